"""Penalties through the engine: device-side token statistics per request."""

import numpy as np
import pytest
import torch

from krait import LLM, SamplingParams
from krait.runner.penalties import PenaltyState
from tests.utils import make_tiny_llama

PROMPTS = [[5, 6, 7, 5, 6, 7], [9] * 12, list(range(3, 40))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("pen") / "llama")


def test_repetition_penalty_matches_hf(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16,
                               do_sample=False, repetition_penalty=1.8, pad_token_id=2,
                               eos_token_id=None)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == want


def test_penalised_and_plain_requests_share_a_batch(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32")
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0,
                         presence_penalty=1.0)
    alone_plain = llm.generate([{"prompt_token_ids": PROMPTS[1]}], plain, use_tqdm=False)
    alone_pen = llm.generate([{"prompt_token_ids": PROMPTS[1]}], pen, use_tqdm=False)
    mixed = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * 2, [plain, pen], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone_plain[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == alone_pen[0].outputs[0].token_ids
    # a frequency penalty of 2 breaks the plain run's repetition
    assert len(set(alone_pen[0].outputs[0].token_ids)) > len(set(alone_plain[0].outputs[0].token_ids))


def test_state_rows_rebuilt_on_add_and_counted_on_record():
    st = PenaltyState(max_reqs=3, vocab_size=10, device=torch.device("cpu"))
    st.add(0, SamplingParams(), [1, 2], [3])
    assert st.output_counts is None  # nothing allocated until a request uses a penalty
    st.add(1, SamplingParams(frequency_penalty=1.0), [1, 2], [3, 3])
    assert st.output_counts[1].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    assert st.prompt_mask[1].nonzero().flatten().tolist() == [1, 2]
    st.record(np.array([0, 1]), torch.tensor([4, 5]))
    assert st.output_counts[1, 5] == 1 and st.output_counts[0].sum() == 0
    st.add(1, SamplingParams(presence_penalty=0.5), [7], [])  # a new owner of row 1
    assert st.output_counts[1].sum() == 0 and st.prompt_mask[1].nonzero().flatten().tolist() == [7]
    counts, mask = st.gather(np.array([1, 0]))
    assert counts.shape == (2, 10) and mask.shape == (2, 10)


def test_logit_bias_forces_and_forbids_tokens(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32")
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": PROMPTS[0]}, base, use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={77: 100.0})
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, forced, use_tqdm=False)[0] \
        .outputs[0].token_ids == [77] * 6
    forbid = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            logit_bias={first: -100.0})
    got = llm.generate({"prompt_token_ids": PROMPTS[0]}, forbid, use_tqdm=False)[0]
    assert got.outputs[0].token_ids[0] != first
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate({"prompt_token_ids": PROMPTS[0]},
                     SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)

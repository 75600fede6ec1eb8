"""prompt_logprobs against HF's log-softmax over the prompt, through chunking and preemption."""

import pytest
import torch

from krait import LLM, SamplingParams
from tests.utils import make_tiny_llama

PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 100, 7, 7, 31, 60, 2, 9], [11, 12], [400]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = make_tiny_llama(tmp_path_factory.mktemp("plp") / "llama")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            lp = hf(torch.tensor([p])).logits[0].log_softmax(-1)  # [len, V]
            want.append(lp)
    return d, want


@pytest.mark.parametrize("opts", [{}, {"max_num_batched_tokens": 5},
                                  {"block_size": 4, "num_kv_blocks": 6, "max_model_len": 24}],
                         ids=["default", "chunked", "preempted"])
def test_prompt_logprobs_match_hf(setup, opts):
    d, want = setup
    llm = LLM(d, device="cpu", dtype="float32", **opts)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for p, out, lp in zip(PROMPTS, outs, want):
        plp = out.prompt_logprobs
        assert len(plp) == len(p) and plp[0] is None
        for q in range(1, len(p)):
            entry = plp[q]
            assert abs(entry[p[q]].logprob - lp[q - 1, p[q]].item()) < 1e-4
            assert entry[p[q]].rank == int((lp[q - 1] >= lp[q - 1, p[q]]).sum())
            top = lp[q - 1].topk(2)
            for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert abs(entry[t].logprob - v) < 1e-4 and entry[t].rank == r


def test_without_prompt_logprobs_none(setup):
    d, _ = setup
    llm = LLM(d, device="cpu", dtype="float32")
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2),
                       use_tqdm=False)
    assert out[0].prompt_logprobs is None

"""The offline LLM API: order, text, finish reasons, stops, min_tokens, n, seeds, progress bar."""

from __future__ import annotations

import re

import pytest

from krait import LLM, RequestOutput, SamplingParams
from krait.engine.engine import LLMEngine
from tests.utils import make_tiny_llama

PROMPTS = ["Hello, my name is", "The capital of France", "a", "Once upon a time there was"]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("api"), arch="llama")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> dict[str, list[int]]:
    """Each prompt's greedy continuation (24 tokens, the tiny model never emits EOS here)."""
    outs = llm.generate(PROMPTS, greedy(ignore_eos=True), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


def test_engine_and_tokenizer_exposed(llm: LLM) -> None:
    assert isinstance(llm.llm_engine, LLMEngine)
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer


def test_outputs_in_prompt_order(llm: LLM, reference) -> None:
    # different lengths make them finish out of order
    prompts = [PROMPTS[0], {"prompt_token_ids": [7, 8, 9]}, PROMPTS[2], {"prompt": PROMPTS[3]}]
    params = [greedy(20), greedy(2), greedy(9), greedy(1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    tok = llm.get_tokenizer()
    assert outs[0].prompt == PROMPTS[0]
    assert outs[0].prompt_token_ids == tok.encode(PROMPTS[0])
    assert outs[1].prompt_token_ids == [7, 8, 9]
    assert outs[3].prompt == PROMPTS[3]
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 2, 9, 1]
    assert outs[0].outputs[0].token_ids == reference[PROMPTS[0]][:20]
    assert outs[2].outputs[0].token_ids == reference[PROMPTS[2]][:9]
    assert outs[3].outputs[0].token_ids == reference[PROMPTS[3]][:1]
    ids = [int(o.request_id) for o in outs]
    assert ids == sorted(ids) and len(set(ids)) == 4


def test_single_prompt_and_params_list_checks(llm: LLM, reference) -> None:
    outs = llm.generate(PROMPTS[2], greedy(3), use_tqdm=False)
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == reference[PROMPTS[2]][:3]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [greedy(3)], use_tqdm=False)


def test_text_equals_decode_of_token_ids(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompts = [*PROMPTS, {"prompt_token_ids": [9] * 20}, {"prompt_token_ids": [300, 301, 5]}]
    outs = llm.generate(prompts, greedy(24, ignore_eos=True), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True), o.prompt


def test_finish_reason_length(llm: LLM) -> None:
    (o,) = llm.generate(PROMPTS[0], greedy(5), use_tqdm=False)
    c = o.outputs[0]
    assert c.finish_reason == "length" and c.stop_reason is None and len(c.token_ids) == 5


def test_stop_token_ids(llm: LLM, reference) -> None:
    ref = reference[PROMPTS[3]]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    (o,) = llm.generate(PROMPTS[3], greedy(stop_token_ids=[stop_tok]), use_tqdm=False)
    c = o.outputs[0]
    assert c.token_ids == ref[: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok


def test_min_tokens_holds_back_stop_tokens(llm: LLM, reference) -> None:
    ref = reference[PROMPTS[2]]
    stop_tok = ref[0]  # the model's first choice, banned until 4 tokens exist
    params = greedy(12, stop_token_ids=[stop_tok], min_tokens=4)
    c = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 5 or c.finish_reason == "length"
    assert stop_tok not in c.token_ids[:4]
    assert c.token_ids[0] != ref[0]
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == stop_tok and stop_tok not in c.token_ids[:-1]


def _ascii_stop(text: str) -> str:
    """A 3-character run of plain letters or spaces, past the first few characters."""
    m = re.search(r"[A-Za-z ]{3}", text[4:])
    assert m is not None, text
    return m.group(0)


def test_stop_strings(llm: LLM, reference) -> None:
    tok = llm.get_tokenizer()
    prompt = PROMPTS[1]
    full = tok.decode(reference[prompt], skip_special_tokens=True)
    stop = _ascii_stop(full)
    cut = full.index(stop)
    c = llm.generate(prompt, greedy(stop=[stop, "never appears"]), use_tqdm=False)[0].outputs[0]
    assert c.text == full[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == reference[prompt][: len(c.token_ids)]
    assert len(c.token_ids) < len(reference[prompt])
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    params = greedy(stop=stop, include_stop_str_in_output=True)
    c = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert c.text == full[: cut + len(stop)] and c.finish_reason == "stop"


def test_eos_stops_unless_ignored(tmp_path_factory: pytest.TempPathFactory, reference) -> None:
    """Same weights, but a config whose eos is a token the model greedily emits."""
    ref = reference[PROMPTS[0]]
    eos = ref[4]
    first = ref.index(eos)
    model = make_tiny_llama(tmp_path_factory.mktemp("eos"), arch="llama", eos_token_id=eos)
    llm = LLM(model)
    assert eos in llm.llm_engine.eos_token_ids
    c = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ref[: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason is None
    c = llm.generate(PROMPTS[0], greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ref and c.finish_reason == "length"
    c = llm.generate(PROMPTS[0], greedy(min_tokens=first + 3), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= first + 3
    assert eos not in c.token_ids[: first + 2]


def test_n_completions_seeded_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=12)
    (a,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    (b,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1]
    assert all(len(c.token_ids) == 12 for c in a.outputs)
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    (c,) = llm.generate(PROMPTS[0], SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    assert len(c.outputs) == 2


def test_seeded_sampling_ignores_batch_neighbours(llm: LLM) -> None:
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=16)
    alone = llm.generate(PROMPTS[1], target, use_tqdm=False)[0].outputs[0].token_ids
    neighbours = [
        (PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=20)),
        ({"prompt_token_ids": list(range(10, 50))}, greedy(5)),
        (PROMPTS[3], SamplingParams(temperature=0.5, seed=3, max_tokens=30)),
    ]
    for pos in (0, 2):
        batch = list(neighbours)
        batch.insert(pos, (PROMPTS[1], target))
        outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
        assert outs[pos].outputs[0].token_ids == alone
    # so does a different scheduling shape
    other = LLM(llm.llm_engine.config.model.model, max_num_batched_tokens=3, block_size=1)
    outs = other.generate(
        [PROMPTS[0], PROMPTS[1]], [neighbours[0][1], target], use_tqdm=False
    )
    assert outs[1].outputs[0].token_ids == alone


def test_use_tqdm(llm: LLM, capsys: pytest.CaptureFixture) -> None:
    llm.generate(PROMPTS[:2], greedy(2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate(PROMPTS[:2], greedy(2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_chat_renders_the_template_and_generates(tmp_path):
    from krait import LLM, SamplingParams
    from tests.utils import make_tiny_llama

    llm = LLM(make_tiny_llama(tmp_path / "m"), device="cpu", dtype="float32")
    conv = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.chat(conv, params, use_tqdm=False)
    ids = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out[0].prompt_token_ids == ids
    direct = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"}]], params, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


def test_prompt_logprobs_must_be_non_negative():
    import pytest

    from krait import SamplingParams

    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()

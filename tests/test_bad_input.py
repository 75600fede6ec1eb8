"""Bad input raises ValueError naming the field, through LLM.generate and LLMEngine.add_request,
and the engine keeps serving everything else."""

from __future__ import annotations

import pytest

from krait import LLM, SamplingParams
from tests.utils import TINY_VOCAB, make_tiny_llama

MAX_LEN = 64
GOOD_IDS = [5, 17, 33, 9, 250]
GOOD = {"prompt_token_ids": GOOD_IDS}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

BAD_PROMPTS = {
    "too_long": ({"prompt_token_ids": [5] * MAX_LEN}, "prompt"),
    "far_too_long": ({"prompt_token_ids": [5] * (3 * MAX_LEN)}, "prompt"),
    "id_too_large": ({"prompt_token_ids": [5, TINY_VOCAB]}, "prompt_token_ids"),
    "id_negative": ({"prompt_token_ids": [-1, 5]}, "prompt_token_ids"),
    "empty_ids": ({"prompt_token_ids": []}, "prompt"),
    "empty_text": ("", "prompt"),
    "not_ints": ({"prompt_token_ids": [5, "x"]}, "prompt_token_ids"),
}

BAD_PARAMS = {
    "max_tokens_0": (dict(max_tokens=0), "max_tokens"),
    "max_tokens_negative": (dict(max_tokens=-3), "max_tokens"),
    "temperature_negative": (dict(temperature=-0.5), "temperature"),
    "top_p_0": (dict(top_p=0.0), "top_p"),
    "top_p_above_1": (dict(top_p=1.5), "top_p"),
    "top_k_0": (dict(top_k=0), "top_k"),
    "top_k_below_-1": (dict(top_k=-2), "top_k"),
    "n_0": (dict(n=0), "n"),
    # more than the sampler's top-k may take (a 100000 once crashed the step for everyone)
    "logprobs_too_many": (dict(logprobs=100_000), "logprobs"),
    "prompt_logprobs_too_many": (dict(prompt_logprobs=21), "prompt_logprobs"),
    "stop_token_ids_outside_vocab": (dict(stop_token_ids=[TINY_VOCAB + 3]), "stop_token_ids"),
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = make_tiny_llama(tmp_path_factory.mktemp("bad"), arch="llama")
    return LLM(model, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def good_tokens(llm: LLM) -> list[int]:
    return llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _cases() -> list:
    cases = [pytest.param(p, GREEDY, f, id=k) for k, (p, f) in BAD_PROMPTS.items()]
    for k, (kw, field) in BAD_PARAMS.items():
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **kw})
        cases.append(pytest.param(GOOD, params, field, id=k))
    return cases


def _field(name: str) -> str:
    """A message naming `name` as a word (so "n" is not found inside "must")."""
    return rf"(^|[^\w]){name}\b"


@pytest.mark.parametrize(("prompt", "params", "field"), _cases())
def test_llm_generate_rejects(llm: LLM, good_tokens, prompt, params, field: str) -> None:
    with pytest.raises(ValueError, match=_field(field)):
        llm.generate([GOOD, prompt], [GREEDY, params], use_tqdm=False)
    engine = llm.llm_engine
    # nothing of the rejected batch is left behind, and the engine still serves
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    out = llm.generate(GOOD, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == good_tokens


@pytest.mark.parametrize(("prompt", "params", "field"), _cases())
def test_engine_add_request_rejects_and_keeps_serving(
    llm: LLM, good_tokens, prompt, params, field: str
) -> None:
    engine = llm.llm_engine
    engine.add_request("good", GOOD, GREEDY)
    with pytest.raises(ValueError, match=_field(field)):
        engine.add_request("bad", prompt, params)
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert list(finished) == ["good"]
    assert finished["good"].outputs[0].token_ids == good_tokens
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


def test_longest_allowed_prompt(llm: LLM) -> None:
    ids = [5 + j % 100 for j in range(MAX_LEN - 1)]
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_duplicate_request_id(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("dup", GOOD, GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", GOOD, GREEDY)
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()


def test_rejected_id_is_free_to_use(llm: LLM, good_tokens) -> None:
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("x", GOOD, SamplingParams(max_tokens=0))
    engine.add_request("x", GOOD, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["x"]
    assert outs[0].outputs[0].token_ids == good_tokens


def test_kv_pool_too_small_for_one_request(llm: LLM) -> None:
    """A pool that cannot hold even one max_model_len request would livelock the scheduler
    (the request preempts itself forever); it must be refused up front."""
    model = llm.llm_engine.config.model.model
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(model, max_model_len=MAX_LEN, block_size=4, num_kv_blocks=2)


def test_max_model_len_past_the_positional_limit(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A max_model_len longer than max_position_embeddings (256 in the tiny config) is refused
    at startup, naming the field, instead of failing (CPU) or reading past the rotary cache
    (GPU) once a request gets there; the override extends the cache and matches HF."""
    from tests.utils import hf_greedy

    model = make_tiny_llama(tmp_path / "m", arch="qwen3")
    with pytest.raises(ValueError, match="max_model_len 300 .*max_position_embeddings"):
        LLM(model, max_model_len=300)
    monkeypatch.setenv("KRAIT_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(model, max_model_len=300, dtype="float32")
    prompt = [5 + i % 200 for i in range(250)]
    want, _, _ = hf_greedy(model, [prompt], 12)  # positions up to 261: past the limit
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0]


def test_positional_limit_follows_rope_scaling():
    """Linear / dynamic rope scaling stretches max_position_embeddings by its factor, yarn its
    original length (as vLLM derives max_model_len); llama3 configs state the long length."""
    from types import SimpleNamespace

    from krait.config import _positional_limit

    def cfg(rope):
        return SimpleNamespace(max_position_embeddings=4096, rope_scaling=rope)

    assert _positional_limit(cfg(None)) == 4096
    assert _positional_limit(cfg({"rope_type": "linear", "factor": 4.0})) == 16384
    assert _positional_limit(cfg({"type": "dynamic", "factor": 2})) == 8192
    assert _positional_limit(cfg({"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 2048})) == 8192
    assert _positional_limit(cfg({"rope_type": "llama3", "factor": 32.0})) == 4096
    assert _positional_limit(SimpleNamespace()) is None  # Mamba2: no positional limit

"""Greedy parity with Hugging Face for Bamba and GraniteMoeHybrid (MoE, dense, NoPE)."""

import random

import pytest

from krait import LLM, SamplingParams
from tests.utils import TINY_VOCAB, hf_greedy, make_tiny_hybrid

MAX_TOKENS = 32
PROMPT_LENS = [1, 6, 13, 22, 31, 40, 51, 60]

CASES = {
    "bamba": ("bamba", {}),
    "granite_moe": ("granitemoehybrid", {}),
    # granite-4.0-h-micro's shape: no experts (shared MLP only) and no rotary
    "granite_dense_nope": (
        "granitemoehybrid", {"num_local_experts": 0, "position_embedding_type": "nope"}
    ),
}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(CASES))
def oracle(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    model_dir = make_tiny_hybrid(tmp_path_factory.mktemp(request.param), arch, **overrides)
    tokens, lps, _ = hf_greedy(model_dir, prompts(), MAX_TOKENS)
    return request.param, model_dir, tokens, lps


def run_krait(model_dir: str, **engine_kw):
    llm = LLM(model_dir, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, ts)] for o, ts in zip(outs, tokens)]
    return tokens, lps


@pytest.mark.parametrize("budget", [None, 7], ids=["default", "chunked7"])
def test_greedy_matches_hf(oracle, budget):
    name, model_dir, hf_tokens, hf_lps = oracle
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    tokens, lps = run_krait(model_dir, **kw)
    for i, (got, want) in enumerate(zip(tokens, hf_tokens)):
        assert got == want, f"{name} prompt {i} (len {PROMPT_LENS[i]}): {got} != {want}"
    worst = max(abs(a - b) for row, ref in zip(lps, hf_lps) for a, b in zip(row, ref))
    assert worst < 1e-3, f"{name}: logprob differs by {worst}"

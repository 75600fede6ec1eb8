"""Prefix caching: shared full blocks by chained token hashes, reference-counted."""

import pytest

from krait import LLM, SamplingParams
from krait.engine.kv_cache_manager import KVCacheManager
from krait.engine.request import Request
from tests.utils import make_tiny_llama


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _run_prefill(kv: KVCacheManager, req: Request) -> None:
    req.num_computed_tokens = kv.match_prefix(req)
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_second_request_reuses_the_first_ones_full_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    a = _req("a", range(100, 122))  # 5 full blocks + 2 tokens
    _run_prefill(kv, a)
    shared = list(a.block_ids[:5])
    kv.free(a)
    b = _req("b", list(range(100, 120)) + [7, 8, 9])  # same first 5 blocks, then different
    assert kv.match_prefix(b) == 20
    assert b.block_ids == shared
    c = _req("c", list(range(100, 108)) + [1] * 9)  # two blocks in common, a live sharer (b)
    assert kv.match_prefix(c) == 8 and c.block_ids == shared[:2]
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_the_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req("a", range(8))
    _run_prefill(kv, a)
    kv.free(a)
    again = _req("again", range(8))  # two full blocks cached; only the first may be reused
    assert kv.match_prefix(again) == 4


def test_reused_free_blocks_lose_their_key():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)  # 3 usable
    a = _req("a", range(12))
    _run_prefill(kv, a)
    kv.free(a)
    b = _req("b", range(50, 62))  # takes every block, overwriting a's contents
    _run_prefill(kv, b)
    kv.free(b)
    assert kv.match_prefix(_req("a2", range(12))) == 0


def test_disabled_by_default():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", range(12))
    _run_prefill(kv, a)
    kv.free(a)
    assert kv.match_prefix(_req("a2", range(12))) == 0


SYSTEM = list(range(5, 45))  # a 40-token shared prefix
PROMPTS = [
    {"prompt_token_ids": p}
    for p in [SYSTEM + [100 + i] * (i + 1) for i in range(6)] + [SYSTEM[:13], [7, 8, 9]]
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("prefix") / "llama")


@pytest.mark.parametrize("opts", [{}, {"max_num_batched_tokens": 7}, {"num_kv_blocks": 30}],
                         ids=["default", "chunked", "tight_pool"])
def test_outputs_unchanged_and_cache_hit(model_dir, opts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    base = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, **opts)
    plain = LLM(model_dir, **base).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model_dir, enable_prefix_caching=True, **base)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    second = llm.generate(PROMPTS, params, use_tqdm=False)  # everything cached now
    for a, b, c in zip(plain, first, second):
        tokens = a.outputs[0].token_ids
        assert tokens == b.outputs[0].token_ids == c.outputs[0].token_ids
        for t, x, y in zip(tokens, a.outputs[0].logprobs, c.outputs[0].logprobs):
            assert abs(x[t].logprob - y[t].logprob) < 1e-4
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_hits"] > 0
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_usable_blocks

"""Prefix caching for models with recurrent (Mamba) layers: state snapshots at hybrid-block
boundaries, their pool's accounting, and outputs equal to running without the cache."""

from pathlib import Path

import pytest

from krait import LLM, SamplingParams
from krait.engine.kv_cache_manager import KVCacheManager
from krait.engine.request import Request
from krait.engine.state_snapshots import StateSnapshotPool
from tests.utils import device_options, hf_greedy, make_tiny_hybrid, make_tiny_qwen3_next

# -- the snapshot pool ---------------------------------------------------------------------


def test_snapshot_pool_fills_and_drains_without_leaking_a_slot():
    pool = StateSnapshotPool([10, 11, 12])
    slots = [pool.reserve(k) for k in (1, 2, 3)]
    assert sorted(slots) == [10, 11, 12] and pool.num_free == 0
    assert pool.reserve(4) is None  # every slot is being written by a step in flight
    assert pool.lookup(1) is None  # reserved is not published: nothing can read it yet
    for s in slots:
        pool.publish(s)
    assert pool.num_published == 3 and pool.num_reserved == 0
    assert pool.reserve(1) is None  # held already
    pool.lookup(1)  # 1 used recently: 2 is now the least recently used
    s4 = pool.reserve(4)
    assert s4 == slots[1] and pool.lookup(2) is None
    pool.publish(s4)
    assert pool.lookup(4) == s4
    for k in (5, 6, 7):  # drain: every slot turned over, none lost
        pool.publish(pool.reserve(k))
    assert pool.num_published + pool.num_reserved + pool.num_free == pool.num_slots == 3
    assert {pool.lookup(k) for k in (5, 6, 7)} == {10, 11, 12}


def _hybrid_kv(num_blocks=64, snapshots=4, block=4, state_block=8) -> KVCacheManager:
    return KVCacheManager(num_blocks, block, num_state_slots=4, slots_per_request=1,
                          enable_prefix_caching=True, state_block_size=state_block,
                          snapshot_slots=list(range(4, 4 + snapshots)))


def _admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, list(tokens), SamplingParams())
    req.num_computed_tokens = kv.match_prefix(req)
    assert kv.allocate_slots(req)
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens) is not None
    return req


def _prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Runs a request's prefill the scheduler's way, chunks cut where prefill_cut says;
    returns the chunk ends where a snapshot was taken (published at once)."""
    saved = []
    while req.num_computed_tokens < req.num_tokens:
        n = kv.prefill_cut(req, req.num_computed_tokens, req.num_tokens - req.num_computed_tokens)
        end = req.num_computed_tokens + n
        save = kv.reserve_snapshot(req, end)
        req.num_computed_tokens = end
        kv.cache_full_blocks(req)
        if save is not None:
            assert save[0] == req.state_slots[0]
            kv.publish_snapshots([save])
            saved.append(end)
    return saved


def test_a_hit_needs_a_snapshot_and_cached_blocks_and_ends_on_a_boundary():
    kv = _hybrid_kv()
    shared = list(range(100, 120))  # 20 tokens: boundaries at 8 and 16
    a = _admit(kv, "a", shared + [1, 2, 3])
    assert _prefill(kv, a) == [16]  # the last boundary its tokens reach
    b = _admit(kv, "b", shared + [7, 8, 9])
    assert b.num_computed_tokens == 16 and b.snapshot_slot >= 4
    assert b.block_ids[:4] == a.block_ids[:4]  # 16 tokens of 4-token blocks shared
    assert b.num_computed_tokens == kv.prefix_hits
    kv.free(b)
    assert b.snapshot_slot == -1
    # the last token is always computed: a 16-token prompt cannot use the snapshot at 16, and
    # there is none at 8
    assert _admit(kv, "c", shared[:16]).num_computed_tokens == 0


def test_no_hit_below_the_state_block_and_none_without_a_snapshot():
    kv = _hybrid_kv()
    a = _admit(kv, "a", list(range(100, 107)))  # 7 tokens: no boundary
    assert _prefill(kv, a) == []
    kv.free(a)
    assert _admit(kv, "b", list(range(100, 107))).num_computed_tokens == 0


def test_a_boundary_shared_with_an_earlier_prompt_gets_a_snapshot():
    kv = _hybrid_kv()
    shared = list(range(100, 110))  # 10 shared tokens: only the boundary at 8 is shared
    a = _admit(kv, "a", shared + list(range(1, 15)))  # 24 tokens
    assert _prefill(kv, a) == [24]
    b = _admit(kv, "b", shared + list(range(50, 64)))  # misses, but has seen 8 before
    assert b.num_computed_tokens == 0 and b.snapshot_cut == 8
    assert _prefill(kv, b) == [8, 24]  # the chunk stopped at 8 to leave a snapshot
    c = _admit(kv, "c", shared + [99] * 5)
    assert c.num_computed_tokens == 8


def test_snapshot_hits_stop_where_attention_blocks_were_evicted():
    kv = _hybrid_kv(num_blocks=7)  # 6 usable 4-token blocks
    a = _admit(kv, "a", list(range(100, 117)))  # 17 tokens, 5 blocks
    assert _prefill(kv, a) == [16]
    kv.free(a)
    b = _admit(kv, "b", list(range(200, 220)))  # takes blocks, evicting a's oldest-freed
    kv.free(b)
    c = _admit(kv, "c", list(range(100, 117)))
    assert c.num_computed_tokens == 0  # the snapshot lives on, but not the KV before it


def test_pure_mamba_caches_state_alone():
    kv = KVCacheManager(0, 4, num_state_slots=2, slots_per_request=1,
                        enable_prefix_caching=True, state_block_size=8, snapshot_slots=[2, 3])
    a = _admit(kv, "a", list(range(30)))
    assert _prefill(kv, a) == [24]
    kv.free(a)
    assert _admit(kv, "b", list(range(30)) + [5]).num_computed_tokens == 24


# -- end to end -------------------------------------------------------------------------

SYSTEM = list(range(5, 45))  # 40 shared tokens
PROMPTS = [SYSTEM + [100 + i] * (i + 2) for i in range(5)] + [SYSTEM[:21], [7, 8, 9]]
ARCHS = ["mamba2", "bamba", "granitemoehybrid", "nemotronh", "falconh1", "qwen3next"]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    if request.param == "qwen3next":
        d = make_tiny_qwen3_next(path)
    else:
        d = make_tiny_hybrid(path, request.param)
    tokens, lps, _ = hf_greedy(d, PROMPTS, MAX_TOKENS)
    return d, tokens, lps


def _gen(llm: LLM, prompts, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)


@pytest.mark.parametrize("opts", [
    {},
    {"max_num_batched_tokens": 11, "mamba_block_size": 8},
    {"num_kv_blocks": 24, "max_num_seqs": 3},
], ids=["default", "chunked", "preempting"])
def test_hybrid_outputs_equal_hf_with_prefix_caching(hybrid, opts):
    d, hf_tokens, hf_lps = hybrid
    if "qwen3_next" in Path(d).joinpath("config.json").read_text():
        opts = {"mamba_block_size": 16, **opts}  # no SSD chunk: the default block is 256
    llm = LLM(d, **device_options(), block_size=4, max_model_len=96,
              enable_prefix_caching=True, **opts)
    sched = llm.llm_engine.scheduler
    preempt, preempted = sched._preempt, []
    sched._preempt = lambda req: (preempted.append(req.request_id), preempt(req))
    # the first pass fills the cache, the second one starts from it
    for rnd in range(2):
        outs = _gen(llm, PROMPTS)
        for o, toks, lps in zip(outs, hf_tokens, hf_lps):
            got = o.outputs[0]
            assert got.token_ids == toks, f"round {rnd}"
            for t, lp, ref in zip(got.token_ids, got.logprobs, lps):
                assert abs(lp[t].logprob - ref) < 1e-3
    assert max(o.num_cached_tokens for o in outs) >= 32
    kv = llm.llm_engine.kv
    # the tight pool preempts (mamba2 has no attention blocks to run out of)
    assert bool(preempted) == ("num_kv_blocks" in opts and kv.uses_blocks)
    assert kv.prefix_hits > 0
    assert kv.num_free_slots == kv.num_state_slots  # no request slot leaked
    assert kv.snapshots.num_reserved == 0  # every snapshot written was published
    if kv.uses_blocks:
        assert kv.num_free_blocks == kv.num_usable_blocks


def test_staggered_arrivals_and_speculation_with_prefix_caching(tmp_path):
    d = make_tiny_hybrid(tmp_path / "g", "granitemoehybrid")
    base = dict(**device_options(), block_size=4, max_model_len=96)
    plain = _gen(LLM(d, **base), PROMPTS)
    llm = LLM(d, enable_prefix_caching=True, mamba_block_size=8, **base,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rnd in range(2):
        done: dict[str, list[int]] = {}
        for i, p in enumerate(PROMPTS):  # one new request every step
            eng.add_request(f"{rnd}-{i}", {"prompt_token_ids": p}, params)
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        assert [done[f"{rnd}-{i}"] for i in range(len(PROMPTS))] == [
            o.outputs[0].token_ids for o in plain]
    assert eng.kv.prefix_hits > 0


def test_prefix_caching_counts_reach_the_server_usage(tmp_path):
    from krait.server.api_server import usage_of

    d = make_tiny_hybrid(tmp_path / "m", "mamba2")
    llm = LLM(d, **device_options(), enable_prefix_caching=True, mamba_block_size=16)
    _gen(llm, [SYSTEM + [1]])
    out = _gen(llm, [SYSTEM + [2]])[0]
    assert out.num_cached_tokens == 32
    assert usage_of({0: out}).prompt_tokens_details.cached_tokens == 32

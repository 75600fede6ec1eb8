"""KVCacheManager: the attention block pool (block 0 is the null block) and the state-slot pool."""

from __future__ import annotations

import pytest

from krait.engine.kv_cache_manager import KVCacheManager, cdiv
from krait.engine.request import Request
from krait.sampling_params import SamplingParams


def _req(rid: str = "r", n_prompt: int = 10) -> Request:
    return Request(rid, list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize(("a", "b", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2)])
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


def test_null_block_is_never_handed_out() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2)
    assert kv.num_usable_blocks == 4
    assert kv.num_free_blocks == 4
    reqs = [_req(str(i), 2) for i in range(4)]
    got = [kv.allocate(r, 2) for r in reqs]
    assert sorted(b for blocks in got for b in blocks) == [1, 2, 3, 4]
    assert KVCacheManager.NULL_BLOCK not in {b for r in reqs for b in r.block_ids}
    assert kv.allocate(_req("x", 1), 1) is None


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_allocate_grows_by_whole_blocks(block_size: int) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    req = _req(n_prompt=13)
    new = kv.allocate(req, 13)
    assert len(new) == cdiv(13, block_size)
    assert req.block_ids == new
    req.num_computed_tokens = 13
    # each later token needs a new block only when it starts one
    for pos in range(13, 40):
        expected = 1 if pos % block_size == 0 else 0
        assert kv.blocks_needed(req, 1) == expected
        assert len(kv.allocate(req, 1)) == expected
        req.num_computed_tokens += 1
    assert len(req.block_ids) == cdiv(40, block_size)
    assert len(set(req.block_ids)) == len(req.block_ids)


def test_allocate_short_pool_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks: 12 tokens
    a, b = _req("a"), _req("b")
    assert kv.allocate(a, 8) is not None
    free_before, blocks_before = kv.num_free_blocks, list(b.block_ids)
    assert kv.allocate(b, 5) is None  # needs 2 blocks, 1 is free
    assert kv.num_free_blocks == free_before
    assert b.block_ids == blocks_before
    assert kv.allocate(b, 4) is not None  # one block fits


def test_free_returns_blocks_and_slots_for_reuse() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, num_state_slots=2, slots_per_request=1)
    a = _req("a")
    assert kv.allocate_slots(a)
    assert kv.allocate(a, 8) is not None
    assert kv.num_free_blocks == 0 and kv.num_free_slots == 1
    kv.free(a)
    assert a.block_ids == [] and a.state_slots == []
    assert kv.num_free_blocks == 2 and kv.num_free_slots == 2
    kv.free(a)  # a second free is harmless
    assert kv.num_free_blocks == 2 and kv.num_free_slots == 2
    b = _req("b")
    assert kv.allocate(b, 8) is not None and kv.allocate_slots(b)


def test_state_slots_per_request() -> None:
    kv = KVCacheManager(num_blocks=0, block_size=16, num_state_slots=5, slots_per_request=2)
    a, b, c = _req("a"), _req("b"), _req("c")
    assert kv.allocate_slots(a) and len(a.state_slots) == 2
    slots = list(a.state_slots)
    assert kv.allocate_slots(a) and a.state_slots == slots  # idempotent
    assert kv.allocate_slots(b) and not set(a.state_slots) & set(b.state_slots)
    assert not kv.allocate_slots(c)  # one slot left, two needed
    assert c.state_slots == [] and kv.num_free_slots == 1


def test_no_slots_needed_for_dense_models() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = _req()
    assert kv.allocate_slots(r)
    assert r.state_slots == []


def test_pure_state_space_model_uses_no_blocks() -> None:
    kv = KVCacheManager(num_blocks=0, block_size=16, num_state_slots=4, slots_per_request=1)
    assert not kv.uses_blocks and kv.num_usable_blocks == 0
    r = _req(n_prompt=100)
    assert kv.blocks_needed(r, 100) == 0
    assert kv.allocate(r, 100) == []
    assert kv.usage() == 0.0
    assert kv.allocate_slots(r)
    assert kv.usage() == pytest.approx(0.25)


def test_usage_counts_blocks() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.usage() == 0.0
    r = _req()
    kv.allocate(r, 6)  # 2 of 4 usable blocks
    assert kv.usage() == pytest.approx(0.5)
    kv.free(r)
    assert kv.usage() == 0.0


def test_conv_only_slots_fill_the_later_columns() -> None:
    # speculative decoding under Mamba2's deferred commit: a request's first slot is a full one
    # (conv window + SSM state), its other slots_per_request - 1 conv-only; each returns to its
    # own pool
    kv = KVCacheManager(num_blocks=0, block_size=16, num_state_slots=2, slots_per_request=3,
                        conv_slots=[5, 6, 7])
    a, b, c = _req("a"), _req("b"), _req("c")
    assert kv.allocate_slots(a) and a.state_slots[0] in (0, 1)
    assert set(a.state_slots[1:]) <= {5, 6, 7} and len(a.state_slots) == 3
    assert not kv.allocate_slots(b)  # a full slot is left, but only one conv-only slot
    assert b.state_slots == [] and kv.num_free_slots == 1
    kv.free(a)
    assert kv.allocate_slots(b) and b.state_slots[0] in (0, 1)
    assert set(b.state_slots[1:]) <= {5, 6, 7}
    assert not kv.allocate_slots(c) and kv.num_free_slots == 1
    kv.free(b)
    assert kv.num_free_slots == 2 and kv.allocate_slots(c)

"""Flash-decoding path of the paged attention kernel (decode rows split over several programs)."""

import pytest
import torch

from krait.ops.paged_attention import (
    decode_num_splits,
    decode_prefetch,
    decode_split_warps,
    paged_attention_ref,
    paged_attention_triton,
)


def _decode_batch(seq_lens, hq, hkv, d=32, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    max_blocks = max(-(-s // bs) for s in seq_lens) + 1
    num_blocks = rows * max_blocks + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    block_table = torch.randperm(num_blocks - 1, generator=g)[: rows * max_blocks]
    block_table = (block_table + 1).view(rows, max_blocks).to(torch.int32)
    q_lens = [1 if s > 0 else 0 for s in seq_lens]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), block_table


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("splits", [2, 4])
def test_split_decode_matches_reference(hq, hkv, window, splits):
    seq_lens = [1, 130, 0, 517, 64]  # a one-token row, long rows, a padding row
    q, kc, vc, qsl, sl, bt = _decode_batch(seq_lens, hq, hkv, seed=splits)
    args = (q, kc, vc, qsl, sl, bt, 1, max(seq_lens), 0.2, window)
    want = paged_attention_ref(*args)
    got = paged_attention_triton(*args, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 8])  # 8: q loaded before the newest key's reload
def test_prefetched_first_tile_matches_reference(window, splits, warps, monkeypatch):
    """prefetch=True: each split's first tile loaded before the PDL wait, its newest
    key after (rows whose newest key falls in a split's first tile: 1, 64, 517 at 4 splits);
    q loaded before that reload (Q_FIRST, 8-warp programs) or after it."""
    import krait.ops.paged_attention as pa

    monkeypatch.setattr(pa, "decode_split_warps", lambda programs, device: warps)
    seq_lens = [1, 130, 0, 517, 64]
    q, kc, vc, qsl, sl, bt = _decode_batch(seq_lens, 8, 2, seed=10 + splits)
    args = (q, kc, vc, qsl, sl, bt, 1, max(seq_lens), 0.2, window)
    want = paged_attention_ref(*args)
    got = paged_attention_triton(*args, num_splits=max(splits, 2), prefetch=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _short_query_batch(q_lens, seq_lens, hq, hkv, d=32, bs=4, seed=0, pad_tokens=0):
    q, kc, vc, _, sl, bt = _decode_batch(seq_lens, hq, hkv, d, bs, seed)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(qsl[-1]) + pad_tokens, hq, d, generator=g)
    return q, kc, vc, qsl, sl, bt


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("splits", [2, 4])
def test_short_query_rows_split_like_decode_rows(window, splits):
    # verify rows of 1 + k tokens (and a one-token row, a padding row): each token runs as its
    # own split-KV row over the keys up to its position
    q_lens, seq_lens = [4, 1, 4, 0, 3], [130, 1, 517, 0, 64]
    q, kc, vc, qsl, sl, bt = _short_query_batch(q_lens, seq_lens, 8, 2, seed=splits)
    args = (q, kc, vc, qsl, sl, bt, 4, max(seq_lens), 0.2, window)
    want = paged_attention_ref(*args)
    got = paged_attention_triton(*args, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_token_rows_cover_every_token_and_padding():
    from krait.ops.paged_attention import token_rows

    qsl = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    seq_lens = torch.tensor([10, 3, 7], dtype=torch.int32)
    bt = torch.arange(3, dtype=torch.int32)[:, None].repeat(1, 2)  # row r's blocks: r
    tok_qsl, tok_seq, tok_bt = token_rows(qsl, seq_lens, bt, 11)  # 2 padded tokens
    assert tok_qsl.tolist() == list(range(12))
    assert tok_seq.tolist() == [7, 8, 9, 10, 3, 4, 5, 6, 7, 1, 1]
    assert tok_bt[:, 0].tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2]


def test_split_choice_fills_the_gpu_but_stays_bounded():
    cpu = torch.device("cpu")  # 4 "SMs" on CPU: 8 programs wanted
    assert decode_num_splits(1, 2, 4096, cpu) == 4
    assert decode_num_splits(64, 8, 4096, cpu) == 1  # the batch already fills it
    assert decode_num_splits(1, 1, 64, cpu) == 1  # one key tile does not split
    assert decode_num_splits(1, 1, 10**6, cpu) <= 16


def test_splits_take_one_key_tile_at_least():
    cpu = torch.device("cpu")
    assert decode_num_splits(1, 1, 512, cpu) == 8  # 64 keys (one tile) a split at least


def test_split_warps_follow_the_grid():
    """8 warps while the grid fits one program an SM (4 "SMs" on CPU), 4 beyond."""
    cpu = torch.device("cpu")
    assert decode_split_warps(4, cpu) == 8
    assert decode_split_warps(5, cpu) == 4


def test_prefetch_only_where_the_first_tile_keeps_occupancy():
    """The first K/V tile is loaded before the PDL wait only while it is at most 64 elements a
    thread (past it, qwen3's head dim 128 at 4 warps lost on the H200)."""
    assert decode_prefetch(8, 64, 128)  # qwen3, one row: 8 warps
    assert not decode_prefetch(4, 64, 128)  # qwen3, 8 rows: 4 warps
    assert decode_prefetch(4, 64, 64)  # llama / granite head dim 64


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ctx", [(1, 16384), (8, 16384), (64, 2048)])
def test_split_decode_real_size_gpu(rows, ctx):
    torch.manual_seed(0)
    hq, hkv, d, bs = 32, 8, 128, 16
    blocks_per = ctx // bs
    kc = torch.randn(rows * blocks_per + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = (torch.randperm(rows * blocks_per, device="cuda") + 1).view(rows, blocks_per).int()
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    args = (q, kc, vc, qsl, sl, bt, 1, ctx, d**-0.5, None)
    want = paged_attention_ref(*args).float()
    for prefetch in (False, True):
        got = paged_attention_triton(*args, prefetch=prefetch).float()
        assert (got - want).norm() / want.norm() < 1e-2, prefetch

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
    """Rows of q_lens query tokens (each a row's last) over seq_lens keys; q has pad_tokens more
    tokens after the last row (a padded bucket)."""
    q, kc, vc, _, sl, bt = _decode_batch(seq_lens, hq, hkv, d, bs, seed)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(qsl[-1]) + pad_tokens, hq, d, generator=g)  # [T + pad, Hq, D]
    return q, kc, vc, qsl, sl, bt


# verify rows of 2..8 tokens mixed with one-token rows, a padding row (q_len 0), a row whose
# queries are all its keys (3 of 3), lengths off the block size
Q_LENS = [4, 1, 8, 0, 3, 2, 5, 1, 7, 6]
SEQ_LENS = [37, 1, 100, 0, 3, 50, 21, 64, 9, 130]


def _check_short_rows(q_lens, seq_lens, hq, hkv, d, bs, window, splits, pad=3, seed=0,
                      prefetch=None):
    q, kc, vc, qsl, sl, bt = _short_query_batch(q_lens, seq_lens, hq, hkv, d, bs, seed, pad)
    args = (q, kc, vc, qsl, sl, bt, max(q_lens), max(seq_lens), d**-0.5, window)
    want = paged_attention_ref(*args)  # zeros at the padded tokens
    got = paged_attention_triton(*args, num_splits=splits, prefetch=prefetch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not got[int(qsl[-1]):].any()  # the padded tokens: zeros


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])  # GQA groups 1, 2, 4, 8
@pytest.mark.parametrize("window", [None, 6, 37])
def test_short_query_rows_match_reference(hq, hkv, window):
    """Rows of up to 8 tokens in one split-KV program each (Q_MAX 8): every token over the
    keys up to its own position (and its own window), split 4 ways."""
    _check_short_rows(Q_LENS, SEQ_LENS, hq, hkv, 64, 16, window, 4, seed=hq + hkv)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bs", [16, 32])
def test_short_query_rows_head_dims_and_blocks(d, bs):
    # at most 3 tokens a row (Q_MAX 4: a pow2 bound above the longest row), 2 splits
    q_lens, seq_lens = [3, 1, 2, 3, 0], [45, 17, 33, 160, 0]
    _check_short_rows(q_lens, seq_lens, 8, 2, d, bs, None, 2, pad=2, seed=d + bs)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("warps", [4, 8])  # 8: q loaded before the new keys' reload
def test_short_query_rows_prefetched_first_tile(window, warps, monkeypatch):
    """prefetch=True: a split's first tile loaded before the PDL wait, the row's new keys (its
    last q_len) reloaded after it: rows whose new keys fall in a first tile, across two tiles
    (130: 127..129 at 1 split) and on a split's edge (256 keys at 2 splits)."""
    import krait.ops.paged_attention as pa

    monkeypatch.setattr(pa, "decode_split_warps", lambda programs, device: warps)
    q_lens, seq_lens = [4, 1, 3, 2, 0], [130, 1, 256, 129, 0]
    for splits in (2, 4):
        _check_short_rows(q_lens, seq_lens, 8, 2, 32, 16, window, splits, seed=splits,
                          prefetch=True)


def test_short_query_rows_split_by_rows(monkeypatch):
    """Short query rows take the split kernel with the splits of their rows (not tokens),
    every token of a row in one program (q_max: max_query_len's power of two); one-token rows
    take its one-token form; a short-row batch that fills the GPU takes the varlen kernel."""
    import krait.ops.paged_attention as pa

    calls = []
    monkeypatch.setattr(pa, "_decode_split", lambda *a, **k: calls.append((a[9], k["q_max"])))
    cpu = torch.device("cpu")
    q, kc, vc, qsl, sl, bt = _short_query_batch([4], [600], 8, 2)
    paged_attention_triton(q, kc, vc, qsl, sl, bt, 4, 600, 0.2)
    assert calls == [(decode_num_splits(1, 2, 600, cpu), 4)]
    q, kc, vc, qsl, sl, bt = _short_query_batch([1, 3, 2], [600, 50, 7], 8, 2)
    paged_attention_triton(q, kc, vc, qsl, sl, bt, 3, 600, 0.2)
    assert calls[1] == (decode_num_splits(3, 2, 600, cpu), 4)
    q, kc, vc, qsl, sl, bt = _decode_batch([600, 9], 8, 2)
    paged_attention_triton(q, kc, vc, qsl, sl, bt, 1, 600, 0.2)
    assert calls[2] == (decode_num_splits(2, 2, 600, cpu), 1)
    q, kc, vc, qsl, sl, bt = _short_query_batch([2] * 4, [600] * 4, 4, 4)
    assert decode_num_splits(4, 4, 600, cpu) == 1
    got = paged_attention_triton(q, kc, vc, qsl, sl, bt, 2, 600, 0.2)
    assert len(calls) == 3  # the varlen kernel
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, qsl, sl, bt, 2, 600, 0.2),
                               rtol=1e-4, atol=1e-4)


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


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (16, 2, 256)])  # qwen3-0.6b, Qwen3-Next
@pytest.mark.parametrize("rows", [1, 64])
def test_short_query_rows_real_size_gpu(hq, hkv, d, rows):
    """Verify rows of 4 tokens (k = 3) over 1024 keys in bf16, through the split kernel's
    Q_MAX form where the rows' splits exceed 1 (batch 1) and the varlen kernel otherwise."""
    torch.manual_seed(0)
    q_len, ctx, bs = 4, 1024, 16
    blocks_per = ctx // bs
    kc = torch.randn(rows * blocks_per + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = (torch.randperm(rows * blocks_per, device="cuda") + 1).view(rows, blocks_per).int()
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32) * q_len
    sl = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(rows * q_len + 3, hq, d, device="cuda", dtype=torch.bfloat16)  # 3 padded
    args = (q, kc, vc, qsl, sl, bt, q_len, ctx, d**-0.5, None)
    want = paged_attention_ref(*args).float()
    for splits in (None, 4):
        for prefetch in (False, True):
            got = paged_attention_triton(*args, num_splits=splits, prefetch=prefetch).float()
            assert (got - want).norm() / want.norm() < 1e-2, (splits, prefetch)
            if splits:
                assert not got[rows * q_len:].any()

import math
import os

import pytest
import torch

from krait.ops.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)


def make_case(rows, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
              device="cpu", extra_tokens=0, seed=0):
    """rows: (q_len, seq_len) per batch row. Blocks are handed out in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_row = [math.ceil(s / block_size) for _, s in rows]
    num_blocks = sum(blocks_per_row) + 3
    perm = torch.randperm(num_blocks, generator=g)
    width = max(blocks_per_row) + 2
    block_table = torch.full((len(rows), width), -1, dtype=torch.int32)  # -1: never read
    used = 0
    for b, n in enumerate(blocks_per_row):
        block_table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    q_lens = [q for q, _ in rows]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    num_tokens = int(qsl[-1]) + extra_tokens
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=g)  # [T, Hq, D]
    kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(kv_shape, generator=g)
    v_cache = torch.randn(kv_shape, generator=g)
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    args = [t.to(device) for t in (q, k_cache, v_cache, qsl, seq_lens, block_table)]
    for i in range(3):
        args[i] = args[i].to(dtype)
    return args + [max(q_lens), max(s for _, s in rows)]


def naive_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, scale, window):
    """Per token and per head, in float64, straight from the definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    for b in range(len(seq_lens)):
        start, end, seq_len = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        for i in range(end - start):
            pos = seq_len - (end - start) + i
            lo = 0 if window is None else max(0, pos - window + 1)
            keys = list(range(lo, pos + 1))
            blk = [int(block_table[b, p // block_size]) for p in keys]
            off = [p % block_size for p in keys]
            for h in range(q.shape[1]):
                k = k_cache[blk, off, h // group].double()  # [n, D]
                v = v_cache[blk, off, h // group].double()
                w = torch.softmax(k @ q[start + i, h].double() * scale, dim=0)
                out[start + i, h] = w @ v
    return out


MIXED = [(1, 37), (0, 12), (13, 50), (20, 20), (0, 0), (3, 3)]  # decode, pad, chunk, prefills


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 7])
def test_reference_matches_naive(heads, block_size, window):
    *args, max_q, max_s = make_case(MIXED, *heads, 16, block_size, extra_tokens=2)
    scale = 16**-0.5
    out = paged_attention_ref(*args, max_q, max_s, scale, window)
    expected = naive_attention(*args, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert out[-2:].abs().sum() == 0  # tokens no row covers


def test_dispatch_on_cpu_uses_reference():
    *args, max_q, max_s = make_case(MIXED, 4, 2, 8, 4)
    out = paged_attention(*args, max_q, max_s, 0.3, None)
    assert torch.equal(out, paged_attention_ref(*args, max_q, max_s, 0.3, None))


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_matches_reference_mixed(heads, block_size, window):
    *args, max_q, max_s = make_case(MIXED, *heads, 32, block_size, extra_tokens=2, seed=1)
    scale = 32**-0.5
    expected = paged_attention_ref(*args, max_q, max_s, scale, window)
    out = paged_attention_triton(*args, max_q, max_s, scale, window)
    n = int(args[3][-1])  # the 2 extra tokens belong to no row: the kernel leaves them alone
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-4, rtol=1e-4)


def test_triton_writes_every_token_of_every_row(monkeypatch):
    """The output starts as torch.empty: poison it and check no row token keeps the poison,
    for prefill chunks, decode rows, a padded decode row over one key and the split path."""
    import krait.ops.paged_attention as pa

    monkeypatch.setattr(pa.torch, "empty_like", lambda t: torch.full_like(t, float("nan")))
    rows = MIXED + [(1, 1)]
    *args, max_q, max_s = make_case(rows, 8, 2, 32, 16, seed=5)
    out = paged_attention_triton(*args, max_q, max_s, 32**-0.5, 7)
    assert not out.isnan().any()
    decode = [(1, 37), (1, 1), (1, 90)]
    *args, max_q, max_s = make_case(decode, 8, 2, 32, 16, seed=6)
    out = paged_attention_triton(*args, max_q, max_s, 32**-0.5, None, num_splits=4)
    assert not out.isnan().any()


@pytest.mark.parametrize("window", [None, 100])
def test_triton_matches_reference_many_tiles(window):
    """Several query tiles per row and several key tiles per query tile; odd head_dim."""
    rows = [(1, 300), (140, 290), (0, 5), (200, 200)]
    *args, max_q, max_s = make_case(rows, 8, 2, 40, 16, seed=2)
    expected = paged_attention_ref(*args, max_q, max_s, 0.1, window)
    out = paged_attention_triton(*args, max_q, max_s, 0.1, window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_triton_strided_query():
    """q as a view of a packed qkv projection, as attention layers produce it."""
    *args, max_q, max_s = make_case(MIXED, 4, 2, 16, 16, seed=3)
    q = args[0]
    qkv = torch.randn(q.shape[0], q.shape[1] * 16 + 64)
    qkv[:, : q.shape[1] * 16] = q.flatten(1)
    q_view = qkv[:, : q.shape[1] * 16].view(q.shape)
    expected = paged_attention_ref(*args, max_q, max_s, 0.25)
    out = paged_attention_triton(q_view, *args[1:], max_q, max_s, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_triton_matches_reference_real_sizes(window):
    assert os.environ.get("TRITON_INTERPRET") != "1"
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1500, 2049, (64,), generator=g).tolist()
    decode = [(1, s) for s in lens]
    mixed = decode[:48] + [(512, 2048), (300, 700), (0, 0), (1000, 1000)]
    for rows in (decode, mixed):
        *args, max_q, max_s = make_case(rows, 32, 8, 128, 16, torch.bfloat16, "cuda")
        scale = 128**-0.5
        expected = paged_attention_ref(*args, max_q, max_s, scale, window)
        out = paged_attention(*args, max_q, max_s, scale, window)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)

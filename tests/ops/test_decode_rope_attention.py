"""The split decode kernel taking the projection's raw q/k/v (`decode_rope_attention`): equal to
`rope_kv_write` then `paged_attention`, outputs and the cache it writes."""

import pytest
import torch

from krait.ops.paged_attention import decode_rope_attention, paged_attention_ref
from krait.ops.rope_kv_write import rope_kv_write_ref, rope_kv_write_triton


def _case(seq_lens, norm, is_neox, rot_dim, hq=4, hkv=2, d=32, bs=4, seed=0,
          dtype=torch.float32, cache_dtype=None, pad_slot=True):
    """Decode rows (a row of seq_len 0 is padding: no token), raw q/k/v as strided views of one
    projection output, positions seq_len - 1, slots inside each row's blocks (one -1)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    max_blocks = max(-(-s // bs) for s in seq_lens) + 1
    num_blocks = rows * max_blocks + 1
    caches = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(cache_dtype or dtype)
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: rows * max_blocks] + 1)
    block_table = block_table.view(rows, max_blocks).to(torch.int32)
    live = [b for b, s in enumerate(seq_lens) if s > 0]
    qsl = torch.tensor([0] + [sum(1 for s in seq_lens[: b + 1] if s > 0) for b in range(rows)],
                       dtype=torch.int32)
    T = len(live)
    qkv = torch.randn(T, (hq + 2 * hkv) * d + 8, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d : (hq + 2 * hkv) * d].view(T, hkv, d)
    positions = torch.tensor([seq_lens[b] - 1 for b in live], dtype=torch.int64)
    slots = torch.tensor([int(block_table[b, (seq_lens[b] - 1) // bs]) * bs + (seq_lens[b] - 1) % bs
                          for b in live], dtype=torch.int64)
    if pad_slot:  # the last live row as a captured graph's padding row: nothing written
        slots[-1] = -1
    ang = torch.rand(max(seq_lens) + 1, rot_dim // 2, generator=g) * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    qw = torch.rand(d, generator=g).to(dtype) + 0.5 if norm else None
    kw = torch.rand(d, generator=g).to(dtype) + 0.5 if norm else None
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return (q, k, v, positions, cs, is_neox, qw, kw, 1e-6), caches, slots, qsl, seq, block_table


def _both(case, window, splits, prefetch, rope_kv_write=rope_kv_write_ref):
    """(fused output, unfused output, the caches each wrote): `rope_kv_write` (the reference,
    or the kernel the fused path replaces) then the attention reference."""
    rope_args, caches, slots, qsl, seq, bt = case
    c_ref, c_got = caches.clone(), caches.clone()
    q_ref = rope_kv_write(*rope_args, c_ref[0], c_ref[1], slots)
    want = paged_attention_ref(q_ref, c_ref[0], c_ref[1], qsl, seq, bt, 1, int(seq.max()), 0.3,
                               window)
    got = decode_rope_attention(*rope_args, c_got[0], c_got[1], slots, qsl, seq, bt,
                                int(seq.max()), 0.3, window, num_splits=splits,
                                prefetch=prefetch)
    return got, want, c_got, c_ref


@pytest.mark.parametrize("norm,is_neox,rot_dim", [(True, True, 32), (False, False, 16),
                                                  (True, False, 32)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_fused_rope_and_kv_write_match_the_two_ops(norm, is_neox, rot_dim, prefetch):
    # the newest key in a split's first tile (130, 1 at 2 splits of 128-key tiles) and in a
    # later one (517: its second split holds keys 384-516, tiles 384 and 512 at 2 splits)
    case = _case([130, 1, 0, 517, 64], norm, is_neox, rot_dim, seed=rot_dim + norm)
    got, want, c_got, c_ref = _both(case, None, 2, prefetch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c_got, c_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [2, 4])
def test_sliding_window_and_more_splits(splits):
    case = _case([300, 37, 90], True, True, 32, hq=8, hkv=2, seed=splits)
    got, want, c_got, c_ref = _both(case, 37, splits, True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c_got, c_ref, rtol=1e-5, atol=1e-5)


def test_bf16_keys_round_as_the_kernel_it_replaces():
    # (the interpreter's bf16 dots are not trusted: outputs in bf16 are compared on the GPU)
    case = _case([130, 260], True, True, 32, seed=3, dtype=torch.bfloat16)
    _, _, c_got, c_ref = _both(case, None, 2, True, rope_kv_write_triton)
    assert torch.equal(c_got, c_ref)


def test_fp8_cache():
    case = _case([130, 260, 9], True, True, 32, seed=4, cache_dtype=torch.float8_e4m3fn)
    got, want, c_got, c_ref = _both(case, None, 2, True, rope_kv_write_triton)
    assert torch.equal(c_got.view(torch.uint8), c_ref.view(torch.uint8))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
def test_real_size_gpu(prefetch):
    """qwen3-0.6b's heads (16 / 8 of 128, q/k norms, neox rotary) at batch 1 and 4, bf16, 16-key
    blocks: the fused kernel writes the same cache bits as `rope_kv_write_triton` and attends
    as the split kernel after it (PDL on: the newest key read back after the wait)."""
    from krait.ops.paged_attention import paged_attention_triton

    for lens in ([1024], [700, 33, 1024, 257]):
        case = _case(lens, True, True, 128, hq=16, hkv=8, d=128, bs=16, seed=len(lens),
                     dtype=torch.bfloat16, pad_slot=len(lens) > 1)
        rope_args, caches, slots, qsl, seq, bt = (
            tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in case[0]),
            *(t.cuda() for t in case[1:]))
        c_ref, c_got = caches.clone(), caches.clone()
        q = rope_kv_write_triton(*rope_args, c_ref[0], c_ref[1], slots)
        want = paged_attention_triton(q, c_ref[0], c_ref[1], qsl, seq, bt, 1, max(lens),
                                      128**-0.5, num_splits=8, prefetch=prefetch)
        got = decode_rope_attention(*rope_args, c_got[0], c_got[1], slots, qsl, seq, bt,
                                    max(lens), 128**-0.5, num_splits=8, prefetch=prefetch)
        assert torch.equal(c_got, c_ref)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_one_split_is_refused():
    case = _case([130], False, True, 32)
    rope_args, caches, slots, qsl, seq, bt = case
    with pytest.raises(ValueError, match="split"):
        decode_rope_attention(*rope_args, caches[0], caches[1], slots, qsl, seq, bt, 130, 0.3,
                              num_splits=1)

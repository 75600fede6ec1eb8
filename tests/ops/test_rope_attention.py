"""rope + KV write folded into the split-KV decode kernel against `rope_kv_write` then
`paged_attention` (torch references)."""


import pytest
import torch

from krait.ops.paged_attention import decode_split_rope, paged_attention_ref
from krait.ops.rope_attention import rope_paged_attention
from krait.ops.rope_kv_write import rope_kv_write_ref

SEQ_LENS = [1, 130, 0, 517, 64]  # a one-key row, long rows, a padding row (no token)


def _decode_case(norm: bool, is_neox: bool, rot_dim: int, seed: int, heads=(8, 2, 32), bs=4):
    """Raw q/k/v of one token per row (strided views of a qkv row, as the projection leaves
    them), each row's position and slot of its newest key, caches with random old keys."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D = heads
    rows = len(SEQ_LENS)
    max_blocks = max(-(-s // bs) for s in SEQ_LENS) + 1
    num_blocks = rows * max_blocks + 1
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: rows * max_blocks] + 1)
    block_table = block_table.view(rows, max_blocks).to(torch.int32)
    live = [b for b, s in enumerate(SEQ_LENS) if s > 0]
    T = len(live)
    qsl = torch.tensor([0] + [sum(1 for r in live if r <= b) for b in range(rows)],
                       dtype=torch.int32)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D + 8, generator=g)  # [T, ...] with padding columns
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D: (Hq + 2 * Hkv) * D].view(T, Hkv, D)
    positions = torch.tensor([SEQ_LENS[b] - 1 for b in live])
    slots = torch.tensor([int(block_table[b, (SEQ_LENS[b] - 1) // bs]) * bs
                          + (SEQ_LENS[b] - 1) % bs for b in live])
    ang = torch.rand(600, rot_dim // 2, generator=g) * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    qw = torch.rand(D, generator=g) + 0.5 if norm else None
    kw = torch.rand(D, generator=g) + 0.5 if norm else None
    caches = torch.randn(2, num_blocks, bs, Hkv, D, generator=g)
    rope = (q, k, v, positions, cs, is_neox, qw, kw, 1e-6)
    attn = (qsl, torch.tensor(SEQ_LENS, dtype=torch.int32), block_table)
    return rope, attn, caches, slots


def _reference(rope, attn, caches, slots, window):
    c = caches.clone()
    q = rope_kv_write_ref(*rope, c[0], c[1], slots)
    return paged_attention_ref(q, c[0], c[1], *attn, 1, max(SEQ_LENS), 0.2, window), c


@pytest.mark.parametrize("norm,is_neox,rot_dim", [(True, True, 32), (False, False, 16),
                                                  (True, False, 32)])
@pytest.mark.parametrize("splits,prefetch,window", [(2, False, None), (4, True, None),
                                                    (4, True, 37)])
@pytest.mark.parametrize("warps", [4, 8])  # 8: q before the newest key's reload (Q_FIRST)
def test_folded_rope_matches_rope_kv_write_then_attention(norm, is_neox, rot_dim, splits,
                                                          prefetch, window, warps, monkeypatch):
    import krait.ops.paged_attention as pa

    monkeypatch.setattr(pa, "decode_split_warps", lambda programs, device: warps)
    rope, attn, caches, slots = _decode_case(norm, is_neox, rot_dim, seed=splits + rot_dim)
    want, want_caches = _reference(rope, attn, caches, slots, window)
    got_caches = caches.clone()
    got = decode_split_rope(*rope, got_caches[0], got_caches[1], slots, *attn, 0.2, window,
                            splits, prefetch=prefetch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_caches, want_caches, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("waves", [2, 8])
def test_rope_paged_attention_dispatch(waves, monkeypatch):
    """The layer's entry point: a decode batch the split-KV kernel takes (8 waves: 5 rows x 2 kv
    heads on 4 "SMs" split) runs `decode_split_rope`, one it does not (2 waves) rope_kv_write
    then paged_attention; the same output and caches either way."""
    import krait.ops.paged_attention as pa
    import krait.ops.rope_attention as ra

    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setattr(pa, "SPLIT_WAVES", waves)
    folded = []
    real = ra.decode_split_rope
    monkeypatch.setattr(ra, "decode_split_rope",
                        lambda *a, **kw: folded.append(1) or real(*a, **kw))
    rope, attn, caches, slots = _decode_case(True, True, 32, seed=5)
    want, want_caches = _reference(rope, attn, caches, slots, None)
    got_caches = caches.clone()
    got = rope_paged_attention(*rope, got_caches[0], got_caches[1], slots, *attn, 1,
                               max(SEQ_LENS), 0.2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_caches, want_caches, rtol=1e-5, atol=1e-5)
    assert bool(folded) == (waves == 8)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_folded_rope_real_size_gpu(rows):
    """qwen3-0.6b's attention shape in bf16 (16 q heads, 8 kv heads, head dim 128, q/k norms,
    neox rotary), context 4096, 16 splits: the output and the written keys match the unfused
    kernels'."""
    from krait.ops.paged_attention import paged_attention_triton
    from krait.ops.rope_kv_write import rope_kv_write_triton

    torch.manual_seed(0)
    hq, hkv, d, bs, ctx = 16, 8, 128, 16, 4096
    blocks_per = ctx // bs
    caches = torch.randn(2, rows * blocks_per + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    bt = (torch.randperm(rows * blocks_per, device="cuda") + 1).view(rows, blocks_per).int()
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(rows, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
    positions = torch.full((rows,), ctx - 1, device="cuda", dtype=torch.int64)
    slots = (bt[:, -1].long() * bs + (ctx - 1) % bs)
    ang = torch.rand(ctx, d // 2, device="cuda") * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    qw, kw = (torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    rope = (q, k, v, positions, cs, True, qw, kw, 1e-6)
    ref_caches = caches.clone()
    q_rot = rope_kv_write_triton(*rope, ref_caches[0], ref_caches[1], slots)
    want = paged_attention_triton(q_rot, ref_caches[0], ref_caches[1], qsl, sl, bt, 1, ctx,
                                  d**-0.5, None, num_splits=16).float()
    for _ in range(2):
        got_caches = caches.clone()
        got = decode_split_rope(*rope, got_caches[0], got_caches[1], slots, qsl, sl, bt, d**-0.5,
                                None, 16).float()
        assert (got - want).norm() / want.norm() < 1e-2
        torch.testing.assert_close(got_caches, ref_caches, rtol=1e-2, atol=1e-2)


def test_folded_rope_on_fp8_caches():
    """The fold's K/V write on an fp8 (e4m3) cache converts as rope_kv_write does (to within
    one fp8 step where the fp32 rotary math differs in the last bit), and attention reads it."""
    fp8 = torch.float8_e4m3fn
    rope, attn, caches, slots = _decode_case(True, True, 32, seed=11)
    want_caches = caches.to(fp8)
    q = rope_kv_write_ref(*rope, want_caches[0], want_caches[1], slots)
    want = paged_attention_ref(q, want_caches[0], want_caches[1], *attn, 1, max(SEQ_LENS), 0.2)
    got_caches = caches.to(fp8)
    got = decode_split_rope(*rope, got_caches[0], got_caches[1], slots, *attn, 0.2, None, 4,
                            prefetch=True)
    diff = (got_caches.float() - want_caches.float()).abs()
    assert (diff <= want_caches.float().abs().clamp_min(2**-6) * 2**-3).all()
    assert (diff > 0).float().mean() < 0.01
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

"""rope_attention: the split-KV decode kernel doing rope_kv_write's work (KRAIT_FUSE_ROPE_ATTN)
against the two references composed: the attention output and both caches."""

from __future__ import annotations

import pytest
import torch

from krait.ops.paged_attention import paged_attention_ref, paged_attention_triton
from krait.ops.rope_attention import _rope_args, rope_attention
from krait.ops.rope_kv_write import rope_kv_write_ref
from tests.ops.test_paged_attention_split import _decode_batch


def _case(norm: bool, is_neox: bool, seed: int, hq: int = 8, hkv: int = 2, d: int = 32):
    """A decode batch whose step tokens come from one qkv buffer (strided views), positions
    and slots as the runner makes them (the row's last position, -1 for the padding row)."""
    seq_lens = [1, 130, 0, 517, 64, 1000]  # 1000: the new key in a split's second tile
    _, kc, vc, qsl, sl, bt = _decode_batch(seq_lens, hq, hkv, d=d, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    T = int(qsl[-1])
    qkv = torch.randn(T, (hq + 2 * hkv) * d + 8, generator=g)  # [T, ...] padded: strided views
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d : (hq + 2 * hkv) * d].view(T, hkv, d)
    active = [r for r, s in enumerate(seq_lens) if s > 0]
    bs = kc.shape[1]
    positions = torch.tensor([seq_lens[r] - 1 for r in active])  # int64 [T]
    slots = torch.tensor([int(bt[r, (seq_lens[r] - 1) // bs]) * bs + (seq_lens[r] - 1) % bs
                          for r in active])
    ang = torch.rand(1024, d // 2, generator=g) * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)  # [max_pos, rot_dim] float32
    qw = torch.rand(d, generator=g) + 0.5 if norm else None
    kw = torch.rand(d, generator=g) + 0.5 if norm else None
    rope = (q, k, v, positions, cs, is_neox, qw, kw, 1e-6)
    return rope, (kc, vc), slots, (qsl, sl, bt, 1, max(seq_lens), 0.2)


def _reference(rope, caches, slots, attn):
    kc, vc = caches[0].clone(), caches[1].clone()
    q = rope_kv_write_ref(*rope, kc, vc, slots)
    return paged_attention_ref(q, kc, vc, *attn), kc, vc


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("prefetch", [False, True])
def test_fused_split_kernel_matches_the_two_ops(norm, is_neox, prefetch):
    rope, caches, slots, attn = _case(norm, is_neox, seed=2 * norm + is_neox)
    want, kc_ref, vc_ref = _reference(rope, caches, slots, attn)
    kc, vc = caches[0].clone(), caches[1].clone()
    got = paged_attention_triton(rope[0], kc, vc, *attn, num_splits=4, prefetch=prefetch,
                                 rope=_rope_args(*rope, slots))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("splits", [1, 4])
def test_rope_attention_dispatch(monkeypatch, splits):
    """Split batches take the fused kernel, the others the two launches; both as the refs."""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    rope, caches, slots, attn = _case(True, True, seed=7)
    want, kc_ref, vc_ref = _reference(rope, caches, slots, attn)
    kc, vc = caches[0].clone(), caches[1].clone()
    got = rope_attention(*rope, kc, vc, slots, *attn[:5], 0.2, None, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc, vc_ref)


def test_rope_args_need_a_split_batch():
    rope, caches, slots, attn = _case(False, True, seed=1)
    with pytest.raises(ValueError, match="rope"):
        paged_attention_triton(rope[0], *caches, *attn, num_splits=1,
                               rope=_rope_args(*rope, slots))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
def test_fused_split_kernel_real_size_gpu(prefetch):
    """qwen3's heads in bf16 (16 q / 8 kv, D 128, blocks of 16), one row at 4096 keys and a
    batch of 8: the fused launch against the two Triton launches it replaces (the caches equal,
    the outputs within bf16 noise) and the references."""
    from krait.ops.rope_kv_write import rope_kv_write_triton

    def cuda(t):
        return t.cuda() if isinstance(t, torch.Tensor) else t

    for seed, rows in ((0, 1), (1, 8)):
        rope, caches, slots, attn = _gpu_case(rows, seed)
        rope = tuple(cuda(t) for t in rope)
        kc0, vc0 = (c.cuda() for c in caches)
        slots = slots.cuda()
        attn = tuple(cuda(t) for t in attn)
        kc1, vc1 = kc0.clone(), vc0.clone()
        q1 = rope_kv_write_triton(*rope, kc1, vc1, slots)
        want = paged_attention_triton(q1, kc1, vc1, *attn, num_splits=16, prefetch=prefetch)
        kc2, vc2 = kc0.clone(), vc0.clone()
        got = paged_attention_triton(rope[0], kc2, vc2, *attn, num_splits=16, prefetch=prefetch,
                                     rope=_rope_args(*rope, slots))
        assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        ref, _, _ = _reference(rope, (kc0, vc0), slots, attn)
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


def _gpu_case(rows: int, seed: int):
    """`_case` at qwen3's sizes in bf16, rows of up to 4096 keys."""
    hq, hkv, d, bs = 16, 8, 128, 16
    seq_lens = [4096, 900, 2000, 1000, 64, 1, 3000, 1500][:rows]
    _, kc, vc, qsl, sl, bt = _decode_batch(seq_lens, hq, hkv, d=d, bs=bs, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    T = rows
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).bfloat16()
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    positions = torch.tensor([s - 1 for s in seq_lens])
    slots = torch.tensor([int(bt[r, (s - 1) // bs]) * bs + (s - 1) % bs
                          for r, s in enumerate(seq_lens)])
    ang = torch.rand(8192, d // 2, generator=g) * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    qw = (torch.rand(d, generator=g) + 0.5).bfloat16()
    kw = (torch.rand(d, generator=g) + 0.5).bfloat16()
    rope = (q, k, v, positions, cs, True, qw, kw, 1e-6)
    return rope, (kc.bfloat16(), vc.bfloat16()), slots, (qsl, sl, bt, 1, max(seq_lens), d**-0.5)

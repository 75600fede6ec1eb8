import pytest
import torch

from krait.ops.rope_kv_write import rope_kv_write_ref, rope_kv_write_triton


def _case(norm: bool, is_neox: bool, rot_dim: int, seed: int, dtype=torch.float32,
          heads: tuple[int, int, int] = (4, 2, 32)):
    g = torch.Generator().manual_seed(seed)
    (Hq, Hkv, D), T, blocks, bs = heads, 7, 6, 4
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D + 8, generator=g).to(dtype)  # padded rows: strided views
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D : (Hq + 2 * Hkv) * D].view(T, Hkv, D)
    positions = torch.randint(0, 50, (T,), generator=g)
    ang = torch.rand(64, min(rot_dim, D) // 2, generator=g) * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    qw = torch.rand(D, generator=g).to(dtype) + 0.5 if norm else None
    kw = torch.rand(D, generator=g).to(dtype) + 0.5 if norm else None
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    slots[3] = -1
    caches = torch.randn(2, blocks, bs, Hkv, D, generator=g).to(dtype)
    return (q, k, v, positions, cs, is_neox, qw, kw, 1e-6), caches, slots


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_triton_matches_reference(norm, is_neox, rot_dim):
    args, caches, slots = _case(norm, is_neox, rot_dim, seed=rot_dim + 2 * norm + is_neox)
    c_ref, c_tri = caches.clone(), caches.clone()
    q_ref = rope_kv_write_ref(*args, c_ref[0], c_ref[1], slots)
    q_tri = rope_kv_write_triton(*args, c_tri[0], c_tri[1], slots)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_tri, c_ref, rtol=1e-5, atol=1e-5)
    # slot -1 wrote nothing; untouched slots kept their (random) contents
    written = set(slots[slots >= 0].tolist())
    flat = caches.view(2, -1, *caches.shape[3:])
    for s in range(flat.shape[1]):
        if s not in written:
            assert torch.equal(c_tri.view_as(flat)[:, s], flat[:, s])


@pytest.mark.parametrize("norm", [False, True])
def test_head_blocks_with_partial_last_blocks(norm):
    """Head dim 128: 4 heads a program at a few tokens, so 6 q heads take two programs (the
    second half empty) and 3 kv heads one, partly masked."""
    args, caches, slots = _case(norm, True, 128, seed=11, heads=(6, 3, 128))
    c_ref, c_tri = caches.clone(), caches.clone()
    q_ref = rope_kv_write_ref(*args, c_ref[0], c_ref[1], slots)
    q_tri = rope_kv_write_triton(*args, c_tri[0], c_tri[1], slots)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_tri, c_ref, rtol=1e-5, atol=1e-5)


def test_reference_equals_the_composed_ops():
    from krait.ops.kv_write import write_kv_ref
    from krait.ops.rms_norm import rms_norm_ref
    from krait.ops.rotary import apply_rotary_ref

    (q, k, v, pos, cs, neox, qw, kw, eps), caches, slots = _case(True, True, 32, seed=9)
    c1, c2 = caches.clone(), caches.clone()
    got = rope_kv_write_ref(q, k, v, pos, cs, neox, qw, kw, eps, c1[0], c1[1], slots)
    qn = torch.stack([rms_norm_ref(q[:, h].contiguous(), qw, eps) for h in range(q.shape[1])], 1)
    kn = torch.stack([rms_norm_ref(k[:, h].contiguous(), kw, eps) for h in range(k.shape[1])], 1)
    qr, kr = apply_rotary_ref(qn, kn, pos, cs, neox)
    write_kv_ref(kr, v, c2[0], c2[1], slots)
    torch.testing.assert_close(got, qr)
    torch.testing.assert_close(c1, c2)

import math

import pytest
import torch

from krait.ops.rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton


def cos_sin_cache(max_positions, rot_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, rot_dim]


def inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=g)  # [T, Hq, D]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)  # [T, Hkv, D]
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    return q, k, positions


def naive(x, positions, rot_dim, is_neox, base=10000.0):
    """Rotates each pair by angle pos * base^(-2i/rot_dim), in float64."""
    out = x.double().clone()
    half = rot_dim // 2
    for t, pos in enumerate(positions.tolist()):
        for i in range(half):
            a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
            theta = pos * base ** (-2 * i / rot_dim)
            c, s = math.cos(theta), math.sin(theta)
            xa, xb = x[t, :, a].double(), x[t, :, b].double()
            out[t, :, a], out[t, :, b] = xa * c - xb * s, xb * c + xa * s
    return out


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_reference_matches_naive(is_neox, rot_dim):
    q, k, positions = inputs(5, 4, 2, 16)
    q_out, k_out = apply_rotary(q, k, positions, cos_sin_cache(64, rot_dim), is_neox)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_out.double(), naive(q, positions, rot_dim, is_neox), **tol)
    torch.testing.assert_close(k_out.double(), naive(k, positions, rot_dim, is_neox), **tol)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim,head_dim", [(32, 32), (16, 40), (24, 24)])
def test_triton_matches_reference(is_neox, rot_dim, head_dim):
    q, k, positions = inputs(7, 6, 2, head_dim, seed=1)
    cache = cos_sin_cache(64, rot_dim)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache, is_neox)
    q_out, k_out = apply_rotary_triton(q, k, positions, cache, is_neox)
    torch.testing.assert_close(q_out, q_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, k_ref, atol=1e-4, rtol=1e-4)


def test_triton_strided_views_and_inputs_untouched():
    q, k, positions = inputs(5, 4, 2, 16, seed=2)
    qkv = torch.cat([q.flatten(1), k.flatten(1), torch.randn(5, 32)], dim=1)
    q_view, k_view = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    before = qkv.clone()
    cache = cos_sin_cache(64, 16)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache, True)
    q_out, k_out = apply_rotary_triton(q_view, k_view, positions, cache, True)
    torch.testing.assert_close(q_out, q_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, k_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(qkv, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("is_neox", [True, False])
def test_gpu_triton_matches_reference_real_sizes(is_neox):
    q, k, _ = inputs(4096, 32, 8, 128)
    q, k = q.cuda().bfloat16(), k.cuda().bfloat16()
    positions = torch.randint(0, 8192, (4096,), device="cuda")
    cache = cos_sin_cache(8192, 128).cuda()
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache, is_neox)
    q_out, k_out = apply_rotary(q, k, positions, cache, is_neox)
    torch.testing.assert_close(q_out, q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, k_ref, atol=2e-2, rtol=2e-2)

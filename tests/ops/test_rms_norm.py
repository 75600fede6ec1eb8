import pytest
import torch

from krait.ops.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)


def inputs(num_tokens, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, dim, generator=g).to(dtype)  # [T, D]
    residual = torch.randn(num_tokens, dim, generator=g).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    return x, residual, weight


def naive(x, weight, eps):
    h = x.double()
    return weight.double() * h / torch.sqrt(h.square().mean(-1, keepdim=True) + eps)


def test_reference_matches_naive():
    x, residual, weight = inputs(7, 48)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6).double(), naive(x, weight, 1e-6), **tol)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out.double(), naive(x + residual, weight, 1e-5), **tol)


def test_reference_rounds_like_hf_in_bf16():
    x, residual, weight = inputs(5, 64, torch.bfloat16)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(rms_norm_ref(x, weight, 1e-6), weight * h.to(x.dtype))


@pytest.mark.parametrize("dim", [64, 100])
def test_triton_matches_reference(dim):
    x, residual, weight = inputs(6, dim, seed=1)
    x_copy, res_copy = x.clone(), residual.clone()
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                               atol=1e-4, rtol=1e-4)
    out, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(summed, ref_summed, atol=1e-6, rtol=1e-6)
    assert torch.equal(x, x_copy) and torch.equal(residual, res_copy)


def test_scaled_residual_add_matches_the_unfused_multiply():
    # Granite: residual + out * residual_multiplier, the product rounded first
    x, residual, weight = inputs(6, 64, seed=2)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6, x_scale=0.22)
    ref_out, ref_summed = fused_add_rms_norm_ref(x * 0.22, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed) and torch.equal(out, ref_out)
    t_out, t_summed = fused_add_rms_norm_triton(x, residual, weight, 1e-6, x_scale=0.22)
    torch.testing.assert_close(t_summed, ref_summed, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(t_out, ref_out, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_matches_reference_real_sizes():
    # bf16 rounding is checked here only: the interpreter truncates float32 -> bfloat16.
    x, residual, weight = (t.cuda() for t in inputs(4096, 4096, torch.bfloat16))
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                               atol=2e-2, rtol=2e-2)
    for scale in (1.0, 0.22):
        out, summed = fused_add_rms_norm(x, residual, weight, 1e-6, scale)
        ref_out, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-6, scale)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)

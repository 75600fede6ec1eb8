import pytest
import torch

from krait.ops.activation import (
    relu2,
    relu2_ref,
    relu2_triton,
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_reference_matches_naive():
    x = randn(5, 2 * 24)
    g, u = x[:, :24].double(), x[:, 24:].double()
    torch.testing.assert_close(silu_and_mul(x).double(), g / (1 + torch.exp(-g)) * u)
    y = randn(3, 7, seed=1)
    torch.testing.assert_close(relu2(y).double(), torch.where(y > 0, y.double() ** 2, 0.0))


@pytest.mark.parametrize("inter", [24, 1500])
def test_triton_matches_reference(inter):
    x = randn(6, 2 * inter, seed=2)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-4, rtol=1e-4)
    y = randn(6, inter, seed=3)
    torch.testing.assert_close(relu2_triton(y), relu2_ref(y), atol=1e-4, rtol=1e-4)


def test_triton_strided_rows():
    x = randn(4, 2 * 40, seed=4)[:, :80]
    wide = torch.cat([x, randn(4, 16, seed=5)], dim=1)[:, :80]  # row stride 96
    torch.testing.assert_close(silu_and_mul_triton(wide), silu_and_mul_ref(x), atol=1e-4, rtol=1e-4)
    y = randn(8, 6, seed=6).t()  # non-contiguous
    torch.testing.assert_close(relu2_triton(y), relu2_ref(y), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_matches_reference_real_sizes():
    x = randn(4096, 2 * 11008).cuda().bfloat16()
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(relu2(x), relu2_ref(x), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_matches_torch(dtype, monkeypatch):
    """The gate a strided view (the second half of each head's q_proj rows), as Qwen3-Next's
    attention hands it over; fp32 within an ulp, bf16 within a rounding step (the interpreter's casts
    truncate)."""
    from krait.ops.activation import sigmoid_gate_ref, sigmoid_gate_triton

    T, H, D = 3, 5, 24
    qg = torch.randn(T, H, 2 * D).to(dtype)
    gate = qg[..., D:]
    x = torch.randn(T, H * D).to(dtype)
    want = sigmoid_gate_ref(x, gate)
    got = sigmoid_gate_triton(x, gate)
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # exp: an ulp
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(want, x * torch.sigmoid(gate.reshape(T, -1)))

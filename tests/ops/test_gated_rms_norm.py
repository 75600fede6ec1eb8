"""gated_rms_norm (reference and Triton) against a float64 per-token loop of HF's formula."""

import pytest
import torch

from krait.ops import gated_rms_norm as grn

IMPL = {"ref": grn.gated_rms_norm_ref, "triton": grn.gated_rms_norm_triton}


def _oracle(x, z, weight, eps, group_size):
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        h = x[t].double()
        if z is not None:
            zt = z[t].double()
            h = h * zt * torch.sigmoid(zt)
        for g0 in range(0, x.shape[1], group_size):
            grp = h[g0:g0 + group_size]
            h[g0:g0 + group_size] = grp / torch.sqrt(grp.square().mean() + eps)
        # HF rounds the normalised value to x's dtype before the weight multiplies it.
        out[t] = weight.double() * h.to(x.dtype).double()
    return out


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dim,group_size", [(96, 96), (96, 24), (64, 16)])
def test_matches_oracle(impl, gated, dim, group_size):
    g = torch.Generator().manual_seed(dim + group_size)
    x = torch.randn(37, dim, generator=g)  # [T, D]
    z = torch.randn(37, dim, generator=g) if gated else None
    weight = torch.randn(dim, generator=g)
    out = IMPL[impl](x, z, weight, 1e-5, group_size)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _oracle(x, z, weight, 1e-5, group_size),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_bf16_and_strided_input(impl):
    g = torch.Generator().manual_seed(0)
    both = torch.randn(19, 2, 80, generator=g).bfloat16()  # [T, 2, D]: x and z interleaved
    x, z = both[:, 0], both[:, 1]
    weight = torch.randn(80, generator=g).bfloat16()
    out = IMPL[impl](x, z, weight, 1e-6, 40)
    assert out.dtype == torch.bfloat16
    want = _oracle(x, z, weight, 1e-6, 40)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group_size", [4096, 512])
def test_triton_matches_ref_real_size(group_size):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8 * 2048, 4096, device="cuda", generator=g).bfloat16()  # [T, D]
    z = torch.randn(8 * 2048, 4096, device="cuda", generator=g).bfloat16()
    weight = torch.randn(4096, device="cuda", generator=g).bfloat16()
    ref = grn.gated_rms_norm_ref(x, z, weight, 1e-5, group_size)
    tri = grn.gated_rms_norm_triton(x, z, weight, 1e-5, group_size)
    torch.testing.assert_close(tri, ref, atol=2e-2, rtol=2e-2)


def _unfused_gate_after(x, z, weight, eps, group_size):
    """Qwen3-Next's norm as the layer formed it before the fused kernel: each group (head) a
    row of the plain norm, then the silu(z) gate in torch."""
    T, D = x.shape
    normed = grn.gated_rms_norm_ref(x.reshape(T * D // group_size, group_size), None, weight,
                                    eps, group_size)
    gate = torch.nn.functional.silu(z.reshape(T * D // group_size, group_size).float())
    return (normed.float() * gate).to(x.dtype).reshape(T, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_after_norm_with_a_shared_group_weight(dtype):
    """gate_after (HF Qwen3NextRMSNormGated) over [T, heads * V] with z a strided view and one
    head's weight [V]: the reference equals the unfused norm-then-gate exactly; the kernel
    equals it in float32 (to float32 rounding: its exp is not torch's); in bf16 the
    interpreter truncates where the device rounds (the device check: test_gate_after_real_size)."""
    g = torch.Generator().manual_seed(11)
    heads, V = 4, 24
    both = torch.randn(13, 2, heads * V, generator=g).to(dtype)  # x and z interleaved
    x, z = both[:, 0].contiguous(), both[:, 1]
    weight = torch.randn(V, generator=g).to(dtype)
    want = _unfused_gate_after(x, z, weight, 1e-6, V)
    ref = grn.gated_rms_norm_ref(x, z, weight, 1e-6, V, gate_after=True)
    assert torch.equal(ref, want)
    tri = grn.gated_rms_norm_triton(x, z, weight, 1e-6, V, gate_after=True)
    assert tri.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(tri, want, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(tri.float(), want.float(), atol=0, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gate_after_real_size():
    """Qwen3-Next-80B's GDN output norm (32 heads x 128, bf16) fused with its gate, against the
    unfused norm-then-gate in torch: equal but for rare one-ulp flips (exp's last bit)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, V = 32, 128
    x = torch.randn(4096, heads * V, device="cuda", generator=g).bfloat16()
    # z a column slice of the projection, as the layer has it
    z = torch.randn(4096, 3 * heads * V, device="cuda", generator=g).bfloat16()[:, heads * V:
                                                                                2 * heads * V]
    weight = torch.randn(V, device="cuda", generator=g).bfloat16()
    want = _unfused_gate_after(x, z, weight, 1e-6, V)
    tri = grn.gated_rms_norm_triton(x, z, weight, 1e-6, V, gate_after=True)
    # one bf16 ulp is up to 2^-7 relative (1.6e-2 near a power of two's bottom)
    torch.testing.assert_close(tri.float(), want.float(), atol=0, rtol=1.6e-2)
    assert (tri != want).float().mean().item() < 1e-2

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

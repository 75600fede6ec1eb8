"""RMSNorm (krait/layers/norm.py) and the decoders' pre-norm (krait/models/decoder.py)."""

import torch

from krait.layers.norm import RMSNorm
from krait.models.decoder import pre_norm
from krait.ops.rms_norm import fused_add_rms_norm_ref, rms_norm_ref


def _norm(dim: int = 48) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(1)))
    return norm


def test_residual_add_and_norm_out_of_place():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 48, generator=g), torch.randn(3, 48, generator=g)
    norm, r_before = _norm(), r.clone()
    h, summed = pre_norm(norm, x, r, x_scale=0.5)
    want_h, want_sum = fused_add_rms_norm_ref(x, r, norm.weight, 1e-6, 0.5)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(summed, want_sum)
    assert torch.equal(r, r_before)  # the incoming residual is left as it was


def test_first_layer_has_no_residual():
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    norm = _norm()
    h, summed = pre_norm(norm, x, None, x_scale=0.5)  # the embedding is never scaled
    torch.testing.assert_close(h, rms_norm_ref(x, norm.weight, 1e-6))
    assert summed is x

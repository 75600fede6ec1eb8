"""PendingNorm: a layer's pre-norm handed to the projection that reads it (krait/layers/norm.py)."""

import pytest
import torch
import torch.nn.functional as F

from krait.layers.linear import Linear, MergedLinear
from krait.layers.norm import PendingNorm, RMSNorm
from krait.ops.rms_norm import fused_add_rms_norm_ref, rms_norm_ref


def _norm(dim: int = 48) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(1)))
    return norm


@pytest.mark.parametrize("fused", [False, True])
def test_projection_of_a_pending_norm_matches_norm_then_linear(fused, monkeypatch):
    if fused:  # the one-row GEMV with the norm in its prologue, interpreted on CPU
        monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
        monkeypatch.setenv("KRAIT_FUSE_NORM", "1")
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(1, 48, generator=g), torch.randn(1, 48, generator=g)
    norm, proj = _norm(), MergedLinear(48, [16, 8])
    torch.nn.init.normal_(proj.weight, generator=g)
    r_before = r.clone()
    h = PendingNorm(norm, x, r, x_scale=0.5)
    with pytest.raises(RuntimeError, match="read the norm"):
        h.residual  # noqa: B018 - nothing has read it yet
    y = proj(h)
    want_h, want_sum = fused_add_rms_norm_ref(x, r, norm.weight, 1e-6, 0.5)
    torch.testing.assert_close(y, F.linear(want_h, proj.weight), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.residual, want_sum)
    assert torch.equal(r, r_before)  # the incoming residual is left as it was (out of place)


def test_first_layer_and_several_readers():
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    norm, a, b = _norm(), Linear(48, 8), Linear(48, 4)
    h = PendingNorm(norm, x, None)  # the first layer: no residual yet
    value = h.value()
    torch.testing.assert_close(value, rms_norm_ref(x, norm.weight, 1e-6))
    assert h.residual is x
    assert h.value() is value  # computed once
    # projections after value(): read the computed activations, no second norm
    torch.testing.assert_close(a(h), F.linear(value, a.weight, a.bias))
    torch.testing.assert_close(b(h), F.linear(value, b.weight, b.bias))


@pytest.mark.parametrize("fused", [False, True])
def test_a_deferred_projection_runs_in_the_next_norm(fused, monkeypatch):
    """KRAIT_NORM_EPILOGUE=1: a layer's last projection comes back unrun and the next norm runs
    it with the residual add (and, through the GEMV, itself in the epilogue)."""
    from krait.layers.deferred import DeferredLinear

    monkeypatch.setenv("KRAIT_NORM_EPILOGUE", "1")
    if fused:
        monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
        monkeypatch.setenv("KRAIT_GEMV", "1")  # a [48, 32] weight is not narrow
    g = torch.Generator().manual_seed(3)
    gate_up, r = torch.randn(1, 64, generator=g), torch.randn(1, 48, generator=g)
    down, norm, nxt = Linear(32, 48), _norm(), Linear(48, 8)
    out = down.forward_silu_mul(gate_up, defer=True)
    assert isinstance(out, DeferredLinear) == fused  # only where the GEMV takes the call
    h = PendingNorm(norm, out, r, x_scale=0.5)
    y = nxt(h)
    branch = F.linear(F.silu(gate_up[:, :32]) * gate_up[:, 32:], down.weight, down.bias)
    want_h, want_sum = fused_add_rms_norm_ref(branch, r, norm.weight, 1e-6, 0.5)
    torch.testing.assert_close(h.residual, want_sum, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, F.linear(want_h, nxt.weight, nxt.bias), atol=1e-5, rtol=1e-5)
    assert not isinstance(down.forward_silu_mul(gate_up), DeferredLinear)  # not asked: runs

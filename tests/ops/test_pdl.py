"""Programmatic dependent launch is on by default, GPU-only: the interpreter has no grid-dependency
instructions, so CPU tensors never ask for it (the sm_90 compile of the PDL variants is in
test_sm90_compile.py; their effect is measured by `scripts/gpu_check.sh ab`)."""

import torch

from krait.ops.pdl import use_pdl


def test_pdl_is_off_on_cpu(monkeypatch):
    t = torch.zeros(2)
    monkeypatch.delenv("KRAIT_PDL", raising=False)
    assert not use_pdl(t)
    monkeypatch.setenv("KRAIT_PDL", "1")
    assert not use_pdl(t)  # CPU tensors: never


def test_kernels_run_unchanged_with_pdl_requested_on_cpu(monkeypatch):
    from krait.ops.rms_norm import rms_norm_ref, rms_norm_triton

    monkeypatch.setenv("KRAIT_PDL", "1")
    x, w = torch.randn(3, 64), torch.rand(64)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                               atol=1e-5, rtol=1e-5)

"""Programmatic dependent launch is GPU-only: the interpreter has no grid-dependency
instructions, so CPU tensors never ask for it (the sm_90 compile of the PDL variants is in
test_sm90_compile.py)."""

import torch

from krait.ops.pdl import pdl_args, use_pdl


def test_pdl_is_off_on_cpu():
    assert not use_pdl(torch.zeros(2))
    assert pdl_args(False) == {"PDL": False}
    assert pdl_args(True) == {"PDL": True, "launch_pdl": True}


def test_kernels_run_unchanged_on_cpu():
    from krait.ops.rms_norm import rms_norm_ref, rms_norm_triton

    x, w = torch.randn(3, 64), torch.rand(64)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                               atol=1e-5, rtol=1e-5)

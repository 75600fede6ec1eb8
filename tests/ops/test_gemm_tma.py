"""The decode-batch TMA GEMM (krait/ops/gemm_tma.py) against F.linear; its dispatch in
krait/ops/linear.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from krait.ops import linear as linear_ops
from krait.ops.gemm_tma import gemm_tma, gemm_tma_config


def _inputs(m, n, k, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)  # [N, K]
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, b


# edges in M, N and K (boxes past them read zeros), the bias
@pytest.mark.parametrize("m,n,k,bias", [(5, 40, 64, False), (70, 130, 96, True),
                                        (64, 64, 200, False)])
def test_matches_linear(m, n, k, bias):
    x, w, b = _inputs(m, n, k, seed=m + n)
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, STAGES=2)
    y = gemm_tma(x, w, b if bias else None, cfg)
    torch.testing.assert_close(y, F.linear(x, w, b if bias else None), atol=1e-4, rtol=1e-4)


def test_config_covers_the_sms():
    # granite in_proj at batch 256: 2 x 67 tiles of 128 x 128; its out_proj (2048 columns)
    # takes 64-wide tiles to reach the SMs; 64 rows: 64-row tiles
    cfg = gemm_tma_config(256, 8512, 2048)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (128, 128)
    assert gemm_tma_config(256, 2048, 4096)["BLOCK_N"] == 64
    assert gemm_tma_config(64, 8512, 2048)["BLOCK_M"] == 64


def test_dispatch_knob(monkeypatch):
    """KRAIT_DECODE_GEMM=1 sends decode batches of 16-256 rows against big 16-bit weights to
    the TMA GEMM; off by default, never for one row or a prefill."""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    calls = []
    monkeypatch.setattr(linear_ops, "gemm_tma", lambda *a, **k: calls.append(a[0].shape[0]))
    w = torch.zeros(2048, 2048, dtype=torch.bfloat16)
    for m in (1, 16, 256, 257):
        monkeypatch.delenv("KRAIT_DECODE_GEMM", raising=False)
        linear_ops.linear(torch.zeros(m, 2048, dtype=torch.bfloat16), w)
        monkeypatch.setenv("KRAIT_DECODE_GEMM", "1")
        linear_ops.linear(torch.zeros(m, 2048, dtype=torch.bfloat16), w)
    assert calls == [16, 256]
    linear_ops.linear(torch.zeros(64, 1024), torch.zeros(4096, 1024))  # float32: cuBLAS
    assert calls == [16, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 64, 256])
@pytest.mark.parametrize("n,k", [(8512, 2048), (2048, 4096), (16384, 2048), (100352, 2048)])
def test_real_sizes_gpu(m, n, k):
    """The shipped configs' projections at decode batch sizes, bf16."""
    x, w, b = _inputs(m, n, k, torch.bfloat16, "cuda", seed=n)
    want = F.linear(x.float(), w.float(), b.float())
    got = gemm_tma(x, w, b)
    assert ((got.float() - want).norm() / want.norm()) < 1e-2

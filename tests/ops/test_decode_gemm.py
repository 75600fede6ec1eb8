"""The decode-batch GEMM (krait/ops/decode_gemm.py) against F.linear: on CPU through the
interpreter at small sizes, on the GPU at the shipped configs' projection shapes."""

import pytest
import torch

from krait.ops import linear as linear_mod
from krait.ops.decode_gemm import decode_gemm_ref, decode_gemm_triton


@pytest.mark.parametrize("m,n,k,bias", [(9, 24, 32, False), (20, 40, 48, True), (33, 16, 40, False)])
def test_matches_reference_fp32(m, n, k, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(decode_gemm_triton(x, w, b), decode_gemm_ref(x, w, b),
                               atol=1e-4, rtol=1e-4)


def test_strided_input_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 64, generator=g)[:, :32]  # row stride 64
    w = torch.randn(16, 32, generator=g)
    torch.testing.assert_close(decode_gemm_triton(x, w), decode_gemm_ref(x, w), atol=1e-4, rtol=1e-4)


def test_linear_takes_it_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_mod, "decode_gemm_triton", lambda *a: calls.append(a[0].shape[0])
                        or decode_gemm_ref(*a))
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    w = torch.randn(8, 16)
    for rows in (4, 16, 600):
        linear_mod.linear(torch.randn(rows, 16), w)
    assert calls == []  # off by default
    monkeypatch.setenv("KRAIT_DECODE_GEMM", "1")
    monkeypatch.setenv("KRAIT_GEMV", "0")
    for rows in (4, 9, 512, 513):
        linear_mod.linear(torch.randn(rows, 16), w)
    assert calls == [9, 512]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [16, 64, 256])
@pytest.mark.parametrize("n,k", [(8512, 2048), (2048, 4096), (16384, 2048), (2048, 8192), (3072, 2048)])
def test_gpu_real_sizes_bf16(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    out = decode_gemm_triton(x, w, b)
    ref = decode_gemm_ref(x.float(), w.float(), b.float())
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)

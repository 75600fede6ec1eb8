"""Decode-batch GEMM: y = x @ W^T (+ b) for x [M, K] with 8 < M <= 512 (opt-in,
`KRAIT_DECODE_GEMM=1`; the choice is krait/ops/linear.py's).

At these row counts cuBLAS picks tiles that leave most of the H200's 132 SMs idle (session 9
profile of granite-4.0-h-micro at batch 256, bf16 SSM state): the Mamba in_proj
[256, 2048] x [8512, 2048]^T ran on a 256x128-tile grid of ~68 CTAs, 30 us a call for
8.9 GFLOP (~300 TFLOP/s); out_proj [256, 4096] x [2048, 4096]^T on ~30 CTAs, 16 us. Together
~1 ms of a 9.7 ms step.

Program p owns one [BLOCK_M, BLOCK_N] tile of y and loops over K with tl.dot (wgmma on sm_90),
accumulating in float32; y (and the bias add) rounded once, as cuBLAS does. Programs walk M
fastest, so the ones that share a column tile of W run together and W's re-reads hit L2. Tile
sizes are autotuned per weight shape and row-count bucket (a power of two), never per row count:
decode graphs are captured at fixed sizes, and each bucket is tuned while the largest graph of
it warms up.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops.fused_moe import _mma

MIN_M, MAX_M = 9, 512  # below: krait/ops/gemv.py or cuBLAS; above: prefill, cuBLAS


@triton.jit
def _decode_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, m_bucket,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _gpu_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in [
            (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
            (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
            (256, 64, 64, 8, 3), (256, 128, 64, 8, 3),
        ]
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """No tile taller than the bucket (past 64 rows: wgmma's smallest)."""
    rows = max(64, named_args["m_bucket"])
    return [c for c in configs if c.kwargs["BLOCK_M"] <= rows]


def _quick_bench(fn, quantiles):
    # a short measurement per config: the tuning runs at start-up, while graphs are captured
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_decode_gemm_tuned = triton.autotune(
    configs=_gpu_configs(), key=["N", "K", "m_bucket", "HAS_BIAS", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": _prune}, do_bench=_quick_bench,
)(triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(_decode_gemm_kernel))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def decode_gemm_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K], weight [N, K] (unit stride along K for both) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"decode_gemm: weight is [N, {weight.shape[1]}], input gives K={k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    interp = _interpreting()
    precision = "upcast" if interp else ("ieee" if x.dtype == torch.float32 else "tf32")
    args = (x, weight, bias if bias is not None else weight, y,
            m, n, k, triton.next_power_of_2(m), x.stride(0), weight.stride(0), y.stride(0))
    kw = dict(HAS_BIAS=bias is not None, DOT_PRECISION=precision)
    if interp:
        bm, bn, bk = 16, min(64, max(16, triton.next_power_of_2(n))), 16
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _decode_gemm_kernel[grid](*args, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn,
                                  BLOCK_K=bk, **kw)
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _decode_gemm_tuned[grid](*args, **kw)
    return y


def decode_gemm_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Torch reference of `decode_gemm_triton`."""
    return torch.nn.functional.linear(x, weight, bias)

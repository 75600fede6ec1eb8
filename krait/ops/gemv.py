"""Skinny linear layer for decode batches: y = x @ W^T (+ b) with x [M, K], M <= 8.

cuBLAS reaches only 0.8-1.6 TB/s on the 4-13 MB projections of a small model at M = 1 (profiled on
the H200, docs/benchmarks.md): a decode step there is bound by reading the weights once, so a kernel
that streams W at copy bandwidth is the whole game. Each program owns BLOCK_N output columns for all
M rows and streams its BLOCK_N rows of W over K once, accumulating in float32.

Opt-in while it is unmeasured on the GPU: `KRAIT_GEMV=1` routes eligible `Linear` calls here
(`scripts/bench_gemv.py` compares it with cuBLAS at the decode shapes of the shipped configs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import use_triton

MAX_M = 8


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [M, N, K]
        acc += tl.sum(prod, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes by shape (never by anything that changes between steps of one batch size).
    The [BLOCK_M, BLOCK_N, BLOCK_K] product stays at 4096 elements (32 float32 registers a thread
    at 4 warps)."""
    block_m = triton.next_power_of_2(max(m, 1))
    block_n = 8
    block_k = max(64, min(512, 4096 // (block_m * block_n), triton.next_power_of_2(k)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                config: dict[str, int] | None = None) -> Tensor:
    """x [M, K] (M <= 8), weight [N, K] with unit stride along K -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(f"gemv_triton serves at most {MAX_M} rows, got {m}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    cfg = dict(config or default_config(m, n, k))
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, **cfg,
    )
    return y


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through gemv_triton for decode-sized inputs when KRAIT_GEMV=1."""
    if (
        os.environ.get("KRAIT_GEMV") == "1"
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_M
        and use_triton(x)
    ):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)

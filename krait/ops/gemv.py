"""Skinny linear layer for decode batches: y = x @ W^T (+ b) with x [M, K], M <= 8.

cuBLAS reaches only 0.8-1.6 TB/s on the 4-13 MB projections of a small model at M = 1 (profiled on
the H200, docs/benchmarks.md): a decode step there is bound by reading the weights once, so a kernel
that streams W at copy bandwidth is the whole game. Program (n, s) owns BLOCK_N output columns for
all M rows and streams its BLOCK_N rows of W over the s-th of SPLIT_K slices of K, accumulating in
float32. With SPLIT_K > 1 (narrow outputs: too few column tiles to keep every SM streaming) each
program writes its partial sums and bumps a per-tile counter; the last program of a tile adds the
partials in slice order (deterministic), writes y and resets the counter for the next launch — one
launch, no memset, graph-safe.

Measured on the H200 (`scripts/bench_gemv.py`, docs/benchmarks.md) it wins at one row against a
narrow weight (qwen3-0.6b o_proj 12.6 -> 5.2 us) and loses elsewhere, so by default only those
calls come here; `KRAIT_GEMV=1` sends every call with M <= 8, `KRAIT_GEMV=0` none.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import use_triton
from krait.ops.activation import silu_and_mul
from krait.ops.arrival import arrival_counters
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl

MAX_M = 8
_COUNTERS: dict[torch.device, Tensor] = {}  # per-tile arrival counters, always back to zero


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Everything lives in one [BLOCK_M, BLOCK_N, BLOCK_K] layout: x is loaded broadcast over N
    # (repeated reads hit L1) so that no layout conversion, and no shared-memory round trip
    # with barriers, sits in the loop; products accumulate elementwise and K is reduced once.
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_wn  # [1, BLOCK_N, 1]
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm + 0 * offs_n[None, :, None]  # [M, N, 1]
    w_ok = n_ok[None, :, None]
    x_ok = m_ok[:, None, None] & w_ok
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # the next weight tile is loaded before the current one is used; the first before the wait
    # for the previous kernel (weights are constant: with PDL it streams while that one drains)
    k = (k_lo + offs_k)[None, None, :]
    w = tl.load(w_rows + k, mask=w_ok & (k < k_hi), other=0.0)
    pdl_wait(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = (k0 + offs_k)[None, None, :]
        k_ok = k < k_hi
        x = tl.load(x_rows + k, mask=x_ok & k_ok, other=0.0)
        if SILU_MUL:  # x holds [gate | up] of width 2K: the input is silu(gate) * up
            up = tl.load(x_rows + K + k, mask=x_ok & k_ok, other=0.0)
            g = x.to(tl.float32)
            # rounded to the activation dtype, as silu_and_mul hands it to the projection
            x = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(up.dtype)
        k_next = k + BLOCK_K
        w_next = tl.load(w_rows + k_next, mask=w_ok & (k_next < k_hi), other=0.0)
        acc3 += x.to(tl.float32) * w.to(tl.float32)  # [M, N, K]
        w = w_next
    acc = tl.sum(acc3, axis=2)  # [M, N]
    mn_ok = m_ok[:, None] & n_ok[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mn_ok)
    else:
        # partials [SPLIT_K, M, N] in float32
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mn_ok)
        arrived = tl.atomic_add(count_ptr + pid_n, 1)  # acq_rel: orders the store above
        if arrived == SPLIT_K - 1:  # the last slice of this tile to finish sums them all
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=mn_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mn_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict[str, int]:
    """Tile sizes and split by shape (never by anything that changes between steps of one batch
    size). Several rows: the [BLOCK_M, BLOCK_N, BLOCK_K] product stays at 4096 elements (32
    float32 registers a thread at 4 warps); K is split until the programs cover the SMs about
    four times."""
    block_m = triton.next_power_of_2(max(m, 1))
    block_n = 8
    if block_m == 1:
        # one row (H200 sweep, session 4): 8 warps and 512-wide K tiles won at every shape; K is
        # split only while each program would stream more than 2048 columns and the tiles cover
        # the SMs fewer than four times (qwen3 down and granite down split, qwen3 o does not)
        block_k = max(64, min(512, triton.next_power_of_2(k)))
        tiles = triton.cdiv(n, block_n)
        split = 1
        while k // split > 2048 and tiles * split < 4 * num_sms and split < 16:
            split *= 2
        return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=8)
    block_k = max(64, min(512, 4096 // (block_m * block_n), triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 4 * num_sms and k // (2 * split) >= 2 * block_k and split < 16:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                config: dict[str, int] | None = None, silu_mul: bool = False) -> Tensor:
    """x [M, K] (M <= 8), weight [N, K] with unit stride along K -> [M, N] in x's dtype.
    With `silu_mul`, x is [M, 2K] = [gate | up] and the input is silu(gate) * up (fused
    silu_and_mul: one launch and no [M, K] intermediate)."""
    m = x.shape[0]
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"gemv_triton: weight is [N, {weight.shape[1]}], input gives K={k}")
    if m > MAX_M:
        raise ValueError(f"gemv_triton serves at most {MAX_M} rows, got {m}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    # PDL reads the weight before waiting for earlier kernels: only a parameter, never a copy
    pdl = use_pdl(x) and weight.stride(-1) == 1
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    cfg = dict(config or default_config(m, n, k, _num_sms(x.device)))
    cfg.setdefault("SPLIT_K", 1)
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    split = cfg["SPLIT_K"]
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
        counters = arrival_counters(_COUNTERS, x.device, tiles)
    else:
        part = counters = y
    _gemv_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, y, part, counters,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, **pdl_args(pdl), **cfg,
    )
    return y


# one-row calls up to this many weight elements go to the GEMV by default: with the one-row
# config of session 4 it beat cuBLAS at every projection shape up to 17M elements on the H200
# (docs/benchmarks.md, run 10) and lost at granite's gate_up (32M); lm_heads (100M+) stay on
# cuBLAS, where a step with every one-row call in the GEMV measured slower for qwen3
ROW_GEMV_MAX_ELEMENTS = 20 << 20


def _use_gemv(x: Tensor, weight: Tensor) -> bool:
    """KRAIT_GEMV=1: every call with M <= 8; =0: never; unset: one row against a weight of at
    most ROW_GEMV_MAX_ELEMENTS, where it beat cuBLAS on the H200 (scripts/bench_gemv.py). With
    more rows this kernel re-reads W per row tile and loses. KRAIT_GEMV=narrow: the rule before
    session 4 (one row, N <= K/2, at most 8M elements), kept for the A/B in gpu_check.sh ab."""
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_M:  # shape first: prefill pays no lookup
        return False
    mode = os.environ.get("KRAIT_GEMV")
    if mode == "0" or not use_triton(x):
        return False
    if mode == "1":
        return True
    if mode == "narrow":
        n, k = weight.shape
        return x.shape[0] == 1 and 2 * n <= k and n * k <= (8 << 20)
    return x.shape[0] == 1 and weight.numel() <= ROW_GEMV_MAX_ELEMENTS


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through gemv_triton for the decode shapes `_use_gemv` picks."""
    if _use_gemv(x, weight):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear(silu_and_mul(x)) for x [T, 2I]: one fused launch for the decode shapes
    `_use_gemv` picks."""
    if _use_gemv(x, weight):
        return gemv_triton(x, weight, bias, silu_mul=True)
    return F.linear(silu_and_mul(x), weight, bias)

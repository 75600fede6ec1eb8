"""A decode-batch GEMM, y = x @ W^T for x [M, K] with M from a few dozen to a few hundred rows
(`gemm_tma`): both operands stream through Hopper's TMA (host-side tensor descriptors) into a
STAGES-deep shared-memory ring, wgmma on the tiles (`tl.dot`).

Why: at batch 256 cuBLAS picks 256 x 128 tiles for a Mamba in_proj ([256, 2048] x 8512: 67
programs on 132 SMs, ~30 µs against ~12 µs of bytes and FLOPs) and 144 x 128 for its out_proj
(~30 programs), the underfilled grids of docs/benchmarks.md (session 9: ~1 ms of a 9.7 ms
granite-micro step). Here the tiles are chosen to cover the SMs: BLOCK_M 64 or 128, BLOCK_N 128
or 64. Session 9's Triton GEMM (cp.async, no TMA) streamed W at 0.2-1 TB/s and was deleted; TMA
descriptors are Triton's fast path on Hopper. Programs walk M first so that the programs
sharing a column strip of W run together and read it once from DRAM.

krait/ops/linear.py takes it where `gemm_tma_config` gives a config (KRAIT_DECODE_GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from krait.ops._dispatch import cdiv


@triton.jit
def _gemm_tma_kernel(x_desc, w_desc, y_ptr, b_ptr, M, N, K, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Tile [pid_m, pid_n] of y [M, N]: x [M, K] and W [N, K] boxes (zeros past the edges)
    through the ring, float32 accumulation, y in its dtype (plus the bias)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([m0, k0])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, w.T, acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemm_tma_config(m: int, n: int, k: int, num_sms: int = 132) -> dict[str, int]:
    """Tiles for [m, k] x [n, k]^T: BLOCK_M 64 up to 64 rows, else 128; BLOCK_N 128 unless the
    grid would then cover fewer than three quarters of the SMs (64 then)."""
    block_m = 64 if m <= 64 else 128
    block_n = 128
    if cdiv(m, block_m) * cdiv(n, block_n) < 3 * num_sms // 4:
        block_n = 64
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, STAGES=4,
                num_warps=8 if block_m * block_n >= 128 * 128 else 4)


def tma_gemm_readable(x: Tensor, weight: Tensor) -> bool:
    """Both operands contiguous with 16-byte aligned rows (TMA) in one 16-bit dtype."""
    return (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.is_contiguous() and weight.is_contiguous()
            and (x.shape[1] * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def gemm_tma(x: Tensor, weight: Tensor, bias: Tensor | None = None,
             config: dict | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype. Both contiguous, 16-byte
    aligned rows; bf16 or fp16 on the GPU (float32 runs too: the CPU interpreter's tests)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"gemm_tma: weight is [N, {weight.shape[1]}], x gives K={k}")
    cfg = dict(config or gemm_tma_config(m, n, k))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    x_desc = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    w_desc = _weight_descriptor(weight, cfg["BLOCK_N"], cfg["BLOCK_K"])
    grid = (cdiv(m, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]))
    _gemm_tma_kernel[grid](x_desc, w_desc, y, bias if bias is not None else y, m, n, k,
                           y.stride(0), HAS_BIAS=bias is not None, **cfg)
    return y


def _weight_descriptor(weight: Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The weight's descriptor in [block_n, block_k] boxes, kept on the weight tensor (it goes
    with the weight: krait/ops/gemv_tma.py `_descriptor`)."""
    cache = getattr(weight, "_krait_gemm_descriptors", None)
    if cache is None:
        cache = {}
        weight._krait_gemm_descriptors = cache
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, block_n, block_k)
    desc = cache.get(key)
    if desc is None:
        desc = cache[key] = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    return desc

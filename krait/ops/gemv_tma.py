"""A one-row decode GEMV, y = x @ W^T with x [1, K], that streams W through Hopper's TMA (a
host-side tensor descriptor) into a STAGES-deep shared-memory ring: more bytes in flight per SM
than krait/ops/gemv.py's one tile prefetched in registers, at no register cost (docs/decode_gemv.md
rule 4: a second tile in registers cost occupancy). On the H200 it wins on the big projections
and loses on small or narrow ones, where gemv.py's weight load before the PDL wait matters more
(docs/benchmarks.md); `tma_config` says which, krait/ops/linear.py's plan takes it.

Program (n, s) owns BLOCK_N output columns and streams its [BLOCK_N, BLOCK_K] weight boxes
over the s-th of SPLIT_K slices of K: `tl.range(..., num_stages=STAGES)` lets Triton's
pipeliner keep STAGES - 1 TMA copies in flight (mbarrier-tracked) while one box is used. x is
tiny and L1/L2 resident: a plain [1, BLOCK_K] load per K tile, which the pipeliner also copies
ahead (cp.async) and reads in the weight's layout (see `_tile_dots`). Products accumulate
elementwise in float32 and K is reduced once after the loop. SPLIT_K > 1 reduces the slices as gemv.py does: each program writes
its partials and bumps a per-tile counter, the last to arrive adds them in slice order
(deterministic), writes y and resets the counter (one launch, graph-safe).

PDL: the wait comes before the loop, the late trigger after it. The weight never depends on
earlier kernels, but a wait inside the loop (first iteration only) does not let the boxes start
early: the pipeliner also prefetches x (cp.async into shared memory) in its prologue, and x is
what the previous kernel writes. With EARLY_BOX the first box comes in through plain loads into
registers before the wait, streaming while the previous kernel drains (krait/ops/linear.py
takes it for the big weights; on small ones it cost more than it hid).
TMA needs 16-byte aligned rows: K * itemsize % 16 == 0 (K a multiple of 8 in bf16/fp16, of 4 in
float32); boxes past N or K read zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from krait.ops._dispatch import cdiv
from krait.ops.arrival import slice_width, split_k_scratch
from krait.ops.gemv import conv_args, conv_tile_finish, conv_tile_operands, finish_tile
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.timeline import ENTRY, EXIT, LOOPED, WAITED, stamp, timeline_args

_COUNTERS: dict[torch.device, Tensor] = {}  # per-tile arrival counters, always back to zero
DEFAULT_CONFIG = dict(BLOCK_N=16, BLOCK_K=256, STAGES=4, SPLIT_K=1, num_warps=4)


@triton.jit
def _x_tile(x_ptr, k0, K, offs_k):
    """x[k0:k0 + BLOCK_K] as [1, BLOCK_K] float32."""
    k = k0 + offs_k[None, :]
    # [1, BLOCK_K]: the pipeliner copies it to shared memory too (cp.async, STAGES - 1 ahead)
    # and reads it in the weight's layout. Broadcast over N by its pointers (gemv.py's way),
    # its ring would be BLOCK_N times larger; through a second descriptor, one more barrier a
    # step and x 16-byte aligned. This load's coalesced layout is the tile's: vectors of
    # BLOCK_K / (32 * num_warps) elements (one when BLOCK_K = 32 * num_warps: scalar reads)
    return tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)


@triton.jit
def _tile_dots(w_desc, n0, k0, x, acc):
    """acc [BLOCK_N, BLOCK_K] float32 plus the products of weight box [n0:, k0:] (zeros past N
    and K) with x [1, BLOCK_K] float32."""
    return acc + x * w_desc.load([n0, k0]).to(tl.float32)


@triton.jit
def _first_box(w_ptr, n0, k0, N, K, offs_n, offs_k):
    """Weight box [n0:, k0:] through plain loads (EARLY_BOX: issued before the PDL wait,
    used after it), zeros past N and K."""
    rows = n0 + offs_n[:, None]
    cols = k0 + offs_k[None, :]
    return tl.load(w_ptr + rows.to(tl.int64) * K + cols, mask=(rows < N) & (cols < K),
                   other=0.0)


@triton.jit
def _write_tile(dots, pid_n, pid_k, offs_n, y_ptr, part_ptr, count_ptr, N,
                SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes dots [BLOCK_N] float32 of column tile pid_n, slice pid_k: straight to y, or with
    SPLIT_K > 1 as partials [SPLIT_K, N] that the tile's last slice to arrive sums in order."""
    n_ok = offs_n < N
    dt = y_ptr.dtype.element_ty
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, dots.to(dt), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, dots, mask=n_ok)
        arrived = tl.atomic_add(count_ptr + pid_n, 1)  # acq_rel: orders the store above
        if arrived == SPLIT_K - 1:  # the last slice of this tile to finish sums them all
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * N + offs_n, mask=n_ok, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            tl.store(y_ptr + offs_n, total.to(dt), mask=n_ok)


@triton.jit
def _gemv_tma_kernel(
    x_ptr, w_desc, w_ptr, y_ptr, part_ptr, count_ptr,
    N, K, k_per_split,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
    SILU_MUL: tl.constexpr = False, CONV: tl.constexpr = False,
    conv_lo=0, conv_dim=0, slots_ptr=None, cw_ptr=None, cb_ptr=None, cs_ptr=None,
    stride_cw_d=0, stride_cw_k=0, stride_cs_slot=0, stride_cs_d=0, stride_cs_k=0,
    CONV_WIDTH: tl.constexpr = 4, CONV_BIAS: tl.constexpr = False,
    CONV_SILU: tl.constexpr = False, EARLY_BOX: tl.constexpr = False,
    TL: tl.constexpr = False, tl_ptr=None,
):
    """y [1, N] = x [1, K] @ W^T, W [N, K] read through w_desc in [BLOCK_N, BLOCK_K] boxes
    (w_ptr: the same weight, for the EARLY_BOX loads only). SILU_MUL (SPLIT_K 1): W is
    [2N, K] = [gate; up] and y = silu(x @ gate^T) * (x @ up^T), each half rounded to y's dtype
    first as a gate_up GEMM and silu_and_mul would; each program streams its columns' gate and
    up boxes side by side. CONV (SPLIT_K 1): the output columns [conv_lo, conv_lo + conv_dim) go
    through a causal conv's decode step on the row's slot, as krait/ops/gemv.py's CONV epilogue
    (`gemv_triton(conv=...)`) does, its operands (slot, state, conv weights) loaded before the
    PDL wait, off the epilogue's dependent loads. EARLY_BOX: the first box through plain loads
    before the PDL wait, the loop from the second."""
    stamp(TL, tl_ptr, ENTRY)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if CONV:
        ch, ok, st, window, shifted, cw, cb = conv_tile_operands(
            n0 + offs_n0, n0 + offs_n0 < N, conv_lo, conv_dim, slots_ptr, cw_ptr, cb_ptr, cs_ptr,
            stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k, CONV_WIDTH,
            CONV_BIAS)
    rows = 2 * N if SILU_MUL else N
    if EARLY_BOX:  # the first box in flight while the previous kernel drains
        w0 = _first_box(w_ptr, n0, k_lo, rows, K, offs_n0, offs_k)
        if SILU_MUL:
            u0 = _first_box(w_ptr, N + n0, k_lo, rows, K, offs_n0, offs_k)
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = k_lo
    if EARLY_BOX:
        x = _x_tile(x_ptr, k_lo, K, offs_k)
        acc += x * w0.to(tl.float32)
        if SILU_MUL:
            acc_up += x * u0.to(tl.float32)
        k_start = k_lo + BLOCK_K
    if SILU_MUL:
        for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
            x = _x_tile(x_ptr, k0, K, offs_k)
            acc = _tile_dots(w_desc, n0, k0, x, acc)
            acc_up = _tile_dots(w_desc, N + n0, k0, x, acc_up)
        stamp(TL, tl_ptr, LOOPED)
        pdl_trigger(PDL)
        offs_n = n0 + offs_n0
        n_ok = offs_n < N
        dots, dots_up = tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)
        tl.store(y_ptr + offs_n, finish_tile(dots, dots_up, y_ptr, offs_n, n_ok, N,
                                             y_ptr.dtype.element_ty, False, 1), mask=n_ok)
    else:
        for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
            x = _x_tile(x_ptr, k0, K, offs_k)
            acc = _tile_dots(w_desc, n0, k0, x, acc)
        stamp(TL, tl_ptr, LOOPED)
        pdl_trigger(PDL)
        dots = tl.sum(acc, axis=1)
        if CONV:
            offs_n = n0 + offs_n0
            n_ok = offs_n < N
            val = dots.to(y_ptr.dtype.element_ty)[None, :]  # [1, BLOCK_N]
            val = conv_tile_finish(val, ch, ok, st, window, shifted, cw, cb, stride_cs_d,
                                   stride_cs_k, CONV_WIDTH, CONV_SILU)
            tl.store(y_ptr + offs_n[None, :], val, mask=n_ok[None, :])
        else:
            _write_tile(dots, pid_n, pid_k, n0 + offs_n0, y_ptr, part_ptr, count_ptr, N,
                        SPLIT_K, BLOCK_N)
    stamp(TL, tl_ptr, EXIT)


def tma_readable(weight: Tensor) -> bool:
    """TMA reads 16-byte aligned rows of a contiguous weight."""
    return (weight.is_contiguous() and (weight.shape[-1] * weight.element_size()) % 16 == 0
            and weight.data_ptr() % 16 == 0)


def tma_config(n: int, k: int, silu_mul_out: bool = False,
               num_sms: int = 132) -> dict[str, int] | None:
    """The config for a one-row projection that streams better through TMA than through
    krait/ops/gemv.py, or None: the big gate_ups and plain weights (granite's gate_up and
    down, qwen3's gate_up, mamba2's in_proj) win, the narrow and the small ones (qwen3 qkv, o,
    down; mamba2 out_proj) lose (H200, docs/benchmarks.md). n, k: the weight's shape
    ([2N, K] with `silu_mul_out`)."""
    if silu_mul_out:  # each program streams BLOCK_N gate rows and as many up rows
        if n * k < (4 << 20):
            return None
        if k >= 2048:
            return dict(BLOCK_N=16, BLOCK_K=128, STAGES=3, SPLIT_K=1, num_warps=8)
        return dict(BLOCK_N=8, BLOCK_K=256, STAGES=3, SPLIT_K=1, num_warps=4)
    if n * k < (12 << 20):
        return None
    if 2 * cdiv(n, 16) >= 3 * num_sms:  # wide (mamba2 in_proj)
        return dict(BLOCK_N=16, BLOCK_K=256, STAGES=3, SPLIT_K=1, num_warps=4)
    tiles, split = cdiv(n, 32), 1  # narrow and deep (granite down): K split
    while 2 * tiles * split < 3 * num_sms and split < 16 and k // (2 * split) >= 1024:
        split *= 2
    return dict(BLOCK_N=32, BLOCK_K=128, STAGES=4, SPLIT_K=split, num_warps=8)


def gemv_tma(x: Tensor, weight: Tensor, config: dict | None = None,
             silu_mul_out: bool = False, conv: tuple | None = None) -> Tensor:
    """x [1, K] (bf16, fp16 or float32) @ weight [N, K]^T (contiguous, K * itemsize a multiple
    of 16 bytes) -> y [1, N] in x's dtype, float32 accumulation. With `silu_mul_out`, weight
    is [2N, K] = [gate; up] (a merged gate_up) and y [1, N] = silu_and_mul of the [1, 2N]
    projection (SPLIT_K 1). config: BLOCK_N, BLOCK_K (each at most 256: one TMA box), STAGES,
    SPLIT_K, num_warps, EARLY_BOX (each program loads its first box through plain loads before
    the PDL wait; krait/ops/linear.py's plan sets it for the big weights). `conv`: as
    `gemv_triton(conv=...)` (a Mamba in_proj's conv in the epilogue; SPLIT_K 1). A persistent
    grid (each program walking several column tiles in one pipelined loop) was never the
    fastest config, alone or in the batch-1 chain, and was removed (docs/benchmarks.md)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv_tma: x must be [1, K], got {list(x.shape)}")
    n, k = weight.shape
    if silu_mul_out:
        if n % 2 or cfg["SPLIT_K"] != 1:
            raise ValueError("gemv_tma: silu_mul_out takes a [2N, K] gate_up weight and "
                             "SPLIT_K 1")
        n //= 2
    extra: dict = {}
    if conv is not None:
        if cfg["SPLIT_K"] != 1 or silu_mul_out:
            raise ValueError("gemv_tma: the conv epilogue takes SPLIT_K 1 and a plain output")
        extra = dict(conv_args(conv, x.shape[0], n, False), CONV=True)
    if x.shape[1] != k:
        raise ValueError(f"gemv_tma: weight is [N, {k}], x gives K={x.shape[1]}")
    if not tma_readable(weight):
        raise ValueError("gemv_tma: TMA needs a contiguous weight with 16-byte aligned rows "
                         f"(K * itemsize % 16 == 0; K={k}, {weight.dtype})")
    if max(cfg["BLOCK_N"], cfg["BLOCK_K"]) > 256:
        raise ValueError("gemv_tma: a TMA box spans at most 256 elements a dimension")
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)  # [1, N]
    if n == 0:
        return y
    split = cfg.pop("SPLIT_K")
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    tiles = cdiv(n, cfg["BLOCK_N"])
    k_slice = slice_width(k, split, cfg["BLOCK_K"])
    desc = _descriptor(weight, cfg["BLOCK_N"], cfg["BLOCK_K"])
    part, counters = split_k_scratch(_COUNTERS, split, (n,), tiles, y)  # [S, N]
    _gemv_tma_kernel[(tiles, split)](
        x, desc, weight, y, part, counters, n, k, k_slice,
        SPLIT_K=split, SILU_MUL=silu_mul_out, **extra, **pdl_args(use_pdl(x)), **cfg,
        **timeline_args("gemv_tma", (tiles, split), x.device))
    return y


def _descriptor(weight: Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The weight's TMA descriptor in [block_n, block_k] boxes, built once per weight and box
    and kept on the weight tensor itself: it goes with the weight (a module-level cache kept
    granite-micro's 6 GiB of weights alive after its engine was deleted, and the HF baseline
    of `krait bench throughput` ran out of memory beside them)."""
    cache = getattr(weight, "_krait_tma_descriptors", None)
    if cache is None:
        cache = {}
        weight._krait_tma_descriptors = cache  # a cycle through the weight: gc frees both
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, block_n, block_k)
    desc = cache.get(key)
    if desc is None:  # a stacked [E, N, K] weight (the MoE's experts) in [1, n, k] boxes
        box = [block_n, block_k] if weight.dim() == 2 else [1, block_n, block_k]
        desc = cache[key] = TensorDescriptor.from_tensor(weight, box)
    return desc

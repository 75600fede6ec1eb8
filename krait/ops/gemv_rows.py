"""A skinny GEMM for 2-8 rows, y = x @ W^T with x [M, K], M <= 8 (a speculative verify step's
1 + k rows at batch 1), that reads W once for all M rows through Hopper's TMA and tensor cores.

cuBLAS streams these 4-35 MB projections at only 1-1.6 TB/s on the H200 with a few rows, and
krait/ops/gemv.py re-reads nothing but pays M times the FMA work and registers of one row; here
the weight is the wide operand of a wgmma: program (n, s) owns BLOCK_N (64 or 128) output
columns and the s-th of SPLIT_K slices of K, and per K step multiplies its weight box
[BLOCK_N, BLOCK_K] (the A operand: 64 rows a warpgroup) by the x tile [BLOCK_M = 16, BLOCK_K]
transposed (the B operand, 16 wide; rows >= M read zeros), accumulating acc [BLOCK_N, 16] in
float32. The weight boxes come through a TMA tensor descriptor (`gemv_tma._descriptor`, cached
on the weight) in `tl.range(..., num_stages=STAGES)`: Triton's pipeliner keeps STAGES - 1
boxes in flight (mbarrier-tracked) while one feeds the dot; x, tiny and L2-resident, through
plain masked loads (also copied ahead by the pipeliner). After the loop y[m, n0 + j] =
acc[j, m] for m < M. float32 inputs take the exact `input_precision="ieee"` dot (tf32 would
miss the float32 parity tests); bf16 and fp16 the tensor cores (in the interpreter float32
products of the same operands: its dot multiplies bf16's raw bits as integers).

SPLIT_K > 1 (narrow weights: too few column tiles to keep every SM streaming) reduces as
gemv.py does: each program writes its partials [M, BLOCK_N] and bumps its tile's arrival
counter (krait/ops/arrival.py); the last slice to arrive sums the partials in slice order
(deterministic), writes y and resets the counter: one launch, graph-safe. SILU_MUL: W is
[2N, K] = [gate; up] and each program streams its gate box and its up box (rows n0 and N + n0)
per K step into two accumulators; y = silu(gate) * up with each half rounded to y's dtype
first (`gemv.finish_tile`), split or not (the up partials beside the gate's).

PDL as gemv_tma.py: the wait before the loop (the pipeliner's prologue also copies x, which
the previous kernel writes), the trigger after it; EARLY_BOX loads the first box through plain
loads before the wait. TMA needs 16-byte aligned rows: K * itemsize % 16 == 0 (`tma_readable`);
boxes past N or K read zeros. Which calls come here is krait/ops/linear.py's plan
(`multi_row_gemv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, num_sms
from krait.ops.arrival import slice_width, split_k_scratch
from krait.ops.gemv import finish_tile
from krait.ops.gemv_tma import _descriptor, _first_box, tma_readable
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.timeline import ENTRY, EXIT, LOOPED, WAITED, stamp, timeline_args

MAX_ROWS = 8
BLOCK_M = 16  # x's rows padded to the dot's smallest width (the wgmma's N)
# the pipeline ring's budget: STAGES boxes (two a step with SILU_MUL) of BLOCK_N x BLOCK_K
RING_BYTES = 160 << 10
_COUNTERS: dict[torch.device, Tensor] = {}  # per-tile arrival counters, always back to zero


@triton.jit
def _x_rows(x_ptr, stride_xm, offs_m, M, k0, K, offs_k):
    """x[:, k0:k0 + BLOCK_K] as [BLOCK_M, BLOCK_K] in x's dtype, zeros past M and K."""
    k = k0 + offs_k[None, :]
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + k,
                   mask=(offs_m[:, None] < M) & (k < K), other=0.0)


@triton.jit
def _box_dot(w, x, acc, IEEE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] float32 + w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K]^T: the
    weight box is the wgmma's A operand, x transposed its B. IEEE: exact float32 products (for
    float32 inputs; and in the interpreter, whose dot multiplies bf16 operands' raw bits)."""
    if IEEE:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit(do_not_specialize=["M"])  # one kernel for every row count (1 too)
def _gemv_rows_kernel(
    x_ptr, w_desc, w_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, stride_xm, stride_ym,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    SILU_MUL: tl.constexpr = False, IEEE: tl.constexpr = False,
    EARLY_BOX: tl.constexpr = False, TL: tl.constexpr = False, tl_ptr=None,
):
    """y [M, N] = x [M, K] @ W^T, W [N, K] read through w_desc in [BLOCK_N, BLOCK_K] boxes
    (w_ptr: the same weight, for the EARLY_BOX loads only). SILU_MUL: W is [2N, K] = [gate; up]
    and y = silu(x @ gate^T) * (x @ up^T). Partials (SPLIT_K > 1): [SPLIT_K, M, rows] float32,
    rows = N (2N with SILU_MUL: the up half beside the gate's)."""
    stamp(TL, tl_ptr, ENTRY)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # [N, M]: y transposed
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    rows = 2 * N if SILU_MUL else N
    if EARLY_BOX:  # the first box in flight while the previous kernel drains
        w0 = _first_box(w_ptr, n0, k_lo, rows, K, tl.arange(0, BLOCK_N), offs_k)
        if SILU_MUL:
            u0 = _first_box(w_ptr, N + n0, k_lo, rows, K, tl.arange(0, BLOCK_N), offs_k)
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    k_start = k_lo
    if EARLY_BOX:
        x = _x_rows(x_ptr, stride_xm, offs_m, M, k_lo, K, offs_k)
        acc = _box_dot(w0, x, acc, IEEE)
        if SILU_MUL:
            acc_up = _box_dot(u0, x, acc_up, IEEE)
        k_start = k_lo + BLOCK_K
    if SILU_MUL:
        for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
            x = _x_rows(x_ptr, stride_xm, offs_m, M, k0, K, offs_k)
            acc = _box_dot(w_desc.load([n0, k0]), x, acc, IEEE)
            acc_up = _box_dot(w_desc.load([N + n0, k0]), x, acc_up, IEEE)
    else:
        for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
            x = _x_rows(x_ptr, stride_xm, offs_m, M, k0, K, offs_k)
            acc = _box_dot(w_desc.load([n0, k0]), x, acc, IEEE)
    stamp(TL, tl_ptr, LOOPED)
    pdl_trigger(PDL)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    mn_ok = n_ok[:, None] & (offs_m < M)[None, :]  # [N, M]
    out = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]  # y[m, n] = acc[n, m]
    dt = y_ptr.dtype.element_ty
    # finish_tile's EPILOGUE: SILU_MUL (True == 1) or the plain output
    if SPLIT_K == 1:
        tl.store(out, finish_tile(acc, acc_up, y_ptr, offs_n, n_ok, N, dt, False, SILU_MUL),
                 mask=mn_ok)
    else:
        part = part_ptr + offs_m[None, :] * rows + offs_n[:, None]  # [S, M, rows] partials
        tl.store(part + pid_k * M * rows, acc, mask=mn_ok)
        if SILU_MUL:
            tl.store(part + pid_k * M * rows + N, acc_up, mask=mn_ok)
        arrived = tl.atomic_add(count_ptr + pid_n, 1)  # acq_rel: orders the stores above
        if arrived == SPLIT_K - 1:  # the last slice of this tile to finish sums them all
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * M * rows, mask=mn_ok, other=0.0,
                                 cache_modifier=".cg")
                if SILU_MUL:
                    total_up += tl.load(part + s * M * rows + N, mask=mn_ok, other=0.0,
                                        cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            tl.store(out, finish_tile(total, total_up, y_ptr, offs_n, n_ok, N, dt, False,
                                      SILU_MUL), mask=mn_ok)
    stamp(TL, tl_ptr, EXIT)


def split_k(tiles: int, k: int, block_k: int, num_sms: int, waves: float = 3.0) -> int:
    """SPLIT_K (1 to 16, by twos) for `tiles` column tiles: K is split while the programs
    cover the SMs fewer than `waves` times and each slice keeps at least two boxes."""
    split = 1
    while tiles * split < waves * num_sms and split < 16 and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def rows_config(m: int, n: int, k: int, silu_mul_out: bool = False, num_sms: int = 132,
                itemsize: int = 2) -> dict[str, int]:
    """The config for x [m, K] against a weight [n, k] ([2N, k] with `silu_mul_out`), by shape
    only (never by anything that changes between steps of one batch size; m does not enter:
    every row count up to 8 is one BLOCK_M = 16 tile). 64-column tiles (one warpgroup's wgmma),
    128 where those still cover the SMs three times; K split for three waves (`split_k`), in
    64-wide boxes where 128-wide ones leave under two waves. The ring (STAGES boxes, two a step
    with silu_mul_out) stays within RING_BYTES (float32: fewer STAGES, then a narrower
    BLOCK_K). Untuned: scripts/bench_gemv_rows.py sweeps the alternatives on the H200."""
    cols = n // 2 if silu_mul_out else n
    block_n = 128 if cdiv(cols, 128) >= 3 * num_sms else 64
    tiles = cdiv(cols, block_n)
    block_k = min(128, max(16, next_pow2(k)))
    split = split_k(tiles, k, block_k, num_sms)
    if tiles * split < 2 * num_sms and block_k > 64:
        block_k = 64
        split = split_k(tiles, k, block_k, num_sms)
    stages, boxes = 4, 2 if silu_mul_out else 1
    while stages * boxes * block_n * block_k * itemsize > RING_BYTES and stages > 2:
        stages -= 1
    while stages * boxes * block_n * block_k * itemsize > RING_BYTES and block_k > 32:
        block_k //= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT_K=split,
                num_warps=4 if block_n == 64 else 8)


def gemv_rows(x: Tensor, weight: Tensor, config: dict | None = None,
              silu_mul_out: bool = False) -> Tensor:
    """x [M, K] (M <= 8; bf16, fp16 or float32) @ weight [N, K]^T (x's dtype, contiguous,
    K * itemsize a multiple of 16 bytes) -> y [M, N] in x's dtype, float32 accumulation. With
    `silu_mul_out`, weight is [2N, K] = [gate; up] (a merged gate_up) and y [M, N] =
    silu_and_mul of the [M, 2N] projection. config: BLOCK_N, BLOCK_K (powers of two, 16 to
    256: one TMA box; BLOCK_N 64 or 128 maps the dot to wgmma), STAGES, SPLIT_K, num_warps,
    EARLY_BOX; missing entries from `rows_config`."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv_rows: x must be [M, K] and weight [N, K], got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    m, (rows, k) = x.shape[0], weight.shape
    if m > MAX_ROWS:
        raise ValueError(f"gemv_rows serves at most {MAX_ROWS} rows, got {m}")
    if x.shape[1] != k:
        raise ValueError(f"gemv_rows: weight is [N, {k}], x gives K={x.shape[1]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"gemv_rows: x is {x.dtype}, the weight {weight.dtype}")
    if silu_mul_out and rows % 2:
        raise ValueError(f"gemv_rows: silu_mul_out takes a [2N, K] gate_up weight, got {rows} "
                         "rows")
    if not tma_readable(weight):
        raise ValueError("gemv_rows: TMA needs a contiguous weight with 16-byte aligned rows "
                         f"(K * itemsize % 16 == 0; K={k}, {weight.dtype})")
    n = rows // 2 if silu_mul_out else rows
    cfg = dict(rows_config(m, rows, k, silu_mul_out, num_sms(x.device), weight.element_size()),
               **(config or {}))
    for key in ("BLOCK_N", "BLOCK_K"):
        b = cfg[key]
        if b < 16 or b > 256 or b & (b - 1):
            raise ValueError(f"gemv_rows: {key} must be a power of two from 16 to 256 (a dot's "
                             f"smallest width, a TMA box's largest), got {b}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    split = cfg.pop("SPLIT_K")
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    tiles = cdiv(n, cfg["BLOCK_N"])
    k_slice = slice_width(k, split, cfg["BLOCK_K"])
    desc = _descriptor(weight, cfg["BLOCK_N"], cfg["BLOCK_K"])
    part, counters = split_k_scratch(_COUNTERS, split, (m, rows), tiles, y)  # [S, M, W]
    _gemv_rows_kernel[(tiles, split)](
        x, desc, weight, y, part, counters, m, n, k, k_slice, x.stride(0), y.stride(0),
        SPLIT_K=split, BLOCK_M=BLOCK_M, SILU_MUL=silu_mul_out,
        IEEE=x.dtype == torch.float32 or interpreting(), **pdl_args(use_pdl(x)), **cfg,
        **timeline_args("gemv_rows", (tiles, split), x.device))
    return y

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

NORM (`norm=`; a Mamba mixer's out_proj over verify rows): x is first the gated RMSNorm of
x * silu(z). Each K step loads x and z, feeds the dot (x * silu(z)) * weight unnormalised and
adds the rows' sums of squares; as each slice lies in one norm group (`norm_split`), the
group's 1 / rms scales the slice's partials where they meet: in the store (one slice), else in
the last program's sum, from the sums each slice wrote. One launch for the norm, the GEMM and
its split-K reduce.

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
from krait.ops.causal_conv1d_verify import conv_verify_row
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
def _normed_rows(x_ptr, z_ptr, wn_ptr, stride_xm, stride_zm, offs_m, M, k0, K, offs_k, ss):
    """NORM: the gated norm's input for x[:, k0:k0 + BLOCK_K] but its 1 / rms: h = x * silu(z)
    in float32, times the norm's weight, in x's dtype; and ss [BLOCK_M] plus the rows' sums of
    h^2 over these columns."""
    x = _x_rows(x_ptr, stride_xm, offs_m, M, k0, K, offs_k)
    z = _x_rows(z_ptr, stride_zm, offs_m, M, k0, K, offs_k).to(tl.float32)
    h = x.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    k = k0 + offs_k
    wn = tl.load(wn_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    return (h * wn).to(x.dtype), ss + tl.sum(h * h, axis=1)


@triton.jit
def _box_dot(w, x, acc, IEEE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] float32 + w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K]^T: the
    weight box is the wgmma's A operand, x transposed its B. IEEE: exact float32 products (for
    float32 inputs; and in the interpreter, whose dot multiplies bf16 operands' raw bits)."""
    if IEEE:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _conv_epilogue(y_ptr, stride_ym, n0, offs_n, conv_lo, conv_dim, conv_rows, conv_cols,
                   cw_ptr, cb_ptr, cs_ptr, cqsl_ptr, cslots_ptr, cacc_ptr, cidx_ptr,
                   stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k,
                   stride_csl_r, stride_csl_c, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """CONV: the tile's columns that are xBC channels (offs_n - conv_lo in [0, conv_dim)),
    just stored to y, go through each verify row's causal conv in place
    (`causal_conv1d_verify`'s `conv_verify_row`: the window from the row's slot of its last
    accepted position, the state after each token to the row's slot of that position)."""
    if (n0 + BLOCK_N > conv_lo) & (n0 < conv_lo + conv_dim):
        chans = offs_n - conv_lo
        ch_ok = (chans >= 0) & (chans < conv_dim)
        tl.debug_barrier()  # the tile's stores above land before its threads read them back
        for r in range(0, conv_rows):
            conv_verify_row(y_ptr + conv_lo, cw_ptr, cb_ptr, cs_ptr, y_ptr + conv_lo, cqsl_ptr,
                            cslots_ptr, cacc_ptr, cidx_ptr, r, chans, ch_ok, conv_cols,
                            stride_ym, 1, stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d,
                            stride_cs_k, stride_ym, stride_csl_r, stride_csl_c, WIDTH,
                            HAS_BIAS, SILU, BLOCK_T, BLOCK_W)


@triton.jit(do_not_specialize=["M"])  # one kernel for every row count (1 too)
def _gemv_rows_kernel(
    x_ptr, w_desc, w_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, stride_xm, stride_ym,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    SILU_MUL: tl.constexpr = False, IEEE: tl.constexpr = False,
    EARLY_BOX: tl.constexpr = False, TL: tl.constexpr = False, tl_ptr=None,
    z_ptr=None, wn_ptr=None, sums_ptr=None, stride_zm=0, group_size=1, eps=0.0,
    NORM: tl.constexpr = False, SLICES_PER_GROUP: tl.constexpr = 1,
    CONV: tl.constexpr = False, conv_lo=0, conv_dim=0, conv_rows=0, conv_cols=1, cw_ptr=None,
    cb_ptr=None, cs_ptr=None, cqsl_ptr=None, cslots_ptr=None, cacc_ptr=None, cidx_ptr=None,
    stride_cw_d=0, stride_cw_k=0, stride_cs_slot=0, stride_cs_d=0, stride_cs_k=0,
    stride_csl_r=0, stride_csl_c=1, CONV_WIDTH: tl.constexpr = 4,
    CONV_BIAS: tl.constexpr = False, CONV_SILU: tl.constexpr = False,
    CONV_BLOCK_T: tl.constexpr = 4, CONV_BLOCK_W: tl.constexpr = 4,
):
    """y [M, N] = x [M, K] @ W^T, W [N, K] read through w_desc in [BLOCK_N, BLOCK_K] boxes
    (w_ptr: the same weight, for the EARLY_BOX loads only). SILU_MUL: W is [2N, K] = [gate; up]
    and y = silu(x @ gate^T) * (x @ up^T). Partials (SPLIT_K > 1): [SPLIT_K, M, rows] float32,
    rows = N (2N with SILU_MUL: the up half beside the gate's). NORM: x is first the gated
    RMSNorm of x * silu(z) over groups of `group_size` columns with weight wn: the dot takes
    the weighted, unnormalised rows (`_normed_rows`), and each K slice (inside one group:
    SLICES_PER_GROUP slices a group) is scaled by its rows' 1 / rms where the slices meet, from
    the sums of squares each program wrote to sums [tiles, SPLIT_K, BLOCK_M]. CONV: the output
    columns [conv_lo, conv_lo + conv_dim) are a Mamba in_proj's xBC over verify rows, and go
    through their causal conv where the tile is finished (`_conv_epilogue`)."""
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
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # NORM: the slice's sums of squares a row
    rows = 2 * N if SILU_MUL else N
    if EARLY_BOX:  # the first box in flight while the previous kernel drains
        w0 = _first_box(w_ptr, n0, k_lo, rows, K, tl.arange(0, BLOCK_N), offs_k)
        if SILU_MUL:
            u0 = _first_box(w_ptr, N + n0, k_lo, rows, K, tl.arange(0, BLOCK_N), offs_k)
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    k_start = k_lo
    if EARLY_BOX:
        if NORM:
            x, ss = _normed_rows(x_ptr, z_ptr, wn_ptr, stride_xm, stride_zm, offs_m, M, k_lo,
                                 K, offs_k, ss)
        else:
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
    elif NORM:
        for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
            x, ss = _normed_rows(x_ptr, z_ptr, wn_ptr, stride_xm, stride_zm, offs_m, M, k0, K,
                                 offs_k, ss)
            acc = _box_dot(w_desc.load([n0, k0]), x, acc, IEEE)
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
        finished = True  # this program wrote the tile's y
        if NORM:  # the one slice is the one group
            acc = acc * tl.rsqrt(ss / group_size + eps)[None, :]
        tl.store(out, finish_tile(acc, acc_up, y_ptr, offs_n, n_ok, N, dt, False, SILU_MUL),
                 mask=mn_ok)
    else:
        part = part_ptr + offs_m[None, :] * rows + offs_n[:, None]  # [S, M, rows] partials
        tl.store(part + pid_k * M * rows, acc, mask=mn_ok)
        if SILU_MUL:
            tl.store(part + pid_k * M * rows + N, acc_up, mask=mn_ok)
        if NORM:
            sums = sums_ptr + pid_n * SPLIT_K * BLOCK_M + offs_m  # this tile's [S, BLOCK_M]
            tl.store(sums + pid_k * BLOCK_M, ss)
        arrived = tl.atomic_add(count_ptr + pid_n, 1)  # acq_rel: orders the stores above
        finished = arrived == SPLIT_K - 1
        if finished:  # the last slice of this tile to finish sums them all
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for g in tl.static_range(SPLIT_K // SLICES_PER_GROUP):
                if NORM:  # 1 / rms of each row over the group's slices
                    gs = tl.zeros([BLOCK_M], dtype=tl.float32)
                    for j in tl.static_range(SLICES_PER_GROUP):
                        gs += tl.load(sums + (g * SLICES_PER_GROUP + j) * BLOCK_M,
                                      cache_modifier=".cg")
                    scale = tl.rsqrt(gs / group_size + eps)[None, :]
                for j in tl.static_range(SLICES_PER_GROUP):
                    s = g * SLICES_PER_GROUP + j
                    p = tl.load(part + s * M * rows, mask=mn_ok, other=0.0, cache_modifier=".cg")
                    if NORM:
                        p = p * scale
                    total += p
                    if SILU_MUL:
                        total_up += tl.load(part + s * M * rows + N, mask=mn_ok, other=0.0,
                                            cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            tl.store(out, finish_tile(total, total_up, y_ptr, offs_n, n_ok, N, dt, False,
                                      SILU_MUL), mask=mn_ok)
    if CONV:
        if finished:  # (uniform: a scalar atomic's result reaches every thread)
            _conv_epilogue(y_ptr, stride_ym, n0, offs_n, conv_lo, conv_dim, conv_rows,
                           conv_cols, cw_ptr, cb_ptr, cs_ptr, cqsl_ptr, cslots_ptr, cacc_ptr,
                           cidx_ptr, stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d,
                           stride_cs_k, stride_csl_r, stride_csl_c, BLOCK_N, CONV_WIDTH,
                           CONV_BIAS, CONV_SILU, CONV_BLOCK_T, CONV_BLOCK_W)
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


def norm_split(k: int, group_size: int, block_k: int, split: int) -> int | None:
    """A SPLIT_K whose K slices (`slice_width`) each lie inside one norm group of
    `group_size` columns, every group in whole slices (the `norm` fold scales a slice's
    partials by its group's 1 / rms): the largest <= split (one slice only when one group spans
    K), else the smallest up to 16 by doublings. None: no such split."""
    if group_size <= 0 or k % group_size:
        return None

    def fits(s: int) -> bool:
        if s == 1:
            return group_size == k
        width = slice_width(k, s, block_k)
        return group_size % width == 0 and s % (group_size // width) == 0

    down = [split >> i for i in range(split.bit_length()) if split >> i]
    up = [split << i for i in range(1, 5) if split << i <= 16]
    return next((s for s in down + up if fits(s)), None)


def norm_fits(m: int, n: int, k: int, group_size: int, num_sms: int = 132,
              itemsize: int = 2) -> bool:
    """`gemv_rows(norm=...)` takes x [m, K] against a weight [n, k] with norm groups of
    `group_size` columns under its default config (`rows_config`, `norm_split`)."""
    cfg = rows_config(m, n, k, False, num_sms, itemsize)
    return norm_split(k, group_size, cfg["BLOCK_K"], cfg["SPLIT_K"]) is not None


def gemv_rows(x: Tensor, weight: Tensor, config: dict | None = None,
              silu_mul_out: bool = False,
              norm: tuple[Tensor, Tensor, float, int] | None = None,
              conv: tuple | None = None) -> Tensor:
    """x [M, K] (M <= 8; bf16, fp16 or float32) @ weight [N, K]^T (x's dtype, contiguous,
    K * itemsize a multiple of 16 bytes) -> y [M, N] in x's dtype, float32 accumulation. With
    `silu_mul_out`, weight is [2N, K] = [gate; up] (a merged gate_up) and y [M, N] =
    silu_and_mul of the [M, 2N] projection. `norm` = (z [M, K], norm weight [K], eps, group
    size): x is first a Mamba mixer's gated RMSNorm, rmsnorm(x * silu(z)) per group of
    columns times the weight (`gated_rms_norm`, gate first), folded into this launch; SPLIT_K
    then becomes one whose slices lie in single groups (`norm_split`). `conv` = (conv_lo,
    conv weight [dim, width], bias [dim] or None, conv_state [slots, dim, width - 1],
    query_start_loc [R + 1], state_slots [R, S], num_accepted [max_reqs], idx_mapping [R],
    silu): the output columns [conv_lo, conv_lo + dim) are a Mamba in_proj's xBC over the
    verify rows of `causal_conv1d_verify` (every one of x's rows a verify row's token) and come
    out convolved, the conv states written as that op writes them. config:
    BLOCK_N, BLOCK_K (powers of two, 16 to 256: one TMA box; BLOCK_N 64 or 128 maps the dot to
    wgmma), STAGES, SPLIT_K, num_warps, EARLY_BOX; missing entries from `rows_config`."""
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
    norm_args: dict = {}
    if norm is not None:
        z, wn, eps, group = norm
        if silu_mul_out or z.shape != x.shape or wn.shape != (k,):
            raise ValueError(f"gemv_rows: norm takes z like x {list(x.shape)} and a weight of "
                             f"[{k}], no silu_mul_out; got z {list(z.shape)}, weight "
                             f"{list(wn.shape)}")
        fitted = norm_split(k, group, cfg["BLOCK_K"], split)
        if fitted is None:
            raise ValueError(f"gemv_rows: no K split puts each slice in one norm group of {group}"
                             f" columns (K={k}, BLOCK_K={cfg['BLOCK_K']})")
        split = fitted
        width = slice_width(k, split, cfg["BLOCK_K"])
        z = z if z.stride(-1) == 1 else z.contiguous()
        norm_args = dict(z_ptr=z, wn_ptr=wn.contiguous(), stride_zm=z.stride(0),
                         group_size=group, eps=float(eps), NORM=True,
                         SLICES_PER_GROUP=group // width if split > 1 else 1)
    conv_args = {} if conv is None else _conv_args(conv, n, silu_mul_out)
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    tiles = cdiv(n, cfg["BLOCK_N"])
    k_slice = slice_width(k, split, cfg["BLOCK_K"])
    desc = _descriptor(weight, cfg["BLOCK_N"], cfg["BLOCK_K"])
    part, counters = split_k_scratch(_COUNTERS, split, (m, rows), tiles, y)  # [S, M, W]
    if norm is not None and split > 1:
        # the slices' sums of squares a row: [tiles, S, BLOCK_M]
        norm_args["sums_ptr"] = torch.empty(tiles * split * BLOCK_M, dtype=torch.float32,
                                            device=x.device)
    _gemv_rows_kernel[(tiles, split)](
        x, desc, weight, y, part, counters, m, n, k, k_slice, x.stride(0), y.stride(0),
        SPLIT_K=split, BLOCK_M=BLOCK_M, SILU_MUL=silu_mul_out,
        IEEE=x.dtype == torch.float32 or interpreting(), **pdl_args(use_pdl(x)), **cfg,
        **timeline_args("gemv_rows", (tiles, split), x.device), **norm_args, **conv_args)
    return y


def _conv_args(conv: tuple, n: int, silu_mul_out: bool) -> dict:
    """The kernel's CONV arguments from `gemv_rows`' `conv` tuple, checked."""
    conv_lo, cw, cb, state, qsl, slots, num_acc, idx, silu = conv
    dim, width = cw.shape
    if silu_mul_out or conv_lo < 0 or conv_lo + dim > n:
        raise ValueError(f"gemv_rows: the conv's channels [{conv_lo}, {conv_lo + dim}) must lie "
                         f"in the {n} output columns, no silu_mul_out")
    if state.shape[1:] != (dim, width - 1) or width & (width - 1):
        raise ValueError(f"gemv_rows: conv state [slots, {dim}, {width - 1}] and a power-of-two "
                         f"width expected, got {list(state.shape)}")
    slots = slots.to(torch.int32)
    return dict(CONV=True, conv_lo=conv_lo, conv_dim=dim, conv_rows=slots.shape[0],
                conv_cols=slots.shape[1], cw_ptr=cw, cb_ptr=cb if cb is not None else cw,
                cs_ptr=state, cqsl_ptr=qsl.to(torch.int32), cslots_ptr=slots,
                cacc_ptr=num_acc.to(torch.int32), cidx_ptr=idx.to(torch.int32),
                stride_cw_d=cw.stride(0), stride_cw_k=cw.stride(1),
                stride_cs_slot=state.stride(0), stride_cs_d=state.stride(1),
                stride_cs_k=state.stride(2), stride_csl_r=slots.stride(0),
                stride_csl_c=slots.stride(1), CONV_WIDTH=width, CONV_BIAS=cb is not None,
                CONV_SILU=bool(silu), CONV_BLOCK_T=next_pow2(slots.shape[1]),
                CONV_BLOCK_W=width)

"""Skinny linear layer for decode batches: y = x @ W^T (+ b) with x [M, K], M <= 8.

cuBLAS reaches only 0.8-1.6 TB/s on the 4-13 MB projections of a small model at M = 1 (profiled on
the H200, docs/benchmarks.md): a decode step there is bound by reading the weights once, so a kernel
that streams W at copy bandwidth is the whole game. Program (n, s) owns BLOCK_N output columns for
all M rows and streams its BLOCK_N rows of W over the s-th of SPLIT_K slices of K, accumulating in
float32. With SPLIT_K > 1 (narrow outputs: too few column tiles to keep every SM streaming) each
program writes its partial sums and bumps a per-tile counter; the last program of a tile adds the
partials in slice order (deterministic), writes y and resets the counter for the next launch — one
launch, no memset, graph-safe.

A prologue may transform the input row as it is loaded: silu(gate) * up (the down projection,
one launch and no [M, K] intermediate), or a Mamba mixer's gated RMSNorm from the sums of
squares its state update wrote (NORM: the norm without a launch of its own). An epilogue may
finish a merged gate_up projection: each program computes its columns' gate and up dots and
writes silu(gate) * up (the activation without its own launch or an [M, 2I] intermediate); or
put a Mamba in_proj's xBC columns through the causal conv's decode step (CONV).

Which calls come here is krait/ops/linear.py's plan (one-row projections; docs/benchmarks.md
has the measurements against cuBLAS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, num_sms
from krait.ops.arrival import slice_width, split_k_scratch
from krait.ops.causal_conv1d import conv_apply, conv_operands, store_conv_state
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.timeline import ENTRY, EXIT, LOOPED, WAITED, stamp, timeline_args

MAX_M = 8
_COUNTERS: dict[torch.device, Tensor] = {}  # per-tile arrival counters, always back to zero


# PROLOGUE, what the x row is turned into before it meets W: PLAIN, SILU_MUL (silu(gate) * up)
# or NORM (the gated RMSNorm); EPILOGUE, what the output becomes: PLAIN, SILU_MUL (a gate_up's
# activation) or CONV (a Mamba in_proj's xBC columns through the causal conv's decode step)
PLAIN, SILU_MUL, NORM, CONV = 0, 1, 2, 3


@triton.jit
def _group_parts(k0, offs_m, m_ok, part_ptr, stride_pm, group_size, parts_per_group,
                 PARTS: tl.constexpr):
    """[M, PARTS] float32: each row's sums of squares over the runs of group_size /
    parts_per_group channels of the norm group holding column k0 (zeros past the group)."""
    j = tl.arange(0, PARTS)
    first = (k0 // group_size) * parts_per_group
    return tl.load(part_ptr + offs_m[:, None] * stride_pm + first + j[None, :],
                   mask=m_ok[:, None] & (j < parts_per_group)[None, :], other=0.0)


@triton.jit
def _row_dots(x_rows, x_ok, w_rows, w_ok, k_lo, k_hi, K, PROLOGUE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr, offs_m=None, m_ok=None, norm_rows=None, part_ptr=None,
              stride_pm=0, group_size=1, parts_per_group=1, eps=0.0,
              PARTS: tl.constexpr = 1, TL: tl.constexpr = False, tl_ptr=None):
    """[BLOCK_M, BLOCK_N] float32 dots of the x rows with the weight rows `w_rows` over columns
    [k_lo, k_hi). Everything lives in one [BLOCK_M, BLOCK_N, BLOCK_K] layout: x is loaded
    broadcast over N (repeated reads hit L1) so that no layout conversion, and no shared-memory
    round trip with barriers, sits in the loop; products accumulate elementwise and K is reduced
    once. The next weight tile is loaded before the current one is used; the first before the
    wait for the previous kernel (weights are constant: with PDL it streams while that one
    drains). NORM (the columns [k_lo, k_hi) lie in one norm group): the loop takes norm weight
    * x in float32 and the dots are scaled by the group's 1 / rms at the end; its partials are
    loaded and summed once, before the loop (summed after it, they stay live in the loop and
    cost registers) (the normalized input is not rounded to the weight dtype first, as a
    separate RMSNorm's output would be: equal in float32, within bf16 rounding otherwise). The
    norm weight is broadcast over N ([1, N, 1] pointers), so that its tile is born in the
    loop's [M, N, K] layout (a [1, 1, K] load costs a shared-memory conversion with barriers in
    every K step)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k = (k_lo + offs_k)[None, None, :]
    w = tl.load(w_rows + k, mask=w_ok & (k < k_hi), other=0.0)
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    group_rstd = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if PROLOGUE == 2:
        ps = _group_parts(k_lo, offs_m, m_ok, part_ptr, stride_pm, group_size,
                          parts_per_group, PARTS)
        group_rstd = tl.rsqrt(tl.sum(ps, axis=1) / group_size + eps)[:, None]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = (k0 + offs_k)[None, None, :]
        k_ok = k < k_hi
        if PROLOGUE == 0:
            x = tl.load(x_rows + k, mask=x_ok & k_ok, other=0.0)
        elif PROLOGUE == 2:  # NORM: g = y * silu(z) in float32 times the norm weight
            gv = tl.load(x_rows + k, mask=x_ok & k_ok, other=0.0).to(tl.float32)
            nw = tl.load(norm_rows + k, mask=w_ok & k_ok, other=0.0)  # [1, N, K]
            x = gv * nw.to(tl.float32)
        else:  # SILU_MUL: x holds [gate | up] of width 2K, the input is silu(gate) * up
            g = tl.load(x_rows + k, mask=x_ok & k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k, mask=x_ok & k_ok, other=0.0)
            # rounded to the activation dtype, as silu_and_mul hands it to the projection
            x = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(up.dtype)
        k_next = k + BLOCK_K
        w_next = tl.load(w_rows + k_next, mask=w_ok & (k_next < k_hi), other=0.0)
        acc3 += x.to(tl.float32) * w.to(tl.float32)  # [M, N, K]
        w = w_next
    dots = tl.sum(acc3, axis=2)
    if PROLOGUE == 2:
        dots = dots * group_rstd
    return dots


@triton.jit
def finish_tile(acc, acc_up, b_ptr, offs_n, n_ok, N, dt, HAS_BIAS: tl.constexpr,
            EPILOGUE: tl.constexpr):
    """The output tile in dtype dt: acc (+ bias), or with the SILU_MUL epilogue
    silu(gate) * up of the two halves, each rounded to dt first as a separate gate_up GEMM and
    silu_and_mul would."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == 1:
            acc_up += tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE != 1:
        return acc.to(dt)
    g = acc.to(dt).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * acc_up.to(dt).to(tl.float32)).to(dt)


@triton.jit
def conv_tile(val, offs_n, n_ok, conv_lo, conv_dim, slots_ptr, cw_ptr, cb_ptr, cs_ptr,
               stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k,
               CONV_WIDTH: tl.constexpr, CONV_BIAS: tl.constexpr, CONV_SILU: tl.constexpr):
    """CONV, one row: the output columns [conv_lo, conv_lo + conv_dim) are the new inputs of a
    depthwise causal conv's decode step (a Mamba in_proj's xBC). The program convolves its own
    columns with their channels' states in the row's slot and writes their next states in
    place; no other program touches those channels. val [1, N] in dt; returns it with those
    columns replaced by the conv's (activated) outputs, rounded to dt as the conv kernel's."""
    ch, ok, st, window, shifted, w, bias = conv_tile_operands(
        offs_n, n_ok, conv_lo, conv_dim, slots_ptr, cw_ptr, cb_ptr, cs_ptr, stride_cw_d,
        stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k, CONV_WIDTH, CONV_BIAS)
    return conv_tile_finish(val, ch, ok, st, window, shifted, w, bias, stride_cs_d, stride_cs_k,
                            CONV_WIDTH, CONV_SILU)


@triton.jit
def conv_tile_operands(offs_n, n_ok, conv_lo, conv_dim, slots_ptr, cw_ptr, cb_ptr, cs_ptr,
                       stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k,
                       CONV_WIDTH: tl.constexpr, CONV_BIAS: tl.constexpr):
    """`conv_tile`'s reads that do not need the projection (the slot, the state, the conv
    weights) for `conv_tile_finish`, loadable before the PDL wait."""
    slot = tl.load(slots_ptr)
    ch = offs_n - conv_lo
    ok = n_ok & (ch >= 0) & (ch < conv_dim) & (slot >= 0)  # slot -1: the row is padding
    ch = tl.where(ok, ch, 0)
    st = cs_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cs_slot
    window, shifted, w, bias = conv_operands(
        st, cw_ptr, cb_ptr, ch, ok, tl.arange(0, CONV_WIDTH), stride_cw_d, stride_cw_k,
        stride_cs_d, stride_cs_k, CONV_WIDTH, CONV_BIAS)
    return ch, ok, st, window, shifted, w, bias


@triton.jit
def conv_tile_finish(val, ch, ok, st, window, shifted, w, bias, stride_cs_d, stride_cs_k,
                     CONV_WIDTH: tl.constexpr, CONV_SILU: tl.constexpr):
    """`conv_tile` with its operands loaded (`conv_tile_operands`)."""
    xv = tl.sum(val.to(tl.float32), axis=0)  # [N]: the row's projection, rounded to dt
    cols = tl.arange(0, CONV_WIDTH)
    acc, shifted = conv_apply(xv, window, shifted, w, bias, cols, CONV_WIDTH, CONV_SILU)
    store_conv_state(st, shifted, ch, ok, cols, stride_cs_d, stride_cs_k, CONV_WIDTH)
    return tl.where(ok, acc, xv).to(val.dtype)[None, :]


@triton.jit
def _store_tile(out, val, mn_ok, offs_n, n_ok, EPILOGUE: tl.constexpr, conv_lo=0, conv_dim=0,
                slots_ptr=None, cw_ptr=None, cb_ptr=None, cs_ptr=None, stride_cw_d=0,
                stride_cw_k=0, stride_cs_slot=0, stride_cs_d=0, stride_cs_k=0,
                CONV_WIDTH: tl.constexpr = 4, CONV_BIAS: tl.constexpr = False,
                CONV_SILU: tl.constexpr = False):
    """Writes the output tile val [M, N] (dt); CONV first puts the conv columns through
    `conv_tile`."""
    if EPILOGUE == 3:  # CONV
        val = conv_tile(val, offs_n, n_ok, conv_lo, conv_dim, slots_ptr, cw_ptr, cb_ptr, cs_ptr,
                        stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k,
                        CONV_WIDTH, CONV_BIAS, CONV_SILU)
    tl.store(out, val, mask=mn_ok)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    EPILOGUE: tl.constexpr = 0,
    norm_ptr=None, norm_part_ptr=None, stride_pm=0, group_size=1, parts_per_group=1, eps=0.0,
    PARTS: tl.constexpr = 1,
    conv_lo=0, conv_dim=0, slots_ptr=None, cw_ptr=None, cb_ptr=None, cs_ptr=None,
    stride_cw_d=0, stride_cw_k=0, stride_cs_slot=0, stride_cs_d=0, stride_cs_k=0,
    CONV_WIDTH: tl.constexpr = 4, CONV_BIAS: tl.constexpr = False,
    CONV_SILU: tl.constexpr = False,
    TL: tl.constexpr = False, tl_ptr=None,
):
    """y [M, N] = x @ W^T; with EPILOGUE = SILU_MUL, W is [2N, K] = [gate; up] and
    y = silu(x @ gate^T) * (x @ up^T): each program streams its BLOCK_N gate rows, then the
    same up rows. NORM prologue: norm_ptr, norm_part_ptr, ... (`gemv_triton(norm=...)`); CONV
    epilogue: conv_lo, ..., CONV_SILU (`conv_args`)."""
    stamp(TL, tl_ptr, ENTRY)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_wn  # [1, BLOCK_N, 1]
    bcast_n = 0 * offs_n[None, :, None]
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm + bcast_n  # [M, N, 1]
    w_ok = n_ok[None, :, None]
    x_ok = m_ok[:, None, None] & w_ok
    norm_rows = norm_ptr
    if PROLOGUE == 2:  # the norm weight broadcast over N, as x: [1, N, 1]
        norm_rows = norm_ptr + bcast_n
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = _row_dots(x_rows, x_ok, w_rows, w_ok, k_lo, k_hi, K, PROLOGUE,
                    BLOCK_M, BLOCK_N, BLOCK_K, PDL, offs_m, m_ok, norm_rows, norm_part_ptr,
                    stride_pm, group_size, parts_per_group, eps, PARTS, TL, tl_ptr)  # [M, N]
    acc_up = acc
    if EPILOGUE == 1:
        up_rows = w_ptr + (offs_n.to(tl.int64) + N)[None, :, None] * stride_wn
        acc_up = _row_dots(x_rows, x_ok, up_rows, w_ok, k_lo, k_hi, K, PROLOGUE,
                           BLOCK_M, BLOCK_N, BLOCK_K, PDL, offs_m, m_ok, norm_rows,
                           norm_part_ptr, stride_pm, group_size, parts_per_group, eps, PARTS)
    stamp(TL, tl_ptr, LOOPED)
    # PDL: the next kernel may launch once every program has triggered, here after the weight
    # loop: triggered at the start, its programs would take SM slots this grid's later programs
    # need (measured slower, also for grids of one wave)
    pdl_trigger(PDL)
    mn_ok = m_ok[:, None] & n_ok[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    dt = y_ptr.dtype.element_ty
    if SPLIT_K == 1:
        _store_tile(out, finish_tile(acc, acc_up, b_ptr, offs_n, n_ok, N, dt, HAS_BIAS, EPILOGUE),
                    mn_ok, offs_n, n_ok, EPILOGUE, conv_lo, conv_dim, slots_ptr, cw_ptr, cb_ptr,
                    cs_ptr, stride_cw_d, stride_cw_k, stride_cs_slot, stride_cs_d, stride_cs_k,
                    CONV_WIDTH, CONV_BIAS, CONV_SILU)
    else:
        # partials [SPLIT_K, M, W] in float32, W = N (the up half beside the gate's: 2N)
        width = N if EPILOGUE != 1 else 2 * N
        part = part_ptr + offs_m[:, None] * width + offs_n[None, :]
        tl.store(part + pid_k * M * width, acc, mask=mn_ok)
        if EPILOGUE == 1:
            tl.store(part + pid_k * M * width + N, acc_up, mask=mn_ok)
        arrived = tl.atomic_add(count_ptr + pid_n, 1)  # acq_rel: orders the stores above
        if arrived == SPLIT_K - 1:  # the last slice of this tile to finish sums them all
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * width, mask=mn_ok, other=0.0,
                                 cache_modifier=".cg")
                if EPILOGUE == 1:
                    total_up += tl.load(part + s * M * width + N, mask=mn_ok, other=0.0,
                                        cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _store_tile(out, finish_tile(total, total_up, b_ptr, offs_n, n_ok, N, dt, HAS_BIAS,
                                         EPILOGUE), mn_ok, offs_n, n_ok, EPILOGUE, conv_lo,
                        conv_dim, slots_ptr, cw_ptr, cb_ptr, cs_ptr, stride_cw_d, stride_cw_k,
                        stride_cs_slot, stride_cs_d, stride_cs_k, CONV_WIDTH, CONV_BIAS,
                        CONV_SILU)
    stamp(TL, tl_ptr, EXIT)


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict[str, int]:
    """Tile sizes and split by shape (never by anything that changes between steps of one batch
    size). Several rows: the [BLOCK_M, BLOCK_N, BLOCK_K] product stays at 4096 elements (32
    float32 registers a thread at 4 warps); K is split until the programs cover the SMs about
    four times."""
    block_m = next_pow2(max(m, 1))
    block_n = 8
    if block_m == 1:
        # one row (a sweep on the H200): 8 warps and 512-wide K tiles won at every shape; K is
        # split only while each program would stream more than 2048 columns and the tiles cover
        # the SMs fewer than four times (qwen3 down and granite down split, qwen3 o does not)
        block_k = max(64, min(512, next_pow2(k)))
        tiles = cdiv(n, block_n)
        split = 1
        while k // split > 2048 and tiles * split < 4 * num_sms and split < 16:
            split *= 2
        return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=8)
    block_k = max(64, min(512, 4096 // (block_m * block_n), next_pow2(k)))
    tiles = cdiv(n, block_n)
    split = 1
    while tiles * split < 4 * num_sms and k // (2 * split) >= 2 * block_k and split < 16:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                config: dict[str, int] | None = None, silu_mul: bool = False,
                silu_mul_out: bool = False, norm: tuple | None = None,
                conv: tuple | None = None) -> Tensor:
    """x [M, K] (M <= 8), weight [N, K] with unit stride along K -> [M, N] in x's dtype.
    With `silu_mul`, x is [M, 2K] = [gate | up] and the input is silu(gate) * up (fused
    silu_and_mul: one launch and no [M, K] intermediate). With `silu_mul_out`, weight is
    [2N, K] = [gate; up] (a merged gate_up projection) and the output [M, N] is
    silu_and_mul of the projection's [M, 2N] (no [M, 2N] intermediate, no activation launch).
    With `norm` = (norm weight [K], partials [M, K / part_size], group_size, eps, part_size),
    x is g = y * silu(z) in float32 (`selective_state_update_triton(gate=...)`) and the input
    its gated RMSNorm per group of channels, from the sums of squares in `partials`: the norm
    without a launch of its own (the output is in the weight's dtype; each program must stream
    columns of one norm group: `norm_one_group`). With `conv` = (conv_lo, conv weight [D, W],
    conv bias [D] or None, conv states [slots, D, W - 1], slots int32 [>= 1], silu) and one
    row, the output columns [conv_lo, conv_lo + D) go through a depthwise causal conv's decode
    step on the row's slot (states updated in place; W a power of two): a Mamba in_proj hands
    the state update its xBC already convolved, with no conv launch of its own."""
    prologue, k = (SILU_MUL, x.shape[1] // 2) if silu_mul else (PLAIN, x.shape[1])
    norm_args: dict = {}
    if norm is not None:
        norm_w, parts, group_size, eps, part_size = norm
        prologue = NORM
        norm_args = dict(norm_ptr=norm_w, norm_part_ptr=parts, stride_pm=parts.stride(0),
                         group_size=group_size, parts_per_group=group_size // part_size,
                         eps=float(eps), PARTS=next_pow2(group_size // part_size))
    m, rows = x.shape[0], weight.shape[0]
    n = rows // 2 if silu_mul_out else rows
    if weight.shape[1] != k:
        raise ValueError(f"gemv_triton: weight is [N, {weight.shape[1]}], input gives K={k}")
    if silu_mul_out and rows % 2:
        raise ValueError(f"gemv_triton: a gate_up weight needs an even row count, got {rows}")
    if m > MAX_M:
        raise ValueError(f"gemv_triton serves at most {MAX_M} rows, got {m}")
    x = _rowwise(x)
    # PDL reads the weight before waiting for earlier kernels: only a parameter, never a copy
    pdl = use_pdl(x) and weight.stride(-1) == 1
    weight = _rowwise(weight)
    # each program of the epilogue streams its tile's gate rows and up rows: sized as a tile of
    # twice the rows
    cfg = dict(config or default_config(m, rows, k, num_sms(x.device)))
    cfg.setdefault("SPLIT_K", 1)
    if norm is not None and (group_size % cfg["BLOCK_K"] or group_size % part_size
                             or not norm_one_group(k, group_size, cfg)):
        raise ValueError(f"gemv_triton: norm groups of {group_size} channels need a multiple "
                         f"of BLOCK_K ({cfg['BLOCK_K']}) and of the partials' {part_size}, and "
                         "each program's columns inside one group")
    tiles = cdiv(n, cfg["BLOCK_N"])
    y = torch.empty(m, n, dtype=weight.dtype if norm else x.dtype,
                    device=x.device)  # [M, N]
    conv_kwargs = {} if conv is None else conv_args(conv, m, n, silu_mul_out)
    if m == 0 or n == 0:
        return y
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    split = cfg["SPLIT_K"]
    k_slice = slice_width(k, split, cfg["BLOCK_K"])
    part, counters = split_k_scratch(_COUNTERS, split, (m, rows), tiles, y)  # [S, M, W]
    _gemv_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, y, part, counters,
        m, n, k, k_slice, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, PROLOGUE=prologue,
        EPILOGUE=SILU_MUL if silu_mul_out else (CONV if conv is not None else PLAIN),
        **norm_args, **conv_kwargs, **pdl_args(pdl), **cfg,
        **timeline_args("gemv", (tiles, split), x.device),
    )
    return y


def conv_args(conv: tuple, m: int, n: int, other_epilogue: bool) -> dict:
    """The CONV epilogue's kernel arguments from `conv` = (conv_lo, conv weight [D, W], conv
    bias [D] or None, conv states [slots, D, W - 1], slots int32 [>= 1], silu) for an output
    of m rows and n columns; a ValueError where the epilogue cannot serve the call (several
    rows, another epilogue, a width not a power of two, columns or states out of shape)."""
    conv_lo, cw, cb, states, slots, silu = conv
    width = cw.shape[1]
    if (m != 1 or other_epilogue or width & (width - 1)
            or not 0 <= conv_lo <= n - cw.shape[0] or states.shape[1:] != (cw.shape[0], width - 1)):
        raise ValueError("the conv epilogue takes one row, a plain output holding the conv's "
                         "columns, a power-of-two width and [slots, D, W - 1] states")
    return dict(conv_lo=conv_lo, conv_dim=cw.shape[0], slots_ptr=slots, cw_ptr=cw,
                cb_ptr=cb if cb is not None else cw, cs_ptr=states,
                stride_cw_d=cw.stride(0), stride_cw_k=cw.stride(1),
                stride_cs_slot=states.stride(0), stride_cs_d=states.stride(1),
                stride_cs_k=states.stride(2), CONV_WIDTH=width,
                CONV_BIAS=cb is not None, CONV_SILU=bool(silu))


def norm_one_group(k: int, group_size: int, cfg: dict[str, int]) -> bool:
    """Does every program of a NORM-prologue GEMV with config `cfg` stream columns of one norm
    group only? The prologue needs it: each program loads its group's partials once and scales
    its dots at the end."""
    return group_size >= k or group_size % slice_width(k, cfg.get("SPLIT_K", 1),
                                                       cfg["BLOCK_K"]) == 0


def _rowwise(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()

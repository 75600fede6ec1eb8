"""Skinny linear layer for decode batches: y = x @ W^T (+ b) with x [M, K], M <= 8.

cuBLAS reaches only 0.8-1.6 TB/s on the 4-13 MB projections of a small model at M = 1 (profiled on
the H200, docs/benchmarks.md): a decode step there is bound by reading the weights once, so a kernel
that streams W at copy bandwidth is the whole game. Program (n, s) owns BLOCK_N output columns for
all M rows and streams its BLOCK_N rows of W over the s-th of SPLIT_K slices of K, accumulating in
float32. With SPLIT_K > 1 (narrow outputs: too few column tiles to keep every SM streaming) each
program writes its partial sums and bumps a per-tile counter; the last program of a tile adds the
partials in slice order (deterministic), writes y and resets the counter for the next launch — one
launch, no memset, graph-safe.

A prologue may transform the input row as it is loaded: silu(gate) * up (the down projection),
or an RMSNorm of it (with the residual add, the sum written out of place; Mamba2's gated norm
over one group): each program first reduces the row over all of K, then streams its slice of W.
The norm and the projection take one launch instead of two. An epilogue may instead add the
output to the residual stream (the sum written out of place) and, in the last tile to finish,
RMS-normalize the whole rows: the next layer's norm without a kernel or a repeated reduction.
Or the norm splits between two launches (EPI_ADD_STATS, then STATS_NORM): the epilogue adds
the residual and writes each tile's sum of squares, and the next GEMV normalizes its input
from those sums as it loads it — no pass over the row before the weight loop, no last tile.

Measured on the H200 (`scripts/bench_gemv.py`, docs/benchmarks.md) it wins at one row against a
narrow weight (qwen3-0.6b o_proj 12.6 -> 5.2 us); which calls come here, and with which fusion,
is krait/ops/linear.py's choice.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops.arrival import arrival_counters
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.rms_norm import fused_add_rms_norm

MAX_M = 8
_COUNTERS: dict[torch.device, Tensor] = {}  # per-tile arrival counters, always back to zero
_NORM_COUNTERS: dict[torch.device, Tensor] = {}  # the add-norm epilogue's, one a launch


# prologue of the GEMV's input: what the x row is turned into before it meets W
PLAIN, SILU_MUL, RMS_NORM, GATED_NORM, STATS_NORM, GATED_STATS_NORM = 0, 1, 2, 3, 4, 5
# epilogue: y as is, the residual add + the next norm (the last tile normalizes the rows), or
# the residual add + each tile's sum of squares (the next GEMV normalizes: STATS_NORM)
EPI_NONE, EPI_ADD_NORM, EPI_ADD_STATS = 0, 1, 2


@triton.jit
def _prologue_h(x_rows, a_rows, k, ld_ok, K, x_scale,
                PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SCALE_X: tl.constexpr):
    """The float32 value a norm prologue normalizes, at columns k ([M, N, BLOCK_K]): RMS_NORM
    the residual sum s = x * x_scale + a (each rounded to x's dtype, as the unfused add is),
    GATED_NORM and GATED_STATS_NORM y * silu(z) with y = x, z = a (not rounded, as in
    MambaRMSNormGated), STATS_NORM x (the sum an EPI_ADD_STATS GEMV wrote)."""
    x = tl.load(x_rows + k, mask=ld_ok, other=0.0)
    if (PROLOGUE != 3) and (PROLOGUE != 5):
        if HAS_RES:
            xs = x
            if SCALE_X:
                xs = (x.to(tl.float32) * x_scale).to(x.dtype)
            r = tl.load(a_rows + k, mask=ld_ok, other=0.0)
            h = (xs.to(tl.float32) + r.to(tl.float32)).to(x.dtype).to(tl.float32)
        else:
            h = x.to(tl.float32)
    else:
        z = tl.load(a_rows + k, mask=ld_ok, other=0.0).to(tl.float32)
        h = x.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    return h


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, a_ptr, nw_ptr, s_ptr, ncount_ptr,
    st_ptr, z_ptr,
    M, N, K, k_per_split, eps, x_scale, n_stats,
    stride_xm, stride_wn, stride_ym, stride_am, stride_sm, stride_stm, stride_zm,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PROLOGUE: tl.constexpr,
    HAS_RES: tl.constexpr, SCALE_X: tl.constexpr, EPI_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    TRIGGER_LATE: tl.constexpr, NORM_BLOCK: tl.constexpr,
):
    # PDL: the next kernel may launch once every program has triggered. Late (the default since
    # session 6), after the weight loop; early (KRAIT_PDL_TRIGGER=early, an A/B knob), its
    # programs can occupy SM slots while this grid still has programs to place
    if not TRIGGER_LATE:
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
    bcast_n = 0 * offs_n[None, :, None]
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm + bcast_n  # [M, N, 1]
    a_rows = a_ptr + offs_m[:, None, None] * stride_am + bcast_n  # residual or gate: [M, N, 1]
    if PROLOGUE == 5:  # the gate comes apart from a (an epilogue may read its residual there)
        a_rows = z_ptr + offs_m[:, None, None] * stride_zm + bcast_n
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
    if (PROLOGUE == 4) or (PROLOGUE == 5):
        # the rows' sums of squares from the kernel before (st: [M, n_stats] partial sums, of
        # an EPI_ADD_STATS GEMV or the state update): no pass over the row before the loop
        t = tl.arange(0, NORM_BLOCK)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for t0 in range(0, n_stats, NORM_BLOCK):
            tt = (t0 + t)[None, :]
            sq += tl.sum(tl.load(st_ptr + offs_m[:, None] * stride_stm + tt,
                                 mask=m_ok[:, None] & (tt < n_stats), other=0.0), axis=1)
        rstd = tl.rsqrt(sq / K + eps)[:, None, None]  # [M, 1, 1]
    if (PROLOGUE == 2) or (PROLOGUE == 3):
        # a norm prologue: every program first reduces its rows over the whole of K (K is at
        # most a few thousand: these reads hit L2), in a [BLOCK_M, BLOCK_K] layout (not
        # broadcast over N); program (0, 0) writes the residual sum out of place (the other
        # programs are still reading the residual it replaces)
        xm = x_ptr + offs_m[:, None] * stride_xm  # [M, 1]
        am = a_ptr + offs_m[:, None] * stride_am
        sm = s_ptr + offs_m[:, None] * stride_sm
        write_sum = (pid_n == 0) & (pid_k == 0)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        # (names apart from the main loop's: a compiled loop keeps each variable's shape)
        for k0 in range(0, K, BLOCK_K):
            kp = (k0 + offs_k)[None, :]  # [1, BLOCK_K]
            ldp = m_ok[:, None] & (kp < K)
            hp = _prologue_h(xm, am, kp, ldp, K, x_scale, PROLOGUE, HAS_RES, SCALE_X)
            if PROLOGUE == 2 and HAS_RES:
                tl.store(sm + kp, hp.to(s_ptr.dtype.element_ty), mask=ldp & write_sum)
            sq += tl.sum(hp * hp, axis=1)
        rstd = tl.rsqrt(sq / K + eps)[:, None, None]  # [M, 1, 1]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = (k0 + offs_k)[None, None, :]
        k_ok = k < k_hi
        if PROLOGUE == 0:
            x = tl.load(x_rows + k, mask=x_ok & k_ok, other=0.0)
        elif PROLOGUE == 1:  # x holds [gate | up] of width 2K: the input is silu(gate) * up
            g = tl.load(x_rows + k, mask=x_ok & k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k, mask=x_ok & k_ok, other=0.0)
            # rounded to the activation dtype, as silu_and_mul hands it to the projection
            x = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(up.dtype)
        else:  # normalized, rounded, scaled by the norm weight and rounded, as the norm op does
            h = _prologue_h(x_rows, a_rows, k, x_ok & k_ok, K, x_scale,
                            PROLOGUE, HAS_RES, SCALE_X)
            h = (h * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (nw * h).to(y_ptr.dtype.element_ty)
        k_next = k + BLOCK_K
        w_next = tl.load(w_rows + k_next, mask=w_ok & (k_next < k_hi), other=0.0)
        acc3 += x.to(tl.float32) * w.to(tl.float32)  # [M, N, K]
        w = w_next
    if TRIGGER_LATE:
        pdl_trigger(PDL)
    acc = tl.sum(acc3, axis=2)  # [M, N]
    mn_ok = m_ok[:, None] & n_ok[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPI_NORM == 1:
            _add_norm_epilogue(acc, offs_m, offs_n, m_ok, mn_ok, N, y_ptr, a_ptr, s_ptr, nw_ptr,
                               ncount_ptr, eps, x_scale, stride_ym, stride_am, stride_sm,
                               SCALE_X, BLOCK_M, NORM_BLOCK)
        elif EPI_NORM == 2:
            _add_stats_epilogue(acc, offs_m, offs_n, m_ok, mn_ok, pid_n, y_ptr, a_ptr, s_ptr,
                                x_scale, stride_ym, stride_am, stride_sm, SCALE_X)
        else:
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
            tl.atomic_xchg(count_ptr + pid_n, 0)
            if EPI_NORM == 1:
                _add_norm_epilogue(total, offs_m, offs_n, m_ok, mn_ok, N, y_ptr, a_ptr, s_ptr,
                                   nw_ptr, ncount_ptr, eps, x_scale, stride_ym, stride_am,
                                   stride_sm, SCALE_X, BLOCK_M, NORM_BLOCK)
            elif EPI_NORM == 2:
                _add_stats_epilogue(total, offs_m, offs_n, m_ok, mn_ok, pid_n, y_ptr, a_ptr,
                                    s_ptr, x_scale, stride_ym, stride_am, stride_sm, SCALE_X)
            else:
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mn_ok)


@triton.jit
def _residual_sum(val, offs_m, offs_n, mn_ok, r_ptr, s_ptr, x_scale, stride_rm, stride_sm,
                  SCALE_X: tl.constexpr):
    """s = val * x_scale + residual for the tile (each rounded to the model dtype, as the unfused
    add is), written out of place; returned [M, BLOCK_N] in the model dtype."""
    dt = s_ptr.dtype.element_ty
    y = val.to(dt)
    if SCALE_X:
        y = (y.to(tl.float32) * x_scale).to(dt)
    r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mn_ok, other=0.0)
    s = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + offs_n[None, :], s, mask=mn_ok)
    return s


@triton.jit
def _add_stats_epilogue(val, offs_m, offs_n, m_ok, mn_ok, pid_n, st_ptr, r_ptr, s_ptr, x_scale,
                        stride_stm, stride_rm, stride_sm, SCALE_X: tl.constexpr):
    """The residual add of `_residual_sum`, and the tile's sum of s^2 per row into column pid_n
    of st [M, tiles] (float32): the next GEMV (STATS_NORM) normalizes from those sums."""
    s = _residual_sum(val, offs_m, offs_n, mn_ok, r_ptr, s_ptr, x_scale, stride_rm, stride_sm,
                      SCALE_X).to(tl.float32)
    sq = tl.sum(tl.where(mn_ok, s * s, 0.0), axis=1)  # [M]
    tl.store(st_ptr + offs_m * stride_stm + pid_n, sq, mask=m_ok)


@triton.jit
def _add_norm_epilogue(
    val, offs_m, offs_n, m_ok, mn_ok, N, y_ptr, r_ptr, s_ptr, nw_ptr, ncount_ptr, eps, x_scale,
    stride_ym, stride_rm, stride_sm,
    SCALE_X: tl.constexpr, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr,
):
    """The tile's output val [M, BLOCK_N] (float32) joins the residual stream: s = y * x_scale +
    residual (each rounded to the model dtype, as the unfused add is) is written out of place;
    the last tile to arrive (one counter a launch, back to zero after) reads the whole rows of s
    and writes their RMSNorm to y: residual add and norm without a kernel of their own."""
    dt = s_ptr.dtype.element_ty
    _residual_sum(val, offs_m, offs_n, mn_ok, r_ptr, s_ptr, x_scale, stride_rm, stride_sm,
                  SCALE_X)
    arrived = tl.atomic_add(ncount_ptr, 1)  # acq_rel: orders the store above
    if arrived == tl.num_programs(0) - 1:
        cols = tl.arange(0, NORM_BLOCK)
        s_rows = s_ptr + offs_m[:, None] * stride_sm
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n0 in range(0, N, NORM_BLOCK):
            c = n0 + cols
            ok = m_ok[:, None] & (c < N)[None, :]
            v = tl.load(s_rows + c[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            sq += tl.sum(v.to(tl.float32) * v.to(tl.float32), axis=1)
        rstd = tl.rsqrt(sq / N + eps)[:, None]  # [M, 1]
        for n0 in range(0, N, NORM_BLOCK):
            c = n0 + cols
            ok = m_ok[:, None] & (c < N)[None, :]
            v = tl.load(s_rows + c[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            h = (v.to(tl.float32) * rstd).to(dt).to(tl.float32)
            w = tl.load(nw_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_m[:, None] * stride_ym + c[None, :], (w[None, :] * h).to(dt),
                     mask=ok)
        tl.atomic_xchg(ncount_ptr, 0)


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
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    return _launch(x, weight, bias, config, SILU_MUL if silu_mul else PLAIN, k)[0]


def gemv_rms_norm_triton(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
    bias: Tensor | None = None, x_scale: float = 1.0, config: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(linear(rms_norm(s)), s) for x [M, K], s = x * x_scale + residual (s = x without a
    residual): fused_add_rms_norm in the GEMV's prologue, one launch. s comes back in a new
    tensor; residual is not modified."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"gemv_rms_norm_triton: residual {tuple(residual.shape)} vs x "
                         f"{tuple(x.shape)}")
    y, summed = _launch(x, weight, bias, config, RMS_NORM, x.shape[1], residual, norm_weight,
                        eps, x_scale)
    return y, (x if residual is None else summed)


def gemv_gated_norm_triton(
    x: Tensor, gate: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
    bias: Tensor | None = None, config: dict[str, int] | None = None,
) -> Tensor:
    """linear(gated_rms_norm(x, gate)) for x, gate [M, K], the norm over all K channels (one
    group): Mamba2's gated norm in the GEMV's prologue."""
    if gate.shape != x.shape:
        raise ValueError(f"gemv_gated_norm_triton: gate {tuple(gate.shape)} vs x {tuple(x.shape)}")
    return _launch(x, weight, bias, config, GATED_NORM, x.shape[1], gate, norm_weight, eps)[0]


def gemv_add_norm_triton(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
    eps: float, x_scale: float = 1.0, silu_mul: bool = False,
    config: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(s), s) for s = y * x_scale + residual, y = linear(x) (x = [gate | up] through
    silu_and_mul with `silu_mul`): the projection, the residual add and the next layer's norm
    in one launch (the last output tile to finish normalizes the rows)."""
    return _launch(x, weight, bias, config, *_input_prologue(x, silu_mul, None), residual,
                   norm_weight, eps, x_scale, epi=EPI_ADD_NORM)


def gemv_add_stats_triton(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, x_scale: float = 1.0,
    silu_mul: bool = False, config: dict[str, int] | None = None,
    gated: GatedStats | None = None,
) -> tuple[Tensor, Tensor]:
    """(s, stats) for s = y * x_scale + residual, y = linear(x) (x = [gate | up] through
    silu_and_mul with `silu_mul`), and stats [M, tiles] float32: each output tile's sum of s^2
    per row. The next layer's norm then runs in the next GEMV (`gemv_stats_norm_triton`),
    without a pass of its own and without a last tile normalizing the rows. With `gated`, x is
    Mamba2's y, gated and normalized as it is loaded (`gemv_gated_stats_norm_triton`)."""
    nw, eps = (gated.norm_weight, gated.eps) if gated is not None else (None, 0.0)
    stats, s = _launch(x, weight, bias, config, *_input_prologue(x, silu_mul, gated), residual,
                       nw, eps, x_scale=x_scale, epi=EPI_ADD_STATS, **_gated_args(gated))
    return s, stats


class GatedStats(NamedTuple):
    """A GEMV input that is Mamba2's y before its gated norm: the gate [M, K], the state
    update's partial sums of (y * silu(gate))^2 [M, T] float32, the norm weight and eps."""

    gate: Tensor
    stats: Tensor
    norm_weight: Tensor
    eps: float


def _input_prologue(x: Tensor, silu_mul: bool, gated: GatedStats | None) -> tuple[int, int]:
    """(prologue, K) of a projection's input x: plain, [gate | up], or gated-normalized y."""
    if gated is not None:
        return GATED_STATS_NORM, x.shape[1]
    return (SILU_MUL, x.shape[1] // 2) if silu_mul else (PLAIN, x.shape[1])


def _gated_args(gated: GatedStats | None) -> dict:
    if gated is None:
        return {}
    _check_stats(gated.gate, gated.stats)
    return dict(stats=gated.stats, gate=gated.gate)


def gemv_stats_norm_triton(
    s: Tensor, stats: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
    bias: Tensor | None = None, config: dict[str, int] | None = None,
) -> Tensor:
    """linear(rms_norm(s)) for s [M, K] whose sums of squares come in stats [M, T] (partial
    sums, any split: `gemv_add_stats_triton`'s): the norm applied as the GEMV loads s."""
    _check_stats(s, stats)
    return _launch(s, weight, bias, config, STATS_NORM, s.shape[1], None, norm_weight, eps,
                   stats=stats)[0]


def gemv_gated_stats_norm_triton(
    y: Tensor, gate: Tensor, stats: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
    bias: Tensor | None = None, config: dict[str, int] | None = None,
) -> Tensor:
    """linear(gated_rms_norm(y, gate)) for y, gate [M, K] (one group) whose sums of
    (y * silu(gate))^2 come in stats [M, T] (the state update's partial sums): Mamba2's gated
    norm applied as the GEMV loads y and the gate."""
    _check_stats(y, stats)
    return _launch(y, weight, bias, config, GATED_STATS_NORM, y.shape[1], None, norm_weight,
                   eps, stats=stats, gate=gate)[0]


def _check_stats(x: Tensor, stats: Tensor) -> None:
    if stats.dim() != 2 or stats.shape[0] != x.shape[0] or stats.dtype != torch.float32:
        raise ValueError(f"gemv: stats must be float32 [{x.shape[0]}, T], "
                         f"got {stats.dtype} {tuple(stats.shape)}")


def _rowwise(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    x: Tensor, weight: Tensor, bias: Tensor | None, config: dict[str, int] | None,
    prologue: int, k: int, aux: Tensor | None = None, norm_weight: Tensor | None = None,
    eps: float = 0.0, x_scale: float = 1.0, epi: int = EPI_NONE, stats: Tensor | None = None,
    gate: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One GEMV launch: (y [M, N], the residual sum: [M, K] of an RMS_NORM prologue with aux,
    [M, N] of the add epilogues (aux the residual; y then holds the normalized sum, or for
    EPI_ADD_STATS the float32 [M, tiles] sums of squares)). The stats prologues read `stats`
    [M, T] (and GATED_STATS_NORM the `gate` [M, K])."""
    m, n = x.shape[0], weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"gemv_triton: weight is [N, {weight.shape[1]}], input gives K={k}")
    if m > MAX_M:
        raise ValueError(f"gemv_triton serves at most {MAX_M} rows, got {m}")
    x = _rowwise(x)
    aux = _rowwise(aux) if aux is not None else None
    gate = _rowwise(gate) if gate is not None else None
    # PDL reads the weight before waiting for earlier kernels: only a parameter, never a copy
    pdl = use_pdl(x) and weight.stride(-1) == 1
    weight = _rowwise(weight)
    cfg = dict(config or default_config(m, n, k, _num_sms(x.device)))
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    if epi == EPI_ADD_STATS:
        y = torch.empty(m, tiles, dtype=torch.float32, device=x.device)  # [M, tiles]
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    summed = None
    if prologue == RMS_NORM and aux is not None:
        summed = torch.empty(m, k, dtype=x.dtype, device=x.device)  # [M, K]
    if epi != EPI_NONE:
        if aux is None or aux.shape != (m, n):
            raise ValueError(f"gemv add epilogue: residual must be [{m}, {n}]")
        summed = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        if summed is not None and epi == EPI_NONE:
            summed.copy_(fused_add_rms_norm(x, aux, norm_weight, eps, x_scale)[1])
        return y, summed
    cfg.setdefault("SPLIT_K", 1)
    if x.device.type == "cpu":
        cfg.pop("num_warps", None)
    split = cfg["SPLIT_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
        counters = arrival_counters(_COUNTERS, x.device, tiles)
    else:
        part = counters = y
    a = aux if aux is not None else x
    s = summed if summed is not None else x
    ncount = arrival_counters(_NORM_COUNTERS, x.device, 1) if epi == EPI_ADD_NORM else y
    st = stats if stats is not None else y
    z = gate if gate is not None else x
    n_stats = stats.shape[1] if stats is not None else 0
    norm_block = n_stats if stats is not None else n
    _gemv_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, y, part, counters, a,
        norm_weight if norm_weight is not None else weight, s, ncount, st, z,
        m, n, k, k_per_split, float(eps), float(x_scale), n_stats,
        x.stride(0), weight.stride(0), y.stride(0), a.stride(0), s.stride(0), st.stride(0),
        z.stride(0), HAS_BIAS=bias is not None, PROLOGUE=prologue,
        HAS_RES=aux is not None and epi == EPI_NONE,
        SCALE_X=x_scale != 1.0, EPI_NORM=epi,
        TRIGGER_LATE=pdl and os.environ.get("KRAIT_PDL_TRIGGER") != "early",
        NORM_BLOCK=min(1024, triton.next_power_of_2(max(norm_block, 1))), **pdl_args(pdl),
        **cfg,
    )
    return y, summed

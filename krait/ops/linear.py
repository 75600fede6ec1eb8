"""Which decode projections go to the GEMV (krait/ops/gemv.py) and which to cuBLAS, and the
norm fusions around it: a pre-norm in the GEMV's prologue (`rms_norm_linear`,
`gated_norm_linear`; KRAIT_FUSE_NORM=1) or the residual add and the next norm in its epilogue
(`linear_add_norm`; KRAIT_NORM_EPILOGUE=1). Every entry point falls back to the unfused ops, so
callers never check the conditions themselves."""

from __future__ import annotations

import os

import torch.nn.functional as F
from torch import Tensor

from krait.ops._dispatch import use_triton
from krait.ops.activation import silu_and_mul
from krait.ops.gated_rms_norm import gated_rms_norm
from krait.ops.gemv import (
    MAX_M,
    GatedStats,
    gemv_add_norm_triton,
    gemv_add_stats_triton,
    gemv_gated_norm_triton,
    gemv_gated_stats_norm_triton,
    gemv_rms_norm_triton,
    gemv_triton,
)
from krait.ops.rms_norm import fused_add_rms_norm, residual_sum, rms_norm

# one-row calls up to this many weight elements may go to the GEMV (KRAIT_GEMV=wide for a plain
# projection; always when a norm is fused into it): with the one-row config of session 4 it beat
# cuBLAS at every projection shape up to 17M elements in isolation on the H200 (docs/benchmarks.md,
# run 10) and lost at granite's gate_up (32M); lm_heads (100M+) stay on cuBLAS
ROW_GEMV_MAX_ELEMENTS = 20 << 20
# the default rule's bound (session 6: with the late PDL trigger, every one-row projection up to
# this size through the GEMV; granite's 17M in_proj and down lost there)
ROW_GEMV_DEFAULT_MAX_ELEMENTS = 8 << 20


def _gemv_allowed(x: Tensor) -> bool:
    """The GEMV serves x at all: at most MAX_M rows, Triton on, KRAIT_GEMV not 0."""
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_M:  # shape first: prefill pays no lookup
        return False
    return os.environ.get("KRAIT_GEMV") != "0" and use_triton(x)


def _use_gemv(x: Tensor, weight: Tensor) -> bool:
    """A plain projection through the GEMV? KRAIT_GEMV=1: every call with M <= 8; =0: never;
    unset: one row against a weight of at most 8M elements. With the GEMV's PDL trigger after
    its weight loop (the default since session 6) this made qwen3's batch-1 step 8% faster on
    the H200 (1.11-1.14 vs 1.22-1.25 ms: its qkv and gate_up join o and down). The A/B rules:
    KRAIT_GEMV=narrow (session 5's default: only N <= K/2, at most 8M), =wide (at most 20M:
    granite's in_proj and down too, 6% slower there). With more rows the GEMV re-reads W per
    row tile and loses."""
    if not _gemv_allowed(x):
        return False
    mode = os.environ.get("KRAIT_GEMV")
    if mode == "1":
        return True
    if x.shape[0] != 1:
        return False
    n, k = weight.shape
    if mode == "wide":
        return weight.numel() <= ROW_GEMV_MAX_ELEMENTS
    if mode == "narrow":
        return 2 * n <= k and n * k <= ROW_GEMV_DEFAULT_MAX_ELEMENTS
    return n * k <= ROW_GEMV_DEFAULT_MAX_ELEMENTS


def fuse_rms_norm(x: Tensor, weight: Tensor) -> bool:
    """A norm fused into the GEMV's prologue, only with KRAIT_FUSE_NORM=1: one row against a
    weight of at most ROW_GEMV_MAX_ELEMENTS (with KRAIT_GEMV=1 every call of at most MAX_M
    rows). Off by default: on the H200 (session 5) every program re-reading and normalizing
    the row cost more than the launch it saves (mamba2 in_proj 19.5 vs 13.4 us for norm +
    cuBLAS; b=1 steps 9% (qwen3) to 50% (mamba2) slower)."""
    if not _gemv_allowed(x) or os.environ.get("KRAIT_FUSE_NORM") != "1":
        return False
    if os.environ.get("KRAIT_GEMV") == "1":
        return True
    return x.shape[0] == 1 and weight.numel() <= ROW_GEMV_MAX_ELEMENTS


def norm_stats_enabled() -> bool:
    """KRAIT_NORM_STATS=1 (opt-in, session 7, unmeasured): a layer's last projection adds the
    residual and writes each output tile's sum of squares (`linear_add_stats`), the next
    layer's first projection normalizes from those sums as it loads its input: the norm
    without a kernel, a pass before the weight loop or a last tile's pass over the rows."""
    return os.environ.get("KRAIT_NORM_STATS") == "1"


def defer_to_norm(x: Tensor, weight: Tensor) -> bool:
    """Leave a projection for the next norm to run with the residual add and the norm in its
    epilogue (`linear_add_norm`; `linear_add_stats`)? Only with KRAIT_NORM_EPILOGUE=1 (H200,
    session 6: batch-1 steps 5-8% slower; the last tile's serial pass ends every GEMV late) or
    KRAIT_NORM_STATS=1, for the calls the GEMV takes; x is the projection's input (for silu_mul
    its gate half's shape decides as well: the rows are what counts)."""
    if os.environ.get("KRAIT_NORM_EPILOGUE") != "1" and not norm_stats_enabled():
        return False
    return _use_gemv(x, weight)


def fuse_stats_norm(s: Tensor, weight: Tensor) -> bool:
    """The next projection normalizes from the sums (`gemv_stats_norm_triton`)? With
    KRAIT_NORM_STATS=1, one row against a weight of at most ROW_GEMV_MAX_ELEMENTS (every call
    of at most MAX_M rows with KRAIT_GEMV=1)."""
    if not norm_stats_enabled() or not _gemv_allowed(s):
        return False
    if os.environ.get("KRAIT_GEMV") == "1":
        return True
    return s.shape[0] == 1 and weight.numel() <= ROW_GEMV_MAX_ELEMENTS


def linear_add_stats(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, x_scale: float = 1.0,
    silu_mul: bool = False, gated: GatedStats | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(s, stats) for s = linear(x) * x_scale + residual (x through silu_and_mul first with
    `silu_mul`, gated and normalized with `gated`): stats [M, tiles] float32 are s's sums of
    squares by output tile where the GEMV takes the call, None where it does not (then s comes
    from the unfused add)."""
    if _use_gemv(x, weight):
        return gemv_add_stats_triton(x, weight, bias, residual, x_scale, silu_mul, gated=gated)
    if gated is not None:
        y = gated_stats_linear(x, gated, weight, bias)
    else:
        y = silu_mul_linear(x, weight, bias) if silu_mul else linear(x, weight, bias)
    return residual_sum(y, residual, x_scale), None


def gated_stats_linear(x: Tensor, gated: GatedStats, weight: Tensor,
                       bias: Tensor | None = None) -> Tensor:
    """linear(gated_rms_norm(x, gate)) over one group, the sums of squares given (`gated`):
    the GEMV normalizing as it loads x where `fuse_stats_norm` allows, else the norm op."""
    if fuse_stats_norm(x, weight):
        return gemv_gated_stats_norm_triton(x, gated.gate, gated.stats, gated.norm_weight,
                                            gated.eps, weight, bias)
    normed = gated_rms_norm(x, gated.gate, gated.norm_weight, gated.eps, x.shape[-1])
    return linear(normed, weight, bias)


def linear_add_norm(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
    eps: float, x_scale: float = 1.0, silu_mul: bool = False, gated: GatedStats | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(s), s) for s = linear(x) * x_scale + residual (x through silu_and_mul first
    with `silu_mul`): one launch for the decode shapes `_use_gemv` picks, else the projection
    then fused_add_rms_norm. With `gated` (x is Mamba2's y before its gated norm) two: the
    projection normalizing x as it loads it, then fused_add_rms_norm."""
    if gated is not None:
        y = gated_stats_linear(x, gated, weight, bias)
        return fused_add_rms_norm(y, residual, norm_weight, eps, x_scale)
    if _use_gemv(x, weight):
        return gemv_add_norm_triton(x, weight, bias, residual, norm_weight, eps, x_scale,
                                    silu_mul)
    y = silu_mul_linear(x, weight, bias) if silu_mul else linear(x, weight, bias)
    return fused_add_rms_norm(y, residual, norm_weight, eps, x_scale)


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


def rms_norm_linear(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
    bias: Tensor | None = None, x_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(linear(rms_norm(s)), s) with s = x * x_scale + residual, or s = x without a residual
    (x_scale then unused): one launch for the decode shapes `fuse_rms_norm` picks, else the norm
    op then `linear`."""
    if fuse_rms_norm(x, weight):
        return gemv_rms_norm_triton(x, residual, norm_weight, eps, weight, bias, x_scale)
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias), x
    h, summed = fused_add_rms_norm(x, residual, norm_weight, eps, x_scale)
    return linear(h, weight, bias), summed


def gated_norm_linear(
    x: Tensor, gate: Tensor, norm_weight: Tensor, eps: float, group_size: int, weight: Tensor,
    bias: Tensor | None = None,
) -> Tensor:
    """linear(gated_rms_norm(x, gate)): one launch for one group (group_size == K) at the
    decode shapes `fuse_rms_norm` picks, else the norm op then `linear`."""
    if fuse_gated_norm(x, group_size, weight):
        return gemv_gated_norm_triton(x, gate, norm_weight, eps, weight, bias)
    return linear(gated_rms_norm(x, gate, norm_weight, eps, group_size), weight, bias)


def fuse_gated_norm(x: Tensor, group_size: int, weight: Tensor) -> bool:
    """The gated norm in the GEMV's prologue: one group only, and `fuse_rms_norm`'s rule."""
    return group_size == x.shape[-1] and fuse_rms_norm(x, weight)

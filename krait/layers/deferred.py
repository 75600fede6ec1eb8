"""A projection left for the norm after it (KRAIT_NORM_EPILOGUE=1 or KRAIT_NORM_STATS=1): a
layer's last projection (o_proj, down, Mamba2's out_proj) returns a `DeferredLinear` instead of
its output, and the next layer's `PendingNorm` runs it with the residual add and the norm in
the GEMV's epilogue (`krait.ops.linear.linear_add_norm`: one launch for projection, add and
norm), or with the add and the sums of squares the next projection normalizes from
(`linear_add_stats`)."""

from __future__ import annotations

from torch import Tensor

from krait.ops.gemv import GatedStats
from krait.ops.linear import (
    gated_stats_linear,
    linear,
    linear_add_norm,
    linear_add_stats,
    silu_mul_linear,
)


class DeferredLinear:
    """linear(x, weight, bias) (x through silu_and_mul first with `silu_mul`, or through
    Mamba2's gated norm from the state update's sums with `gated`), not run yet."""

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, silu_mul: bool,
                 gated: GatedStats | None = None) -> None:
        self.x, self.weight, self.bias, self.silu_mul = x, weight, bias, silu_mul
        self.gated = gated

    def value(self) -> Tensor:
        """The projection's output [T, N], on its own."""
        if self.gated is not None:
            return gated_stats_linear(self.x, self.gated, self.weight, self.bias)
        if self.silu_mul:
            return silu_mul_linear(self.x, self.weight, self.bias)
        return linear(self.x, self.weight, self.bias)

    def add_norm(
        self, residual: Tensor, norm_weight: Tensor, eps: float, x_scale: float
    ) -> tuple[Tensor, Tensor]:
        """(rms_norm(s), s) for s = value() * x_scale + residual, in one launch where it can."""
        return linear_add_norm(self.x, self.weight, self.bias, residual, norm_weight, eps,
                               x_scale, self.silu_mul, self.gated)

    def add_stats(self, residual: Tensor, x_scale: float) -> tuple[Tensor, Tensor | None]:
        """(s, stats) for s = value() * x_scale + residual: `linear_add_stats`."""
        return linear_add_stats(self.x, self.weight, self.bias, residual, x_scale, self.silu_mul,
                                self.gated)

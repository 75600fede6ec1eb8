"""RMSNorm with optional fused residual add, and `PendingNorm`: a norm that the projection
reading it may fuse into its decode GEMV."""

from __future__ import annotations

import torch

from krait.layers.deferred import DeferredLinear
from krait.ops.gemv import gemv_rms_norm_triton, gemv_stats_norm_triton
from krait.ops.linear import fuse_rms_norm, fuse_stats_norm, linear
from krait.ops.rms_norm import fused_add_rms_norm, rms_norm


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, x_scale: float = 1.0
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(s), s) for s = x * x_scale + residual
        (the scale only applies with a residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, x_scale)


class PendingNorm:
    """norm(s) for s = x * x_scale + residual (s = x when residual is None: the first layer),
    not computed yet. A layer hands it to its mixer in place of the normalized activations: a
    `Linear` reading it computes norm and projection in one launch where the decode GEMV takes
    the call (`fuse_rms_norm`), anything else asks for `value()`. Once read, `residual` is s,
    the residual stream the layer carries on."""

    def __init__(
        self, norm: RMSNorm, x: torch.Tensor | DeferredLinear, residual: torch.Tensor | None,
        x_scale: float = 1.0,
    ) -> None:
        self.norm, self.x, self.residual_in, self.x_scale = norm, x, residual, x_scale
        self._value: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None  # s's sums of squares by tile (NORM_STATS)

    def value(self) -> torch.Tensor:
        """The normalized activations [T, hidden] (computed once). A deferred projection as x
        runs here, with the residual add and this norm in its epilogue where it can."""
        if self._value is None and self._sum is not None and isinstance(self.x, DeferredLinear):
            self._value = self.norm(self._sum)  # s made by `project` (KRAIT_NORM_STATS)
            return self._value
        if self._value is None and isinstance(self.x, DeferredLinear):
            if self.residual_in is not None:
                self._value, self._sum = self.x.add_norm(
                    self.residual_in, self.norm.weight, self.norm.eps, self.x_scale)
                return self._value
            self.x = self.x.value()
        if self._value is None:
            if self.residual_in is None:
                self._value, self._sum = self.norm(self.x), self.x
            else:
                self._value, self._sum = self.norm(self.x, self.residual_in, self.x_scale)
        return self._value

    def project(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """linear(value(), weight, bias), the norm fused in when nothing has read it yet (else
        the norm runs once, through value(), and later readers reuse it). With
        KRAIT_NORM_STATS=1 a deferred projection as x adds the residual and writes its sums of
        squares, and this projection normalizes from them as it loads s."""
        if (self._value is None and isinstance(self.x, DeferredLinear)
                and self.residual_in is not None and fuse_stats_norm(self.residual_in, weight)):
            if self._sum is None:
                self._sum, self._stats = self.x.add_stats(self.residual_in, self.x_scale)
            if self._stats is not None:
                return gemv_stats_norm_triton(self._sum, self._stats, self.norm.weight,
                                              self.norm.eps, weight, bias)
        if (self._value is None and not isinstance(self.x, DeferredLinear)
                and fuse_rms_norm(self.x, weight)):
            y, self._sum = gemv_rms_norm_triton(self.x, self.residual_in, self.norm.weight,
                                                self.norm.eps, weight, bias, self.x_scale)
            return y
        return linear(self.value(), weight, bias)

    @property
    def residual(self) -> torch.Tensor:
        """s = x * x_scale + residual: the residual stream after this norm."""
        if self._sum is None:
            raise RuntimeError("PendingNorm.residual: read the norm (value() or a projection) first")
        return self._sum

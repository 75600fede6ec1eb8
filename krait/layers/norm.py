"""RMSNorm with optional fused residual add."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass
class FoldedResidual:
    """A block's output with the residual already added by its last GEMV (KRAIT_NORM_PROLOGUE):
    h [1, H] is the residual stream's next value, parts [1, H / RESIDUAL_PART] float32 its sums
    of squares per run of columns, which the next block's input GEMV normalizes from."""

    h: torch.Tensor
    parts: torch.Tensor

    def normed(self, norm: RMSNorm) -> NormedInput:
        """norm(h), left to the GEMV that consumes it."""
        return NormedInput(self.h, self.parts, norm.weight, norm.eps)


@dataclass
class NormedInput:
    """rms_norm(h) still to be applied, by the GEMV that consumes it (its prologue)."""

    h: torch.Tensor
    parts: torch.Tensor
    weight: torch.Tensor
    eps: float

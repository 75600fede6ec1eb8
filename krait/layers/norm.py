"""RMSNorm with optional fused residual add."""

from __future__ import annotations

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

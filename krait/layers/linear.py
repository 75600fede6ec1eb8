"""Linear layers. `MergedLinear` fuses several HF projections (q/k/v, gate/up) into one GEMM.
Both take a tensor or a `PendingNorm` (the norm then fused into the decode GEMV)."""

from __future__ import annotations

import torch

from krait.layers.deferred import DeferredLinear
from krait.layers.norm import PendingNorm
from krait.ops.gated_rms_norm import gated_rms_norm
from krait.ops.gemv import GatedStats
from krait.ops.linear import (
    defer_to_norm,
    fuse_gated_norm,
    gated_norm_linear,
    gated_stats_linear,
    linear,
    silu_mul_linear,
)


def _project(x: torch.Tensor | PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None):
    if isinstance(x, PendingNorm):
        return x.project(weight, bias)
    return linear(x, weight, bias)


class Linear(torch.nn.Linear):
    """A plain linear layer (tensor-parallel variants come with the parallelism work)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return _project(x, self.weight, self.bias)

    def forward_silu_mul(
        self, gate_up: torch.Tensor, defer: bool = False
    ) -> torch.Tensor | DeferredLinear:
        """self(silu_and_mul(gate_up)) for gate_up [T, 2 * in_features] (fused for decode).
        With `defer`, a decode call may come back unrun, for the next norm (`DeferredLinear`)."""
        if defer and defer_to_norm(gate_up, self.weight):
            return DeferredLinear(gate_up, self.weight, self.bias, silu_mul=True)
        return silu_mul_linear(gate_up, self.weight, self.bias)

    def forward_deferred(self, x: torch.Tensor) -> torch.Tensor | DeferredLinear:
        """self(x), or for a decode call the GEMV takes (KRAIT_NORM_EPILOGUE=1) the unrun
        projection, for the next norm to run with the residual add and itself."""
        if defer_to_norm(x, self.weight):
            return DeferredLinear(x, self.weight, self.bias, silu_mul=False)
        return linear(x, self.weight, self.bias)

    def forward_gated_norm(
        self, x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
        group_size: int, defer: bool = False,
    ) -> torch.Tensor | DeferredLinear:
        """self(gated_rms_norm(x, gate)) for x, gate [T, in_features]: the norm in the GEMV's
        prologue (KRAIT_FUSE_NORM=1) or, with `defer`, the projection possibly left unrun."""
        if defer and not fuse_gated_norm(x, group_size, self.weight):
            return self.forward_deferred(gated_rms_norm(x, gate, norm_weight, eps, group_size))
        return gated_norm_linear(x, gate, norm_weight, eps, group_size, self.weight, self.bias)


    def forward_gated_stats(
        self, x: torch.Tensor, gated: GatedStats, defer: bool = False
    ) -> torch.Tensor | DeferredLinear:
        """self(gated_rms_norm(x, gate)) for Mamba2's decode y with the state update's sums of
        squares (KRAIT_NORM_STATS=1): normalized as the GEMV loads it; with `defer` possibly
        left unrun for the next norm (which then adds its own sums in the same launch)."""
        if defer and defer_to_norm(x, self.weight):
            return DeferredLinear(x, self.weight, self.bias, silu_mul=False, gated=gated)
        return gated_stats_linear(x, gated, self.weight, self.bias)


class MergedLinear(torch.nn.Module):
    """One weight [sum(out_sizes), in_features] holding several projections side by side.
    `load_shard(i, w)` copies projection i's checkpoint tensor (weight or bias) into place."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight = torch.nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = torch.nn.Parameter(torch.empty(sum(out_sizes))) if bias else None

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return _project(x, self.weight, self.bias)

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool = False) -> None:
        target = self.bias if is_bias else self.weight
        lo = self.offsets[shard]
        target.data[lo : lo + self.out_sizes[shard]].copy_(tensor)

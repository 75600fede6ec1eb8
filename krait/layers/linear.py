"""Linear layers. `MergedLinear` fuses several HF projections (q/k/v, gate/up) into one GEMM."""

from __future__ import annotations

import torch

from krait.layers.norm import FoldedResidual, NormedInput
from krait.ops.gemv import gemv_triton
from krait.ops.linear import linear, norm_linear, norm_silu_mlp, silu_mlp


class Linear(torch.nn.Linear):
    """A plain linear layer (tensor-parallel variants come with the parallelism work)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(torch.nn.Module):
    """One weight [sum(out_sizes), in_features] holding several projections side by side.
    `load_shard(i, w)` copies projection i's checkpoint tensor (weight or bias) into place."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight = torch.nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = torch.nn.Parameter(torch.empty(sum(out_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool = False) -> None:
        target = self.bias if is_bias else self.weight
        lo = self.offsets[shard]
        target.data[lo : lo + self.out_sizes[shard]].copy_(tensor)


def gated_silu_mlp(x: torch.Tensor | NormedInput, gate_up: torch.nn.Module,
                   down: torch.nn.Module, residual: torch.Tensor | None = None,
                   residual_scale: float = 1.0) -> torch.Tensor | FoldedResidual:
    """down(silu_and_mul(gate_up(x))) for layers holding `weight` and `bias`: gate_up's weight
    [2I, H] (gate rows, then up rows), down's [H, I]; the activation fused for decode. A
    NormedInput x with the block's `residual` (KRAIT_NORM_PROLOGUE, `block_fold_ok`) gives a
    FoldedResidual: the norm in gate_up's prologue, the residual (plus the output times
    `residual_scale`) in down's epilogue."""
    if isinstance(x, NormedInput):
        return FoldedResidual(*norm_silu_mlp(x.h, x.parts, x.weight, x.eps, gate_up.weight,
                                             down.weight, gate_up.bias, down.bias, residual,
                                             residual_scale))
    return silu_mlp(x, gate_up.weight, down.weight, gate_up.bias, down.bias)


def project(layer: torch.nn.Module, x: torch.Tensor | NormedInput) -> torch.Tensor:
    """layer(x), or for a NormedInput the GEMV with the RMSNorm in its prologue."""
    if isinstance(x, NormedInput):
        return norm_linear(x.h, x.parts, x.weight, x.eps, layer.weight, layer.bias)
    return layer(x)


def project_folding(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                    residual_scale: float = 1.0) -> torch.Tensor | FoldedResidual:
    """layer(x), or with `residual` a FoldedResidual: the residual plus the output times
    `residual_scale` added and each tile's sum of squares written by the GEMV's epilogue."""
    if residual is None:
        return layer(x)
    return FoldedResidual(*gemv_triton(x, layer.weight, layer.bias, residual=residual,
                                       residual_scale=residual_scale))

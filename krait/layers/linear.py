"""Linear layers (`MergedLinear` fuses several HF projections, q/k/v or gate/up, into one GEMM)
and the projections they run: on the Triton path one-row decode calls follow
krait/ops/linear.py's plan (the decode GEMV, the TMA GEMV, their prologues and epilogues), the
rest is F.linear (cuBLAS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from krait.ops import linear as plan
from krait.ops._dispatch import num_sms, use_triton
from krait.ops.activation import silu_and_mul
from krait.ops.gemv import gemv_triton
from krait.ops.gemv_tma import gemv_tma, tma_readable


def _one_row(x: Tensor) -> bool:
    """x is one row the Triton kernels take (the shape first: a prefill pays no lookup)."""
    return x.dim() == 2 and x.shape[0] == 1 and use_triton(x)


def _tma(x: Tensor, weight: Tensor, bias: Tensor | None, silu_mul_out: bool = False):
    return plan.tma_plan(weight.shape[0], weight.shape[1], silu_mul_out, bias is not None,
                         tma_readable(weight), num_sms(x.device))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through the GEMV (or the TMA GEMV) for the one-row calls the plan gives it."""
    if _one_row(x) and plan.row_gemv(1, *weight.shape):
        cfg = _tma(x, weight, bias)
        if cfg is not None:
            return gemv_tma(x, weight, cfg)
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def conv_linear(x: Tensor, weight: Tensor, bias: Tensor | None, conv: tuple) -> Tensor:
    """A one-row Mamba in_proj with its conv in the GEMV's epilogue (`gemv_triton(conv=...)`;
    the caller checked `plan.conv_epilogue`), through the TMA GEMV where the plan takes it."""
    cfg = plan.one_slice_tma_plan(weight.shape[0], weight.shape[1], bias is not None,
                                  tma_readable(weight), num_sms(x.device))
    if cfg is not None:
        return gemv_tma(x, weight, cfg, conv=conv)
    return gemv_triton(x, weight, bias, conv=conv)


def silu_mul_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear(silu_and_mul(x)) for x [T, 2I]: one GEMV launch, the activation in its prologue,
    for the one-row calls the plan gives the GEMV."""
    if _one_row(x) and plan.row_gemv(1, *weight.shape):
        return gemv_triton(x, weight, bias, silu_mul=True)
    return F.linear(silu_and_mul(x), weight, bias)


def silu_mlp(x: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None = None,
             down_bias: Tensor | None = None) -> Tensor:
    """down(silu_and_mul(gate_up(x))): x [T, H], gate_up [2I, H] (the gate's rows, then the
    up's), down [H, I] -> [T, H]. A row the plan gives the gate_up epilogue runs the gate_up
    GEMV with the activation in its epilogue, then `linear`; the rest `silu_mul_linear`."""
    if _one_row(x) and plan.gate_up_epilogue(1, *gate_up.shape):
        cfg = _tma(x, gate_up, gate_up_bias, silu_mul_out=True)
        if cfg is not None:
            act = gemv_tma(x, gate_up, cfg, silu_mul_out=True)  # [1, I]
        else:
            act = gemv_triton(x, gate_up, gate_up_bias, silu_mul_out=True)  # [1, I]
        return linear(act, down, down_bias)
    return silu_mul_linear(linear(x, gate_up, gate_up_bias), down, down_bias)


def gated_norm_linear(packed: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor,
                      group_size: int, eps: float, part_size: int) -> Tensor:
    """linear(gated_rms_norm(y, z, norm_weight, eps, group_size), weight, bias) from packed
    [1, I + I / part_size] float32 = [y * silu(z) | partial sums of its squares] (what the gated
    state update writes): one GEMV launch, the norm in its prologue (the caller checked
    `plan.gated_norm_prologue`)."""
    inter = weight.shape[1]
    return gemv_triton(packed[:, :inter], weight, bias,
                       config=plan.norm_config(weight.shape[0], inter, group_size),
                       norm=(norm_weight, packed[:, inter:], group_size, eps, part_size))


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


def gated_silu_mlp(x: torch.Tensor, gate_up: torch.nn.Module,
                   down: torch.nn.Module) -> torch.Tensor:
    """down(silu_and_mul(gate_up(x))) for layers holding `weight` and `bias`: gate_up's weight
    [2I, H] (gate rows, then up rows), down's [H, I]; the activation fused for decode."""
    return silu_mlp(x, gate_up.weight, down.weight, gate_up.bias, down.bias)

"""Linear layers (`MergedLinear` fuses several HF projections, q/k/v or gate/up, into one GEMM)
and the projections they run: on the Triton path one-row decode calls follow
krait/ops/linear.py's plan (the decode GEMV, the TMA GEMV, their prologues and epilogues), and
so do CUDA calls of 2-8 rows (a verify step's 1 + k: the multi-row GEMV, krait/ops/gemv_rows.py);
the rest is F.linear (cuBLAS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from krait.distributed import parallel_state as ps
from krait.distributed.sharding import ShardSpec, even_pieces, materialize, read_shard, set_spec
from krait.ops import linear as plan
from krait.ops._dispatch import num_sms, use_triton
from krait.ops.activation import silu_and_mul
from krait.ops.gemv import gemv_triton
from krait.ops.gemv_rows import gemv_rows
from krait.ops.gemv_tma import gemv_tma, tma_readable


def _one_row(x: Tensor) -> bool:
    """x is one row the Triton kernels take (the shape first: a prefill pays no lookup)."""
    return x.dim() == 2 and x.shape[0] == 1 and use_triton(x)


def _few_rows(x: Tensor) -> bool:
    """x is 2 to 8 rows on CUDA the Triton kernels take (the shape first: a prefill pays no
    lookup)."""
    return x.dim() == 2 and 2 <= x.shape[0] <= plan.MULTI_ROW_MAX_ROWS and x.is_cuda and \
        use_triton(x)


def _rows_take(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """The multi-row GEMV can serve x against weight: no bias, one dtype, TMA-readable rows."""
    return bias is None and x.dtype == weight.dtype and tma_readable(weight)


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
    if (_few_rows(x) and plan.multi_row_gemv(x.shape[0], *weight.shape)
            and _rows_take(x, weight, bias)):
        return gemv_rows(x, weight)
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
    for the one-row calls the plan gives the GEMV; the rest the activation, then `linear`."""
    if _one_row(x) and plan.row_gemv(1, *weight.shape):
        return gemv_triton(x, weight, bias, silu_mul=True)
    return linear(silu_and_mul(x), weight, bias)


def silu_mlp(x: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None = None,
             down_bias: Tensor | None = None) -> Tensor:
    """down(silu_and_mul(gate_up(x))): x [T, H], gate_up [2I, H] (the gate's rows, then the
    up's), down [H, I] -> [T, H]. A row the plan gives the gate_up epilogue runs the gate_up
    GEMV with the activation in its epilogue, then `linear`, and so do 2-8 rows the plan gives
    the multi-row GEMV (`multi_row_gate_up`); the rest `silu_mul_linear`."""
    if _one_row(x) and plan.gate_up_epilogue(1, *gate_up.shape):
        cfg = _tma(x, gate_up, gate_up_bias, silu_mul_out=True)
        if cfg is not None:
            act = gemv_tma(x, gate_up, cfg, silu_mul_out=True)  # [1, I]
        else:
            act = gemv_triton(x, gate_up, gate_up_bias, silu_mul_out=True)  # [1, I]
        return linear(act, down, down_bias)
    if (_few_rows(x) and plan.multi_row_gate_up(x.shape[0], *gate_up.shape)
            and gate_up.shape[0] % 2 == 0 and _rows_take(x, gate_up, gate_up_bias)):
        act = gemv_rows(x, gate_up, silu_mul_out=True)  # [T, I]
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
    """A plain (replicated) linear layer; ColumnParallelLinear and RowParallelLinear split it
    across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(torch.nn.Module):
    """One weight [sum(out_sizes), in_features] holding several projections side by side.
    `load_shard(i, w)` copies projection i's checkpoint tensor (weight or bias) into place.
    Under tensor parallelism `out_sizes` are this rank's sizes and `specs[i]` says which rows
    of projection i's checkpoint tensor the rank holds (column-parallel)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 specs: list[ShardSpec | None] | None = None) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.specs = specs
        self.weight = torch.nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = torch.nn.Parameter(torch.empty(sum(out_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool = False) -> None:
        target = self.bias if is_bias else self.weight
        lo, n = self.offsets[shard], self.out_sizes[shard]
        if self.specs is None:
            target.data[lo : lo + n].copy_(materialize(tensor))
            return
        local = target.data[lo : lo + n]
        target.data[lo : lo + n].copy_(read_shard(tensor, self.specs[shard], local.shape))


class ColumnParallelLinear(Linear):
    """Linear whose output rows are split across the TP ranks: each rank holds its part of
    every segment of `segments` (sizes summing to out_features; default one segment), or the
    explicit checkpoint row ranges `pieces`. The output stays split (no collective)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 segments: list[int] | None = None,
                 pieces: tuple[tuple[int, int], ...] | None = None) -> None:
        tp = ps.get_tp_size()
        if tp > 1 or pieces is not None:
            pieces = pieces or even_pieces(segments or [out_features])
            local = sum(n for _, n in pieces)
        else:
            local = out_features
        super().__init__(in_features, local, bias)
        if pieces is not None:
            set_spec(self.weight, ShardSpec(0, out_features, pieces))
            set_spec(self.bias, ShardSpec(0, out_features, pieces))


class RowParallelLinear(Linear):
    """Linear whose input columns are split across the TP ranks; the partial outputs are summed
    by one all-reduce (`reduce=False`: the caller sums, e.g. two branches in one reduce). The
    bias is held by TP rank 0 only (zeros elsewhere), so it is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce: bool = True) -> None:
        tp = ps.get_tp_size()
        super().__init__(in_features // tp, out_features, bias)
        self.reduce = reduce
        self.tp_size = tp
        if tp > 1:
            set_spec(self.weight, ShardSpec(1, in_features, even_pieces([in_features])))
            rank0 = ((0, out_features),) if ps.get_tp_rank() == 0 else ()
            set_spec(self.bias, ShardSpec(0, out_features, rank0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(linear(x, self.weight, self.bias))

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The all-reduce of this layer's partial output y (for callers that run the weight
        through a fused path); y itself without TP or with reduce=False."""
        if self.tp_size > 1 and self.reduce:
            return ps.tp_all_reduce(y)
        return y


def qkv_parallel(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, q_rows_per_head: int | None = None
                 ) -> tuple[MergedLinear, int, int]:
    """The fused q/k/v projection and this rank's (query heads, kv heads): query heads split
    across the TP ranks; kv heads split too, or (more ranks than kv heads) replicated, each rank
    holding the kv head its query heads use. `q_rows_per_head`: q_proj's rows a head when not
    head_dim (Qwen3-Next's [q | gate] heads: 2 head_dim)."""
    tp, rank = ps.get_tp_size(), ps.get_tp_rank()
    q_rows = q_rows_per_head or head_dim
    if tp == 1:
        q, kv = num_heads * q_rows, num_kv_heads * head_dim
        return MergedLinear(hidden, [q, kv, kv], bias=bias), num_heads, num_kv_heads
    heads = num_heads // tp
    q_pieces = ((rank * heads * q_rows, heads * q_rows),)
    if num_kv_heads >= tp:
        kv_heads = num_kv_heads // tp
        kv_pieces = ((rank * kv_heads * head_dim, kv_heads * head_dim),)
    else:
        kv_heads = 1
        kv_pieces = ((rank // (tp // num_kv_heads) * head_dim, head_dim),)
    q_full, kv_full = num_heads * q_rows, num_kv_heads * head_dim
    specs = [ShardSpec(0, q_full, q_pieces), ShardSpec(0, kv_full, kv_pieces),
             ShardSpec(0, kv_full, kv_pieces)]
    q, kv = heads * q_rows, kv_heads * head_dim
    return MergedLinear(hidden, [q, kv, kv], bias=bias, specs=specs), heads, kv_heads


def gate_up_parallel(hidden: int, intermediate: int, bias: bool = False) -> MergedLinear:
    """The fused gate/up projection of a gated MLP, column-parallel (each rank its part of the
    intermediate dimension of both)."""
    tp = ps.get_tp_size()
    if tp == 1:
        return MergedLinear(hidden, [intermediate, intermediate], bias=bias)
    local = intermediate // tp
    spec = ShardSpec(0, intermediate, even_pieces([intermediate]))
    return MergedLinear(hidden, [local, local], bias=bias, specs=[spec, spec])


def gated_silu_mlp(x: torch.Tensor, gate_up: torch.nn.Module,
                   down: torch.nn.Module) -> torch.Tensor:
    """down(silu_and_mul(gate_up(x))) for layers holding `weight` and `bias`: gate_up's weight
    [2I, H] (gate rows, then up rows), down's [H, I]; the activation fused for decode."""
    return silu_mlp(x, gate_up.weight, down.weight, gate_up.bias, down.bias)

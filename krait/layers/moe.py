"""Mixture-of-experts layer: stacked expert weights run through the fused MoE op, routing helpers
and checkpoint loading for the common expert layouts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from krait.distributed import parallel_state as ps
from krait.distributed.sharding import ShardSpec, materialize, read_shard, set_spec
from krait.layers.linear import gated_silu_mlp
from krait.ops.fused_moe import fused_moe
from krait.ops.moe_routes import use_moe_routes

_GATE_UP = ("w13", "gate_up")
_GATE = ("w1", "gate")
_UP = ("w3", "up")
_DOWN = ("w2", "down")


class FusedMoE(torch.nn.Module):
    """Experts of one layer: w13 [E, 2I, H] (gate rows then up rows; [E, I, H] for the non-gated
    "relu2") and w2 [E, H, I]. forward(x [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H].
    Routing lives with the model (see `krait.ops.moe_routes.route_topk`).

    Under tensor parallelism every rank holds every expert with its part of the intermediate
    dimension (I / tp rows of gate and of up, I / tp columns of down); the output is then a
    partial sum the caller all-reduces (once, with a shared expert's partial output)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
        top_k: int = 1,
    ) -> None:
        """top_k: the routes a token takes (what its router picks; the decode roofline counts
        the experts a step touches from it: krait/bench/roofline.py)."""
        super().__init__()
        if activation not in ("silu", "relu2"):
            raise ValueError(f"FusedMoE: activation {activation!r} is not silu or relu2")
        tp = ps.get_tp_size()
        self.num_experts = num_experts
        self.top_k = top_k
        self.full_intermediate = intermediate_size
        intermediate_size //= tp
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gated = activation == "silu"
        rows = 2 * intermediate_size if self.gated else intermediate_size
        self.w13 = torch.nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self._loaded: set[tuple[str, int | None, str]] = set()
        self._specs = None
        if tp > 1:
            full, r, n = self.full_intermediate, ps.get_tp_rank(), intermediate_size
            mine = ((r * n, n),)
            rows = mine + ((full + r * n, n),) if self.gated else mine
            self._specs = {"w13": ShardSpec(-2, 2 * full if self.gated else full, rows),
                           "part": ShardSpec(-2, full, mine), "w2": ShardSpec(-1, full, mine)}
            set_spec(self.w13, self._specs["w13"])
            set_spec(self.w2, self._specs["w2"])

    def forward(
        self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, add: Tensor | None = None,
        add_gate: Tensor | None = None, shared_expert: torch.nn.Module | None = None,
    ) -> Tensor:
        """The routed experts' output, plus `add` [T, H] when given (a shared expert's output:
        added inside the last launch on the few-route path), times sigmoid(add_gate) [T, 1]
        when that is given. `shared_expert` (instead of `add`): a gated-SiLU MLP module
        (`gate_up_proj`, `down_proj`) whose output is the add; on the few-route path, where
        it has no biases and the experts' intermediate size, it runs as one more route a
        token inside the experts' two launches (one TP rank only). Under TP the result, the
        add and its gate included, is a partial sum the caller all-reduces: the gate
        (replicated) scales each rank's partial add, so the sum equals the single process's."""
        if shared_expert is not None:
            weights = self._shared_route(shared_expert)
            if weights is not None and use_moe_routes(x, topk_ids.numel(), self.num_experts):
                return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids,
                                 self.activation, add_gate=add_gate, shared=weights)
            # its output as a partial sum under TP (no all-reduce of its own: the caller's
            # one all-reduce sums it with the experts' partial output); at one rank the MLP's
            add = gated_silu_mlp(x, shared_expert.gate_up_proj, shared_expert.down_proj)
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.activation, add,
                         add_gate)

    def _shared_route(self, mlp: torch.nn.Module) -> tuple[Tensor, Tensor] | None:
        """(gate_up [2I, H], down [H, I]) of a shared expert the few-route kernels can run as
        a route (gated SiLU experts, one rank, no biases, this layer's I and H), else None."""
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if (not self.gated or ps.get_tp_size() > 1 or gate_up.bias is not None
                or down.bias is not None
                or gate_up.weight.shape != self.w13.shape[1:]
                or down.weight.shape != self.w2.shape[1:]):
            return None
        return gate_up.weight, down.weight

    def load_expert(self, name_kind: str, expert: int | None, tensor: Tensor) -> None:
        """Copies one checkpoint tensor into place.

        name_kind: "w13"/"gate_up" (all w13 rows), "w1"/"gate" (gate rows), "w3"/"up" (up rows;
        all rows when non-gated), "w2"/"down". expert: the expert index, or None when `tensor`
        holds every expert stacked on dim 0."""
        inter = self.intermediate_size
        if name_kind in _DOWN:
            param, lo, hi, part = self.w2, 0, self.w2.shape[1], "all"
        elif name_kind in _GATE_UP or (name_kind in _UP and not self.gated):
            param, lo, hi, part = self.w13, 0, self.w13.shape[1], "all"
        elif name_kind in _GATE and self.gated:
            param, lo, hi, part = self.w13, 0, inter, "gate"
        elif name_kind in _UP:
            param, lo, hi, part = self.w13, inter, 2 * inter, "up"
        else:
            raise ValueError(f"FusedMoE ({self.activation}): unknown expert weight {name_kind!r}")
        target = param.data[:, lo:hi] if expert is None else param.data[expert, lo:hi]
        if self._specs is not None:  # this rank's rows (columns of down) only
            spec = self._specs["w2" if param is self.w2 else ("w13" if part == "all" else "part")]
            try:
                tensor = read_shard(tensor, spec, target.shape)
            except ValueError as e:
                raise ValueError(f"FusedMoE: {name_kind} tensor {e}") from None
        tensor = materialize(tensor)
        if target.shape != tensor.shape:
            raise ValueError(
                f"FusedMoE: {name_kind} tensor has shape {tuple(tensor.shape)}, expected "
                f"{tuple(target.shape)}"
            )
        target.copy_(tensor)
        self._loaded.add(("w2" if param is self.w2 else "w13", expert, part))

    def fully_loaded(self, param_name: str) -> bool:
        """Whether every row of `param_name` ("w13" or "w2") came through `load_expert`."""

        def has(e: int | None, part: str) -> bool:
            return (param_name, e, part) in self._loaded

        if has(None, "all"):
            return True
        split = self.gated and param_name == "w13"
        for e in range(self.num_experts):
            whole = has(e, "all")
            gate = has(None, "gate") or has(e, "gate")
            up = has(None, "up") or has(e, "up")
            if not (whole or (split and gate and up)):
                return False
        return True


ExpertMatch = Callable[[str], tuple[str, str, int | None] | None]


def load_expert_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, Tensor]], match: ExpertMatch
) -> Iterator[tuple[str, Tensor]]:
    """Wraps a checkpoint stream for `load_named_weights`: tensors for which `match(name)`
    returns (FusedMoE module path in `model`, name_kind, expert) go through `load_expert`;
    the rest pass through. At the end each FusedMoE parameter that was fully loaded this way is
    yielded under its own name (the copy onto itself is a no-op), so the loader's
    missing-weights check covers the experts too."""
    modules = dict(model.named_modules())
    touched: dict[str, FusedMoE] = {}
    for name, tensor in weights:
        hit = match(name)
        if hit is None:
            yield name, tensor
            continue
        path, kind, expert = hit
        mod = modules.get(path)
        if mod is None and _held_elsewhere(modules, path):
            continue  # another pipeline stage's layer
        if not isinstance(mod, FusedMoE):
            raise ValueError(f"checkpoint tensor {name!r}: {path!r} is not a FusedMoE")
        mod.load_expert(kind, expert, tensor)
        touched[path] = mod
    for path, mod in touched.items():
        for pname in ("w13", "w2"):
            if mod.fully_loaded(pname):
                yield f"{path}.{pname}", getattr(mod, pname).data


def _held_elsewhere(modules: dict, path: str) -> bool:
    """`path` lies under a MissingModule (a layer another pipeline stage holds)."""
    from krait.layers.embedding import MissingModule

    parts = path.split(".")
    return any(isinstance(modules.get(".".join(parts[:i])), MissingModule)
               for i in range(1, len(parts)))

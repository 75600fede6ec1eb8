"""Start-up checks of a tensor/pipeline layout against the model: every impossible layout is a
ValueError naming the dimension that does not divide."""

from __future__ import annotations

from typing import Any

import torch

BACKENDS = ("mp", "ray", "uni")

# architectures whose layers are not tensor/pipeline parallel yet (none at present)
_NOT_PARALLEL: dict[str, str] = {}


def _first(cfg: Any, *keys: str) -> int | None:
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def num_layers(cfg: Any) -> int:
    pattern = getattr(cfg, "layers_block_type", None) or getattr(cfg, "hybrid_override_pattern",
                                                                  None)
    if getattr(cfg, "model_type", None) == "nemotron_h" and pattern:
        return len(pattern)
    return int(cfg.num_hidden_layers)


def validate_layout(cfg: Any, tp: int, pp: int, backend: str | None,
                    device: torch.device) -> str:
    """Checks the layout; returns the executor backend ("uni" for one process)."""
    for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}; "
                         f"got {backend!r}")
    world = tp * pp
    if world == 1:
        return backend or "uni"
    if backend == "uni":
        raise ValueError(f"distributed_executor_backend='uni' runs one process; "
                         f"tensor_parallel_size * pipeline_parallel_size = {world} needs "
                         "'mp' or 'ray'")
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    if arch in _NOT_PARALLEL:
        raise ValueError(f"{arch}: tensor/pipeline parallelism is not supported yet "
                         f"({_NOT_PARALLEL[arch]})")
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if world > n:
            raise ValueError(f"tensor_parallel_size * pipeline_parallel_size = {world} needs "
                             f"{world} GPUs; {n} are visible")
    layers = num_layers(cfg)
    if pp > 1:
        from krait.distributed.pipeline import layer_partition, stage_layer_ranges

        stage_layer_ranges(layers, pp, layer_partition())  # raises for an impossible split
    if tp > 1:
        _check_tp(cfg, tp)
    return backend or "mp"


def _divides(tp: int, value: int | None, what: str) -> None:
    if value is not None and value % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {what} "
                         f"({value})")


def _check_tp(cfg: Any, tp: int) -> None:
    heads = _first(cfg, "num_attention_heads")
    _divides(tp, heads, "attention heads (num_attention_heads)")
    kv = _first(cfg, "num_key_value_heads") or heads
    if kv is not None:
        if kv >= tp:
            _divides(tp, kv, "key/value heads (num_key_value_heads)")
        elif tp % kv:
            raise ValueError(f"tensor_parallel_size={tp} is neither a divisor nor a multiple of "
                             f"the model's key/value heads ({kv}): the kv heads cannot be "
                             "replicated evenly")
    mamba_heads = _first(cfg, "mamba_n_heads", "mamba_num_heads")
    if mamba_heads is None and getattr(cfg, "model_type", None) == "mamba2":
        mamba_heads = _first(cfg, "num_heads")
    _divides(tp, mamba_heads, "Mamba heads")
    groups = _first(cfg, "mamba_n_groups", "n_groups")
    if mamba_heads is not None and groups is not None:
        if groups >= tp:
            _divides(tp, groups, "Mamba groups (n_groups)")
        elif tp % groups:
            raise ValueError(f"tensor_parallel_size={tp} is neither a divisor nor a multiple of "
                             f"the model's Mamba groups ({groups})")
    # Gated DeltaNet (Qwen3-Next): whole key heads a rank, with their value heads
    _divides(tp, _first(cfg, "linear_num_key_heads"),
             "Gated DeltaNet key heads (linear_num_key_heads)")
    _divides(tp, _first(cfg, "linear_num_value_heads"),
             "Gated DeltaNet value heads (linear_num_value_heads)")
    for key in ("intermediate_size", "shared_intermediate_size", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"):
        _divides(tp, _first(cfg, key), f"{key}")

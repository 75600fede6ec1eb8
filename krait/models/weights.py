"""Copying checkpoint tensors into a model's parameters by name."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from krait.distributed.sharding import load_param
from krait.layers.embedding import MissingModule
from krait.layers.linear import MergedLinear

# checkpoint name fragment -> (merged parameter fragment, shard index)
QKV_SHARDS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
}
QKV_GATE_UP_SHARDS = {
    **QKV_SHARDS,
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def load_named_weights(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: dict[str, tuple[str, int]] | None = None,
    strip_prefix: str | tuple[str, ...] = (),
    rename: Callable[[str], str | None] | None = None,
    skip_missing: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> set[str]:
    """Loads (name, tensor) pairs into `model`.

    Names lose `strip_prefix`, then go through `rename` (which may return None to drop a
    tensor); a name holding a key of `stacked` is loaded as one shard of a MergedLinear.
    Raises ValueError for names the model has no parameter for, and for parameters left
    unloaded (tied lm_head excepted). Tensors of modules another pipeline stage holds
    (MissingModule) are skipped; parameters with a `tp_spec` take their tensor-parallel shard.
    A tensor may be a `LazyTensor` (read only where and as far as it is needed)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    absent = tuple(n + "." for n, m in modules.items() if isinstance(m, MissingModule))
    prefixes = (strip_prefix,) if isinstance(strip_prefix, str) else strip_prefix
    loaded: set[str] = set()
    for name, tensor in weights:
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                break
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if any(s in name for s in skip_missing):
            continue
        if absent and name.startswith(absent):
            continue
        for frag, (merged, shard) in (stacked or {}).items():
            if frag in name:
                target = name.replace(frag, merged)
                mod_name, _, kind = target.rpartition(".")
                mod = modules.get(mod_name)
                if isinstance(mod, MergedLinear):
                    mod.load_shard(shard, tensor, is_bias=(kind == "bias"))
                    loaded.add(target)
                    break
        else:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            param = params[name]
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() == param.data_ptr():
                loaded.add(name)  # loaded in place already (FusedMoE experts)
                continue
            try:
                load_param(param, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from None
            loaded.add(name)
    tied = {n for n, p in params.items() if n not in loaded and _is_tied(model, n, p, loaded, params)}
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")
    return loaded


def _is_tied(model, name, param, loaded, params) -> bool:
    return any(params[other] is param for other in loaded if other in params)

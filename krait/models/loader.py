"""Builds a model from a checkpoint directory (config.json + safetensors) or dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from krait.config import ModelConfig
from krait.distributed import parallel_state as ps
from krait.distributed.sharding import LazyTensor
from krait.layers.rotary import RotaryEmbedding
from krait.models.registry import get_model_class


def iterate_safetensors(model_dir: str | Path, lazy: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """(name, tensor) pairs of every safetensors file (sharded through the index, or not).
    `lazy`: LazyTensor slices instead, read by the parameter that takes them (tensor and
    pipeline parallel ranks read only their shards); valid until the next pair."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no safetensors files in {model_dir}")
    for f in files:
        with safe_open(str(d / f), framework="pt") as fh:
            for name in fh.keys():
                yield name, (LazyTensor(fh.get_slice(name)) if lazy else fh.get_tensor(name))


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if "norm" in name and p.dim() == 1:
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-0.02, 0.02, generator=gen)
    post = getattr(model, "post_dummy_init", None)
    if post is not None:
        post()


def load_model(cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """Instantiates the architecture named in config.json (parameters born on `device` in the
    model dtype; rotary caches stay float32) and loads its weights."""
    cls = get_model_class(cfg.hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        with torch.device(device):
            model = cls(cfg.hf_config)
    finally:
        torch.set_default_dtype(old)
    if cfg.load_format == "dummy":
        _fill_dummy(model, cfg.seed)
    else:
        with torch.no_grad():
            model.load_weights(iterate_safetensors(cfg.model, lazy=ps.state().world_size > 1))
    for m in model.modules():  # every position a request may reach has its rotary entry
        if isinstance(m, RotaryEmbedding):
            m.cover(cfg.max_model_len)
    return model.eval()

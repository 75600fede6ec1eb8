"""What every decoder-only model here shares: the pre-norm with a carried residual, the layer loop
with the final norm, and the (optionally tied) lm_head. Module names stay in each model: they
follow the checkpoint's tensor names."""

from __future__ import annotations

from typing import Any

import torch

from krait.layers.linear import Linear
from krait.layers.norm import RMSNorm
from krait.runner.attention_metadata import StepMetadata


def pre_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, x_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) for s = x * x_scale + residual; the first layer has no residual yet (its x is
    the embedding, never scaled): (norm(x), x)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual, x_scale)


def run_layers(
    layers: torch.nn.ModuleList, final_norm: RMSNorm, x: torch.Tensor, positions: torch.Tensor,
    meta: StepMetadata, x_scale: float = 1.0,
) -> torch.Tensor:
    """Each layer maps (positions, x, residual, meta) -> (x, residual); returns the final norm
    of the last layer's output (times x_scale) plus its residual: hidden states [T, hidden]."""
    residual = None
    for layer in layers:
        x, residual = layer(positions, x, residual, meta)
    return pre_norm(final_norm, x, residual, x_scale)[0]


def lm_head_for(cfg: Any, embedding: torch.nn.Embedding) -> Linear:
    """The output projection, sharing the embedding's weight when the config ties them."""
    head = Linear(cfg.hidden_size, cfg.vocab_size)
    if getattr(cfg, "tie_word_embeddings", False):
        head.weight = embedding.weight
    return head

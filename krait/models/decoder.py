"""What every decoder-only model here shares: the pre-norm with a carried residual, the layer loop
with the final norm, and the (optionally tied) lm_head. Module names stay in each model: they
follow the checkpoint's tensor names."""

from __future__ import annotations

from typing import Any

import torch

from krait.distributed import parallel_state as ps
from krait.distributed import pipeline
from krait.layers.embedding import MissingModule, ParallelLMHead, VocabParallelEmbedding
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
    stage = pipeline.current()
    if stage is not None:  # pipeline parallel: this stage's layers, hand-over in and out
        return stage.run(layers, final_norm, x, positions, meta, x_scale, pre_norm)
    residual = None
    for layer in layers:
        x, residual = layer(positions, x, residual, meta)
    return pre_norm(final_norm, x, residual, x_scale)[0]


def run_layers_keeping(
    layers: torch.nn.ModuleList, final_norm: RMSNorm, x: torch.Tensor, positions: torch.Tensor,
    meta: StepMetadata, keep: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """run_layers (one stage), also returning the input hidden states (x + residual) of the
    layers in `keep`, concatenated in that order: [T, len(keep) * hidden] (HF's
    `output_hidden_states[i]` for each i; EAGLE-3 heads read them)."""
    kept: dict[int, torch.Tensor] = {}
    residual = None
    for i, layer in enumerate(layers):
        if i in keep:
            kept[i] = x if residual is None else x + residual
        x, residual = layer(positions, x, residual, meta)
    return pre_norm(final_norm, x, residual)[0], torch.cat([kept[i] for i in keep], dim=-1)


class _TiedEmbedding(VocabParallelEmbedding):
    """The embedding's weight held by a later pipeline stage only for its tied LM head: the
    stage receives its input, so the lookup returns nothing."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.empty(0)


def embedding_for(cfg: Any) -> torch.nn.Module:
    """The token embedding (vocabulary-parallel under TP). Under PP only the first stage looks
    tokens up; the last holds the weight too when the LM head is tied to it; the other stages
    hold nothing."""
    st = ps.state()
    if st.is_first_stage:
        return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
    if st.is_last_stage and getattr(cfg, "tie_word_embeddings", False):
        return _TiedEmbedding(cfg.vocab_size, cfg.hidden_size)
    return MissingModule()


def lm_head_for(cfg: Any, embedding: torch.nn.Module) -> torch.nn.Module:
    """The output projection (vocabulary-parallel under TP, the last stage's under PP), sharing
    the embedding's weight when the config ties them."""
    if not ps.state().is_last_stage:
        return MissingModule()
    head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
    if getattr(cfg, "tie_word_embeddings", False):
        head.weight = embedding.weight
    return head

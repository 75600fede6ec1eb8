"""HF `Mamba2ForCausalLM`: a stack of Mamba2 mixers, no attention."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from krait.distributed.pipeline import make_layers
from krait.layers.mamba2 import Mamba2Dims, Mamba2Mixer, mixer_weight_name, time_step_limit
from krait.layers.norm import RMSNorm
from krait.models.decoder import embedding_for, lm_head_for, pre_norm, run_layers
from krait.models.weights import load_named_weights
from krait.runner.attention_metadata import StepMetadata


def mamba2_dims(cfg: Any, **overrides) -> Mamba2Dims:
    """Mixer shapes from a Mamba2-style config (field names shared by the hybrid families)."""
    kw = dict(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        n_groups=cfg.n_groups,
        d_state=cfg.state_size,
        d_conv=cfg.conv_kernel,
        chunk_size=cfg.chunk_size,
        eps=cfg.layer_norm_epsilon,
        use_conv_bias=getattr(cfg, "use_conv_bias", True),
        use_bias=getattr(cfg, "use_bias", False),
        time_step_limit=time_step_limit(cfg),
    )
    kw.update(overrides)
    return Mamba2Dims(**kw)


class Mamba2Block(torch.nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(mamba2_dims(cfg))

    def forward(self, positions, x, residual, meta: StepMetadata):
        normed, residual = pre_norm(self.norm, x, residual)
        return self.mixer(normed, meta.mamba), residual


class Mamba2ForCausalLM(torch.nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = embedding_for(cfg)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: Mamba2Block(cfg))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.lm_head = lm_head_for(cfg, self.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata):
        x = self.embeddings(input_ids)
        return run_layers(self.layers, self.norm_f, x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V] in the model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, strip_prefix="backbone.", rename=mixer_weight_name)

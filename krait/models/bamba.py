"""HF `BambaForCausalLM`: Mamba2 mixers with full-attention layers at `attn_layer_indices`
(partial rotary), each followed by a gated SiLU MLP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from krait.distributed.pipeline import make_layers
from krait.layers.mamba2 import Mamba2Dims, Mamba2Mixer, mixer_weight_name, time_step_limit
from krait.layers.norm import RMSNorm
from krait.models.decoder import embedding_for, lm_head_for, pre_norm, run_layers
from krait.models.llama import LlamaAttention, LlamaMLP
from krait.models.weights import QKV_GATE_UP_SHARDS, load_named_weights
from krait.runner.attention_metadata import StepMetadata


def bamba_mamba_dims(cfg: Any, **overrides) -> Mamba2Dims:
    """Mixer shapes from the `mamba_*` fields shared by Bamba and GraniteMoeHybrid."""
    kw = dict(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_n_heads,
        head_dim=cfg.mamba_d_head,
        n_groups=cfg.mamba_n_groups,
        d_state=cfg.mamba_d_state,
        d_conv=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size,
        eps=cfg.rms_norm_eps,
        use_conv_bias=getattr(cfg, "mamba_conv_bias", True),
        use_bias=getattr(cfg, "mamba_proj_bias", False),
        time_step_limit=time_step_limit(cfg),
        activation=getattr(cfg, "hidden_act", "silu"),
    )
    kw.update(overrides)
    return Mamba2Dims(**kw)


def is_mamba_layer(layer_type: str) -> bool:
    """Layer-type names of the recurrent layers across transformers versions."""
    return layer_type in ("mamba", "linear_attention")


class BambaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: Any, is_attention: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if is_attention:
            self.self_attn = LlamaAttention(cfg, cfg.attention_bias, False, None)
            self.mamba = None
        else:
            self.self_attn = None
            self.mamba = Mamba2Mixer(bamba_mamba_dims(cfg))
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Bamba: hidden_act {cfg.hidden_act!r} is not supported")
        self.feed_forward = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, positions, x, residual, meta: StepMetadata):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        if self.mamba is not None:
            x = self.mamba(x, meta.mamba)
        else:
            x = self.self_attn(x, positions, meta)
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual


class BambaForCausalLM(torch.nn.Module):
    stacked = QKV_GATE_UP_SHARDS

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        attn = set(cfg.attn_layer_indices or ())
        self.embed_tokens = embedding_for(cfg)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: BambaDecoderLayer(cfg, i in attn))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head_for(cfg, self.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        return run_layers(self.layers, self.final_layernorm, x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V] in the model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(
            self, weights, self.stacked, strip_prefix="model.",
            rename=lambda n: mixer_weight_name(n, ".mamba."),
        )

    def post_dummy_init(self) -> None:
        """Mixer parameters as HF initializes them, so random-weight runs stay stable."""
        for layer in self.layers:
            if getattr(layer, "mamba", None) is not None:
                _init_mixer(layer.mamba)


def _init_mixer(m: Mamba2Mixer) -> None:
    n = m.A_log.shape[0]
    m.A_log.data.copy_(torch.log(torch.arange(1, n + 1, dtype=torch.float32)))
    m.D.data.fill_(1.0)
    m.dt_bias.data.fill_(1.0)

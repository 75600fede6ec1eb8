"""Llama-family dense decoders: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from krait.distributed.pipeline import make_layers
from krait.layers.attention import Attention
from krait.layers.linear import RowParallelLinear, gate_up_parallel, gated_silu_mlp, qkv_parallel
from krait.layers.norm import RMSNorm
from krait.layers.rotary import RotaryEmbedding, rope_parameters
from krait.models.decoder import (
    embedding_for,
    lm_head_for,
    pre_norm,
    run_layers,
    run_layers_keeping,
)
from krait.models.weights import QKV_GATE_UP_SHARDS, load_named_weights
from krait.runner.attention_metadata import StepMetadata


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: Any, qkv_bias: bool, qk_norm: bool, sliding_window: int | None,
                 reduce_output: bool = True, input_size: int | None = None) -> None:
        """Under TP the heads are split across ranks (`qkv_parallel`); `reduce_output=False`
        leaves o_proj's all-reduce to the caller (a layer summing two branches first).
        `input_size`: q/k/v's input width when it is not hidden_size (an EAGLE-3 head's 2H)."""
        super().__init__()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            input_size or cfg.hidden_size, heads, kv_heads, self.head_dim, qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size,
                                        bias=getattr(cfg, "attention_bias", False),
                                        reduce=reduce_output)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg), is_neox=True
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window
        )
        self.split = [q_size, kv_size, kv_size]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        T = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        out = self.attn.forward_rope(
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            positions, self.rotary, meta.attn, self.q_norm, self.k_norm,
        )
        return self.o_proj(out)


class LlamaMLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_parallel(hidden, intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.finish(gated_silu_mlp(x, self.gate_up_proj, self.down_proj))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        window = None
        if getattr(cfg, "use_sliding_window", True) and getattr(cfg, "sliding_window", None):
            types = getattr(cfg, "layer_types", None)
            if types is None or types[layer_idx] == "sliding_attention":
                window = cfg.sliding_window
        self.self_attn = LlamaAttention(cfg, qkv_bias, qk_norm, window)
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for {type(self)}")
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(torch.nn.Module):
    """HF `LlamaForCausalLM` (also Mistral, Qwen2, Qwen3 through the class flags)."""

    qkv_bias = False
    qk_norm = False
    stacked = QKV_GATE_UP_SHARDS

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        # EAGLE-3 (set by its drafter only): the layers whose input hidden states each forward
        # keeps in `aux_hidden` ([T, len * hidden], concatenated in this order)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        qkv_bias = self.qkv_bias or getattr(cfg, "attention_bias", False)
        self.embed_tokens = embedding_for(cfg)
        self.layers = make_layers(
            cfg.num_hidden_layers, lambda i: LlamaDecoderLayer(cfg, i, qkv_bias, self.qk_norm))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head_for(cfg, self.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.aux_hidden_layers:
            hidden, self.aux_hidden = run_layers_keeping(
                self.layers, self.norm, x, positions, meta, self.aux_hidden_layers)
            return hidden
        return run_layers(self.layers, self.norm, x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V] in the model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.stacked, strip_prefix="model.")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass

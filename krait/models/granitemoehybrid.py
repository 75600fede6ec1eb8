"""HF `GraniteMoeHybridForCausalLM` (Granite 4.0 H): Mamba2 and attention layers, each followed by
a routed MoE plus a shared MLP (only the shared MLP when num_local_experts is 0), with Granite's
embedding, residual, attention and logits multipliers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from krait.distributed import parallel_state as ps
from krait.distributed.pipeline import make_layers
from krait.layers.attention import Attention
from krait.layers.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    gated_silu_mlp,
    qkv_parallel,
)
from krait.layers.mamba2 import Mamba2Mixer, mixer_weight_name
from krait.layers.moe import FusedMoE
from krait.layers.norm import RMSNorm
from krait.layers.rotary import RotaryEmbedding, rope_parameters
from krait.models.bamba import _init_mixer, bamba_mamba_dims, is_mamba_layer
from krait.models.decoder import embedding_for, lm_head_for, pre_norm, run_layers
from krait.models.weights import QKV_SHARDS, load_named_weights
from krait.ops.moe_routes import route_topk
from krait.runner.attention_metadata import StepMetadata


class GraniteAttention(torch.nn.Module):
    """Attention scaled by `attention_multiplier`; rotary only with position_embedding_type
    "rope" (otherwise no position encoding)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            cfg.hidden_size, heads, cfg.num_key_value_heads or heads, self.head_dim, bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rotary = None
        if getattr(cfg, "position_embedding_type", None) == "rope":
            self.rotary = RotaryEmbedding(
                self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg), is_neox=True
            )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, float(cfg.attention_multiplier)
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        T = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        if self.rotary is None:
            out = self.attn(q, k, v, meta.attn)
        else:
            out = self.attn.forward_rope(
                q.view(T, self.num_heads, self.head_dim),
                k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim),
                positions, self.rotary, meta.attn,
            )
        return self.o_proj(out)


class GraniteMLP(torch.nn.Module):
    """The shared MLP: input_linear [2I, H] (gate rows, then up rows), output_linear [H, I];
    under TP each rank holds its part of I. `reduce=False`: the partial output, for the caller
    to sum with the experts' in one all-reduce."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_linear = ColumnParallelLinear(hidden, 2 * intermediate,
                                                 segments=[intermediate, intermediate])
        self.output_linear = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        y = gated_silu_mlp(x, self.input_linear, self.output_linear)
        return self.output_linear.finish(y) if reduce else y


class GraniteMoE(torch.nn.Module):
    """Top-k router (softmax over the k largest logits, weights rounded to the model dtype as in
    HF) and the experts."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = Linear(cfg.hidden_size, cfg.num_local_experts)
        self.experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                top_k=self.top_k)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output [T, H], plus `add` (the shared MLP's output) when given."""
        weights, ids = route_topk(self.router(x), self.top_k, renormalize=True,
                                  round_to_dtype=True)
        return self.experts(x, weights, ids, add)


class GraniteMoeHybridDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: Any, layer_type: str) -> None:
        super().__init__()
        self.residual_multiplier = float(cfg.residual_multiplier)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if is_mamba_layer(layer_type):
            self.mamba, self.self_attn = Mamba2Mixer(bamba_mamba_dims(cfg)), None
        else:
            self.mamba, self.self_attn = None, GraniteAttention(cfg)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"GraniteMoeHybrid: hidden_act {cfg.hidden_act!r} is not supported")
        self.block_sparse_moe = GraniteMoE(cfg) if cfg.num_local_experts > 0 else None
        self.shared_mlp = GraniteMLP(cfg.hidden_size, cfg.shared_intermediate_size)

    def forward(self, positions, x, residual, meta: StepMetadata):
        """Returns (branch output, residual): the next norm adds them as HF's
        `residual + out * residual_multiplier`, the scale fused into the norm's residual add."""
        m = self.residual_multiplier
        x, residual = pre_norm(self.input_layernorm, x, residual, m)
        if self.mamba is not None:
            x = self.mamba(x, meta.mamba)
        else:
            x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual, m)
        if self.block_sparse_moe is None:
            return self.shared_mlp(x), residual
        # under TP both are partial sums: one all-reduce for the two
        out = self.block_sparse_moe(x, add=self.shared_mlp(x, reduce=False))
        return ps.tp_all_reduce(out), residual


class GraniteMoeHybridForCausalLM(torch.nn.Module):
    stacked = QKV_SHARDS
    renames = {
        ".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.w13",
        ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.w2",
        ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.router.weight",
    }

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.residual_multiplier = float(cfg.residual_multiplier)
        self.logits_scaling = float(cfg.logits_scaling)
        types = list(cfg.layer_types)
        self.embed_tokens = embedding_for(cfg)
        self.layers = make_layers(cfg.num_hidden_layers,
                                  lambda i: GraniteMoeHybridDecoderLayer(cfg, types[i]))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head_for(cfg, self.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        return run_layers(self.layers, self.norm, x, positions, meta, self.residual_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling  # [T, V], model dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.stacked, strip_prefix="model.", rename=self._rename)

    def _rename(self, name: str) -> str:
        for old, new in self.renames.items():
            if name.endswith(old):
                return name[: -len(old)] + new
        return mixer_weight_name(name, ".mamba.")

    def post_dummy_init(self) -> None:
        """Mixer parameters as HF initializes them, so random-weight runs stay stable."""
        for layer in self.layers:
            if getattr(layer, "mamba", None) is not None:
                _init_mixer(layer.mamba)

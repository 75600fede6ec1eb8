"""HF `Qwen3NextForCausalLM` (Qwen3-Next): Gated DeltaNet (`linear_attention`) and gated
attention (`full_attention`) layers, each followed by a sparse MoE with a sigmoid-gated shared
expert (or a dense MLP on `mlp_only_layers`). Its RMSNorms are zero-centred (HF scales by
1 + w): the weights are stored as 1 + w at load time, so the ordinary RMSNorm kernels apply.
The multi-token-prediction weights (`mtp.*`) are not the target's: the MTP head
(krait/models/qwen3_next_mtp.py, speculative method "mtp") reads them from the same checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from krait.distributed import parallel_state as ps
from krait.distributed.pipeline import make_layers
from krait.distributed.sharding import materialize
from krait.layers.attention import Attention
from krait.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetDims,
    regroup_ba,
    regroup_qkvz,
)
from krait.layers.linear import MergedLinear, RowParallelLinear, qkv_parallel
from krait.layers.moe import FusedMoE, load_expert_weights
from krait.layers.norm import RMSNorm
from krait.layers.rotary import RotaryEmbedding, rope_parameters
from krait.models.decoder import embedding_for, lm_head_for, pre_norm, run_layers
from krait.models.llama import LlamaMLP
from krait.models.weights import QKV_GATE_UP_SHARDS, load_named_weights
from krait.ops.activation import sigmoid_gate
from krait.ops.moe_routes import route_topk
from krait.runner.attention_metadata import StepMetadata


def gdn_dims(cfg: Any) -> GatedDeltaNetDims:
    return GatedDeltaNetDims(
        hidden_size=cfg.hidden_size,
        num_k_heads=cfg.linear_num_key_heads,
        num_v_heads=cfg.linear_num_value_heads,
        head_k_dim=cfg.linear_key_head_dim,
        head_v_dim=cfg.linear_value_head_dim,
        conv_width=cfg.linear_conv_kernel_dim,
        eps=cfg.rms_norm_eps,
        activation=cfg.hidden_act,
    )


class Qwen3NextAttention(torch.nn.Module):
    """Attention with an output gate: q_proj yields [q | gate] per head (2 D rows a head); per-head
    q/k RMSNorm, partial rotary, then out * sigmoid(gate) into o_proj. Under TP the heads split
    as llama's (`qkv_parallel`: a rank's [q | gate] rows, kv heads split or replicated); o_proj
    is row-parallel and all-reduces."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            cfg.hidden_size, heads, kv_heads, self.head_dim, bias,
            q_rows_per_head=2 * self.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [2 * q_size, kv_size, kv_size]
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg), is_neox=True
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, 2 q + 2 kv]
        T = qkv.shape[0]
        qg, k, v = qkv.split(self.split, dim=-1)
        qg = qg.view(T, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]  # [T, H, D] views
        out = self.attn.forward_rope(
            q, k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            positions, self.rotary, meta.attn, self.q_norm, self.k_norm,
        )  # [T, H * D]
        return self.o_proj(sigmoid_gate(out, gate))


class Qwen3NextMoE(torch.nn.Module):
    """Softmax top-k routing (renormalised with norm_topk_prob; weights rounded to the model
    dtype as in HF) over `num_experts` experts, plus shared_expert(x) * sigmoid(gate(x)).
    Under TP the router (with the shared gate's row) is replicated, the experts and the shared
    expert hold their part of the intermediate dimension, and the gated sum of both partial
    outputs takes one all-reduce."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = bool(cfg.norm_topk_prob)
        self.num_experts = cfg.num_experts
        # the router (`gate`) and the shared expert's gate (`shared_expert_gate`) in one weight
        self.router = MergedLinear(cfg.hidden_size, [cfg.num_experts, 1])
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                top_k=self.top_k)
        self.shared_expert = LlamaMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [T, E + 1]: expert logits, then the shared gate's
        weights, ids = route_topk(logits[:, : self.num_experts], self.top_k, self.renormalize,
                                  round_to_dtype=True)
        # shared_expert(x) * sigmoid(shared gate logit), the gate applied by the experts
        out = self.experts(x, weights, ids, add_gate=logits[:, self.num_experts :],
                           shared_expert=self.shared_expert)
        return ps.tp_all_reduce(out)  # a no-op at one rank


def is_moe_layer(cfg: Any, i: int) -> bool:
    return (i not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0
            and (i + 1) % cfg.decoder_sparse_step == 0)


class Qwen3NextDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: Any, i: int) -> None:
        super().__init__()
        kind = cfg.layer_types[i]
        if kind not in ("linear_attention", "full_attention"):
            raise ValueError(f"Qwen3-Next: unknown layer type {kind!r} at layer {i}")
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Qwen3-Next: hidden_act {cfg.hidden_act!r} is not supported")
        self.linear_attn = GatedDeltaNet(gdn_dims(cfg)) if kind == "linear_attention" else None
        self.self_attn = Qwen3NextAttention(cfg) if kind == "full_attention" else None
        self.mlp = (Qwen3NextMoE(cfg) if is_moe_layer(cfg, i)
                    else LlamaMLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta: StepMetadata):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        if self.linear_attn is not None:
            x = self.linear_attn(x, meta.mamba)
        else:
            x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


_EXPERT = re.compile(
    r"(layers\.\d+\.mlp\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)"
    r"(?:\.weight)?$")
_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"}
# zero-centred norms: stored as 1 + w (the GDN output norm is an ordinary one)
_CENTRED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$"
                      r"|^norm\.weight$")


def _match_expert(name: str) -> tuple[str, str, int | None] | None:
    """Per-expert (`experts.N.gate_proj.weight`, as HF saves them) or stacked
    (`experts.gate_up_proj`, `experts.down_proj`) expert tensors."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    path, expert, proj = m.groups()
    return path, _KINDS[proj], None if expert is None else int(expert)


class Qwen3NextForCausalLM(torch.nn.Module):
    stacked = {
        **QKV_GATE_UP_SHARDS,
        ".in_proj_qkvz.": (".in_proj.", 0),
        ".in_proj_ba.": (".in_proj.", 1),
        ".mlp.gate.": (".mlp.router.", 0),
        ".mlp.shared_expert_gate.": (".mlp.router.", 1),
    }

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.dims = gdn_dims(cfg)
        self.embed_tokens = embedding_for(cfg)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: Qwen3NextDecoderLayer(cfg, i))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head_for(cfg, self.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        return run_layers(self.layers, self.norm, x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V] in the model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stream = self._convert(weights)
        stream = load_expert_weights(self, stream, _match_expert)
        load_named_weights(self, stream, self.stacked, rename=_rename)

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names without `model.` and without the MTP head; the GDN projections'
        rows regrouped; zero-centred norm weights as 1 + w."""
        for name, tensor in weights:
            if name.startswith("mtp."):
                continue
            if name.startswith("model."):
                name = name[len("model."):]
            # (these read the whole tensor, also under TP: each rank takes its rows after)
            if name.endswith(".in_proj_qkvz.weight"):
                tensor = regroup_qkvz(materialize(tensor), self.dims)
            elif name.endswith(".in_proj_ba.weight"):
                tensor = regroup_ba(materialize(tensor), self.dims)
            elif _CENTRED.search(name):
                tensor = materialize(tensor).float() + 1.0
            yield name, tensor


def _rename(name: str) -> str:
    for old, new in (("conv1d.weight", "conv1d_weight"), ("norm.weight", "norm_weight")):
        if ".linear_attn." in name and name.endswith("." + old):
            return name[: -len(old)] + new
    return name

"""HF `NemotronHForCausalLM`: a stack of single-mixer blocks (Mamba2, attention without rotary,
relu2 MLP, or sigmoid-routed MoE), each `x + mixer(norm(x))`."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from krait.distributed import parallel_state as ps
from krait.distributed.pipeline import make_layers
from krait.layers.activation import get_act_fn
from krait.layers.attention import Attention
from krait.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, qkv_parallel
from krait.layers.mamba2 import Mamba2Dims, Mamba2Mixer, mixer_weight_name, time_step_limit
from krait.layers.moe import FusedMoE, load_expert_weights
from krait.layers.norm import RMSNorm
from krait.models.decoder import embedding_for, lm_head_for, pre_norm, run_layers
from krait.models.weights import QKV_SHARDS, load_named_weights
from krait.runner.attention_metadata import StepMetadata

# layer kinds by pattern character and by `layers_block_type` name (old and new spellings)
_KINDS = {
    "M": "mamba", "mamba": "mamba", "linear_attention": "mamba",
    "*": "attention", "attention": "attention", "full_attention": "attention",
    "-": "mlp", "mlp": "mlp",
    "E": "moe", "moe": "moe",
}


def nemotron_h_layer_kinds(cfg: Any) -> list[str]:
    """One of mamba / attention / mlp / moe per layer, from `layers_block_type` (new configs)
    or `hybrid_override_pattern` (released checkpoints, e.g. "M-M*-ME")."""
    types = getattr(cfg, "layers_block_type", None)
    if not types:
        types = getattr(cfg, "hybrid_override_pattern", None)
    if not types:
        raise ValueError("NemotronH: config has neither layers_block_type nor hybrid_override_pattern")
    unknown = sorted({t for t in types if t not in _KINDS})
    if unknown:
        raise ValueError(f"NemotronH: unknown layer types {unknown}")
    return [_KINDS[t] for t in types]


def nemotron_h_dims(cfg: Any) -> Mamba2Dims:
    """Mixer shapes of a NemotronH config. dt is clamped to the config's `time_step_limit`
    ((0, inf) in released checkpoints), as NVIDIA's reference code and HF's decode path do;
    HF 5.x's prefill path alone clamps at (time_step_min, inf) instead."""
    return Mamba2Dims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        n_groups=cfg.n_groups,
        d_state=cfg.ssm_state_size,
        d_conv=cfg.conv_kernel,
        chunk_size=cfg.chunk_size,
        eps=cfg.layer_norm_epsilon,
        use_conv_bias=getattr(cfg, "use_conv_bias", True),
        use_bias=getattr(cfg, "use_bias", False),
        time_step_limit=time_step_limit(cfg),
        activation=getattr(cfg, "mamba_hidden_act", "silu"),
    )


class NemotronHAttention(torch.nn.Module):
    """GQA attention with no positional encoding (NemotronH attends without rotary)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            cfg.hidden_size, heads, getattr(cfg, "num_key_value_heads", None) or heads,
            self.head_dim, bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        return self.o_proj(self.attn(q, k, v, meta.attn))


def linear_of(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's GEMM alone (a row-parallel layer's partial output, before its reduce)."""
    return Linear.forward(layer, x)


class NemotronHMLP(torch.nn.Module):
    """Non-gated MLP: down(act(up(x))), act relu2 in released models; column- then
    row-parallel under TP (`reduce=False`: the partial output)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        y = linear_of(self.down_proj, self.act(self.up_proj(x)))
        return self.down_proj.finish(y) if reduce else y


class NemotronHRouter(torch.nn.Module):
    """Sigmoid scores; experts chosen on score + e_score_correction_bias within the best
    `topk_group` of `n_group` groups (a group ranks by its two best biased scores); weights are
    the unbiased scores of the chosen experts, renormalised when `norm_topk_prob`, times
    `routed_scaling_factor`. Weights stay float32, as in HF."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = getattr(cfg, "n_group", 1) or 1
        self.topk_group = getattr(cfg, "topk_group", 1) or 1
        self.norm_topk_prob = getattr(cfg, "norm_topk_prob", True)
        self.scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        self.weight = torch.nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = torch.nn.Parameter(
            torch.zeros(e, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights float32 [T, k], expert ids int32 [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1 and self.topk_group < self.n_group:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids.to(torch.int32)


class NemotronHMoE(torch.nn.Module):
    """Routed relu2 experts (optionally in a latent space) plus one shared expert."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        act = getattr(cfg, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"NemotronH MoE: mlp_hidden_act {act!r} is not supported (relu2)")
        bias = getattr(cfg, "mlp_bias", False)
        latent = getattr(cfg, "moe_latent_size", None)
        self.gate = NemotronHRouter(cfg)
        self.experts = FusedMoE(
            cfg.n_routed_experts, latent or cfg.hidden_size, cfg.moe_intermediate_size, act,
            top_k=cfg.num_experts_per_tok,
        )
        self.shared_experts = NemotronHMLP(
            cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, bias, act
        )
        self.fc1_latent_proj = Linear(cfg.hidden_size, latent, bias) if latent else None
        self.fc2_latent_proj = Linear(latent, cfg.hidden_size, bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, weights, ids)  # a partial sum under TP
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(ps.tp_all_reduce(h))
            return h + self.shared_experts(x)
        return ps.tp_all_reduce(h + self.shared_experts(x, reduce=False))


class NemotronHBlock(torch.nn.Module):
    def __init__(self, cfg: Any, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(nemotron_h_dims(cfg))
        elif kind == "attention":
            self.mixer = NemotronHAttention(cfg)
        elif kind == "mlp":
            self.mixer = NemotronHMLP(
                cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False),
                getattr(cfg, "mlp_hidden_act", "relu2"),
            )
        else:
            self.mixer = NemotronHMoE(cfg)

    def forward(self, positions, x, residual, meta: StepMetadata):
        x, residual = pre_norm(self.norm, x, residual)
        if self.kind == "mamba":
            return self.mixer(x, meta.mamba), residual
        if self.kind == "attention":
            return self.mixer(x, meta), residual
        return self.mixer(x), residual


_EXPERT = re.compile(r"(layers\.\d+\.mixer\.experts)\.(?:(\d+)\.)?(up_proj|down_proj)(?:\.weight)?$")


def _match_expert(name: str) -> tuple[str, str, int | None] | None:
    """Per-expert (`experts.N.up_proj.weight`) or stacked (`experts.up_proj`) tensors."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    path, expert, proj = m.groups()
    return path, "up" if proj == "up_proj" else "down", None if expert is None else int(expert)


class NemotronHForCausalLM(torch.nn.Module):
    stacked = QKV_SHARDS

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = embedding_for(cfg)
        kinds = nemotron_h_layer_kinds(cfg)
        self.layers = make_layers(len(kinds), lambda i: NemotronHBlock(cfg, kinds[i]))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.lm_head = lm_head_for(cfg, self.embeddings)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (positions are unused)."""
        x = self.embeddings(input_ids)
        return run_layers(self.layers, self.norm_f, x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V] in the model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # multi-token-prediction heads (`mtp.*`) are not used
        stream = ((n, t) for n, t in weights if not n.startswith("mtp."))
        stream = load_expert_weights(self, _strip(stream, "backbone."), _match_expert)
        load_named_weights(self, stream, self.stacked, rename=mixer_weight_name)


def _strip(weights: Iterable[tuple[str, torch.Tensor]], prefix: str):
    for name, tensor in weights:
        yield (name[len(prefix) :] if name.startswith(prefix) else name), tensor

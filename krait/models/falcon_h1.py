"""HF `FalconH1ForCausalLM`: every layer runs a Mamba2 mixer and attention side by side on the
same normed input, then a gated MLP. The muP multipliers are folded into weights at load time
(each scales the output of a linear map, so folding is exact up to rounding); the embedding
and lm_head multipliers are applied at run time (the two matrices may be tied)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from krait.distributed import parallel_state as ps
from krait.distributed.pipeline import make_layers
from krait.layers.linear import RowParallelLinear
from krait.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    MambaMetadata,
    mixer_weight_name,
)
from krait.layers.norm import RMSNorm
from krait.models.bamba import bamba_mamba_dims
from krait.models.decoder import embedding_for, lm_head_for, pre_norm, run_layers
from krait.models.llama import LlamaAttention, LlamaMLP
from krait.models.weights import QKV_GATE_UP_SHARDS, load_named_weights
from krait.ops.gated_rms_norm import gated_rms_norm
from krait.runner.attention_metadata import StepMetadata


def falcon_h1_dims(cfg: Any) -> Mamba2Dims:
    """Mixer shapes from a FalconH1 config (`mamba_d_ssm`, else expand * hidden, is the width)."""
    d_ssm = getattr(cfg, "mamba_d_ssm", None) or int(cfg.mamba_expand * cfg.hidden_size)
    head_dim = cfg.mamba_d_head
    if head_dim in (None, "auto"):
        head_dim = d_ssm // cfg.mamba_n_heads
    return bamba_mamba_dims(cfg, head_dim=head_dim)


def mup_vector(d: Mamba2Dims, multipliers: list[float]) -> torch.Tensor:
    """Per-channel scale of in_proj's output [z | x | B | C | dt] (HF `compute_mup_vector`)."""
    gs = d.n_groups * d.d_state
    sizes = [d.intermediate, d.intermediate, gs, gs, d.num_heads]
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, multipliers)])


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2 mixer with FalconH1's output gating: `y * silu(z)` without a norm
    (`mamba_rms_norm=False`), norm(y * silu(z)) (gate first), or norm(y) * silu(z)."""

    def __init__(self, d: Mamba2Dims, rms_norm: bool, norm_before_gate: bool, out_bias: bool):
        super().__init__(d)
        # the layer sums this and attention's partial outputs in one all-reduce (TP)
        self.out_proj = RowParallelLinear(d.intermediate, d.hidden_size, out_bias, reduce=False)
        self.rms_norm = rms_norm
        self.norm_before_gate = norm_before_gate
        if not rms_norm:
            self.norm_weight = None

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.rms_norm and not self.norm_before_gate:
            return super().forward(x, meta)
        d = self.d
        y, gate = self.scan(x, meta)
        if self.rms_norm:
            if self.cross_rank_norm:  # TP with fewer groups than ranks
                y = self._cross_rank_gated_norm(y, None)
            else:
                y = gated_rms_norm(y, None, self.norm_weight, d.eps, self._norm_group())
        return self.out_proj(y * F.silu(gate))


class FalconH1DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.mamba = FalconH1Mixer(
            falcon_h1_dims(cfg),
            rms_norm=getattr(cfg, "mamba_rms_norm", False),
            norm_before_gate=getattr(cfg, "mamba_norm_before_gate", True),
            out_bias=getattr(cfg, "projectors_bias", False),
        )
        bias = getattr(cfg, "attention_bias", False)
        self.self_attn = LlamaAttention(cfg, qkv_bias=bias, qk_norm=False, sliding_window=None,
                                        reduce_output=False)
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"FalconH1: hidden_act {act!r} is not supported (silu)")
        self.feed_forward = LlamaMLP(
            cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta: StepMetadata):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        # both branches are partial sums under TP: one all-reduce
        x = ps.tp_all_reduce(self.mamba(x, meta.mamba) + self.self_attn(x, positions, meta))
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual

    @torch.no_grad()
    def fold_multipliers(self, cfg: Any) -> None:
        """Scales weights by the config's muP multipliers (once, after loading)."""
        m = self.mamba
        ssm_in = float(getattr(cfg, "ssm_in_multiplier", 1.0))
        mup = mup_vector(m.d, getattr(cfg, "ssm_multipliers", None) or [1.0] * 5)
        mup = mup.to(m.in_proj.weight.device)
        _scale_rows(m.in_proj.weight, (mup * ssm_in)[:, None])
        if m.in_proj.bias is not None:
            _scale_rows(m.in_proj.bias, mup)
        _scale(m.out_proj, float(getattr(cfg, "ssm_out_multiplier", 1.0)))

        a = self.self_attn
        attn_in = float(getattr(cfg, "attention_in_multiplier", 1.0))
        key = float(getattr(cfg, "key_multiplier", 1.0))
        a.qkv_proj.weight.mul_(attn_in)
        q, kv = a.split[0], a.split[1]
        a.qkv_proj.weight[q : q + kv].mul_(key)
        if a.qkv_proj.bias is not None:
            a.qkv_proj.bias[q : q + kv].mul_(key)
        _scale(a.o_proj, float(getattr(cfg, "attention_out_multiplier", 1.0)))

        gate_m, down_m = getattr(cfg, "mlp_multipliers", None) or [1.0, 1.0]
        f = self.feed_forward
        inter = f.gate_up_proj.out_sizes[0]
        f.gate_up_proj.weight[:inter].mul_(float(gate_m))
        if f.gate_up_proj.bias is not None:
            f.gate_up_proj.bias[:inter].mul_(float(gate_m))
        _scale(f.down_proj, float(down_m))


def _scale_rows(t: torch.Tensor, factor: torch.Tensor) -> None:
    # in float32, so a low-precision weight is rounded once
    t.copy_((t.float() * factor).to(t.dtype))


def _scale(linear: torch.nn.Module, factor: float) -> None:
    linear.weight.mul_(factor)
    if linear.bias is not None:
        linear.bias.mul_(factor)


class FalconH1ForCausalLM(torch.nn.Module):
    stacked = QKV_GATE_UP_SHARDS

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = embedding_for(cfg)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: FalconH1DecoderLayer(cfg))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head_for(cfg, self.embed_tokens)
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(getattr(cfg, "lm_head_multiplier", 1.0))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        return run_layers(self.layers, self.final_layernorm, x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [T, V] in the model dtype: the sampler upcasts
        if self.lm_head_multiplier != 1.0:  # scaled in float32
            logits = logits.float() * self.lm_head_multiplier
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(
            self, weights, self.stacked, strip_prefix="model.",
            rename=lambda n: mixer_weight_name(n, ".mamba."),
        )
        for layer in self.layers:
            if isinstance(layer, FalconH1DecoderLayer):  # not another pipeline stage's
                layer.fold_multipliers(self.config)

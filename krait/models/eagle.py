"""EAGLE draft heads for Llama-family targets, in the public checkpoint layouts.

A head is run by its drafter (krait/runner/spec_decode/eagle.py), which sets `input_hidden`
([T, width], the batch's token order) before each forward: the target's hidden states, or the
head's own output of the step before. Head position p takes the token at target position p + 1
and the hidden state of position p, and predicts the token at p + 2.

EAGLE-1 (`EagleLlamaForCausalLM`, `LlamaForCausalLMEagle`): x = fc(cat(embed(token), hidden))
(fc [H, 2H], with a bias when the checkpoint has `fc.bias`), then `num_hidden_layers` Llama
decoder layers, the first without its input_layernorm; the output x + residual predicts the
target's next final hidden state (after the target's final norm), so it is fed back as is and
its logits are lm_head(output): the target's lm_head (and embed_tokens) unless the checkpoint
has its own. Tensor names: fc.*, layers.N.*, embed_tokens.weight and lm_head.weight (both
optional), with or without a "model." prefix.

EAGLE-3 (`Eagle3LlamaForCausalLM`, `LlamaForCausalLMEagle3`): the target's hidden states at
the inputs of three of its layers ([T, 3H], see `aux_layer_ids`) go through fc [H, 3H]; the
head's own (pre-norm) output [T, H] is fed back without it. One `midlayer`: residual = h (or
hidden_norm(h) with `norm_before_residual`), attention q/k/v over
cat(input_layernorm(embed(token)), hidden_norm(h)) [2H], then the usual post-attention norm and
MLP; the output is mlp + residual. Logits: lm_head(norm(output)) over `draft_vocab_size` ids,
draft id d standing for target id d + d2t[d] (the other target ids get -inf). Tensor names:
fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d (unused), embed_tokens.weight
(optional: the target's otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from krait.distributed.sharding import materialize
from krait.layers.embedding import MissingModule, ParallelLMHead, VocabParallelEmbedding
from krait.layers.linear import Linear
from krait.layers.norm import RMSNorm
from krait.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from krait.models.weights import QKV_GATE_UP_SHARDS, load_named_weights
from krait.runner.attention_metadata import StepMetadata


def aux_layer_ids(head_cfg: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states an EAGLE-3 head reads: the config's
    `eagle_config.eagle_aux_hidden_state_layer_ids` when given, else (2, L // 2, L - 3)."""
    eagle_cfg = getattr(head_cfg, "eagle_config", None) or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
    L = num_target_layers
    return tuple(int(i) for i in ids) if ids else (2, L // 2, L - 3)


class _NoNorm(torch.nn.Module):
    """The first EAGLE-1 layer's input_layernorm: none (its input is fc's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _EagleHead(torch.nn.Module):
    """What both heads share: the side input, the shared target modules, the loading."""

    has_own_lm_head_always = False
    owns_embedding = True  # False: always the target's (share_target), never allocated here

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.input_hidden: torch.Tensor | None = None  # set by the drafter before each forward
        self.output_hidden: torch.Tensor | None = None  # the last forward's output, kept for it
        self.embed_tokens: torch.nn.Module = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.owns_embedding
            else MissingModule())

    @property
    def input_hidden_width(self) -> int:
        """The width of the side input a CUDA graph of the head takes (krait/runner/
        cuda_graphs.py): [T, hidden_size], what `project_hidden` gives."""
        return self.config.hidden_size

    def project_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The target's hidden states in the form the head's layers read ([T, hidden_size]):
        as they are, but EAGLE-3's three layers' [T, 3H], which its fc fuses."""
        return h

    def share_target(self, target: torch.nn.Module) -> None:
        """Takes the target's embedding (and lm_head) where the checkpoint had none."""
        if isinstance(self.embed_tokens, MissingModule):
            self.embed_tokens = target.embed_tokens
        if isinstance(getattr(self, "lm_head", None), MissingModule):
            self.lm_head = target.lm_head

    def _take_hidden(self, num_tokens: int) -> torch.Tensor:
        h = self.input_hidden
        if h is None or h.shape[0] != num_tokens:
            raise RuntimeError(f"{type(self).__name__}: the drafter must set input_hidden for "
                               f"the step's {num_tokens} tokens")
        self.input_hidden = None
        return h

    def _rename(self, name: str) -> str | None:
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        pairs = []
        for name, t in weights:
            name = self._rename(name.removeprefix("model."))
            if name is not None:
                pairs.append((name, t))
        names = {n for n, _ in pairs}
        if "embed_tokens.weight" not in names:
            self.embed_tokens = MissingModule()  # the target's (share_target)
        if not self.has_own_lm_head_always and "lm_head.weight" not in names:
            self.lm_head = MissingModule()
        self._before_load(names, pairs)
        load_named_weights(self, pairs, QKV_GATE_UP_SHARDS)

    def _before_load(self, names: set[str], pairs: list) -> None:
        """Per-head adjustments once the checkpoint's names are known (may edit `pairs`)."""


class EagleLlamaForCausalLM(_EagleHead):
    """EAGLE-1 over a Llama-family target (see the module doc)."""

    hidden_width_factor = 1  # the target hidden states it reads: [T, 1 * H]

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=True)  # the bias goes when the checkpoint has none
        qkv_bias = getattr(cfg, "attention_bias", False)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(cfg, i, qkv_bias, False) for i in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = _NoNorm()
        self.lm_head: torch.nn.Module = ParallelLMHead(H, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor:
        """-> the predicted next target hidden states [T, H] (fed back as they are)."""
        h = self._take_hidden(input_ids.shape[0])
        x = self.fc(torch.cat([self.embed_tokens(input_ids), h.to(self.fc.weight.dtype)], -1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        self.output_hidden = x + residual
        return self.output_hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _rename(self, name: str) -> str | None:
        return None if name == "layers.0.input_layernorm.weight" else name  # not applied

    def _before_load(self, names: set[str], pairs: list) -> None:
        if "fc.bias" not in names:
            self.fc.bias = None


class Eagle3MidLayer(torch.nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        H = cfg.hidden_size
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for {type(self)}")
        self.self_attn = LlamaAttention(cfg, getattr(cfg, "attention_bias", False), False, None,
                                        input_size=2 * H)
        self.mlp = LlamaMLP(H, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, h: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class Eagle3LlamaForCausalLM(_EagleHead):
    """EAGLE-3 over a Llama-family target (see the module doc)."""

    hidden_width_factor = 3  # [T, 3 * H]: three target layers' hidden states
    has_own_lm_head_always = True

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        H = cfg.hidden_size
        if getattr(cfg, "num_hidden_layers", 1) != 1:
            raise ValueError(f"an EAGLE-3 head has one midlayer; num_hidden_layers is "
                             f"{cfg.num_hidden_layers}")
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.fc = Linear(3 * H, H)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(H, self.draft_vocab_size)
        # draft id d -> target id d + d2t[d]
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor:
        """-> the pre-norm outputs [T, H] (fed back as they are; logits take their norm)."""
        h = self.project_hidden(self._take_hidden(input_ids.shape[0]))
        self.output_hidden = self.midlayer(positions, self.embed_tokens(input_ids), h, meta)
        return self.output_hidden

    def project_hidden(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.config.hidden_size:  # the target's three layers: fused by fc
            h = self.fc(h.to(self.fc.weight.dtype))
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab_size] logits: the draft vocabulary's at their target ids, -inf elsewhere."""
        logits = self.lm_head(self.norm(hidden))
        ids = self._target_ids()
        if ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, ids] = logits
        return full

    def _target_ids(self) -> torch.Tensor | None:
        """The target id of each draft id (None: the identity), computed once, on the first
        call (eager, before any graph capture: reading d2t synchronizes with the device)."""
        if not hasattr(self, "_ids"):
            identity = self.draft_vocab_size == self.config.vocab_size and not self.d2t.any()
            self._ids = None if identity else (
                torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t)
        return self._ids

    def _rename(self, name: str) -> str | None:
        return None if name == "t2d" else name

    def _before_load(self, names: set[str], pairs: list) -> None:
        self.__dict__.pop("_ids", None)  # `_target_ids` reads the loaded d2t
        d2t = [t for n, t in pairs if n == "d2t"]
        pairs[:] = [(n, t) for n, t in pairs if n != "d2t"]
        if d2t:
            t = materialize(d2t[0])  # (a checkpoint slice not read yet under TP)
            if tuple(t.shape) != (self.draft_vocab_size,):
                raise ValueError(f"checkpoint tensor 'd2t' has shape {tuple(t.shape)}, the head "
                                 f"expects ({self.draft_vocab_size},)")
            self.d2t.copy_(t.to(torch.long))
        elif self.draft_vocab_size != self.config.vocab_size:
            raise ValueError("checkpoint lacks 'd2t' (draft_vocab_size "
                             f"{self.draft_vocab_size} < vocab_size {self.config.vocab_size})")
        top = int((torch.arange(self.draft_vocab_size) + self.d2t.cpu()).max())
        if top >= self.config.vocab_size:
            raise ValueError(f"checkpoint tensor 'd2t' maps a draft id to {top}, past "
                             f"vocab_size {self.config.vocab_size}")

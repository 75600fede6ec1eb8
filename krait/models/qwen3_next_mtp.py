"""Qwen3-Next's multi-token-prediction (MTP) head, the drafter of `speculative_config={"method":
"mtp", "num_speculative_tokens": k}` (krait/runner/spec_decode/eagle.py runs it as it runs an
EAGLE head).

The head lives in the target's own checkpoint under `mtp.*`: `fc` [H, 2H] (no bias),
`pre_fc_norm_embedding` and `pre_fc_norm_hidden`, `mtp_num_hidden_layers` (one in the public
checkpoints) Qwen3-Next decoder layers with gated full attention and the layer-0 MLP kind (the
sparse MoE with its shared expert), and a final `norm`; every norm is zero-centred (1 + w), as
in the target. The embedding and the lm_head are the target's.

Head position p takes the token at target position p + 1 and the target's hidden state at p
(the target model's output, after its final norm):
x = fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden))), the decoder
layer, then norm; the result gives the logits (lm_head) and is the hidden state the next draft
step takes (the target's hidden state for the position after)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from krait.distributed.sharding import materialize
from krait.layers.embedding import MissingModule
from krait.layers.linear import Linear
from krait.layers.moe import load_expert_weights
from krait.layers.norm import RMSNorm
from krait.models.eagle import _EagleHead
from krait.models.qwen3_next import (
    _CENTRED,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    _match_expert,
)
from krait.models.weights import load_named_weights
from krait.runner.attention_metadata import StepMetadata

# the head's own zero-centred norms (the decoder layer's are matched by `_CENTRED`)
_HEAD_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def mtp_layer_count(cfg: Any) -> int:
    """The MTP decoder layers a Qwen3-Next config declares (`mtp_num_hidden_layers`, or
    `num_nextn_predict_layers` as other tools name it); 0 when it declares none."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        n = getattr(cfg, key, None)
        if n:
            return int(n)
    return 0


class Qwen3NextMTP(_EagleHead):
    """The MTP head (see the module doc); the drafter sets `input_hidden` before each
    forward."""

    hidden_width_factor = 1  # the target hidden states it reads: [T, 1 * H]
    owns_embedding = False  # the target's embedding and lm_head

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        H = cfg.hidden_size
        if mtp_layer_count(cfg) != 1:
            raise ValueError(f"a Qwen3-Next MTP head with {mtp_layer_count(cfg)} layers: one is "
                             "supported (mtp_num_hidden_layers)")
        layer_cfg = copy.copy(cfg)
        layer_cfg.layer_types = ["full_attention"]  # the head's layer 0
        self.lm_head: torch.nn.Module = MissingModule()
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = Linear(2 * H, H)
        self.layers = torch.nn.ModuleList([Qwen3NextDecoderLayer(layer_cfg, 0)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor:
        """-> the head's normed outputs [T, H] (logits and the next step's hidden state)."""
        h = self._take_hidden(input_ids.shape[0])
        e = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(h.to(e.dtype))], -1))  # [T, H]
        x, residual = self.layers[0](positions, x, None, meta)
        self.output_hidden, _ = self.norm(x, residual)
        return self.output_hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """From the target's checkpoint: the `mtp.*` tensors only (the rest is the target's)."""
        stream = load_expert_weights(self, self._convert(weights), _match_expert)
        load_named_weights(self, stream, Qwen3NextForCausalLM.stacked)

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        seen = False
        for name, tensor in weights:
            if not name.startswith("mtp."):
                continue
            seen = True
            name = name[len("mtp."):]
            if name in _HEAD_NORMS or _CENTRED.search(name):
                tensor = materialize(tensor).float() + 1.0
            yield name, tensor
        if not seen:
            raise ValueError("speculative_config.method='mtp': the checkpoint has no mtp.* "
                             "tensors (no multi-token-prediction head)")

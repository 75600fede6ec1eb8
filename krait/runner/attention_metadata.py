"""Metadata the attention layers read each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from krait.ops._dispatch import use_triton
from krait.ops.paged_attention import SHORT_QUERY_ROWS, token_rows


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs_padded + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs_padded]
    block_table: torch.Tensor  # int32 [num_reqs_padded, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded]
    max_query_len: int
    max_seq_len: int  # from the real batch; max_model_len only for CUDA-graph capture
    # (the layer that built it, num_tokens, token_rows(...)) for the step's other layers
    _short_rows: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def short_rows(self, layer: object, num_tokens: int) -> tuple[torch.Tensor, ...] | None:
        """The step's query tokens as one-token rows (`token_rows`), where the Triton attention
        may run short query rows (speculative verify rows) that way; None for other steps.
        Built by the first attention layer that asks and reused by the others of its forward,
        instead of a handful of index launches in every layer. That first layer asking again
        means a new forward over the same metadata (a CUDA graph's warm-up, then its capture):
        built again, so a captured graph computes it itself."""
        if not (1 < self.max_query_len <= SHORT_QUERY_ROWS) or not use_triton(self.seq_lens):
            return None
        memo = self._short_rows
        if memo is None or memo[0] is layer or memo[1] != num_tokens:
            memo = self._short_rows = (layer, num_tokens, token_rows(
                self.query_start_loc, self.seq_lens, self.block_table, num_tokens))
        return memo[2]


@dataclass
class StepMetadata:
    """Everything a model's layers need beyond tokens and positions."""

    attn: AttentionMetadata | None
    mamba: object | None = None  # MambaMetadata for hybrid models

"""Metadata the attention layers read each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass
class StepMetadata:
    """Everything a model's layers need beyond tokens and positions."""

    attn: AttentionMetadata | None
    mamba: object | None = None  # MambaMetadata for hybrid models

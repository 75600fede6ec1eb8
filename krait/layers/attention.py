"""Paged attention layer: writes this step's K/V into the cache, then attends."""

from __future__ import annotations

import torch

from krait.ops.kv_write import write_kv
from krait.ops.paged_attention import paged_attention
from krait.ops.rope_attention import rope_paged_attention
from krait.runner.attention_metadata import AttentionMetadata
from krait.runner.piecewise_graphs import mixer_call


class Attention(torch.nn.Module):
    """The runner binds `kv_cache` ([2, num_blocks, block_size, kv_heads, head_dim])."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] (already position-encoded) -> [T, Hq*D]."""
        return mixer_call(self._write_attend, (q, k, v), meta, "attn")

    def _write_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        write_kv(k, v, self.kv_cache[0], self.kv_cache[1], meta.slot_mapping[:T])
        return self.attend(q, meta)

    def forward_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary,
        meta: AttentionMetadata,
        q_norm=None,
        k_norm=None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] as they leave the projection (views are fine): optional
        per-head q/k RMSNorm, rotary and the K/V write in one kernel, then attention."""
        return mixer_call(self._rope_attend, (q, k, v, positions), meta, "attn", rotary, q_norm,
                          k_norm)

    def _rope_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        meta: AttentionMetadata, rotary, q_norm, k_norm,
    ) -> torch.Tensor:
        T = q.shape[0]
        out = rope_paged_attention(
            q, k, v, positions, rotary.cos_sin_cache, rotary.is_neox,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
            self.kv_cache[0], self.kv_cache[1], meta.slot_mapping[:T],
            meta.query_start_loc, meta.seq_lens, meta.block_table, meta.max_query_len,
            meta.max_seq_len, self.scale, self.sliding_window,
        )
        return out.reshape(T, self.num_heads * self.head_dim)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] over the cache (this step's K/V already written) -> [T, Hq*D]."""
        T = q.shape[0]
        out = paged_attention(
            q,
            self.kv_cache[0],
            self.kv_cache[1],
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.max_query_len,
            meta.max_seq_len,
            self.scale,
            self.sliding_window,
        )
        return out.reshape(T, self.num_heads * self.head_dim)

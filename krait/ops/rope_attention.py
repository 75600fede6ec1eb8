"""An attention layer's work after its q/k/v projection: `rope_kv_write` (per-head q/k norm,
rotary, the K/V write), then `paged_attention`. A decode batch that the split-KV kernel takes
runs the first inside the second (`decode_split_rope`): one launch fewer an attention layer
(faster on the H200 at batch 1 and 8: docs/benchmarks.md)."""

from torch import Tensor

from krait.ops._dispatch import use_triton
from krait.ops.paged_attention import decode_num_splits, decode_split_rope, paged_attention
from krait.ops.rope_kv_write import rope_kv_write


def rope_paged_attention(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
    max_query_len: int, max_seq_len: int, scale: float, sliding_window: int | None = None,
) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] as the projection left them; the other arguments as in
    `rope_kv_write` and `paged_attention`. Returns the attention output [T, Hq, D]."""
    if use_triton(q) and max_query_len == 1:
        splits = decode_num_splits(seq_lens.shape[0], k_cache.shape[2], max_seq_len, q.device)
        if splits > 1:
            return decode_split_rope(
                q, k, v, positions, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight, eps,
                k_cache, v_cache, slot_mapping, query_start_loc, seq_lens, block_table, scale,
                sliding_window, splits)
    q = rope_kv_write(q, k, v, positions, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight,
                      eps, k_cache, v_cache, slot_mapping)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                           max_query_len, max_seq_len, scale, sliding_window)

"""`rope_kv_write` then `paged_attention`, in one launch for the decode batches that take the
split-KV kernel (KRAIT_FUSE_ROPE_ATTN=1, opt-in until measured on the GPU).

At batch 1 every attention layer runs the rotary/KV-write kernel (~3 us) between the qkv
projection and the attention; here each split program rotates its own q heads and the split
that holds a row's newest key writes it first. Other batches run the two ops one after the
other, as the reference does.
"""

from __future__ import annotations

import os

from torch import Tensor

from krait.ops._dispatch import use_triton
from krait.ops.paged_attention import decode_num_splits, paged_attention, paged_attention_triton
from krait.ops.rope_kv_write import rope_kv_write


def fuse_rope_attention_enabled() -> bool:
    """KRAIT_FUSE_ROPE_ATTN=1 (off by default)."""
    return os.environ.get("KRAIT_FUSE_ROPE_ATTN") == "1"


def rope_attention(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
    max_query_len: int, max_seq_len: int, scale: float, sliding_window: int | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] as they leave the projection, the rest as `rope_kv_write`
    and `paged_attention` take them; writes this step's K/V into the caches and returns the
    attention output [T, Hq, D]. num_splits: the split-KV decode's (None: from the batch)."""
    if use_triton(q) and max_query_len == 1 and q.shape[0] > 0:
        if num_splits is None:
            num_splits = decode_num_splits(seq_lens.shape[0], k_cache.shape[2], max_seq_len,
                                           q.device)
        if num_splits > 1:
            rope = _rope_args(q, k, v, positions, cos_sin_cache, is_neox, q_norm_weight,
                              k_norm_weight, eps, slot_mapping)
            return paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens,
                                          block_table, max_query_len, max_seq_len, scale,
                                          sliding_window, num_splits=num_splits, rope=rope)
    q = rope_kv_write(q, k, v, positions, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight,
                      eps, k_cache, v_cache, slot_mapping)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                           max_query_len, max_seq_len, scale, sliding_window)


def _rope_args(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor,
               is_neox: bool, q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
               eps: float, slot_mapping: Tensor) -> dict:
    """The split-KV kernel's ROPE arguments."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert cos_sin_cache.stride(-1) == 1
    norm = q_norm_weight is not None
    return dict(
        k_new_ptr=k, v_new_ptr=v, pos_ptr=positions, cs_ptr=cos_sin_cache,
        qw_ptr=q_norm_weight if norm else q, kw_ptr=k_norm_weight if norm else k,
        slot_ptr=slot_mapping, eps=eps, rot_dim=cos_sin_cache.shape[-1],
        stride_knt=k.stride(0), stride_knh=k.stride(1), stride_vnt=v.stride(0),
        stride_vnh=v.stride(1), stride_cs=cos_sin_cache.stride(0),
        ROPE=True, NORM=norm, IS_NEOX=is_neox,
    )

"""Where a tile of keys lives in the paged KV cache, and the leading arguments of the varlen
attention kernel that walks it (krait/ops/paged_attention.py)."""

import math

import triton
import triton.language as tl
from torch import Tensor


def paged_attention_args(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, block_table: Tensor, scale: float, sliding_window: int | None,
) -> tuple:
    """(q, caches, out, metadata, log2-scaled scale, head_dim, block_size, window, strides) in
    the order `_paged_attention_kernel` takes them."""
    return (
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
        scale * math.log2(math.e), q.shape[2], k_cache.shape[1], sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
    )


@triton.jit
def kv_tile_offsets(start_n, hi, kv_head, bt_row, block_size,
                    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                    BLOCK_N: tl.constexpr):
    """Key positions [start_n, start_n + BLOCK_N), which of them are < hi, and their K and V
    row offsets in the paged caches (through the block table)."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_ok = k_pos < hi
    blk = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
    off = k_pos % block_size
    k_off = blk * stride_kc_b + off * stride_kc_o + kv_head * stride_kc_h
    v_off = blk * stride_vc_b + off * stride_vc_o + kv_head * stride_vc_h
    return k_pos, k_ok, k_off, v_off

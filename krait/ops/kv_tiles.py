"""Where a tile of keys lives in the paged KV cache: shared by the attention kernels."""

import triton
import triton.language as tl


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

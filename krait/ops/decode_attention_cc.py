"""Decode attention on CUDA cores for rows of one query token (KRAIT_DECODE_CUDA_CORE=1; opt-in
until measured on the GPU).

The varlen kernel runs a decode row through tensor-core dots of at least 16 query rows: a row
with a GQA group of 2 fills 2 of them, and every K/V tile is staged through shared memory for
the dot layouts (an fp8 tile twice: widened between two trips, docs/benchmarks.md session 7).
Here one program owns (row, kv head) and keeps everything in registers: the group's q heads
[G, D], each K/V tile [BLOCK_N, D] loaded (and widened) where it lands, scores and the
weighted sum of V as products reduced over D and over the keys.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from torch import Tensor

from krait.ops.kv_tiles import kv_tile_offsets, paged_attention_args
from krait.ops.kv_write import from_cache
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl


def decode_cuda_core_enabled() -> bool:
    """KRAIT_DECODE_CUDA_CORE=1 (off by default)."""
    return os.environ.get("KRAIT_DECODE_CUDA_CORE") == "1"


@triton.jit
def _decode_cc_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, head_dim, block_size, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kc_b, stride_kc_o, stride_kc_h,
    stride_vc_b, stride_vc_o, stride_vc_h,
    stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    if (q_len == 1) & (seq_len > 0):
        g = tl.arange(0, G_PAD)
        g_ok = g < GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        head = kv_head * GROUP + g
        q_off = q_start.to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32) * qk_scale  # [G, D], scores in log2 units
        m_i = tl.full([G_PAD], -1.0e30, tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(seq_len - sliding_window, 0)
        bt_row = block_table_ptr + row * stride_bt
        for start_n in range(lo, seq_len, BLOCK_N):
            k_pos, k_ok, k_off, v_off = kv_tile_offsets(
                start_n, seq_len, kv_head, bt_row, block_size, stride_kc_b, stride_kc_o,
                stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h, BLOCK_N)
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = from_cache(tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask,
                                   other=0.0), kv_mask, tl.float32)  # [N, D]
            v = from_cache(tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask,
                                   other=0.0), kv_mask, tl.float32)  # [N, D]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
            s = tl.where(k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [G, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = q_start.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


def decode_attention_cc(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, block_table: Tensor, scale: float, sliding_window: int | None,
) -> None:
    """Writes out [T, Hq, D] for a batch whose rows have one query token each (rows of
    q_len 0 or seq_len 0 write nothing): `paged_attention_triton`'s decode rows, on CUDA
    cores. q [T, Hq, D] with a unit last stride; caches [blocks, block_size, Hkv, D]."""
    num_rows = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    interpret = q.device.type == "cpu"
    opts = {} if interpret else dict(num_warps=4)
    pdl = use_pdl(q)
    _decode_cc_kernel[(num_rows, num_kv_heads)](
        *paged_attention_args(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                              scale, sliding_window),
        GROUP=group, G_PAD=triton.next_power_of_2(group),
        USE_WINDOW=sliding_window is not None,
        BLOCK_N=max(8, 64 // triton.next_power_of_2(group)),  # [G, N, D] products: 8K elements
        BLOCK_D=triton.next_power_of_2(head_dim), **opts, **pdl_args(pdl),
    )

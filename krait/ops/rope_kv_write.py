"""One pass over a step's fresh q/k/v before attention: optional per-head RMSNorm of q and k
(Qwen3's q_norm/k_norm), rotary embedding, and the K/V write into the paged cache.

Replaces four to six launches per attention layer (two norms, rotary, contiguous copies, KV write)
with one. Semantics equal composing `rms_norm` per head, `apply_rotary` and `write_kv`.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton
from krait.ops.kv_write import to_cache, write_kv_ref
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.rms_norm import rms_norm_ref
from krait.ops.rotary import apply_rotary_ref, norm_rope_loaded, rope_constants
from krait.ops.timeline import ENTRY, EXIT, WAITED, stamp, timeline_args


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, eps,
    k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
    num_q_heads, num_kv_heads, head_dim, rot_dim,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_cs,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
    NORM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, TL: tl.constexpr = False, tl_ptr=None,
):
    """Program (token, block): blocks [0, cdiv(Hq, BLOCK_H)) take BLOCK_H q heads, the rest
    BLOCK_H k and v heads. The position's cos/sin, the norm weights and the slot come from the
    step's input preparation or are constants: loaded before the PDL wait, so that after it a
    program only loads its heads, rotates and stores (at batch 1 one program for all heads
    spent ~3 µs in the chain)."""
    pdl_trigger(PDL)
    stamp(TL, tl_ptr, ENTRY)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    in_d = d[None, :] < head_dim
    cs_row = cs_ptr + tl.load(pos_ptr + token) * stride_cs
    if block < q_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        partner, rotated, cos, sin, w, wp = rope_constants(cs_row, qw_ptr, head_dim, rot_dim,
                                                           NORM, IS_NEOX, BLOCK_D)
        pdl_wait(PDL)
        stamp(TL, tl_ptr, WAITED)
        q = norm_rope_loaded(q_ptr + token * stride_qt, heads, num_q_heads, eps, head_dim,
                             stride_qh, partner, rotated, cos, sin, w, wp, NORM, BLOCK_D)
        tl.store(q_out_ptr + token * stride_qot + heads[:, None] * stride_qoh + d[None, :],
                 q.to(q_out_ptr.dtype.element_ty), mask=(heads[:, None] < num_q_heads) & in_d)
    else:
        heads = (block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        slot = tl.load(slot_ptr + token)
        partner, rotated, cos, sin, w, wp = rope_constants(cs_row, kw_ptr, head_dim, rot_dim,
                                                           NORM, IS_NEOX, BLOCK_D)
        pdl_wait(PDL)
        stamp(TL, tl_ptr, WAITED)
        if slot >= 0:
            store_rope_kv(k_ptr + token * stride_kt, v_ptr + token * stride_vt, heads,
                          num_kv_heads, eps, head_dim, stride_kh, stride_vh, partner, rotated,
                          cos, sin, w, wp, slot, block_size, k_cache_ptr, v_cache_ptr,
                          stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o,
                          stride_vc_h, q_out_ptr.dtype.element_ty, NORM, BLOCK_D)
    stamp(TL, tl_ptr, EXIT)


@triton.jit
def store_rope_kv(k_row, v_row, heads, num_heads, eps, head_dim, stride_kh, stride_vh,
                  partner, rotated, cos, sin, w, wp, slot, block_size, k_cache_ptr, v_cache_ptr,
                  stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                  dt: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's k heads (normalised, rotated: `norm_rope_loaded` with the operands of
    `rope_constants`) and v heads (those below num_heads) stored into the caches at `slot`
    (>= 0), k rounded to the activation dtype dt first, as the unfused path hands it to
    write_kv."""
    d = tl.arange(0, BLOCK_D)
    k = norm_rope_loaded(k_row, heads, num_heads, eps, head_dim, stride_kh, partner, rotated,
                         cos, sin, w, wp, NORM, BLOCK_D)
    kv_mask = (heads[:, None] < num_heads) & (d[None, :] < head_dim)
    v = tl.load(v_row + heads[:, None] * stride_vh + d[None, :], mask=kv_mask)
    block_id = slot // block_size
    offset = slot % block_size
    kc = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_o
    vc = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_o
    tl.store(kc + heads[:, None] * stride_kc_h + d[None, :], to_cache(k.to(dt), k_cache_ptr),
             mask=kv_mask)
    tl.store(vc + heads[:, None] * stride_vc_h + d[None, :], to_cache(v, v_cache_ptr),
             mask=kv_mask)


def rope_kv_write_triton(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
) -> Tensor:
    """Triton launcher of `rope_kv_write`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if num_tokens == 0:
        return q_out
    norm = q_norm_weight is not None
    block_d = next_pow2(head_dim)
    if num_tokens <= 64:  # few tokens: ~512 elements a program, many programs in parallel
        block_h = max(1, 512 // block_d)
    else:
        block_h = min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, 4096 // block_d))
    grid = (num_tokens, cdiv(num_q_heads, block_h) + cdiv(num_kv_heads, block_h))
    pdl = use_pdl(q)
    _rope_kv_write_kernel[grid](
        q, k, v, q_out, positions, cos_sin_cache,
        q_norm_weight if norm else q, k_norm_weight if norm else k, eps,
        k_cache, v_cache, slot_mapping, k_cache.shape[1],
        num_q_heads, num_kv_heads, head_dim, cos_sin_cache.shape[-1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NORM=norm, IS_NEOX=is_neox, BLOCK_H=block_h, BLOCK_D=block_d, **pdl_args(pdl),
        **timeline_args("rope_kv_write", grid, q.device),
    )
    return q_out


def rope_kv_write_ref(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
) -> Tensor:
    """Torch reference of `rope_kv_write`: the three ops composed."""
    if q_norm_weight is not None:
        q = rms_norm_ref(q.reshape(-1, q.shape[-1]), q_norm_weight, eps).view(q.shape)
        k = rms_norm_ref(k.reshape(-1, k.shape[-1]), k_norm_weight, eps).view(k.shape)
    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def rope_kv_write(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (views with a contiguous last dim); positions int64 [T];
    cos_sin_cache [max_pos, rot_dim] float32; q/k norm weights [D] or both None;
    k_cache/v_cache [num_blocks, block_size, Hkv, D] written at slot_mapping int64 [T] (-1 skips).
    Returns the normalised, rotated q [T, Hq, D]."""
    if use_triton(q):
        return rope_kv_write_triton(q, k, v, positions, cos_sin_cache, is_neox, q_norm_weight,
                                    k_norm_weight, eps, k_cache, v_cache, slot_mapping)
    return rope_kv_write_ref(q, k, v, positions, cos_sin_cache, is_neox, q_norm_weight,
                             k_norm_weight, eps, k_cache, v_cache, slot_mapping)

"""Rotary position embedding for q and k, full or partial (first rot_dim dims of each head).

cos_sin_cache [max_positions, rot_dim] float32 holds cos in [:rot_dim//2] and sin in [rot_dim//2:].
neox style rotates pairs (i, i + rot_dim/2); gpt-j style rotates pairs (2i, 2i + 1).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton


@triton.jit
def rope_constants(
    cs_row, w_ptr, head_dim, rot_dim,
    NORM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """What `norm_rope_heads` needs besides the heads themselves, all [BLOCK_D]: each dim's
    rotation partner, which dims rotate, cos, signed sin, and the norm weight at the dim and at
    its partner (1 without NORM). Nothing here depends on the fresh activations: a kernel under
    PDL loads it before its wait."""
    d = tl.arange(0, BLOCK_D)
    half = rot_dim // 2
    if IS_NEOX:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        cs_idx = tl.where(first, d, d - half)
    else:
        first = d % 2 == 0
        partner = tl.where(first, d + 1, d - 1)
        cs_idx = d // 2
    rotated = d < rot_dim
    cos = tl.load(cs_row + cs_idx, mask=rotated, other=1.0)
    sin = tl.load(cs_row + half + cs_idx, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)
    w = tl.full([BLOCK_D], 1.0, tl.float32)
    wp = w
    if NORM:
        w = tl.load(w_ptr + d, mask=d < head_dim, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    return partner, rotated, cos, sin, w, wp


@triton.jit
def norm_rope_loaded(
    x_row, heads, num_heads, eps, head_dim, stride_h, partner, rotated, cos, sin, w, wp,
    NORM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """[BLOCK_H, BLOCK_D] float32: heads of one token, normalised (NORM) then rotated, with
    the operands of `rope_constants`."""
    d = tl.arange(0, BLOCK_D)
    in_d = d < head_dim
    hmask = heads[:, None] < num_heads
    ptr = x_row + heads[:, None] * stride_h
    x = tl.load(ptr + d[None, :], mask=hmask & in_d[None, :], other=0.0)
    xp = tl.load(ptr + partner[None, :], mask=hmask & rotated[None, :], other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    if NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]
        # HF rounds the normalised value to the activation dtype before the weight
        x = (x * inv).to(dtype).to(tl.float32) * w[None, :]
        xp = (xp * inv).to(dtype).to(tl.float32) * wp[None, :]
        x = x.to(dtype).to(tl.float32)
        xp = xp.to(dtype).to(tl.float32)
    return x * cos[None, :] + xp * sin[None, :]


@triton.jit
def norm_rope_heads(
    x_row, heads, num_heads, cs_row, w_ptr, eps, head_dim, rot_dim, stride_h,
    NORM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """[BLOCK_H, BLOCK_D] float32: heads of one token, normalised (NORM) then rotated."""
    partner, rotated, cos, sin, w, wp = rope_constants(cs_row, w_ptr, head_dim, rot_dim, NORM,
                                                       IS_NEOX, BLOCK_D)
    return norm_rope_loaded(x_row, heads, num_heads, eps, head_dim, stride_h, partner, rotated,
                            cos, sin, w, wp, NORM, BLOCK_D)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cs_ptr, token, head0, num_heads, head_dim, rot_dim,
    stride_xt, stride_xh, stride_ot, stride_oh,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    heads = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    out = norm_rope_heads(x_ptr + token * stride_xt, heads, num_heads, cs_ptr, x_ptr, 0.0,
                          head_dim, rot_dim, stride_xh, False, IS_NEOX, BLOCK_D)
    o_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    tl.store(o_row + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(heads[:, None] < num_heads) & (d[None, :] < head_dim))


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cs_ptr,
    num_q_heads, num_k_heads, head_dim, rot_dim,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    cs_row = cs_ptr + tl.load(pos_ptr + token) * stride_cs
    if head0 < num_q_heads:
        _rotate_heads(q_ptr, q_out_ptr, cs_row, token, head0, num_q_heads, head_dim, rot_dim,
                      stride_qt, stride_qh, stride_qot, stride_qoh, IS_NEOX, BLOCK_H, BLOCK_D)
    if head0 < num_k_heads:
        _rotate_heads(k_ptr, k_out_ptr, cs_row, token, head0, num_k_heads, head_dim, rot_dim,
                      stride_kt, stride_kh, stride_kot, stride_koh, IS_NEOX, BLOCK_H, BLOCK_D)


def apply_rotary_triton(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Triton launcher of `apply_rotary`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if num_tokens == 0:
        return q_out, k_out
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(max(num_q_heads, num_k_heads)), max(1, 4096 // block_d))
    grid = (num_tokens, cdiv(max(num_q_heads, num_k_heads), block_h))
    _rotary_kernel[grid](
        q, k, q_out, k_out, positions, cs,
        num_q_heads, num_k_heads, head_dim, rot_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cs.stride(0),
        IS_NEOX=is_neox, BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return q_out, k_out


def _rotate_ref(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    rot_dim = cos.shape[-1] * 2
    h = x.float()
    rot, rest = h[..., :rot_dim], h[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


def apply_rotary_ref(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Torch reference of `apply_rotary`."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, rot_dim // 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate_ref(q, cos, sin, is_neox), _rotate_ref(k, cos, sin, is_neox)


def apply_rotary(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] at int64 `positions` [T]; returns new tensors.

    Only the first rot_dim = cos_sin_cache.shape[-1] dims of each head rotate; the rest pass
    through unchanged. Computed in float32, returned in the inputs' dtypes.
    """
    if use_triton(q):
        return apply_rotary_triton(q, k, positions, cos_sin_cache, is_neox)
    return apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)

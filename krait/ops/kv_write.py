"""Scatter this step's keys and values into the paged KV cache."""

import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import use_triton


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (d[None, :] < head_dim) & (slot >= 0)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_o
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_o
    tl.store(kc + heads[:, None] * stride_kc_h + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + heads[:, None] * stride_vc_h + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Triton launcher of `write_kv`."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_heads, head_dim, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )


def write_kv_ref(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Torch reference of `write_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Writes key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] in place.

    slot_mapping int64 [T]: slot = block * block_size + offset; a slot of -1 skips the token.
    """
    if use_triton(key):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

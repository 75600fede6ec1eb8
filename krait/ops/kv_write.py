"""Scatter this step's keys and values into the paged KV cache (in the model dtype, or fp8)."""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton

# e4m3's largest finite value: fp8 caches saturate there (vLLM's fp8 cache without scales)
FP8_MAX = 448.0


@triton.jit
def _round_to_e4m3(x):
    """x (float32, within +-448) rounded to the nearest e4m3 value, ties to even, still in
    float32: the conversion after it is exact. (The hardware's conversion rounds the same way;
    Triton 3.8's interpreter loses the exponent carry when rounding up, 1.97 -> 1.0.)"""
    bits = x.to(tl.int32, bitcast=True)
    # normal numbers: keep 3 of float32's 23 mantissa bits
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal: multiples of 2^-9 (rounded in magnitude)
    y = tl.abs(x) * 512.0
    fl = tl.floor(y)
    frac = y - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    sub = (fl + up.to(tl.float32)) * (1.0 / 512.0)
    # the sign as a bit, so -tiny rounds to -0.0 like torch (the GPU compiles -sub to 0 - sub)
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def to_cache(x, cache_ptr):
    """x converted to the cache's element type; an fp8 cache saturates at +-FP8_MAX and rounds
    to nearest, ties to even."""
    dt = cache_ptr.dtype.element_ty
    if dt == tl.float8e4nv:
        x = _round_to_e4m3(tl.clamp(x.to(tl.float32), -448.0, 448.0))
    return x.to(dt)


# e4m3 bytes -> bf16, four at a time: each byte to the high byte of a 16-bit lane, the
# exponent and mantissa moved down into bf16's fields, the sign kept, times 2^120 (0x7B80)
_E4M3X4_TO_BF16X4 = tl.constexpr("""{
    .reg .b32 t0, t1, c, z;
    mov.b32 c, 0x7B807B80;
    mov.b32 z, 0x80008000;
    prmt.b32 t0, $2, 0, 0x1404;
    prmt.b32 t1, $2, 0, 0x3424;
    and.b32 $0, t0, 0x80008000;
    and.b32 $1, t1, 0x80008000;
    shr.b32 t0, t0, 4;
    shr.b32 t1, t1, 4;
    and.b32 t0, t0, 0x07F007F0;
    and.b32 t1, t1, 0x07F007F0;
    or.b32 t0, t0, $0;
    or.b32 t1, t1, $1;
    fma.rn.bf16x2 $0, t0, c, z;
    fma.rn.bf16x2 $1, t1, c, z;
}""")
_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def from_cache(x, mask, dt):
    """A tile loaded from the cache (0 outside `mask`) in dtype dt: a no-op for a model-dtype
    cache; an fp8 (e4m3) tile widens exactly (every finite value) by its bits: exponent and
    mantissa moved into bf16's fields, times 2^120. Compiled, the widening is PTX in the
    registers the load filled, then masked: Triton moves a plain `.to` (or any chain of
    elementwise ops on the load alone) behind the tile's move into the dot-operand layout,
    which for a transposed 8-bit operand means byte loads from shared memory (the decode
    attention 1.5x slower at batch 64). The interpreter decodes the fields in float32."""
    if x.dtype == tl.float8e4nv:
        bits = x.to(tl.uint8, bitcast=True)
        if _COMPILED:
            wide = tl.inline_asm_elementwise(_E4M3X4_TO_BF16X4, "=r,=r,r", [bits],
                                             dtype=tl.bfloat16, is_pure=True, pack=4)
            return tl.where(mask, wide, 0.0).to(dt)
        b = bits.to(tl.int32)
        exp, man = (b >> 3) & 15, b & 7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(exp == 0, man.to(tl.float32) * (1.0 / 512.0), normal)
        return tl.where(b >= 128, -mag, mag).to(dt)
    return x.to(dt)


def to_cache_ref(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Torch reference of `to_cache`."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


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
    tl.store(kc + heads[:, None] * stride_kc_h + d[None, :], to_cache(k, k_cache_ptr), mask=mask)
    tl.store(vc + heads[:, None] * stride_vc_h + d[None, :], to_cache(v, v_cache_ptr), mask=mask)


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
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    grid = (num_tokens, cdiv(num_heads, block_h))
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
    k_cache[blocks, offsets] = to_cache_ref(key[keep], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_ref(value[keep], v_cache.dtype)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Writes key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] in place
    (converted to the cache dtype: an fp8 cache saturates at +-448).

    slot_mapping int64 [T]: slot = block * block_size + offset; a slot of -1 skips the token.
    """
    if use_triton(key):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

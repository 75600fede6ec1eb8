"""The fp8 (e4m3) KV cache: writes saturate at +-448 and round to nearest, the attention
kernels widen the cache to q's dtype; each Triton path (interpreted here) against its torch
reference on the same fp8 caches."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from krait.ops.kv_write import FP8_MAX, from_cache, to_cache_ref, write_kv_ref, write_kv_triton
from krait.ops.paged_attention import paged_attention_ref, paged_attention_triton
from krait.ops.rope_kv_write import rope_kv_write_ref, rope_kv_write_triton
from tests.ops.test_kv_write import make_case as kv_case
from tests.ops.test_paged_attention import MIXED
from tests.ops.test_paged_attention import make_case as attn_case
from tests.ops.test_paged_attention_split import _decode_batch
from tests.ops.test_rope_kv_write import _case as rope_case

FP8 = torch.float8_e4m3fn


def test_to_cache_ref_saturates_and_rounds_to_nearest():
    x = torch.tensor([1000.0, -1e6, 448.0, 1.0625, 0.0, -3.3])
    got = to_cache_ref(x, FP8).float()
    assert got[:3].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert got[3:].tolist() == x[3:].to(FP8).float().tolist()
    assert to_cache_ref(x, torch.float32) is not None  # other dtypes: a plain conversion


@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_fp8_triton_matches_reference(block_size):
    key, value, k_cache, v_cache, slots = kv_case(24, 3, 40, block_size, 96 // block_size + 1)
    # saturation, tiny values (-1e-3 rounds to -0.0, as torch does)
    key[0, 0, :5] = torch.tensor([900.0, -900.0, 448.0, 1e-3, -1e-3])
    k_ref, v_ref = k_cache.to(FP8), v_cache.to(FP8)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_tri.view(torch.uint8), v_ref.view(torch.uint8))
    keep = slots >= 0
    blocks, offs = slots[keep] // block_size, slots[keep] % block_size
    assert torch.equal(k_ref[blocks, offs].float(), key[keep].to(FP8).float())  # round to nearest


@pytest.mark.parametrize("norm", [False, True])
def test_rope_kv_write_fp8_matches_reference(norm):
    args, caches, slots = rope_case(norm, True, 32, seed=5 + norm)
    c_ref, c_tri = caches.to(FP8), caches.to(FP8)
    q_ref = rope_kv_write_ref(*args, c_ref[0], c_ref[1], slots)
    q_tri = rope_kv_write_triton(*args, c_tri[0], c_tri[1], slots)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    # the fp32 rotary math of the two paths may differ in the last bit, which can move a value
    # that sits at an fp8 rounding midpoint by one fp8 step, never more
    diff = (c_tri.float() - c_ref.float()).abs()
    step = c_ref.float().abs().clamp_min(2**-6) * 2**-3
    assert (diff <= step).all()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_attention_on_fp8_caches(block_size):
    # q in float32: Triton 3.8's interpreter gets bf16 dots wrong (the GPU test below: bf16)
    *args, max_q, max_s = attn_case(MIXED, 8, 2, 32, block_size, seed=3)
    args[1], args[2] = args[1].to(FP8), args[2].to(FP8)
    scale = 32**-0.5
    want = paged_attention_ref(*args, max_q, max_s, scale, None)
    got = paged_attention_triton(*args, max_q, max_s, scale, None)
    n = int(args[3][-1])
    torch.testing.assert_close(got[:n], want[:n], atol=1e-4, rtol=1e-4)
    # the reference reads the fp8 cache as the same values widened: its output equals the
    # reference on a float32 copy of the fp8 cache
    wide = paged_attention_ref(args[0], args[1].float(), args[2].float(), *args[3:], max_q,
                               max_s, scale, None)
    assert torch.equal(want, wide)


def test_split_decode_on_fp8_caches():
    seq_lens = [1, 130, 0, 517]
    q, kc, vc, qsl, sl, bt = _decode_batch(seq_lens, 8, 2, seed=4)
    kc, vc = kc.to(FP8), vc.to(FP8)
    args = (q, kc, vc, qsl, sl, bt, 1, max(seq_lens), 0.2, None)
    want = paged_attention_ref(*args)
    got = paged_attention_triton(*args, num_splits=4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,ctx", [(1, 4096), (64, 1024)])
def test_fp8_cache_real_size_gpu(rows, ctx):
    """bf16 q on fp8 caches at real sizes (split decode at one row, one program per row at 64),
    and the KV write's conversion bit-equal to torch's (round to nearest even, saturating)."""
    q, kc, vc, qsl, sl, bt = _decode_batch([ctx] * rows, 16, 8, d=128, bs=16, seed=rows)
    q, kc, vc = q.cuda().bfloat16(), kc.cuda().to(FP8), vc.cuda().to(FP8)
    args = (q, kc, vc, qsl.cuda(), sl.cuda(), bt.cuda(), 1, ctx, 128**-0.5, None)
    want = paged_attention_ref(*args)
    got = paged_attention_triton(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    key, value, k_cache, v_cache, slots = kv_case(4096, 8, 128, 16, 1024)
    key = key * 100  # past 448 too
    key, value, slots = key.cuda(), value.cuda(), slots.cuda()
    k8, v8 = k_cache.cuda().to(FP8), v_cache.cuda().to(FP8)
    k_ref, v_ref = k8.clone(), v8.clone()
    write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k8, v8, slots)
    assert torch.equal(k8.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v_ref.view(torch.uint8))


@triton.jit
def _from_cache_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, from_cache(x, mask, out_ptr.dtype.element_ty), mask=mask)


def _check_from_cache(device: str) -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    fp8 = codes.to(device).view(FP8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.empty(fp8.numel(), dtype=dtype, device=device)
        _from_cache_kernel[(1,)](fp8, out, fp8.numel(), BLOCK=256)
        want = fp8.to(dtype)
        assert torch.equal(out.float(), want.float()), dtype
        assert torch.equal(out.float().signbit(), want.float().signbit()), dtype  # -0.0 kept


def test_from_cache_widens_every_e4m3_value_exactly():
    """The interpreter's arithmetic widening (the compiled one is PTX: the GPU test below)."""
    _check_from_cache("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_cache_widens_every_e4m3_value_exactly_gpu():
    _check_from_cache("cuda")

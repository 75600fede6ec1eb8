"""The TMA-streamed one-row GEMV (krait/ops/gemv_tma.py) against F.linear in the
interpreter (tensor descriptors, `tl.range(num_stages=...)`, split K, the silu-and-mul and conv
epilogues),
and its sm_90 compile: TMA bulk copies in the PTX, nothing spilled."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from krait.ops.gemv_tma import _COUNTERS, _descriptor, gemv_tma, tma_config
from tests.ops.conv_cases import mamba2_conv_case, small_conv_case
from tests.ops.sm90 import compile_sm90, sm90_available


def _inputs(n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype)  # [1, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    return x, w


VARIANTS = {
    "plain": dict(BLOCK_N=8, BLOCK_K=64, STAGES=3),
    "split": dict(BLOCK_N=16, BLOCK_K=32, STAGES=2, SPLIT_K=3),
    "split2": dict(BLOCK_N=8, BLOCK_K=32, STAGES=3, SPLIT_K=2),
    "early": dict(BLOCK_N=8, BLOCK_K=64, STAGES=3, EARLY_BOX=True),
    "early_split": dict(BLOCK_N=16, BLOCK_K=32, STAGES=2, SPLIT_K=3, EARLY_BOX=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n,k", [(40, 96), (17, 200), (64, 64), (9, 1000), (33, 8)])
def test_gemv_tma_matches_linear(variant, n, k):
    # K past the last whole tile (200, 1000, 8) reads zeros from the descriptor; N past the last
    # column tile too
    x, w = _inputs(n, k, seed=n + k)
    for _ in range(2):  # split K: the second launch finds the counters back at zero
        torch.testing.assert_close(gemv_tma(x, w, config=VARIANTS[variant]), F.linear(x, w),
                                   atol=1e-4, rtol=1e-4)
    assert int(_COUNTERS.get(x.device, torch.zeros(1)).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_tma_half_inputs_accumulate_in_float32(dtype):
    x, w = _inputs(24, 520, dtype=dtype, seed=3)
    y = gemv_tma(x, w, config=dict(BLOCK_N=8, BLOCK_K=128, STAGES=2, SPLIT_K=2))
    assert y.dtype == dtype and y.shape == (1, 24)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


def test_tma_descriptors_go_with_their_weight():
    """A weight's TMA descriptor is built once per box and freed with the weight: no cache
    outside the model keeps a deleted engine's weights alive (6 GiB of them once made the HF
    baseline of `krait bench throughput` run out of memory)."""
    w = torch.randn(64, 256)
    desc = _descriptor(w, 16, 128)
    assert _descriptor(w, 16, 128) is desc and _descriptor(w, 32, 128) is not desc
    dead = weakref.ref(w)
    del w, desc
    gc.collect()
    assert dead() is None


def test_gemv_tma_default_config():
    x, w = _inputs(48, 512, seed=5)
    torch.testing.assert_close(gemv_tma(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k", [(24, 64), (20, 200)])
def test_gemv_tma_silu_mul_epilogue_matches_gate_up_then_silu_and_mul(n, k):
    # W = [gate; up] ([2N, K]); N = 20 leaves a partial column tile whose gate box reads up
    # rows (masked at the store) and whose up box reads zeros past 2N
    x, w = _inputs(2 * n, k, seed=n)
    proj = F.linear(x, w)
    want = F.silu(proj[:, :n]) * proj[:, n:]
    got = gemv_tma(x, w, config=dict(BLOCK_N=8, BLOCK_K=64, STAGES=2), silu_mul_out=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="silu_mul_out"):
        gemv_tma(x, w, config=dict(SPLIT_K=2), silu_mul_out=True)


@pytest.mark.parametrize("slot", [2, -1])
def test_gemv_tma_conv_epilogue_matches_projection_then_conv_update(slot):
    """A Mamba in_proj's xBC columns through the causal conv's decode step in the epilogue (its
    operands loaded before the PDL wait): equal to F.linear then causal_conv1d_update, the
    slot's state shifted the same way, the other slots (every slot for a padding row, slot -1)
    untouched."""
    x, w, conv, want, want_states = small_conv_case(52, slot)
    states = conv[3]
    got = gemv_tma(x, w, config=dict(BLOCK_N=8, BLOCK_K=32, STAGES=2), conv=conv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)
    others = [i for i in range(3) if i != slot]
    assert torch.equal(states[others], want_states[others])
    with pytest.raises(ValueError, match="conv epilogue"):
        gemv_tma(x, w, config=dict(SPLIT_K=2), conv=conv)


def test_tma_config_takes_only_the_shapes_it_won():
    assert tma_config(2048, 8192)["SPLIT_K"] == 4  # granite down
    assert tma_config(16384, 2048, silu_mul_out=True)["BLOCK_N"] == 16  # granite gate_up
    assert tma_config(6144, 1024, silu_mul_out=True) is not None  # qwen3 gate_up
    assert tma_config(8512, 2048) == dict(BLOCK_N=16, BLOCK_K=256, STAGES=3, SPLIT_K=1,
                                          num_warps=4)  # mamba2 in_proj
    for n, k in [(4096, 1024), (1024, 2048), (1024, 3072), (2048, 4096)]:  # lost or even
        assert tma_config(n, k) is None


@pytest.mark.gpu
def test_gemv_tma_conv_epilogue_real_sizes_gpu():
    """mamba2-1.3b's in_proj in bf16 through TMA with its xBC through the conv in the
    epilogue, against gemv.py's conv epilogue (outputs and the conv state)."""
    from krait.ops.gemv import gemv_triton

    x, w, conv = mamba2_conv_case(9)
    inter, cw, cb, states, slots, _ = conv
    n, hidden = w.shape
    want_states = states.clone()
    want = gemv_triton(x, w, conv=(inter, cw, cb, want_states, slots, True)).float()
    got = gemv_tma(x, w, tma_config(n, hidden), conv=conv)
    assert ((got.float() - want).norm() / want.norm()) < 1e-2
    assert ((states.float() - want_states.float()).norm() / want_states.float().norm()) < 1e-2
    assert torch.equal(states[[0, 1, 3]], want_states[[0, 1, 3]])


@pytest.mark.gpu
@pytest.mark.parametrize("early_box", [False, True])
@pytest.mark.parametrize("n,k,silu", [(2048, 8192, False), (16384, 2048, True),
                                      (6144, 1024, True)])
def test_gemv_tma_real_sizes_gpu(n, k, silu, early_box):
    """granite-micro's down (K split in 4) and gate_up, qwen3's gate_up, in bf16 with their
    dispatch configs, with and without the first box before the PDL wait, against F.linear
    (then silu_and_mul)."""
    x, w = _inputs(n, k, dtype=torch.bfloat16, seed=7)
    x, w = x.cuda(), w.cuda()
    for _ in range(2):
        got = gemv_tma(x, w, dict(tma_config(n, k, silu), EARLY_BOX=early_box),
                       silu_mul_out=silu)
        proj = F.linear(x.float(), w.float())
        want = F.silu(proj[:, :n // 2]) * proj[:, n // 2:] if silu else proj
        assert ((got.float() - want).norm() / want.norm()) < 1e-2


def test_gemv_tma_rejects_what_tma_cannot_read():
    x, w = _inputs(8, 100, dtype=torch.bfloat16)  # 200-byte rows: not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte"):
        gemv_tma(x, w)
    x, w = _inputs(8, 128)
    with pytest.raises(ValueError, match="16-byte"):
        gemv_tma(x, w.t().contiguous().t())  # not contiguous
    with pytest.raises(ValueError, match="256"):
        gemv_tma(x, w, config=dict(BLOCK_K=512))
    with pytest.raises(ValueError, match=r"\[1, K\]"):
        gemv_tma(torch.randn(2, 128), w)


def _compile(block_n: int, block_k: int, stages: int, num_warps: int,
             split: int = 1, pdl: bool = True, silu: bool = False, conv: bool = False,
             early_box: bool = False) -> dict:
    types = dict(x_ptr="*bf16", w_desc=f"tensordesc<bf16[{block_n}, {block_k}]>", w_ptr="*bf16",
                 y_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", slots_ptr="*i32",
                 cw_ptr="*bf16", cb_ptr="*bf16", cs_ptr="*bf16")
    return compile_sm90("krait.ops.gemv_tma", "_gemv_tma_kernel", types, dict(
        SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl,
        SILU_MUL=silu, CONV=conv, CONV_WIDTH=4, CONV_BIAS=conv, CONV_SILU=conv,
        EARLY_BOX=early_box), num_warps=num_warps)


@pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
@pytest.mark.parametrize("block_n,block_k,stages,num_warps,split", [
    (8, 256, 4, 4, 1), (16, 256, 4, 4, 2), (32, 128, 6, 8, 1), (32, 256, 3, 8, 1),
    (16, 256, 3, 4, 1), (32, 128, 4, 8, 4)])
def test_gemv_tma_compiles_to_bulk_copies_without_spills(block_n, block_k, stages, num_warps,
                                                         split):
    r = _compile(block_n, block_k, stages, num_warps, split)
    print(f"\ngemv_tma sm_90 N{block_n} K{block_k} S{stages} w{num_warps} split={split}: {r}")
    assert r["local"] == 0 and r["pdl"], r
    assert r["bulk_tensor_copies"] > 0 and r["mbarrier_waits"] > 0, r
    # the ring: STAGES - 1 weight boxes in flight while one is read (plus x's small copies)
    assert r["dynamic_shared"] >= (stages - 1) * block_n * block_k * 2, r


@pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
@pytest.mark.parametrize("block_n,block_k,num_warps", [(16, 128, 8), (8, 256, 4)])
def test_gemv_tma_silu_mul_compiles_without_spills(block_n, block_k, num_warps):
    # the gate_up configs `tma_config` picks: gate and up boxes side by side in the ring
    r = _compile(block_n, block_k, 3, num_warps, silu=True)
    print(f"\ngemv_tma silu sm_90 N{block_n} K{block_k} w{num_warps}: {r}")
    assert r["local"] == 0 and r["pdl"] and r["bulk_tensor_copies"] > 0, r


@pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
@pytest.mark.parametrize("early_box", [False, True])
def test_gemv_tma_conv_epilogue_compiles_without_spills(early_box):
    # mamba2's in_proj config with the conv in the epilogue (its operands before the wait)
    r = _compile(16, 256, 3, 4, conv=True, early_box=early_box)
    print(f"\ngemv_tma conv early_box={early_box} sm_90: {r}")
    assert r["local"] == 0 and r["pdl"] and r["bulk_tensor_copies"] > 0, r


@pytest.mark.gpu
def test_gemv_tma_conv_epilogue_gdn_in_proj_gpu():
    """Qwen3-Next-80B's GDN in_proj [12352, 2048] (q, k, v: its first 8192 outputs, the conv's
    channels; no conv bias) with the conv in the epilogue, as the plan runs it, against
    F.linear then the conv update's torch reference."""
    from krait.ops import linear as plan
    from krait.ops.causal_conv1d import causal_conv1d_update_ref

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 2048, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(12352, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    cw = (torch.randn(8192, 4, device="cuda", generator=gen) * 0.3).bfloat16()
    states = torch.randn(4, 8192, 3, device="cuda", generator=gen).bfloat16()
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")
    want_states = states.clone()
    proj = F.linear(x, w)
    want = proj.clone()
    want[:, :8192] = causal_conv1d_update_ref(proj[:, :8192], want_states, cw, None, slots,
                                              "silu")
    got = gemv_tma(x, w, plan.one_slice_tma_plan(12352, 2048),
                   conv=(0, cw, None, states, slots, True))
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert ((states.float() - want_states.float()).norm() / want_states.float().norm()) < 1e-2
    assert torch.equal(states[[0, 1, 3]], want_states[[0, 1, 3]])

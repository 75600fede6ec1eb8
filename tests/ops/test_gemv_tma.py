"""The TMA-streamed one-row GEMV prototype (krait/ops/gemv_tma.py) against F.linear in the
interpreter (tensor descriptors, `tl.range(num_stages=...)`, split K, the silu-and-mul and conv
epilogues),
and its sm_90 compile: TMA bulk copies in the PTX, nothing spilled."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from krait.ops.causal_conv1d import causal_conv1d_update_ref
from krait.ops.gemv_tma import (
    _COUNTERS,
    _descriptor,
    config_from_text,
    gemv_tma,
    prefetch_lines,
    tma_config,
)
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
    outside the model keeps a deleted engine's weights alive (session 18: 6 GiB of them made
    the HF baseline of `krait bench throughput` run out of memory)."""
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


@pytest.mark.parametrize("early", ["0", "1"])
@pytest.mark.parametrize("slot", [2, -1])
def test_gemv_tma_conv_epilogue_matches_projection_then_conv_update(slot, early, monkeypatch):
    """A Mamba in_proj's xBC columns through the causal conv's decode step in the epilogue:
    equal to F.linear then causal_conv1d_update, the slot's state shifted the same way, the
    other slots (every slot for a padding row, slot -1) untouched; the same with the conv's
    operands loaded before the PDL wait (KRAIT_CONV_EARLY=1)."""
    monkeypatch.setenv("KRAIT_CONV_EARLY", early)
    x, w, conv, want, want_states = small_conv_case(52, slot)
    states = conv[3]
    got = gemv_tma(x, w, config=dict(BLOCK_N=8, BLOCK_K=32, STAGES=2), conv=conv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)
    others = [i for i in range(3) if i != slot]
    assert torch.equal(states[others], want_states[others])
    with pytest.raises(ValueError, match="conv epilogue"):
        gemv_tma(x, w, config=dict(SPLIT_K=2), conv=conv)


def _rms_normed(h: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("form", ["plain", "silu_mul", "conv"])
def test_gemv_tma_norm_prologue_matches_rms_norm_then_projection(form, early):
    """norm=(weight, eps): the GEMV's input is rms_norm(h), the squares summed as the row
    streams: equal to a separate RMSNorm then F.linear (then silu_and_mul, or the conv's decode
    step on the xBC columns); with the first box loaded before the PDL wait too (EARLY_BOX)."""
    n, k, eps = 38, 200, 1e-5
    g_ = torch.Generator().manual_seed(11)
    h = torch.randn(1, k, generator=g_) * 3.0  # [1, K]: far from unit rms
    nw = torch.randn(k, generator=g_)
    w = torch.randn(2 * n if form == "silu_mul" else n, k, generator=g_) / k**0.5
    cfg = dict(BLOCK_N=8, BLOCK_K=64, STAGES=2, EARLY_BOX=early)
    proj = F.linear(_rms_normed(h, nw, eps), w)
    if form == "plain":
        got, want = gemv_tma(h, w, cfg, norm=(nw, eps)), proj
    elif form == "silu_mul":
        got = gemv_tma(h, w, cfg, silu_mul_out=True, norm=(nw, eps))
        want = F.silu(proj[:, :n]) * proj[:, n:]
    else:
        lo, dim, width = 12, 20, 4
        cw, cb = torch.randn(dim, width, generator=g_), torch.randn(dim, generator=g_)
        states = torch.randn(3, dim, width - 1, generator=g_)
        slots = torch.tensor([1], dtype=torch.int32)
        want_states = states.clone()
        want = proj.clone()
        want[:, lo:lo + dim] = causal_conv1d_update_ref(proj[:, lo:lo + dim], want_states, cw,
                                                        cb, slots, "silu")
        got = gemv_tma(h, w, cfg, conv=(lo, cw, cb, states, slots, True), norm=(nw, eps))
        torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gemv_tma_norm_prologue_rejects_split_k_and_a_wrong_weight():
    x, w = _inputs(16, 64)
    with pytest.raises(ValueError, match="SPLIT_K 1"):
        gemv_tma(x, w, dict(SPLIT_K=2), norm=(torch.ones(64), 1e-5))
    with pytest.raises(ValueError, match="norm weight"):
        gemv_tma(x, w, norm=(torch.ones(32), 1e-5))


def test_norm_linear_takes_the_tma_gemv_where_it_streams_faster(monkeypatch):
    """The residual fold's normed projections (norm_linear, norm_silu_mlp's gate_up) go to the
    TMA GEMV with its norm prologue wherever `_tma` picks it for the plain projection."""
    import krait.ops.linear as linear_mod

    seen = []
    monkeypatch.setattr(linear_mod, "_tma", lambda *a, **kw: dict(
        BLOCK_N=16, BLOCK_K=256, STAGES=3, SPLIT_K=1, num_warps=4))
    monkeypatch.setattr(linear_mod, "gemv_tma", lambda x, w, cfg, **kw: seen.append(
        (kw.get("silu_mul_out", False), kw["norm"][1])) or torch.zeros(1, w.shape[0] // 2))
    monkeypatch.setattr(linear_mod, "gemv_triton", lambda *a, **kw: torch.zeros(1, 8))
    h, nw, parts = torch.zeros(1, 8), torch.ones(8), torch.zeros(1, 1)
    linear_mod.norm_linear(h, parts, nw, 1e-6, torch.zeros(8, 8), None)
    linear_mod.norm_silu_mlp(h, parts, nw, 1e-6, torch.zeros(16, 8), torch.zeros(8, 8), None,
                             None, torch.zeros(1, 8))
    assert seen == [(False, 1e-6), (True, 1e-6)]


def test_tma_config_takes_only_the_shapes_it_won():
    assert tma_config(2048, 8192)["SPLIT_K"] == 4  # granite down
    assert tma_config(16384, 2048, silu_mul_out=True)["BLOCK_N"] == 16  # granite gate_up
    assert tma_config(6144, 1024, silu_mul_out=True) is not None  # qwen3 gate_up
    assert tma_config(8512, 2048) == dict(BLOCK_N=16, BLOCK_K=256, STAGES=3, SPLIT_K=1,
                                          num_warps=4)  # mamba2 in_proj
    for n, k in [(4096, 1024), (1024, 2048), (1024, 3072), (2048, 4096)]:  # lost or even
        assert tma_config(n, k) is None


def test_inproj_config_knob(monkeypatch):
    """KRAIT_INPROJ_TMA replaces the in_proj's TMA config (conv_linear), parsed strictly."""
    import krait.ops.linear as linear_mod

    assert config_from_text("32,128,4,8") == dict(BLOCK_N=32, BLOCK_K=128, STAGES=4, SPLIT_K=1,
                                                  num_warps=8)
    for bad in ["32,128,4", "32,128,4,4,1", "32,128,4,x", "24,128,4,4", "512,128,4,4", "32,128,0,4"]:
        with pytest.raises(ValueError):
            config_from_text(bad)
    seen = []
    monkeypatch.setattr(linear_mod, "_tma", lambda *a, **kw: dict(
        BLOCK_N=16, BLOCK_K=256, STAGES=3, SPLIT_K=1, num_warps=4))
    monkeypatch.setattr(linear_mod, "gemv_tma", lambda x, w, cfg, conv: seen.append(cfg))
    monkeypatch.setenv("KRAIT_INPROJ_TMA", "8,64,5,4")
    linear_mod.conv_linear(torch.zeros(1, 8), torch.zeros(8, 8), None, ())
    assert seen == [dict(BLOCK_N=8, BLOCK_K=64, STAGES=5, SPLIT_K=1, num_warps=4)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["", "32,128,4,4"])
def test_gemv_tma_conv_epilogue_real_sizes_gpu(config):
    """mamba2-1.3b's in_proj in bf16 through TMA with its xBC through the conv in the
    epilogue, against gemv.py's conv epilogue (outputs and the conv state); also with a
    KRAIT_INPROJ_TMA config."""
    from krait.ops.gemv import gemv_triton

    x, w, conv = mamba2_conv_case(9)
    inter, cw, cb, states, slots, _ = conv
    n, hidden = w.shape
    want_states = states.clone()
    want = gemv_triton(x, w, conv=(inter, cw, cb, want_states, slots, True)).float()
    cfg = config_from_text(config) if config else tma_config(n, hidden)
    got = gemv_tma(x, w, cfg, conv=conv)
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


def test_prefetch_lines_cover_the_first_boxes():
    assert prefetch_lines(4, 256, 2) == 16  # 4 boxes of 512-byte rows: 16 lines
    assert prefetch_lines(3, 256, 2) == 8  # 12 lines, down to a power of two
    assert prefetch_lines(2, 32, 2) == 1


def _compile(block_n: int, block_k: int, stages: int, num_warps: int,
             split: int = 1, pdl: bool = True, silu: bool = False, conv: bool = False,
             conv_early: bool = False, norm: bool = False, early_box: bool = False) -> dict:
    types = dict(x_ptr="*bf16", w_desc=f"tensordesc<bf16[{block_n}, {block_k}]>", w_ptr="*bf16",
                 y_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", slots_ptr="*i32",
                 cw_ptr="*bf16", cb_ptr="*bf16", cs_ptr="*bf16", norm_ptr="*bf16", eps="fp32")
    return compile_sm90("krait.ops.gemv_tma", "_gemv_tma_kernel", types, dict(
        SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        PDL=pdl, PREFETCH_LINES=prefetch_lines(stages, block_k, 2) if pdl else 0,
        SILU_MUL=silu, CONV=conv, CONV_WIDTH=4, CONV_BIAS=conv, CONV_SILU=conv,
        CONV_EARLY=conv_early, NORM=norm, EARLY_BOX=early_box),
        num_warps=num_warps)


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
@pytest.mark.parametrize("early", [False, True])
def test_gemv_tma_conv_epilogue_compiles_without_spills(early):
    # mamba2's in_proj config with the conv in the epilogue (its operands before the wait)
    r = _compile(16, 256, 3, 4, conv=True, conv_early=early)
    print(f"\ngemv_tma conv early={early} sm_90: {r}")
    assert r["local"] == 0 and r["pdl"] and r["bulk_tensor_copies"] > 0, r


@pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
@pytest.mark.parametrize("silu,early_box", [(False, False), (False, True), (True, True)])
def test_gemv_tma_norm_prologue_compiles_without_spills(silu, early_box):
    # mamba2's in_proj with the norm and the conv; granite's gate_up with the norm
    r = (_compile(16, 128, 3, 8, silu=True, norm=True, early_box=early_box) if silu else
         _compile(16, 256, 3, 4, conv=True, conv_early=True, norm=True, early_box=early_box))
    print(f"\ngemv_tma norm silu={silu} early_box={early_box} sm_90: {r}")
    assert r["local"] == 0 and r["pdl"] and r["bulk_tensor_copies"] > 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("early_box", [False, True])
def test_gemv_tma_norm_prologue_real_sizes_gpu(early_box):
    """mamba2-1.3b's in_proj with the block's RMSNorm in its prologue and the conv in its
    epilogue, and granite-micro's gate_up with the norm, in bf16 against a separate RMSNorm
    then the GEMV (relative error within bf16 rounding)."""
    from krait.ops.gemv import gemv_triton

    x, w, conv = mamba2_conv_case(13)
    inter, cw, cb, states, slots, _ = conv
    nw = (1.0 + 0.1 * torch.randn(x.shape[1], device="cuda")).bfloat16()
    normed = _rms_normed(x, nw, 1e-5).bfloat16()
    want_states = states.clone()
    want = gemv_triton(normed, w, conv=(inter, cw, cb, want_states, slots, True)).float()
    cfg = dict(tma_config(*w.shape), EARLY_BOX=early_box)
    got = gemv_tma(x, w, cfg, conv=conv, norm=(nw, 1e-5))
    assert ((got.float() - want).norm() / want.norm()) < 1e-2
    assert ((states.float() - want_states.float()).norm() / want_states.float().norm()) < 1e-2
    x, w = _inputs(16384, 2048, dtype=torch.bfloat16, seed=7)
    x, w, nw = x.cuda() * 4, w.cuda(), nw[:2048]
    proj = F.linear(_rms_normed(x, nw, 1e-5), w.float())
    want = F.silu(proj[:, :8192]) * proj[:, 8192:]
    cfg = dict(tma_config(16384, 2048, True), EARLY_BOX=early_box)
    got = gemv_tma(x, w, cfg, silu_mul_out=True, norm=(nw, 1e-5))
    assert ((got.float() - want).norm() / want.norm()) < 1e-2


def test_early_box_rule_takes_the_big_weights(monkeypatch):
    """`_tma` loads the first box before the PDL wait for TMA weights of at least
    TMA_EARLY_BOX_MIN_ELEMENTS (measured wins: granite-micro, llama; qwen3's 6.3M gate_up
    lost); KRAIT_TMA_EARLY_BOX=0/1 forces it for every TMA weight."""
    from krait.ops.linear import _tma

    x = torch.zeros(1, 2048, dtype=torch.bfloat16)
    in_proj = torch.zeros(8512, 2048, dtype=torch.bfloat16)  # mamba2's, 17.4M
    gate_up = torch.zeros(6144, 1024, dtype=torch.bfloat16)  # qwen3's, 6.3M
    monkeypatch.delenv("KRAIT_TMA_EARLY_BOX", raising=False)
    assert _tma(x, in_proj, None)["EARLY_BOX"] is True
    assert "EARLY_BOX" not in _tma(x[:, :1024], gate_up, None, silu_mul_out=True)
    monkeypatch.setenv("KRAIT_TMA_EARLY_BOX", "1")
    assert _tma(x[:, :1024], gate_up, None, silu_mul_out=True)["EARLY_BOX"] is True
    monkeypatch.setenv("KRAIT_TMA_EARLY_BOX", "0")
    assert "EARLY_BOX" not in _tma(x, in_proj, None)

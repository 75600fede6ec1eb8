"""Skinny decode GEMV (krait/ops/gemv.py) against F.linear: shapes, bias, strides, the norm
prologues and epilogue; the dispatch of krait/ops/linear.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from krait.ops.activation import silu_and_mul_ref
from krait.ops.gated_rms_norm import gated_rms_norm_ref
from krait.ops.gemv import (
    MAX_M,
    GatedStats,
    default_config,
    gemv_add_norm_triton,
    gemv_add_stats_triton,
    gemv_gated_norm_triton,
    gemv_gated_stats_norm_triton,
    gemv_rms_norm_triton,
    gemv_stats_norm_triton,
    gemv_triton,
)
from krait.ops.linear import (
    gated_norm_linear,
    linear,
    linear_add_norm,
    rms_norm_linear,
    silu_mul_linear,
)
from krait.ops.rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref


def _inputs(m, n, k, dtype=torch.float32, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 17, 200), (8, 64, 64), (5, 9, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(m, n, k, bias):
    x, w, b = _inputs(m, n, k, seed=m + n, bias=bias)
    y = gemv_triton(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_split_k_sums_every_slice_and_resets_its_counters(split, bias):
    x, w, b = _inputs(3, 40, 700, seed=split, bias=bias)
    cfg = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    for _ in range(2):  # the second launch finds the counters back at zero
        torch.testing.assert_close(gemv_triton(x, w, b, config=cfg), F.linear(x, w, b),
                                   atol=1e-4, rtol=1e-4)
    from krait.ops.gemv import _COUNTERS

    assert int(_COUNTERS[x.device].abs().sum()) == 0


def test_default_config_splits_narrow_outputs_only():
    narrow = default_config(1, 1024, 3072, num_sms=132)
    wide = default_config(1, 16384, 2048, num_sms=132)
    assert narrow["SPLIT_K"] > 1 and wide["SPLIT_K"] == 1
    assert default_config(1, 64, 64, num_sms=132)["SPLIT_K"] == 1  # too short to split


@pytest.mark.parametrize("split", [1, 4])
def test_gemv_fused_silu_mul(split):
    x2, _, _ = _inputs(3, 8, 2 * 300, seed=11)  # [M, 2I]
    _, w, b = _inputs(3, 24, 300, seed=12, bias=True)
    want = F.linear(silu_and_mul_ref(x2), w, b)
    cfg = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    got = gemv_triton(x2, w, b, config=cfg, silu_mul=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="weight is"):
        gemv_triton(x2[:, :500], w, silu_mul=True)


def test_silu_mul_linear_matches_unfused_everywhere(monkeypatch):
    x2, _, _ = _inputs(2, 8, 2 * 40, seed=13)
    _, w, _ = _inputs(2, 16, 40, seed=14)
    want = F.linear(silu_and_mul_ref(x2), w)
    torch.testing.assert_close(silu_mul_linear(x2, w), want)  # reference path
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_GEMV", "1")
    torch.testing.assert_close(silu_mul_linear(x2, w), want, atol=1e-4, rtol=1e-4)


def test_gemv_bf16_and_strided_input():
    x, w, _ = _inputs(4, 48, 160, torch.bfloat16, seed=3)
    wide = torch.zeros(4, 320, dtype=torch.bfloat16)
    wide[:, ::2] = x  # a non-contiguous view
    view = wide[:, ::2]
    ref = F.linear(x.float(), w.float())
    err = (gemv_triton(view, w).float() - ref).norm() / ref.norm()
    assert err < 1e-2


def test_gemv_refuses_wide_batches_and_configs_follow_shape_only():
    x, w, _ = _inputs(MAX_M + 1, 8, 32)
    with pytest.raises(ValueError, match="at most"):
        gemv_triton(x, w)
    assert default_config(1, 4096, 1024) == default_config(1, 4096, 1024)
    assert default_config(8, 64, 64)["BLOCK_M"] == 8


def test_linear_dispatch(monkeypatch):
    x, w, b = _inputs(2, 24, 48, bias=True)
    calls = []
    monkeypatch.setattr("krait.ops.linear.gemv_triton", lambda *a: calls.append(a) or F.linear(*a))
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_GEMV", "1")
    linear(x, w, b)
    assert len(calls) == 1
    big, _, _ = _inputs(MAX_M + 3, 24, 48)
    linear(big, w, b)  # prefill-sized: F.linear
    monkeypatch.setenv("KRAIT_GEMV", "0")
    linear(x, w, b)
    assert len(calls) == 1


def test_default_dispatch_takes_one_row_against_a_small_weight(monkeypatch):
    from krait.ops.linear import ROW_GEMV_MAX_ELEMENTS

    calls = []
    monkeypatch.setattr("krait.ops.linear.gemv_triton", lambda *a: calls.append(a) or F.linear(*a))
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.delenv("KRAIT_GEMV", raising=False)
    narrow, wide = torch.zeros(24, 64), torch.zeros(64, 24)
    linear(torch.ones(1, 64), narrow)
    linear(torch.ones(1, 24), wide)  # N > K/2 too, by default
    assert len(calls) == 2
    linear(torch.ones(2, 64), narrow)  # two rows: cuBLAS
    assert len(calls) == 2
    # over 8M elements (qwen3's lm_head, mamba2's in_proj): cuBLAS (views: no memory behind)
    big = torch.zeros(1, 64).expand((8 << 20) // 64 + 1, 64)
    linear(torch.ones(1, 64), big)
    assert len(calls) == 2
    monkeypatch.setenv("KRAIT_GEMV", "narrow")  # session 5's rule: N <= K/2 only
    linear(torch.ones(1, 64), narrow)
    linear(torch.ones(1, 24), wide)
    assert len(calls) == 3
    monkeypatch.setenv("KRAIT_GEMV", "wide")  # up to 20M elements
    linear(torch.ones(1, 64), big)
    assert len(calls) == 4
    head = torch.zeros(1, 64).expand(ROW_GEMV_MAX_ELEMENTS // 64 + 1, 64)
    linear(torch.ones(1, 64), head)
    assert len(calls) == 4


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("x_scale", [1.0, 0.5])
def test_gemv_rms_norm_prologue_matches_norm_then_linear(split, x_scale):
    x, w, b = _inputs(3, 24, 300, seed=21, bias=True)
    r, _, _ = _inputs(3, 1, 300, seed=22)
    nw = 1 + 0.1 * _inputs(1, 1, 300, seed=23)[0][0]  # [K]
    cfg = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    for _ in range(2):  # split K: the counters are back at zero for the second launch
        y, summed = gemv_rms_norm_triton(x, r, nw, 1e-6, w, b, x_scale, config=cfg)
        h, want_sum = fused_add_rms_norm_ref(x, r, nw, 1e-6, x_scale)
        torch.testing.assert_close(summed, want_sum)
        torch.testing.assert_close(y, F.linear(h, w, b), atol=1e-4, rtol=1e-4)
    assert summed.data_ptr() not in (x.data_ptr(), r.data_ptr())  # out of place
    y, same = gemv_rms_norm_triton(x, None, nw, 1e-6, w, config=cfg)  # the first layer
    assert same is x
    torch.testing.assert_close(y, F.linear(rms_norm_ref(x, nw, 1e-6), w), atol=1e-4, rtol=1e-4)


def test_gemv_rms_norm_prologue_rounds_as_the_norm_kernel_bf16():
    x, w, _ = _inputs(1, 16, 256, torch.bfloat16, seed=24)
    r, _, _ = _inputs(1, 1, 256, torch.bfloat16, seed=25)
    nw = torch.ones(256, dtype=torch.bfloat16)
    y, summed = gemv_rms_norm_triton(x, r, nw, 1e-6, w, x_scale=0.25)
    h, want_sum = fused_add_rms_norm_triton(x, r, nw, 1e-6, 0.25)
    assert torch.equal(summed, want_sum)  # the residual stream is bit-identical
    ref = F.linear(h.float(), w.float())
    assert ((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("split", [1, 2])
def test_gemv_gated_norm_prologue(split):
    x, w, _ = _inputs(2, 16, 320, seed=26)
    z = _inputs(2, 1, 400, seed=27)[0][:, 40:360]  # a column slice of in_proj's output, as in Mamba2
    nw = 1 + 0.1 * _inputs(1, 1, 320, seed=28)[0][0]
    cfg = dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    got = gemv_gated_norm_triton(x, z, nw, 1e-5, w, config=cfg)
    want = F.linear(gated_rms_norm_ref(x, z, nw, 1e-5, 320), w)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="gate"):
        gemv_gated_norm_triton(x, z[:1], nw, 1e-5, w)


def test_norm_linear_dispatch_fuses_one_row_on_request_only(monkeypatch):
    x, w, _ = _inputs(1, 24, 48, seed=29)
    r, _, _ = _inputs(1, 1, 48, seed=30)
    nw = torch.ones(48)
    fused = []
    real = gemv_rms_norm_triton
    monkeypatch.setattr("krait.ops.linear.gemv_rms_norm_triton",
                        lambda *a, **k: fused.append(a) or real(*a, **k))
    h, want_sum = fused_add_rms_norm_ref(x, r, nw, 1e-6)
    monkeypatch.setenv("KRAIT_FUSE_NORM", "1")
    y, summed = rms_norm_linear(x, r, nw, 1e-6, w)  # CPU without KRAIT_TRITON_CPU: unfused
    assert not fused and torch.equal(summed, want_sum)
    torch.testing.assert_close(y, F.linear(h, w))
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    y, summed = rms_norm_linear(x, r, nw, 1e-6, w)
    assert len(fused) == 1
    torch.testing.assert_close(y, F.linear(h, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(summed, want_sum)
    x2, r2 = x.expand(2, 48).contiguous(), r.expand(2, 48).contiguous()
    rms_norm_linear(x2, r2, nw, 1e-6, w)  # two rows: norm kernel, then the projection
    monkeypatch.delenv("KRAIT_FUSE_NORM")  # opt-in: measured slower on the H200
    rms_norm_linear(x, r, nw, 1e-6, w)
    assert len(fused) == 1
    monkeypatch.setenv("KRAIT_FUSE_NORM", "1")
    z, _, _ = _inputs(1, 1, 48, seed=31)
    want = F.linear(gated_rms_norm_ref(x, z, nw, 1e-5, 24), w[:, :48])
    # two groups: the prologue covers one group only, so the norm runs on its own
    torch.testing.assert_close(gated_norm_linear(x, z, nw, 1e-5, 24, w), want,
                               atol=1e-4, rtol=1e-4)


def _add_norm_case(silu: bool, seed: int, m: int = 3, n: int = 40, k: int = 300):
    """A projection whose output joins a residual stream and its next norm: x ([M, 2K] with
    silu), w, b, residual, norm weight, and the unfused result (normalized, summed)."""
    x, _, _ = _inputs(m, 1, 2 * k if silu else k, seed=seed)
    _, w, b = _inputs(m, n, k, seed=seed + 1, bias=True)
    r, _, _ = _inputs(m, 1, n, seed=seed + 2)
    nw = 1 + 0.1 * _inputs(1, 1, n, seed=seed + 3)[0][0]
    y = F.linear(silu_and_mul_ref(x) if silu else x, w, b)
    return (x, w, b, r, nw, *fused_add_rms_norm_ref(y, r, nw, 1e-6, 0.5))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("silu", [False, True])
def test_gemv_add_norm_epilogue(split, silu):
    """Projection, residual add and the next norm in one launch: the residual sum as the
    unfused add, the normalized rows from the last tile; counters back at zero."""
    x, w, b, r, nw, want_h, want_sum = _add_norm_case(silu, seed=41)
    cfg = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    for _ in range(2):
        h, summed = gemv_add_norm_triton(x, w, b, r, nw, 1e-6, 0.5, silu, config=cfg)
        torch.testing.assert_close(summed, want_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)
    from krait.ops.gemv import _COUNTERS, _NORM_COUNTERS

    assert int(_NORM_COUNTERS[x.device].abs().sum()) == 0
    if split > 1:
        assert int(_COUNTERS[x.device].abs().sum()) == 0
    with pytest.raises(ValueError, match="residual"):
        gemv_add_norm_triton(x, w, b, r[:, :8], nw, 1e-6, silu_mul=silu)


def test_linear_add_norm_dispatch(monkeypatch):
    x, w, _ = _inputs(1, 24, 48, seed=45)
    r, _, _ = _inputs(1, 1, 24, seed=46)
    nw = torch.ones(24)
    want_h, want_sum = fused_add_rms_norm_ref(F.linear(x, w), r, nw, 1e-6)
    fused = []
    real = gemv_add_norm_triton
    monkeypatch.setattr("krait.ops.linear.gemv_add_norm_triton",
                        lambda *a, **k: fused.append(a) or real(*a, **k))
    h, summed = linear_add_norm(x, w, None, r, nw, 1e-6)  # CPU references: unfused
    assert not fused
    torch.testing.assert_close(h, want_h)
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_GEMV", "1")
    h, summed = linear_add_norm(x, w, None, r, nw, 1e-6)
    assert len(fused) == 1
    torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, want_sum, atol=1e-5, rtol=1e-5)

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (8512, 2048), (2048, 8192)])
def test_gemv_real_sizes_gpu(m, n, k):
    x, w, b = (t.cuda() if t is not None else None for t in _inputs(m, n, k, torch.bfloat16))
    y = gemv_triton(x, w)
    ref = F.linear(x.float(), w.float())
    assert ((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (8512, 2048), (2048, 4096)])
def test_gemv_norm_prologues_real_sizes_gpu(n, k):
    x, w, _ = (t.cuda() if t is not None else None for t in _inputs(1, n, k, torch.bfloat16))
    r, _, _ = _inputs(1, 1, k, torch.bfloat16, seed=5)
    r, nw = r.cuda(), (1 + 0.1 * torch.randn(k)).to(torch.bfloat16).cuda()
    y, summed = gemv_rms_norm_triton(x, r, nw, 1e-6, w, x_scale=0.5)
    h, want_sum = fused_add_rms_norm_triton(x, r, nw, 1e-6, 0.5)
    assert torch.equal(summed, want_sum)
    ref = F.linear(h.float(), w.float())
    assert ((y.float() - ref).norm() / ref.norm()) < 1e-2
    y = gemv_gated_norm_triton(x, r, nw, 1e-5, w)
    ref = F.linear(gated_rms_norm_ref(x, r, nw, 1e-5, k).float(), w.float())
    assert ((y.float() - ref).norm() / ref.norm()) < 1e-2



@pytest.mark.gpu
@pytest.mark.parametrize("n,k,silu", [(1024, 2048, False), (1024, 3072, True), (2048, 4096, False)])
def test_gemv_add_norm_epilogue_real_sizes_gpu(n, k, silu):
    x, w, _ = (t.cuda() if t is not None else None
               for t in _inputs(1, n, k, torch.bfloat16))
    if silu:
        x = torch.cat([x, x.flip(-1)], dim=-1)
    r = _inputs(1, 1, n, torch.bfloat16, seed=6)[0].cuda()
    nw = (1 + 0.1 * torch.randn(n)).to(torch.bfloat16).cuda()
    h, summed = gemv_add_norm_triton(x, w, None, r, nw, 1e-6, 0.5, silu)
    y = (silu_mul_linear if silu else linear)(x, w)  # the unfused kernels
    want_h, want_sum = fused_add_rms_norm_triton(y, r, nw, 1e-6, 0.5)
    assert ((summed.float() - want_sum.float()).norm() / want_sum.float().norm()) < 1e-2
    assert ((h.float() - want_h.float()).norm() / want_h.float().norm()) < 1e-2


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("silu", [False, True])
def test_gemv_add_stats_then_stats_norm(split, silu):
    """The norm split across two GEMVs (KRAIT_NORM_STATS): the first adds the residual and
    writes each tile's sums of squares, the next normalizes from them as it loads its input;
    together they equal projection, fused_add_rms_norm and projection."""
    m = 3
    x, w, b, r, nw, want_h, want_sum = _add_norm_case(silu, seed=51)
    _, w2, b2 = _inputs(m, 24, w.shape[0], seed=55, bias=True)
    cfg = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    for _ in range(2):
        summed, stats = gemv_add_stats_triton(x, w, b, r, 0.5, silu, config=cfg)
        torch.testing.assert_close(summed, want_sum, atol=1e-5, rtol=1e-5)
        assert stats.shape == (m, 5) and stats.dtype == torch.float32  # [M, tiles of 8]
        torch.testing.assert_close(stats.sum(1), (summed * summed).sum(1), rtol=1e-5, atol=1e-5)
        for cfg2 in (dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=16, SPLIT_K=1),
                     dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=16, SPLIT_K=2)):
            got = gemv_stats_norm_triton(summed, stats, nw, 1e-6, w2, b2, config=cfg2)
            torch.testing.assert_close(got, F.linear(want_h, w2, b2), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="residual"):
        gemv_add_stats_triton(x, w, b, r[:, :8], silu_mul=silu)
    with pytest.raises(ValueError, match="stats"):
        gemv_stats_norm_triton(summed, stats.double(), nw, 1e-6, w2)


def test_gemv_stats_norm_rounds_as_the_norm_kernel_bf16():
    x, w, _ = _inputs(1, 64, 256, torch.bfloat16, seed=56)
    _, w2, _ = _inputs(1, 16, 64, torch.bfloat16, seed=57)
    r, _, _ = _inputs(1, 1, 64, torch.bfloat16, seed=58)
    nw = torch.ones(64, dtype=torch.bfloat16)
    summed, stats = gemv_add_stats_triton(x, w, None, r)
    h, want_sum = fused_add_rms_norm_triton(gemv_triton(x, w), r, nw, 1e-6)
    assert torch.equal(summed, want_sum)  # the residual stream is bit-identical
    got = gemv_stats_norm_triton(summed, stats, nw, 1e-6, w2)
    ref = F.linear(h.float(), w2.float())
    assert ((got.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,n2,silu", [(1024, 3072, 4096, True), (2048, 4096, 8512, False),
                                         (1024, 2048, 6144, False)])
def test_gemv_stats_norm_pair_real_sizes_gpu(n, k, n2, silu):
    """qwen3's down -> qkv, mamba2's out_proj -> in_proj, qwen3's o -> gate_up in bf16: the
    split norm against the GEMV, the add-norm op and the GEMV one after the other."""
    x, w, _ = (t.cuda() if t is not None else None
               for t in _inputs(1, n, 2 * k if silu else k, torch.bfloat16, seed=61))
    w = w[:, :k].contiguous() if silu else w
    _, w2, _ = _inputs(1, n2, n, torch.bfloat16, seed=62)
    r, _, _ = _inputs(1, 1, n, torch.bfloat16, seed=63)
    w2, r = w2.cuda(), r.cuda()
    nw = (1 + 0.1 * torch.randn(n)).to(torch.bfloat16).cuda()
    summed, stats = gemv_add_stats_triton(x, w, None, r, 0.5, silu)
    h, want_sum = fused_add_rms_norm_triton(gemv_triton(x, w, silu_mul=silu), r, nw, 1e-6, 0.5)
    assert torch.equal(summed, want_sum)
    got = gemv_stats_norm_triton(summed, stats, nw, 1e-6, w2)
    ref = F.linear(h.float(), w2.float())
    assert ((got.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("split", [1, 2])
def test_gemv_gated_stats_norm(split):
    """Mamba2's gated norm from the state update's partial sums, as out_proj loads y and the
    gate: alone, and with the residual add and per-tile sums for the next norm."""
    m, k, n = 2, 320, 24
    y, w, b = _inputs(m, n, k, seed=71, bias=True)
    z = _inputs(m, 1, 400, seed=72)[0][:, 40:360].contiguous()
    nw = 1 + 0.1 * _inputs(1, 1, k, seed=73)[0][0]
    gz = y * F.silu(z)
    stats = (gz * gz).reshape(m, 8, 40).sum(2)  # [M, 8] partial sums, any split of K
    cfg = dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    want = F.linear(gated_rms_norm_ref(y, z, nw, 1e-5, k), w, b)
    got = gemv_gated_stats_norm_triton(y, z, stats, nw, 1e-5, w, b, config=cfg)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    r, _, _ = _inputs(m, 1, n, seed=74)
    gated = GatedStats(z, stats, nw, 1e-5)
    summed, tile_sums = gemv_add_stats_triton(y, w, b, r, 0.5, config=cfg, gated=gated)
    want_sum = fused_add_rms_norm_ref(want, r, torch.ones(n), 1e-6, 0.5)[1]
    torch.testing.assert_close(summed, want_sum, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tile_sums.sum(1), (summed * summed).sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="stats"):
        gemv_gated_stats_norm_triton(y, z, stats[:1], nw, 1e-5, w)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 4096), (2048, 3072)])
def test_gemv_gated_stats_norm_real_sizes_gpu(n, k):
    """mamba2's and granite's out_proj in bf16: the gated norm from given partial sums."""
    y, w, _ = (t.cuda() if t is not None else None for t in _inputs(1, n, k, torch.bfloat16))
    z, _, _ = _inputs(1, 1, k, torch.bfloat16, seed=81)
    z, nw = z.cuda(), (1 + 0.1 * torch.randn(k)).to(torch.bfloat16).cuda()
    gz = y.float() * F.silu(z.float())
    stats = (gz * gz).reshape(1, 64, -1).sum(2)  # [1, 64] float32
    got = gemv_gated_stats_norm_triton(y, z, stats, nw, 1e-5, w)
    ref = F.linear(gated_rms_norm_ref(y, z, nw, 1e-5, k).float(), w.float())
    assert ((got.float() - ref).norm() / ref.norm()) < 1e-2

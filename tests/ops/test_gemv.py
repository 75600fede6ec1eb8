"""Skinny decode GEMV (krait/ops/gemv.py) against F.linear: shapes, bias, strides, the fused
silu_and_mul, the norm prologue and the conv epilogue; krait/layers/linear.py following the plan
(krait/ops/linear.py, its rules: tests/ops/test_linear_plan.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from krait.layers.linear import linear, silu_mul_linear
from krait.ops.activation import silu_and_mul_ref
from krait.ops.gemv import MAX_M, default_config, gemv_triton
from tests.ops.conv_cases import mamba2_conv_case, small_conv_case


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
    x2, _, _ = _inputs(1, 8, 2 * 40, seed=13)
    _, w, _ = _inputs(1, 16, 40, seed=14)
    want = F.linear(silu_and_mul_ref(x2), w)
    torch.testing.assert_close(silu_mul_linear(x2, w), want)  # reference path
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")  # one row: the GEMV, silu-and-mul its prologue
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


def test_linear_takes_the_gemv_for_one_row_against_a_small_weight(monkeypatch):
    from krait.ops.linear import ROW_GEMV_MAX_ELEMENTS

    calls = []
    monkeypatch.setattr("krait.layers.linear.gemv_triton",
                        lambda *a: calls.append(a) or F.linear(*a))
    x, w, b = _inputs(1, 24, 48, bias=True)
    linear(x, w, b)  # the torch path: F.linear
    assert calls == []
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    narrow, wide = torch.zeros(24, 64), torch.zeros(64, 24)
    linear(torch.ones(1, 64), narrow)
    linear(torch.ones(1, 24), wide)
    linear(x, w, b)
    assert len(calls) == 3
    linear(torch.ones(2, 64), narrow)  # two rows: cuBLAS
    assert len(calls) == 3
    # up to 20M elements (mamba2's in_proj, granite's MLP down; views: no memory behind)
    tall = torch.zeros(1, 64).expand((8 << 20) // 64 + 1, 64)
    linear(torch.ones(1, 64), tall)
    assert len(calls) == 4
    head = torch.zeros(1, 64).expand(ROW_GEMV_MAX_ELEMENTS // 64 + 1, 64)  # an lm_head: cuBLAS
    linear(torch.ones(1, 64), head)
    assert len(calls) == 4


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_gate_up_epilogue_matches_projection_then_silu_and_mul(split, bias):
    x, w, b = _inputs(3, 2 * 20, 300, seed=21 + split, bias=bias)  # gate_up [2I, K], I = 20
    want = silu_and_mul_ref(F.linear(x, w, b))  # [M, I]
    cfg = dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    for _ in range(2):  # the second launch finds the counters back at zero
        got = gemv_triton(x, w, b, config=cfg, silu_mul_out=True)
        assert got.shape == (3, 20)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="even row count"):
        gemv_triton(x, w[:39], silu_mul_out=True)


def test_gemv_gate_up_epilogue_rounds_each_half_as_the_unfused_path_bf16():
    x, w, _ = _inputs(1, 2 * 48, 256, torch.bfloat16, seed=5)
    got = gemv_triton(x, w, silu_mul_out=True)
    want = silu_and_mul_ref(F.linear(x.float(), w.float()).to(torch.bfloat16))
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_silu_mlp_dispatch(monkeypatch):
    from krait.layers import linear as linear_mod
    from krait.layers.linear import silu_mlp

    x, gu, b = _inputs(1, 2 * 24, 48, seed=8, bias=True)  # [1, H], [2I, H]
    _, down, db = _inputs(1, 48, 24, seed=9, bias=True)  # [H, I]
    want = F.linear(silu_and_mul_ref(F.linear(x, gu, b)), down, db)
    torch.testing.assert_close(silu_mlp(x, gu, down, b, db), want)  # reference path
    calls = []
    real = linear_mod.gemv_triton
    monkeypatch.setattr(linear_mod, "gemv_triton",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    torch.testing.assert_close(silu_mlp(x, gu, down, b, db), want, atol=1e-4, rtol=1e-4)
    assert calls[0] == {"silu_mul_out": True} and len(calls) == 2  # gate_up, then down
    calls.clear()
    x2 = torch.cat([x, x])  # two rows: cuBLAS and the activation kernel
    torch.testing.assert_close(silu_mlp(x2, gu, down, b, db), torch.cat([want, want]),
                               atol=1e-4, rtol=1e-4)
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (8512, 2048), (2048, 8192)])
def test_gemv_real_sizes_gpu(m, n, k):
    x, w, b = (t.cuda() if t is not None else None for t in _inputs(m, n, k, torch.bfloat16))
    y = gemv_triton(x, w)
    ref = F.linear(x.float(), w.float())
    assert ((y.float() - ref).norm() / ref.norm()) < 1e-2



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter,hidden", [(3072, 1024), (8192, 2048)])  # qwen3, granite-micro
def test_gemv_gate_up_epilogue_real_sizes_gpu(dtype, inter, hidden):
    x, w, _ = (t.cuda() if t is not None else None
               for t in _inputs(1, 2 * inter, hidden, dtype, seed=inter))
    y = gemv_triton(x, w, silu_mul_out=True)  # [1, I]
    ref = silu_and_mul_ref(F.linear(x.float(), w.float()))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert ((y.float() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("split,group", [(1, 128), (2, 64), (4, 64)])
def test_gemv_norm_gated_prologue_matches_gated_rms_norm_then_linear(split, group):
    """Every program streams columns of one norm group (one group, or a K slice a group)."""
    from krait.ops.gated_rms_norm import gated_rms_norm_ref

    g_ = torch.Generator().manual_seed(31)
    m, k, n, part = 2, 128, 24, 16
    y = torch.randn(m, k, generator=g_)
    z = torch.randn(m, k, generator=g_)
    nw = torch.randn(k, generator=g_)
    w = torch.randn(n, k, generator=g_) / k**0.5
    want = F.linear(gated_rms_norm_ref(y, z, nw, 1e-5, group), w)
    gv = y * F.silu(z)  # what the gated state update hands over, float32
    parts = gv.square().view(m, k // part, part).sum(-1)  # [M, K / part]
    cfg = dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=32, SPLIT_K=split)
    got = gemv_triton(gv, w, config=cfg, norm=(nw, parts, group, 1e-5, part))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="norm groups"):  # a K tile across groups
        gemv_triton(gv, w, config=dict(cfg, BLOCK_K=128, SPLIT_K=1),
                    norm=(nw, parts, 64, 1e-5, part))
    with pytest.raises(ValueError, match="inside one group"):  # a program across groups
        gemv_triton(gv, w, config=dict(cfg, SPLIT_K=1), norm=(nw, parts, 64, 1e-5, part))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_gated_prologue_real_sizes_gpu(dtype):
    """mamba2-1.3b's decode row: the gated state update's g and partials, then out_proj with the
    norm in its prologue, against the state update, gated_rms_norm and F.linear."""
    from krait.layers.linear import gated_norm_linear
    from krait.ops.gated_rms_norm import gated_rms_norm_ref
    from krait.ops.selective_state_update import gated_part_size, selective_state_update_triton

    g_ = torch.Generator().manual_seed(5)
    heads, p, n, hidden = 64, 64, 128, 2048
    inter = heads * p

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g_) * scale).cuda()

    states = r(2, heads, p, n)
    x, dt, z = r(1, heads, p).to(dtype), r(1, heads).to(dtype), r(1, inter).to(dtype)
    A, D, dt_bias = -r(heads).abs(), r(heads), r(heads, scale=0.1)
    B, C = r(1, 1, n).to(dtype), r(1, 1, n).to(dtype)
    slots = torch.tensor([1], dtype=torch.int32, device="cuda")
    nw, w = r(inter).to(dtype), r(hidden, inter, scale=inter**-0.5).to(dtype)
    y = selective_state_update_triton(states.clone(), x, dt, A, B, C, D, dt_bias, slots)
    want = F.linear(gated_rms_norm_ref(y.reshape(1, inter), z, nw, 1e-5, inter).float(),
                    w.float())
    part = gated_part_size(p, n)
    packed = torch.empty(1, inter + inter // part, device="cuda")
    selective_state_update_triton(states.clone(), x, dt, A, B, C, D, dt_bias, slots, gate=z,
                                  g_out=packed[:, :inter], parts_out=packed[:, inter:])
    got = gated_norm_linear(packed, w, None, nw, inter, 1e-5, part)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert ((got.float() - want).norm() / want.norm()) < tol


@pytest.mark.parametrize("split,slot,channel_last", [(1, 2, False), (3, 0, True), (1, -1, False)])
def test_gemv_conv_epilogue_matches_projection_then_conv_update(split, slot, channel_last):
    """A Mamba in_proj's xBC columns through the causal conv's decode step in the GEMV's
    epilogue: equal to F.linear then causal_conv1d_update, the slot's conv state shifted the
    same way, the other slots (and every slot for a padding row, slot -1) untouched."""
    x, w, conv, want, want_states = small_conv_case(51, slot, channel_last)
    states = conv[3]
    k = x.shape[1]
    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=32, SPLIT_K=split)
    got = gemv_triton(x, w, config=cfg, conv=conv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)
    others = [i for i in range(3) if i != slot]
    assert torch.equal(states[others], want_states[others])  # bit for bit: never written
    with pytest.raises(ValueError, match="conv epilogue"):
        gemv_triton(x.expand(2, k), w, conv=conv)


@pytest.mark.gpu
def test_conv_epilogue_real_sizes_gpu():
    """mamba2-1.3b's in_proj in bf16 with its xBC through the conv in the GEMV's epilogue,
    against F.linear then the conv update kernel (the state compared too)."""
    from krait.ops.causal_conv1d import causal_conv1d_update_triton

    x, w, conv = mamba2_conv_case(8)
    inter, cw, cb, states, slots, _ = conv
    conv_dim = cw.shape[0]
    want_states = states.clone()
    proj = F.linear(x, w)
    want = proj.clone()
    want[:, inter:inter + conv_dim] = causal_conv1d_update_triton(
        proj[:, inter:inter + conv_dim], want_states, cw, cb, slots, "silu")
    got = gemv_triton(x, w, conv=conv)
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert ((states.float() - want_states.float()).norm() / want_states.float().norm()) < 1e-2
    assert torch.equal(states[[0, 1, 3]], want_states[[0, 1, 3]])

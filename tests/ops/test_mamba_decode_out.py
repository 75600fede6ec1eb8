"""The one-launch state update + gated norm + out_proj of one decode row
(krait/ops/mamba_decode_out.py) against the two-kernel path and the torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from krait.ops.gated_rms_norm import gated_rms_norm_ref
from krait.ops.linear import gated_norm_linear
from krait.ops.mamba_decode_out import ssu_out_config, ssu_out_ok, ssu_out_proj
from krait.ops.selective_state_update import (
    gated_part_size,
    selective_state_update_ref,
    selective_state_update_triton,
)


def _case(heads, p, groups, n, hidden, dtype, device="cpu", seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    inter = heads * p
    # x, B, C as views of one xBC row, as the mixer splits it
    xbc = r(1, inter + 2 * groups * n).to(dtype)
    x = xbc[:, :inter].view(1, heads, p)
    B = xbc[:, inter : inter + groups * n].view(1, groups, n)
    C = xbc[:, inter + groups * n :].view(1, groups, n)
    proj = r(1, 2 * inter + heads).to(dtype)  # [gate | ... | dt] as in_proj's row
    gate, dt = proj[:, :inter], proj[:, 2 * inter :]
    return dict(
        states=r(3, heads, p, n), x=x, dt=dt, A=-r(heads).abs(), B=B, C=C, D=r(heads),
        dt_bias=r(heads, scale=0.1), gate=gate, w=r(hidden, inter, scale=inter**-0.5).to(dtype),
        bias=r(hidden).to(dtype) if bias else None, nw=r(inter).to(dtype),
    )


def _reference(c, slots, limit=(0.0, float("inf")), group=None):
    """(out, states): the torch state update, gated_rms_norm and F.linear."""
    states = c["states"].clone()
    y = selective_state_update_ref(states, c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"],
                                   c["dt_bias"], slots, True, limit)
    inter = c["w"].shape[1]
    normed = gated_rms_norm_ref(y.reshape(1, inter), c["gate"], c["nw"], 1e-5, group or inter)
    return F.linear(normed.float(), c["w"].float(),
                    None if c["bias"] is None else c["bias"].float()), states


def _fused(c, slots, limit=(0.0, float("inf")), group=None):
    states = c["states"].clone()
    out = ssu_out_proj(states, c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"],
                       slots, c["gate"], c["w"], c["bias"], c["nw"], 1e-5,
                       group or c["w"].shape[1], limit)
    return out, states


# hidden 8: one program (the grid barrier under the interpreter); 40: five, two launches
@pytest.mark.parametrize("hidden", [8, 40])
@pytest.mark.parametrize("bias,limit", [(False, (0.0, float("inf"))), (True, (0.05, 2.0))])
def test_matches_reference(hidden, bias, limit):
    c = _case(heads=4, p=16, groups=2, n=16, hidden=hidden, dtype=torch.float32, seed=hidden,
              bias=bias)
    slots = torch.tensor([2], dtype=torch.int32)
    want, want_states = _reference(c, slots, limit)
    got, got_states = _fused(c, slots, limit)
    assert got.shape == (1, hidden) and got.dtype == c["w"].dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[:2], c["states"][:2])  # other slots untouched


@pytest.mark.parametrize("hidden", [8, 24])
def test_norm_groups(hidden):
    """Norm groups smaller than the row (nemotron-h's 8 groups): each K tile's own 1 / rms."""
    c = _case(heads=4, p=16, groups=2, n=16, hidden=hidden, dtype=torch.float32, seed=11)
    slots = torch.tensor([1], dtype=torch.int32)
    want, want_states = _reference(c, slots, group=32)
    got, got_states = _fused(c, slots, group=32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)


def test_equals_the_two_kernel_path_bf16():
    """Same arithmetic as the gated state update then `gated_norm_linear` (bf16 inputs)."""
    c = _case(heads=4, p=16, groups=1, n=16, hidden=16, dtype=torch.bfloat16, seed=3)
    slots = torch.tensor([0], dtype=torch.int32)
    inter = c["w"].shape[1]
    part = gated_part_size(16, 16)
    states = c["states"].clone()
    packed = torch.empty(1, inter + inter // part)
    selective_state_update_triton(states, c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"],
                                  c["dt_bias"], slots, gate=c["gate"], g_out=packed[:, :inter],
                                  parts_out=packed[:, inter:])
    want = gated_norm_linear(packed, c["w"], None, c["nw"], inter, 1e-5, part)
    got, got_states = _fused(c, slots)
    assert torch.equal(got_states, states)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_padding_row_leaves_the_states():
    c = _case(heads=2, p=16, groups=1, n=16, hidden=8, dtype=torch.float32)
    _, states = _fused(c, torch.tensor([-1], dtype=torch.int32))
    assert torch.equal(states, c["states"])


def test_barrier_counters_return_to_zero():
    """The grid barrier leaves its counters at zero: a second call (a graph replay) works."""
    from krait.ops import mamba_decode_out as mdo

    c = _case(heads=2, p=16, groups=1, n=16, hidden=8, dtype=torch.float32, seed=7)
    slots = torch.tensor([1], dtype=torch.int32)
    first, _ = _fused(c, slots)
    assert int(mdo._COUNTERS[torch.device("cpu")][:2].abs().sum()) == 0
    again, _ = _fused(c, slots)
    torch.testing.assert_close(first, again)


def test_ok_and_config(monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_SSU_OUT", "1")
    row = torch.zeros(1, 4)
    w = torch.zeros(2048, 4096)
    assert ssu_out_ok(row, w, 4096, 64, 128)
    assert ssu_out_ok(row, w, 512, 64, 128)  # 8 norm groups
    assert not ssu_out_ok(row, w, 24, 64, 128)  # a group that is no whole row block
    assert not ssu_out_ok(torch.zeros(2, 4), w, 4096, 64, 128)
    # the CPU counts 4 SMs: 8 programs at most, so BLOCK_N grows with the columns
    cpu = torch.device("cpu")
    assert ssu_out_config(64, 4096, cpu) == dict(BLOCK_N=8, BLOCK_K=1024)
    assert ssu_out_config(2048, 96, cpu) == dict(BLOCK_N=256, BLOCK_K=32)
    assert ssu_out_config(4096, 4096, cpu) is None


def test_ok_knob(monkeypatch):
    """Off unless KRAIT_SSU_OUT=1 (slower than the two kernels on the H200, session 20)."""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.delenv("KRAIT_SSU_OUT", raising=False)
    assert not ssu_out_ok(torch.zeros(1, 4), torch.zeros(64, 256), 256, 16, 16)
    monkeypatch.setenv("KRAIT_SSU_OUT", "1")
    assert ssu_out_ok(torch.zeros(1, 4), torch.zeros(64, 256), 256, 16, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden,heads", [(2048, 64), (1536, 48)])
def test_real_sizes_gpu(dtype, hidden, heads):
    """mamba2-1.3b / granite-micro's decode row (2048 columns, 64 heads) and granite-tiny's
    (1536, 48 heads) on the GPU: the grid barrier with every program resident; twice in a row
    (the counters reset)."""
    c = _case(heads=heads, p=64, groups=1, n=128, hidden=hidden, dtype=dtype, device="cuda",
              seed=hidden)
    slots = torch.tensor([1], dtype=torch.int32, device="cuda")
    want, want_states = _reference(c, slots)
    for _ in range(2):
        got, got_states = _fused(c, slots)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        assert ((got.float() - want).norm() / want.norm()) < tol
        torch.testing.assert_close(got_states, want_states, atol=1e-4, rtol=1e-4)

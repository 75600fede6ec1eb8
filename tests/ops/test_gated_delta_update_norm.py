"""gated_delta_update with the output norm fused (`norm=(z, weight, eps)`): the decode update
followed by Qwen3-Next's gated RMSNorm in one launch, against the unfused update then
`gated_rms_norm(..., gate_after=True)`; the interpreter on CPU, real sizes on the GPU."""

import pytest
import torch

from krait.ops import gated_delta_update as gdu
from krait.ops.gated_rms_norm import gated_rms_norm_ref


def _inputs(B, hk, hv, kd, vd, num_slots, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=gen, device=device)
    q = torch.randn(B, hk, kd, **kw).to(dtype)  # [B, Hk, K]
    k = torch.randn(B, hk, kd, **kw).to(dtype)
    v = torch.randn(B, hv, vd, **kw).to(dtype)  # [B, Hv, V]
    a = torch.randn(B, hv, **kw).to(dtype)
    b = (torch.randn(B, hv, **kw) * 2).to(dtype)
    A_log = (torch.rand(hv, **kw) * 3 - 2).to(dtype)
    dt_bias = torch.randn(hv, **kw).to(dtype)
    z = torch.randn(B, hv * vd + 7, **kw).to(dtype)[:, 3 : 3 + hv * vd]  # rows strided
    w = (1 + 0.3 * torch.randn(vd, **kw)).to(dtype)  # one head's norm weight
    states = torch.randn(num_slots, hv, kd, vd, **kw) * 0.3  # float32 [slots, Hv, K, V]
    return q, k, v, a, b, A_log, dt_bias, z, w, states


def _unfused(q, k, v, a, b, A_log, dt_bias, z, w, states, slots, eps):
    o = gdu.gated_delta_update_ref(q, k, v, a, b, states, slots, A_log=A_log, dt_bias=dt_bias)
    B, hv, vd = o.shape
    return gated_rms_norm_ref(o.reshape(B, -1), z, w, eps, vd, gate_after=True).view(B, hv, vd)


@pytest.mark.parametrize("vd", [24, 40, 32])  # 2, 3 (not a power of two) and 2 V blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_equals_update_then_norm(vd, dtype):
    B, hk, hv, kd, eps = 3, 2, 6, 16, 1e-6
    q, k, v, a, b, A_log, dt_bias, z, w, states = _inputs(B, hk, hv, kd, vd, 6, dtype)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    want_states = states.clone()
    want = _unfused(q, k, v, a, b, A_log, dt_bias, z, w, want_states, slots, eps)
    got_states = states.clone()
    got = gdu.gated_delta_update_triton(q, k, v, a, b, got_states, slots, A_log=A_log,
                                        dt_bias=dt_bias, norm=(z, w, eps))
    assert got.shape == (B, hv, vd) and got.dtype == dtype
    # fp32 exact up to summation order; bf16 within a rounding step or two (the interpreter's
    # casts truncate)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # a -1 row's output is 0
    assert torch.equal(got_states[[0, 2, 3, 5]], states[[0, 2, 3, 5]])  # untouched slots


def test_fused_norm_leaves_its_counters_at_zero():
    """The arrival counters are back to 0 after a launch (a graph replays it with no memset),
    and a second launch gives the same output."""
    q, k, v, a, b, A_log, dt_bias, z, w, states = _inputs(2, 1, 2, 16, 40, 3, torch.float32)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    outs = []
    for _ in range(2):
        s = states.clone()
        outs.append(gdu.gated_delta_update_triton(q, k, v, a, b, s, slots, A_log=A_log,
                                                  dt_bias=dt_bias, norm=(z, w, 1e-6)))
        assert not gdu._COUNTERS[q.device].any()
    assert torch.equal(outs[0], outs[1])


def test_public_entry_takes_norm_on_the_torch_path():
    q, k, v, a, b, A_log, dt_bias, z, w, states = _inputs(2, 1, 2, 8, 8, 3, torch.float32)
    slots = torch.tensor([1, -1], dtype=torch.int32)
    s1, s2 = states.clone(), states.clone()
    want = _unfused(q, k, v, a, b, A_log, dt_bias, z, w, s1, slots, 1e-6)
    got = gdu.gated_delta_update_ref(q, k, v, a, b, s2, slots, A_log=A_log, dt_bias=dt_bias,
                                     norm=(z, w, 1e-6))
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 64])
def test_fused_norm_real_size(batch):
    """Qwen3-Next-80B's GDN (16 key heads, 32 value heads, K = V = 128), bf16."""
    q, k, v, a, b, A_log, dt_bias, z, w, states = _inputs(
        batch, 16, 32, 128, 128, batch + 8, torch.bfloat16, device="cuda")
    slots = torch.randperm(batch + 8, device="cuda")[:batch].to(torch.int32)
    if batch > 1:
        slots[7] = -1
    s_ref, s_tri = states.clone(), states.clone()
    want = _unfused(q, k, v, a, b, A_log, dt_bias, z, w, s_ref, slots, 1e-6)
    got = gdu.gated_delta_update_triton(q, k, v, a, b, s_tri, slots, A_log=A_log,
                                        dt_bias=dt_bias, norm=(z, w, 1e-6))
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    torch.testing.assert_close(s_tri, s_ref, atol=1e-3, rtol=1e-3)
    for _ in range(3):  # counters back at zero: the same output again from the same state
        s = states.clone()
        again = gdu.gated_delta_update_triton(q, k, v, a, b, s, slots, A_log=A_log,
                                              dt_bias=dt_bias, norm=(z, w, 1e-6))
        assert torch.equal(again, got)

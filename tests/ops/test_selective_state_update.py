"""selective_state_update (reference and Triton) against a float64 oracle and the prefill scan."""

import pytest
import torch
import torch.nn.functional as F

from krait.ops import mamba_ssd
from krait.ops import selective_state_update as ssu

UPDATE = {"ref": ssu.selective_state_update_ref, "triton": ssu.selective_state_update_triton}
SCAN = {"ref": mamba_ssd.mamba_chunk_scan_ref, "triton": mamba_ssd.mamba_chunk_scan_triton}
IMPLS = ["ref", "triton"]
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 16, 2, 16


def _oracle(states, x, dt, A, B, C, D, dt_bias, slots, softplus, limit):
    """One recurrence step per row in float64; returns (y, new states). Skipped rows stay zero."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    states = states.double().clone()
    rep = x.shape[1] // B.shape[1]
    for b, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        d = dt[b].double() + dt_bias.double()
        d = (F.softplus(d) if softplus else d).clamp(*limit)  # [H]
        bt = B[b].double().repeat_interleave(rep, 0)  # [H, N]
        ct = C[b].double().repeat_interleave(rep, 0)
        xb = x[b].double()  # [H, P]
        h = torch.exp(d * A.double())[:, None, None] * states[slot]
        h = h + (d[:, None] * xb)[..., None] * bt[:, None]
        y[b] = (h @ ct[..., None]).squeeze(-1) + D.double()[:, None] * xb
        states[slot] = h
    return y, states


def _inputs(batch, num_slots=7, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)  # [B, H, P]
    dt = (torch.randn(batch, HEADS, generator=g) * 0.5 - 1.0).to(dtype)  # [B, H]
    A = -torch.exp(torch.rand(HEADS, generator=g))  # [H]
    B = torch.randn(batch, GROUPS, D_STATE, generator=g).to(dtype)  # [B, G, N]
    C = torch.randn(batch, GROUPS, D_STATE, generator=g).to(dtype)
    D = torch.randn(HEADS, generator=g)
    dt_bias = torch.rand(HEADS, generator=g) - 0.5
    states = torch.randn(num_slots, HEADS, HEAD_DIM, D_STATE, generator=g).to(state_dtype)
    return states, x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softplus,limit", [(True, (0.0, float("inf"))), (False, (0.05, 0.5))])
def test_matches_oracle(impl, softplus, limit):
    states, *args = _inputs(5)
    slots = torch.tensor([3, -1, 0, 6, 1], dtype=torch.int32)
    want, want_states = _oracle(states, *args, slots, softplus, limit)
    got_states = states.clone()
    y = UPDATE[impl](got_states, *args, slots, dt_softplus=softplus, dt_limit=limit)
    rows = slots >= 0
    torch.testing.assert_close(y[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states.double(), want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[[2, 4, 5]], states[[2, 4, 5]])  # untouched slots


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_activations_and_state(impl):
    states, *args = _inputs(3, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=1)
    slots = torch.tensor([2, 0, 5], dtype=torch.int32)
    want, want_states = _oracle(states, *args, slots, True, (0.0, float("inf")))
    got_states = states.clone()
    y = UPDATE[impl](got_states, *args, slots)
    assert y.dtype == torch.bfloat16 and got_states.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got_states.double(), want_states, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_token_prefill_equals_update(impl):
    states, x, dt, A, B, C, D, dt_bias = _inputs(4, seed=2)
    slots = torch.tensor([1, 4, -1, 2], dtype=torch.int32)
    upd_states = states.clone()
    y_upd = UPDATE[impl](upd_states, x, dt, A, B, C, D, dt_bias, slots)
    scan_states = states.clone()
    qsl = torch.arange(5, dtype=torch.int32)
    y_scan = SCAN[impl](
        x, dt, A, B, C, D, dt_bias, scan_states, qsl, slots,
        torch.ones(4, dtype=torch.bool), 8,
    )
    rows = slots >= 0
    torch.testing.assert_close(y_scan[rows], y_upd[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scan_states, upd_states, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref_real_size(state_dtype):
    batch, heads, head_dim, d_state, groups = 64, 64, 64, 128, 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    x = torch.randn(batch, heads, head_dim, **kw).bfloat16()  # [B, H, P]
    dt = (torch.randn(batch, heads, **kw) * 0.5 - 2.0).bfloat16()  # [B, H]
    A = -torch.exp(torch.rand(heads, **kw) * 2)
    B = torch.randn(batch, groups, d_state, **kw).bfloat16()  # [B, G, N]
    C = torch.randn(batch, groups, d_state, **kw).bfloat16()
    D = torch.randn(heads, **kw)
    dt_bias = torch.rand(heads, **kw) - 0.5
    states = torch.randn(batch + 8, heads, head_dim, d_state, **kw).to(state_dtype)
    slots = torch.randperm(batch + 8, device="cuda")[:batch].to(torch.int32)
    slots[7] = -1
    s_ref, s_tri = states.clone(), states.clone()
    args = (x, dt, A, B, C, D, dt_bias, slots)
    ref = ssu.selective_state_update_ref(s_ref, *args)
    tri = ssu.selective_state_update_triton(s_tri, *args)
    rows = slots >= 0
    torch.testing.assert_close(tri[rows].float(), ref[rows].float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(s_tri.float(), s_ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_output_and_partial_sums(dtype):
    """gate=z: besides y (unchanged), g = y * silu(z) in float32 (y rounded to its dtype first)
    and the sums of g^2 over each part_size run of channels."""
    states, *args = _inputs(3, dtype=dtype, seed=4)
    slots = torch.tensor([2, -1, 5], dtype=torch.int32)
    z = torch.randn(3, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(9)).to(dtype)
    want_y = ssu.selective_state_update_triton(states.clone(), *args, slots)
    part_size = ssu.gated_part_size(HEAD_DIM, D_STATE)
    # both outputs views of one packed buffer, as the Mamba mixer hands them over
    packed = torch.empty(3, HEADS * HEAD_DIM + HEADS * HEAD_DIM // part_size)
    g, parts = packed[:, : HEADS * HEAD_DIM], packed[:, HEADS * HEAD_DIM :]
    y = ssu.selective_state_update_triton(states.clone(), *args, slots, gate=z, g_out=g,
                                          parts_out=parts)
    rows = slots >= 0  # a skipped row's outputs are unspecified
    assert torch.equal(y[rows], want_y[rows]) and HEAD_DIM % part_size == 0
    want_g = y.reshape(3, -1).float() * F.silu(z.float())
    torch.testing.assert_close(g[rows], want_g[rows], atol=1e-6, rtol=1e-6)
    want_parts = want_g.square().view(3, -1, part_size).sum(-1)
    torch.testing.assert_close(parts[rows], want_parts[rows], atol=1e-5, rtol=1e-5)

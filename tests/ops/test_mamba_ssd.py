"""mamba_chunk_scan (chunked reference and Triton) against a float64 token-by-token recurrence."""

import pytest
import torch
import torch.nn.functional as F

from krait.ops import mamba_ssd

SCAN = {"ref": mamba_ssd.mamba_chunk_scan_ref, "triton": mamba_ssd.mamba_chunk_scan_triton}
IMPLS = ["ref", "triton"]
HEADS, HEAD_DIM, GROUPS, D_STATE, CHUNK = 4, 16, 2, 16, 16


def _oracle(x, dt, A, B, C, D, dt_bias, states, qsl, slots, has_init, softplus, limit):
    """Naive recurrence in float64; returns (y, new states). Skipped rows stay zero."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    states = states.double().clone()
    rep = x.shape[1] // B.shape[1]
    for b, slot in enumerate(slots.tolist()):
        start, end = int(qsl[b]), int(qsl[b + 1])
        if slot < 0 or end == start:
            continue
        h = states[slot].clone() if has_init[b] else torch.zeros_like(states[slot])
        for t in range(start, end):
            d = dt[t].double() + dt_bias.double()
            d = F.softplus(d) if softplus else d
            d = d.clamp(*limit)  # [H]
            bt = B[t].double().repeat_interleave(rep, 0)  # [H, N]
            ct = C[t].double().repeat_interleave(rep, 0)
            xt = x[t].double()  # [H, P]
            h = torch.exp(d * A.double())[:, None, None] * h
            h = h + (d[:, None] * xt)[..., None] * bt[:, None]
            y[t] = (h @ ct[..., None]).squeeze(-1) + D.double()[:, None] * xt
        states[slot] = h
    return y, states


def _inputs(lens, num_slots=6, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, HEADS, HEAD_DIM, generator=g).to(dtype)  # [T, H, P]
    dt = (torch.randn(T, HEADS, generator=g) * 0.5 - 1.0).to(dtype)  # [T, H]
    A = -torch.exp(torch.rand(HEADS, generator=g))  # [H]
    B = torch.randn(T, GROUPS, D_STATE, generator=g).to(dtype)  # [T, G, N]
    C = torch.randn(T, GROUPS, D_STATE, generator=g).to(dtype)
    D = torch.randn(HEADS, generator=g)
    dt_bias = torch.rand(HEADS, generator=g) - 0.5
    states = torch.randn(num_slots, HEADS, HEAD_DIM, D_STATE, generator=g).to(state_dtype)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, dt, A, B, C, D, dt_bias, states, qsl


def _valid_rows(qsl, slots):
    rows = [range(int(qsl[b]), int(qsl[b + 1])) for b, s in enumerate(slots.tolist()) if s >= 0]
    return torch.tensor([t for r in rows for t in r], dtype=torch.long)


def _run(impl, x, dt, A, B, C, D, dt_bias, states, qsl, slots, has_init, **kw):
    return SCAN[impl](x, dt, A, B, C, D, dt_bias, states, qsl, slots, has_init, CHUNK, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "softplus,limit", [(True, (0.0, float("inf"))), (True, (0.2, 0.6)), (False, (0.01, 1.0))]
)
def test_matches_oracle(impl, softplus, limit):
    # Lengths 1, 20 (crosses a chunk), 32 (two whole chunks), plus a padding row; slot 5 holds
    # garbage and must be ignored (no initial state).
    lens = [1, 5, 20, 32]
    x, dt, A, B, C, D, dt_bias, states, qsl = _inputs(lens)
    slots = torch.tensor([4, -1, 5, 0], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True])
    args = (x, dt, A, B, C, D, dt_bias)
    want, want_states = _oracle(*args, states, qsl, slots, has_init, softplus, limit)
    got_states = states.clone()
    y = _run(impl, *args, got_states, qsl, slots, has_init, dt_softplus=softplus, dt_limit=limit)
    rows = _valid_rows(qsl, slots)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y[rows].double(), want[rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_states.double(), want_states, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_states[[1, 2, 3]], states[[1, 2, 3]])  # untouched slots


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_activations_and_state(impl):
    lens = [3, 16, 25]
    x, dt, A, B, C, D, dt_bias, states, qsl = _inputs(
        lens, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=1
    )
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    args = (x, dt, A, B, C, D, dt_bias)
    want, want_states = _oracle(*args, states, qsl, slots, has_init, True, (0.0, float("inf")))
    got_states = states.clone()
    y = _run(impl, *args, got_states, qsl, slots, has_init)
    assert y.dtype == torch.bfloat16 and got_states.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got_states.double(), want_states, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("split", [7, 16, 39])
def test_two_pieces_equal_one(impl, split):
    total = 40
    x, dt, A, B, C, D, dt_bias, states, _ = _inputs([total], seed=2)
    slots = torch.tensor([3], dtype=torch.int32)
    whole_states = states.clone()
    qsl = torch.tensor([0, total], dtype=torch.int32)
    whole = _run(impl, x, dt, A, B, C, D, dt_bias, whole_states, qsl, slots, torch.tensor([False]))
    piece_states = states.clone()
    pieces = []
    for lo, hi, init in ((0, split, False), (split, total, True)):
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
        pieces.append(_run(
            impl, x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, dt_bias, piece_states, qsl,
            slots, torch.tensor([init]),
        ))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(piece_states, whole_states, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref_real_size(state_dtype):
    heads, head_dim, d_state, groups, chunk, num_seqs, seqlen = 64, 64, 128, 1, 256, 8, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    T = num_seqs * seqlen
    x = torch.randn(T, heads, head_dim, **kw).bfloat16()  # [T, H, P]
    dt = (torch.randn(T, heads, **kw) * 0.5 - 2.0).bfloat16()  # [T, H]
    A = -torch.exp(torch.rand(heads, **kw) * 2)
    B = torch.randn(T, groups, d_state, **kw).bfloat16()  # [T, G, N]
    C = torch.randn(T, groups, d_state, **kw).bfloat16()
    D = torch.randn(heads, **kw)
    dt_bias = torch.rand(heads, **kw) - 0.5
    states = (torch.randn(num_seqs + 2, heads, head_dim, d_state, **kw) * 0.1).to(state_dtype)
    # Uneven lengths (chunk-crossing and chunk-aligned) with the same total.
    lens = torch.tensor([1, 2047, 2048, 300, 3796, 2048, 4096, 2048])
    qsl = torch.cat([torch.zeros(1), lens.cumsum(0)]).to(device="cuda", dtype=torch.int32)
    slots = torch.arange(num_seqs, device="cuda", dtype=torch.int32) + 2
    slots[5] = -1
    has_init = torch.arange(num_seqs, device="cuda") % 3 != 0
    s_ref, s_tri = states.clone(), states.clone()
    args = (x, dt, A, B, C, D, dt_bias)
    ref = mamba_ssd.mamba_chunk_scan_ref(*args, s_ref, qsl, slots, has_init, chunk)
    tri = mamba_ssd.mamba_chunk_scan_triton(*args, s_tri, qsl, slots, has_init, chunk)
    keep = torch.ones(T, dtype=torch.bool, device="cuda")
    keep[int(qsl[5]): int(qsl[6])] = False
    torch.testing.assert_close(tri[keep].float(), ref[keep].float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(s_tri.float(), s_ref.float(), atol=2e-2, rtol=2e-2)


def test_gpu_launch_plan_at_mamba2_shapes():
    """The per-shape launch plan (cached) keeps the H200-swept configs, clipped to the problem:
    mamba2-1.3b's 64 heads of 64, d_state 128, chunks of 256."""
    from krait.ops.mamba_ssd import _scan_plan

    plan = _scan_plan(64, 64, 128, 256, False, "tf32")
    assert plan["state"] == dict(DOT_PRECISION="tf32", BLOCK_P=64, BLOCK_N=128, BLOCK_K=64,
                                 num_warps=4, num_stages=3)
    assert plan["scan"]["BLOCK_K"] == 32 and plan["bmm"]["BLOCK_S"] == plan["bmm"]["BLOCK_M"] == 64
    assert plan["grids"] == dict(cumsum=8, state=1, passing=8, bmm=16, scan=4)
    assert _scan_plan(64, 64, 128, 256, False, "tf32") is plan  # computed once per shape
    small = _scan_plan(8, 16, 16, 32, False, "ieee")  # blocks clipped to the problem
    assert small["state"]["BLOCK_N"] == 16 and small["cumsum"]["BLOCK_H"] == 8

"""selective_state_verify (reference and Triton) against selective_state_update run token by
token (tests/ops/verify_cases.py), and Triton against the reference at mamba2-1.3b's size."""

import pytest
import torch

from krait.ops import selective_state_verify as ssv
from krait.ops.selective_state_update import selective_state_update_ref
from tests.ops.verify_cases import NUM_COLS, token_by_token, verify_batch

VERIFY = {"ref": ssv.selective_state_verify_ref, "triton": ssv.selective_state_verify_triton}
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 16, 2, 16
INF_LIMIT = (0.0, float("inf"))


def _inputs(num_tokens, num_slots, dtype, state_dtype, seed):
    """x, B and C are views of one packed [T, H * P + 2 * G * N] projection, as the mixer
    hands them over."""
    g = torch.Generator().manual_seed(seed)
    width = HEADS * HEAD_DIM + 2 * GROUPS * D_STATE
    xbc = torch.randn(num_tokens, width, generator=g).to(dtype)  # [T, H * P + 2 * G * N]
    x = xbc[:, : HEADS * HEAD_DIM].view(num_tokens, HEADS, HEAD_DIM)  # [T, H, P]
    B = xbc[:, HEADS * HEAD_DIM : -GROUPS * D_STATE].view(num_tokens, GROUPS, D_STATE)
    C = xbc[:, -GROUPS * D_STATE :].view(num_tokens, GROUPS, D_STATE)  # [T, G, N]
    dt = (torch.randn(num_tokens, HEADS, generator=g) * 0.5 - 1.0).to(dtype)  # [T, H]
    A = -torch.exp(torch.rand(HEADS, generator=g))  # [H]
    D = torch.randn(HEADS, generator=g)
    dt_bias = torch.rand(HEADS, generator=g) - 0.5
    states = torch.randn(num_slots, HEADS, HEAD_DIM, D_STATE, generator=g).to(state_dtype)
    return states, (x, dt, A, B, C, D, dt_bias)


def _oracle(states, args, batch, softplus, limit):
    x, dt, A, B, C, D, dt_bias = args

    def step(work, t, spare):
        s = slice(t, t + 1)
        return selective_state_update_ref(work, x[s], dt[s], A, B[s], C[s], D, dt_bias, spare,
                                          softplus, limit)[0]

    return token_by_token(states, batch, x, step)


def _run(impl, states, args, batch, **kw):
    got = states.clone()
    y = VERIFY[impl](got, *args, batch.query_start_loc, batch.state_slots, batch.num_accepted,
                     batch.idx_mapping, **kw)
    return y, got


@pytest.mark.parametrize("dtype,state_dtype,y_tol,s_tol", [
    (torch.float32, torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, torch.float32, None, 1e-5),  # y: torch's bf16 tolerance (an ulp apart)
    (torch.bfloat16, torch.bfloat16, 3e-2, 3e-2),
])
def test_matches_token_by_token(dtype, state_dtype, y_tol, s_tol):
    """Rows of 1..4 tokens from source columns 0..3 (a source that is also a destination), a
    padding row and a row of -1 slots; the two implementations agree with each other closely
    and with the single-token chain (which, unlike them, rounds a bf16 state every token)."""
    batch = verify_batch(seed=1)
    states, args = _inputs(batch.num_tokens, batch.num_slots, dtype, state_dtype, seed=2)
    want_y, want_states = _oracle(states, args, batch, True, INF_LIMIT)
    rows, keep = batch.live_tokens(), batch.untouched()
    got = {impl: _run(impl, states, args, batch) for impl in VERIFY}
    y_kw = {} if y_tol is None else dict(atol=y_tol, rtol=y_tol)
    for y, s in got.values():
        assert y.dtype == dtype and s.dtype == state_dtype
        torch.testing.assert_close(y[rows], want_y[rows], **y_kw)
        torch.testing.assert_close(s.float(), want_states.float(), atol=s_tol, rtol=s_tol)
        assert torch.equal(s[keep], states[keep])  # bitwise untouched
    (y_ref, s_ref), (y_tri, s_tri) = got["ref"], got["triton"]
    # torch's tolerances for the dtype: an ulp of bf16 where the float32 math rounds apart
    torch.testing.assert_close(y_tri[rows], y_ref[rows])
    torch.testing.assert_close(s_tri, s_ref)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_dt_limit_without_softplus(impl):
    batch = verify_batch(seed=3)
    states, args = _inputs(batch.num_tokens, batch.num_slots, torch.float32, torch.float32, 4)
    limit = (0.05, 0.5)
    want_y, want_states = _oracle(states, args, batch, False, limit)
    y, got = _run(impl, states, args, batch, dt_softplus=False, dt_limit=limit)
    rows = batch.live_tokens()
    torch.testing.assert_close(y[rows], want_y[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want_states, atol=1e-5, rtol=1e-5)


def test_one_token_rows_equal_decode():
    """Every row one token from column 0: the plain decode step's result, slot for slot."""
    rows = [(1, 1, 0), (1, 1, 1), (1, 1, -1)]
    batch = verify_batch(seed=5, rows=rows)
    states, args = _inputs(batch.num_tokens, batch.num_slots, torch.float32, torch.float32, 6)
    want_states = states.clone()
    slots = batch.state_slots[:, 0].clone()
    slots[batch.idx_mapping < 0] = -1
    want_y = selective_state_update_ref(want_states, *args, slots)
    for impl in VERIFY:
        y, got = _run(impl, states, args, batch)
        torch.testing.assert_close(y[:2], want_y[:2], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, want_states, atol=1e-6, rtol=1e-6)


def test_dispatch_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KRAIT_TRITON_CPU", raising=False)
    batch = verify_batch(seed=7)
    states, args = _inputs(batch.num_tokens, batch.num_slots, torch.float32, torch.float32, 8)
    got = states.clone()
    y = ssv.selective_state_verify(got, *args, batch.query_start_loc, batch.state_slots,
                                   batch.num_accepted, batch.idx_mapping)
    y_ref, s_ref = _run("ref", states, args, batch)
    assert torch.equal(y, y_ref) and torch.equal(got, s_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref_real_size(rows, state_dtype):
    heads, head_dim, d_state, groups = 64, 64, 128, 1  # mamba2-1.3b
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    lens = torch.randint(1, NUM_COLS + 1, (rows,), **kw)
    num_tokens = int(lens.sum())
    qsl = torch.zeros(rows + 1, dtype=torch.int32, device="cuda")
    qsl[1:] = lens.cumsum(0)
    num_slots = rows * NUM_COLS + 8
    slots = torch.randperm(num_slots, **kw)[: rows * NUM_COLS].view(rows, NUM_COLS)
    slots = slots.to(torch.int32)
    idx = torch.randperm(rows + 4, **kw)[:rows].to(torch.int32)
    num_accepted = torch.randint(1, NUM_COLS + 1, (rows + 4,), **kw).to(torch.int32)
    if rows > 1:
        idx[5] = -1
        slots[9] = -1
    x = torch.randn(num_tokens, heads, head_dim, **kw).bfloat16()  # [T, H, P]
    dt = (torch.randn(num_tokens, heads, **kw) * 0.5 - 2.0).bfloat16()  # [T, H]
    A = -torch.exp(torch.rand(heads, **kw) * 2)
    B = torch.randn(num_tokens, groups, d_state, **kw).bfloat16()  # [T, G, N]
    C = torch.randn(num_tokens, groups, d_state, **kw).bfloat16()
    D = torch.randn(heads, **kw)
    dt_bias = torch.rand(heads, **kw) - 0.5
    states = torch.randn(num_slots, heads, head_dim, d_state, **kw).to(state_dtype)
    s_ref, s_tri = states.clone(), states.clone()
    args = (x, dt, A, B, C, D, dt_bias, qsl, slots, num_accepted, idx)
    ref = ssv.selective_state_verify_ref(s_ref, *args)
    tri = ssv.selective_state_verify_triton(s_tri, *args)
    live = (idx >= 0) & (slots[:, 0] >= 0)
    row_of = torch.repeat_interleave(torch.arange(rows, device="cuda"), lens)
    tok = live[row_of]
    torch.testing.assert_close(tri[tok].float(), ref[tok].float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(s_tri.float(), s_ref.float(), atol=1e-2, rtol=1e-2)

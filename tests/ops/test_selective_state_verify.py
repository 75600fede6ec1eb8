"""selective_state_verify's deferred commit (reference and Triton) against selective_state_update
run token by token over the accepted tokens: three steps of verify rows (rows with drafts, rows
without, a padding row, a row with a dead slot), the accepted counts recorded by
`fill_replay_ctl` between steps, and Triton against the reference at mamba2-1.3b's size
(docs/architecture.md, invariant 2)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from krait.ops import selective_state_verify as ssv
from krait.ops.num_accepted import fill_replay_ctl_ref, fill_replay_ctl_triton
from krait.ops.selective_state_update import selective_state_update_ref

# the kernel's forms: token loops as loops or unrolled (UNROLL)
KERNELS = {f"triton{'_unroll' * unroll}": partial(ssv.selective_state_verify_triton,
                                                   unroll=unroll) for unroll in (False, True)}
VERIFY = {"ref": ssv.selective_state_verify_ref, **KERNELS}
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 16, 2, 16
S = 4  # 1 + 3 drafts
MAX_REQS = 8
REQS = [5, 0, -1, 3, 2]  # request row of each batch row; -1: a padding row
DEAD = 4  # this batch row's slot is -1
# per step: tokens a row (1: a decode row without drafts) and how many of them are accepted
STEPS = [([4, 1, 2, 3, 2], [2, 1, 1, 3, 1]),
         ([3, 4, 1, 1, 4], [3, 1, 1, 1, 2]),
         ([1, 2, 3, 4, 1], [1, 2, 3, 4, 1])]


def _step_inputs(lens, dtype, g):
    """x, dt, B, C of a step's packed tokens (x, B, C views of one packed projection, as the
    mixer hands them over) and its query_start_loc."""
    t = sum(lens)
    width = HEADS * HEAD_DIM + 2 * GROUPS * D_STATE
    xbc = torch.randn(t, width, generator=g).to(dtype)  # [T, H * P + 2 * G * N]
    x = xbc[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)  # [T, H, P]
    B = xbc[:, HEADS * HEAD_DIM : -GROUPS * D_STATE].view(t, GROUPS, D_STATE)  # [T, G, N]
    C = xbc[:, -GROUPS * D_STATE :].view(t, GROUPS, D_STATE)
    dt = (torch.randn(t, HEADS, generator=g) * 0.5 - 1.0).to(dtype)  # [T, H]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (x, dt, B, C), qsl


def _params(g):
    A = -torch.exp(torch.rand(HEADS, generator=g))  # [H]
    D = torch.randn(HEADS, generator=g)
    dt_bias = torch.rand(HEADS, generator=g) - 0.5
    return A, D, dt_bias


def _replay(dtype):
    return (torch.zeros(2, MAX_REQS, S, HEADS, HEAD_DIM, dtype=dtype),
            torch.zeros(2, MAX_REQS, S, HEADS, dtype=dtype),
            torch.zeros(2, MAX_REQS, S, GROUPS, D_STATE, dtype=dtype),
            torch.zeros(MAX_REQS, dtype=torch.int32))


def _run_steps(impl, dtype, state_dtype, softplus=True, limit=(0.0, float("inf")),
               slot_cols=S):
    """Three steps through `impl`, and the token-by-token chain of the accepted tokens:
    (outputs of each step, final states, the chain's outputs, the chain's final states, the
    slots no row writes, the initial states). `slot_cols`: columns of state_slots handed over
    (the kernel reads column 0 alone; a row's tokens are bounded by the kept buffers' S)."""
    g = torch.Generator().manual_seed(0)
    rows = len(REQS)
    num_slots = rows + 3
    slots = torch.randperm(num_slots, generator=g)[:rows].to(torch.int32)
    slots[DEAD] = -1
    state_slots = torch.full((rows, S), -1, dtype=torch.int32)
    state_slots[:, 0] = slots  # columns past 0 are the conv's: the state update reads none
    state_slots = state_slots[:, :slot_cols].contiguous()
    idx = torch.tensor(REQS, dtype=torch.int32)
    A, D, dt_bias = _params(g)
    states = torch.randn(num_slots, HEADS, HEAD_DIM, D_STATE, generator=g).to(state_dtype)
    init = states.clone()
    live = [r for r in range(rows) if REQS[r] >= 0 and r != DEAD]
    chain = {r: states[slots[r]].float()[None].clone() for r in live}  # [1, H, P, N] a row
    replay = _replay(dtype)
    outs, want = [], []
    for lens, accepted in STEPS:
        args, qsl = _step_inputs(lens, dtype, g)
        x, dt, B, C = args
        outs.append(VERIFY[impl](states, x, dt, A, B, C, D, dt_bias, qsl, state_slots, idx,
                                 replay, softplus, limit))
        step_want = torch.zeros_like(x)
        for r in live:  # the chain: every token's output, then back to the accepted ones
            base = chain[r].clone()
            for j in range(lens[r]):
                t = int(qsl[r]) + j
                step_want[t] = selective_state_update_ref(
                    base, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, dt_bias,
                    torch.zeros(1, dtype=torch.int32), softplus, limit)[0]
            for j in range(accepted[r]):
                t = int(qsl[r]) + j
                selective_state_update_ref(
                    chain[r], x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D,
                    dt_bias, torch.zeros(1, dtype=torch.int32), softplus, limit)
        want.append((step_want, qsl))
        fill_replay_ctl_ref(replay[3], idx, torch.tensor(accepted, dtype=torch.int32),
                            torch.tensor(lens, dtype=torch.int32) - 1)
    untouched = [s for s in range(num_slots) if s not in slots[live].tolist()]
    return outs, states, want, chain, slots, live, untouched, init


@pytest.mark.parametrize("dtype,state_dtype,tol", [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.float32, None),  # y: torch's bf16 tolerance (an ulp apart)
    (torch.bfloat16, torch.bfloat16, 3e-2),
])
@pytest.mark.parametrize("impl", list(VERIFY))
@pytest.mark.parametrize("slot_cols", [S, 1])
def test_invariant_2_deferred_commit_matches_token_by_token(impl, dtype, state_dtype, tol,
                                                            slot_cols):
    """Each step's outputs are those of the accepted tokens' chain, and after the last step
    (every row without drafts: it commits its token) each live slot holds the chain's state;
    the padding row's and the dead row's slots are bitwise untouched. With one slot column
    every token of a row still runs (rows were once cut at state_slots' column count)."""
    outs, states, want, chain, slots, live, untouched, init = _run_steps(
        impl, dtype, state_dtype, slot_cols=slot_cols)
    kw = {} if tol is None else dict(atol=tol, rtol=tol)
    for y, (y_want, qsl) in zip(outs, want, strict=True):
        assert y.dtype == dtype
        toks = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in live])
        torch.testing.assert_close(y[toks], y_want[toks], **kw)
    # the last step: rows of 1 token committed, rows with drafts committed what the step
    # before accepted (their last step's own tokens wait in the replay buffers)
    last_lens = STEPS[-1][0]
    for r in live:
        if last_lens[r] == 1:
            s_tol = 1e-5 if state_dtype == torch.float32 else 3e-2
            torch.testing.assert_close(states[slots[r]].float(), chain[r][0], atol=s_tol,
                                       rtol=s_tol)
    assert torch.equal(states[untouched], init[untouched])


def test_invariant_2_triton_equals_reference():
    """The interpreter's Triton kernel and the reference agree on every step and state."""
    got = {impl: _run_steps(impl, torch.float32, torch.float32) for impl in VERIFY}
    o_ref, s_ref, want, _, _, live, _, _ = got["ref"]
    for impl in KERNELS:
        o_tri, s_tri = got[impl][:2]
        for a, b, (_, qsl) in zip(o_ref, o_tri, want, strict=True):
            toks = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in live])
            torch.testing.assert_close(a[toks], b[toks], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s_ref, s_tri, atol=1e-5, rtol=1e-5)


def test_verify_tile_on_the_gpu(monkeypatch):
    """The compiled kernel's tiles at mamba2-1.3b's sizes (fp32 state): the decode update's at
    batch 1, 8 KB on 4 warps at batch 64."""
    monkeypatch.setattr(ssv, "interpreting", lambda: False)
    block_p = ssv._block_p(64, 128, 4)
    assert ssv.verify_tile(1, 64, 64, 128, 4) == (block_p, ssv.ssu_warps(64 * 64 // block_p))
    assert ssv.verify_tile(64, 64, 64, 128, 4) == (16, 4)


@pytest.mark.parametrize("impl", list(VERIFY))
def test_dt_limit_without_softplus(impl):
    outs, states, want, chain, slots, live, _, _ = _run_steps(
        impl, torch.float32, torch.float32, softplus=False, limit=(0.05, 0.5))
    for y, (y_want, qsl) in zip(outs, want, strict=True):
        toks = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in live])
        torch.testing.assert_close(y[toks], y_want[toks], atol=1e-5, rtol=1e-5)


def test_one_token_rows_equal_decode():
    """Rows of one token with nothing kept: the plain decode step's result, slot for slot."""
    g = torch.Generator().manual_seed(5)
    args, qsl = _step_inputs([1, 1, 1], torch.float32, g)
    x, dt, B, C = args
    A, D, dt_bias = _params(g)
    states = torch.randn(6, HEADS, HEAD_DIM, D_STATE, generator=g)
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    idx = torch.tensor([0, 1, -1], dtype=torch.int32)
    want_states = states.clone()
    want_y = selective_state_update_ref(want_states, x, dt, A, B, C, D, dt_bias,
                                        torch.tensor([4, 1, -1], dtype=torch.int32))
    for impl in VERIFY:
        got = states.clone()
        y = VERIFY[impl](got, x, dt, A, B, C, D, dt_bias, qsl, slots[:, None], idx,
                         _replay(torch.float32))
        torch.testing.assert_close(y[:2], want_y[:2], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, want_states, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_fill_replay_ctl(impl):
    """Rows with drafts keep their accepted count (0 -> 1) and flip their parity; rows
    without drafts (a decode row without drafts, a prefill chunk: -1) keep nothing; -1 rows
    are skipped."""
    fill = fill_replay_ctl_ref if impl == "ref" else fill_replay_ctl_triton
    ctl = torch.tensor([7, 2 | 1 << 16, 9, 3, 4], dtype=torch.int32)
    idx = torch.tensor([1, 0, -1, 3, 4], dtype=torch.int32)
    fill(ctl, idx, torch.tensor([3, 0, 2, 1, 2], dtype=torch.int32),
         torch.tensor([3, 2, 1, 0, -1], dtype=torch.int32))
    assert ctl.tolist() == [1 | 1 << 16, 3, 9, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref_real_size(rows, state_dtype):
    heads, head_dim, d_state, groups = 64, 64, 128, 1  # mamba2-1.3b
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    max_reqs = rows + 4
    slots = torch.randperm(rows + 8, **kw)[:rows].to(torch.int32)[:, None]
    idx = torch.randperm(max_reqs, **kw)[:rows].to(torch.int32)
    if rows > 1:
        idx[5] = -1
        slots[9] = -1
    states = torch.randn(rows + 8, heads, head_dim, d_state, **kw).to(state_dtype)
    A = -torch.exp(torch.rand(heads, **kw) * 2)
    D = torch.randn(heads, **kw)
    dt_bias = torch.rand(heads, **kw) - 0.5
    lead = (2, max_reqs, S)
    replay = {impl: (torch.zeros(*lead, heads, head_dim, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(*lead, heads, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(*lead, groups, d_state, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(max_reqs, device="cuda", dtype=torch.int32))
              for impl in VERIFY}
    got = {impl: states.clone() for impl in VERIFY}
    for _ in range(3):  # three steps, random lengths and accepted counts between them
        lens = torch.randint(1, S + 1, (rows,), **kw)
        num_tokens = int(lens.sum())
        qsl = torch.zeros(rows + 1, dtype=torch.int32, device="cuda")
        qsl[1:] = lens.cumsum(0)
        x = torch.randn(num_tokens, heads, head_dim, **kw).bfloat16()  # [T, H, P]
        dt = (torch.randn(num_tokens, heads, **kw) * 0.5 - 2.0).bfloat16()  # [T, H]
        B = torch.randn(num_tokens, groups, d_state, **kw).bfloat16()  # [T, G, N]
        C = torch.randn(num_tokens, groups, d_state, **kw).bfloat16()
        accepted = (torch.rand(rows, **kw) * lens).long().clamp(min=1).to(torch.int32)
        ys = {}
        for impl, fn in VERIFY.items():
            ys[impl] = fn(got[impl], x, dt, A, B, C, D, dt_bias, qsl, slots, idx, replay[impl])
            fill_replay_ctl_ref(replay[impl][3], idx, accepted, (lens - 1).to(torch.int32))
        live = (idx >= 0) & (slots[:, 0] >= 0)
        tok = live[torch.repeat_interleave(torch.arange(rows, device="cuda"), lens)]
        for impl in KERNELS:
            torch.testing.assert_close(ys[impl][tok].float(), ys["ref"][tok].float(),
                                       atol=5e-2, rtol=2e-2)
            torch.testing.assert_close(got[impl].float(), got["ref"].float(), atol=1e-2,
                                       rtol=1e-2)

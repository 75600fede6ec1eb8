"""causal_conv1d_verify (reference and Triton) against causal_conv1d_update run token by token
(tests/ops/verify_cases.py), and Triton against the reference at mamba2-1.3b's size."""

from functools import partial

import pytest
import torch

from krait.ops import causal_conv1d_verify as ccv
from krait.ops.causal_conv1d import causal_conv1d_update_ref
from tests.ops.verify_cases import NUM_COLS, token_by_token, verify_batch

# "triton_split": channels across programs as on the GPU (the interpreter's default puts a row's
# channels in one program), the last block partial
VERIFY = {"ref": ccv.causal_conv1d_verify_ref, "triton": ccv.causal_conv1d_verify_triton,
          "triton_split": partial(ccv.causal_conv1d_verify_triton, block_d=16)}
WIDTH, DIM = 4, 40


def _in_layout(states, layout):
    """A copy of states [slots, dim, taps], stored dim-major or channel-last (the runner's
    layout: [slots, taps, dim] storage seen through a transposed view)."""
    if layout == "dim_major":
        return states.clone()
    return states.transpose(1, 2).contiguous().transpose(1, 2)


def _inputs(num_tokens, num_slots, dtype, bias, seed):
    """x is a column slice of a wider projection (as the mixer's xBC is)."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(num_tokens, DIM + 24, generator=g).to(dtype)
    x = proj[:, 8 : 8 + DIM]  # [T, dim], row stride DIM + 24
    weight = (torch.randn(DIM, WIDTH, generator=g) * 0.5).to(dtype)
    b = torch.randn(DIM, generator=g).to(dtype) if bias else None
    states = torch.randn(num_slots, DIM, WIDTH - 1, generator=g).to(dtype)
    return x, weight, b, states


def _oracle(x, weight, bias, states, batch, activation):
    def step(work, t, spare):
        return causal_conv1d_update_ref(x[t : t + 1], work, weight, bias, spare, activation)[0]

    return token_by_token(states, batch, x, step)


def _run(impl, x, weight, bias, states, batch, activation):
    out = VERIFY[impl](x, states, weight, bias, batch.query_start_loc, batch.state_slots,
                       batch.num_accepted, batch.idx_mapping, activation)
    return out, states


@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
@pytest.mark.parametrize("layout", ["dim_major", "channel_last"])
def test_matches_token_by_token(bias, activation, layout):
    """Rows of 1..4 tokens from source columns 0..3 (a source that is also a destination), a
    padding row and a row of -1 slots: both implementations give the chain's outputs, and its
    states exactly (they are copies of inputs)."""
    batch = verify_batch(seed=1)
    x, weight, b, states = _inputs(batch.num_tokens, batch.num_slots, torch.float32, bias, 2)
    want, want_states = _oracle(x, weight, b, states, batch, activation)
    rows, keep = batch.live_tokens(), batch.untouched()
    outs = {}
    for impl in VERIFY:
        got_states = _in_layout(states, layout)
        out, got_states = _run(impl, x, weight, b, got_states, batch, activation)
        assert got_states.stride() == _in_layout(states, layout).stride()
        torch.testing.assert_close(out[rows], want[rows], atol=1e-5, rtol=1e-5)
        assert torch.equal(got_states, want_states)
        assert torch.equal(got_states[keep], states[keep])  # bitwise untouched
        outs[impl] = out
    torch.testing.assert_close(outs["triton"][rows], outs["ref"][rows], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", ["dim_major", "channel_last"])
def test_bf16(layout):
    batch = verify_batch(seed=3)
    x, weight, b, states = _inputs(batch.num_tokens, batch.num_slots, torch.bfloat16, True, 4)
    want, want_states = _oracle(x, weight, b, states, batch, "silu")
    rows = batch.live_tokens()
    for impl in VERIFY:
        out, got_states = _run(impl, x, weight, b, _in_layout(states, layout), batch, "silu")
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out[rows], want[rows])  # torch's bf16 tolerance
        assert torch.equal(got_states, want_states)


def test_one_token_rows_equal_decode():
    """Every row one token from column 0: the plain decode step's result, slot for slot."""
    batch = verify_batch(seed=5, rows=[(1, 1, 0), (1, 1, 1), (1, 1, -1)])
    x, weight, b, states = _inputs(batch.num_tokens, batch.num_slots, torch.float32, True, 6)
    want_states = states.clone()
    slots = batch.state_slots[:, 0].clone()
    slots[batch.idx_mapping < 0] = -1
    want = causal_conv1d_update_ref(x, want_states, weight, b, slots, "silu")
    for impl in VERIFY:
        out, got_states = _run(impl, x, weight, b, states.clone(), batch, "silu")
        torch.testing.assert_close(out[:2], want[:2], atol=1e-6, rtol=1e-6)
        assert torch.equal(got_states, want_states)


def test_dispatch_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KRAIT_TRITON_CPU", raising=False)
    batch = verify_batch(seed=7)
    x, weight, b, states = _inputs(batch.num_tokens, batch.num_slots, torch.float32, True, 8)
    got = states.clone()
    out = ccv.causal_conv1d_verify(x, got, weight, b, batch.query_start_loc, batch.state_slots,
                                   batch.num_accepted, batch.idx_mapping, "silu")
    want, want_states = _run("ref", x, weight, b, states.clone(), batch, "silu")
    assert torch.equal(out, want) and torch.equal(got, want_states)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("layout", ["dim_major", "channel_last"])
def test_triton_matches_ref_real_size(rows, layout):
    heads, head_dim, d_state, groups = 64, 64, 128, 1  # mamba2-1.3b
    dim = heads * head_dim + 2 * groups * d_state
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
    x = torch.randn(num_tokens, dim, **kw).bfloat16()  # [T, dim]
    weight = (torch.randn(dim, WIDTH, **kw) * 0.5).bfloat16()
    bias = torch.randn(dim, **kw).bfloat16()
    states = _in_layout(torch.randn(num_slots, dim, WIDTH - 1, **kw).bfloat16(), layout)
    s_ref, s_tri = states.clone(), states.clone()
    args = (qsl, slots, num_accepted, idx, "silu")
    ref = ccv.causal_conv1d_verify_ref(x, s_ref, weight, bias, *args)
    tri = ccv.causal_conv1d_verify_triton(x, s_tri, weight, bias, *args)
    live = (idx >= 0) & (slots[:, 0] >= 0)
    tok = live[torch.repeat_interleave(torch.arange(rows, device="cuda"), lens)]
    torch.testing.assert_close(tri[tok], ref[tok], atol=2e-2, rtol=2e-2)
    assert torch.equal(s_tri, s_ref)

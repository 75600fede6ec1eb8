"""causal_conv1d_fn / causal_conv1d_update (reference and Triton) against a float64 token loop."""

import pytest
import torch

from krait.ops import causal_conv1d as cc

FN = {"ref": cc.causal_conv1d_fn_ref, "triton": cc.causal_conv1d_fn_triton}
UPDATE = {"ref": cc.causal_conv1d_update_ref, "triton": cc.causal_conv1d_update_triton}
WIDTH = 4


def _oracle(x, weight, bias, states, qsl, slots, has_init, activation):
    """Token-by-token float64 conv; returns (out, new states). Skipped rows stay zero."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    states = states.double().clone()
    w = weight.double()
    for b, slot in enumerate(slots.tolist()):
        start, end = int(qsl[b]), int(qsl[b + 1])
        if slot < 0 or end == start:
            continue
        window = states[slot].clone() if has_init[b] else torch.zeros(w.shape[0], WIDTH - 1)
        window = window.double()
        for t in range(start, end):
            full = torch.cat([window, x[t].double()[:, None]], dim=1)  # [dim, width]
            y = (full * w).sum(-1)
            if bias is not None:
                y = y + bias.double()
            out[t] = y * torch.sigmoid(y) if activation else y
            window = full[:, 1:]
        states[slot] = window
    return out, states


def _inputs(lens, dim=40, num_slots=6, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), dim, generator=g).to(dtype)  # [T, dim]
    weight = (torch.randn(dim, WIDTH, generator=g) * 0.5).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype) if bias else None
    states = torch.randn(num_slots, dim, WIDTH - 1, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, weight, b, states, qsl


def _in_layout(states, layout):
    """A copy of states [slots, dim, taps], stored dim-major or channel-last (the runner's
    layout: [slots, taps, dim] storage seen through a transposed view)."""
    if layout == "dim_major":
        return states.clone()
    out = torch.empty(states.shape[0], states.shape[2], states.shape[1], dtype=states.dtype,
                      device=states.device)
    out = out.transpose(1, 2)
    out.copy_(states)
    return out


def _valid_rows(qsl, slots):
    rows = [range(int(qsl[b]), int(qsl[b + 1])) for b, s in enumerate(slots.tolist()) if s >= 0]
    return torch.tensor([t for r in rows for t in r], dtype=torch.long)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
@pytest.mark.parametrize("layout", ["dim_major", "channel_last"])
def test_fn_matches_oracle(impl, bias, activation, layout):
    # Lengths 1, 2 (< width - 1) and 9, plus a padding row; slot 5 holds garbage and is ignored.
    lens = [1, 3, 2, 9]
    x, weight, b, states, qsl = _inputs(lens, bias=bias)
    slots = torch.tensor([4, -1, 5, 2], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True])
    want, want_states = _oracle(x, weight, b, states, qsl, slots, has_init, activation)
    got_states = _in_layout(states, layout)
    out = FN[impl](x, weight, b, got_states, qsl, slots, has_init, activation)
    rows = _valid_rows(qsl, slots)
    torch.testing.assert_close(out[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states.double(), want_states, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_states[[0, 1, 3]], states[[0, 1, 3]])  # untouched slots


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_fn_bf16(impl):
    lens = [1, 5, 8]
    x, weight, b, states, qsl = _inputs(lens, dtype=torch.bfloat16, seed=1)
    slots = torch.tensor([0, 3, 1], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    want, want_states = _oracle(x, weight, b, states, qsl, slots, has_init, "silu")
    got_states = states.clone()
    out = FN[impl](x, weight, b, got_states, qsl, slots, has_init, "silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_states.double(), want_states, atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("split", [5, 10])
def test_fn_two_pieces_equal_one(impl, split):
    x, weight, b, states, _ = _inputs([11], seed=2)
    slots = torch.tensor([1], dtype=torch.int32)
    whole_states = states.clone()
    whole = FN[impl](
        x, weight, b, whole_states, torch.tensor([0, 11], dtype=torch.int32), slots,
        torch.tensor([True]),
    )
    piece_states = states.clone()
    first = FN[impl](
        x[:split], weight, b, piece_states, torch.tensor([0, split], dtype=torch.int32), slots,
        torch.tensor([True]),
    )
    second = FN[impl](
        x[split:], weight, b, piece_states, torch.tensor([0, 11 - split], dtype=torch.int32),
        slots, torch.tensor([True]),
    )
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(piece_states, whole_states, atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("layout", ["dim_major", "channel_last"])
def test_update_matches_oracle_and_one_token_prefill(impl, layout):
    x, weight, b, states, _ = _inputs([1, 1, 1, 1], seed=3)
    slots = torch.tensor([2, -1, 0, 5], dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    has_init = torch.ones(4, dtype=torch.bool)
    want, want_states = _oracle(x, weight, b, states, qsl, slots, has_init, "silu")
    upd_states = _in_layout(states, layout)
    out = UPDATE[impl](x, upd_states, weight, b, slots)
    rows = _valid_rows(qsl, slots)
    torch.testing.assert_close(out[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(upd_states.double(), want_states, atol=0, rtol=0)
    assert torch.equal(upd_states[[1, 3, 4]], states[[1, 3, 4]])

    fn_states = _in_layout(states, layout)
    fn_out = FN[impl](x, weight, b, fn_states, qsl, slots, has_init)
    torch.testing.assert_close(fn_out[rows], out[rows], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fn_states, upd_states, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["dim_major", "channel_last"])
def test_triton_matches_ref_real_size(layout):
    dim, num_seqs, seqlen = 64 * 64 + 2 * 128, 8, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    x = torch.randn(num_seqs * seqlen, dim, **kw).bfloat16()  # [T, dim]
    weight = (torch.randn(dim, WIDTH, **kw) * 0.5).bfloat16()
    bias = torch.randn(dim, **kw).bfloat16()
    states = _in_layout(torch.randn(num_seqs + 2, dim, WIDTH - 1, **kw).bfloat16(), layout)
    qsl = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * seqlen
    slots = torch.arange(num_seqs, device="cuda", dtype=torch.int32).flip(0) + 2
    slots[3] = -1
    has_init = torch.arange(num_seqs, device="cuda") % 2 == 0
    s_ref, s_tri = states.clone(), states.clone()
    ref = cc.causal_conv1d_fn_ref(x, weight, bias, s_ref, qsl, slots, has_init)
    tri = cc.causal_conv1d_fn_triton(x, weight, bias, s_tri, qsl, slots, has_init)
    keep = torch.ones(num_seqs * seqlen, dtype=torch.bool, device="cuda")
    keep[3 * seqlen: 4 * seqlen] = False
    torch.testing.assert_close(tri[keep], ref[keep], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s_tri, s_ref, atol=0, rtol=0)

    batch = 64
    xd = torch.randn(batch, dim, **kw).bfloat16()  # [B, dim]
    dslots = torch.randperm(batch, device="cuda").to(torch.int32)
    states = _in_layout(torch.randn(batch, dim, WIDTH - 1, **kw).bfloat16(), layout)
    s_ref, s_tri = states.clone(), states.clone()
    ref = cc.causal_conv1d_update_ref(xd, s_ref, weight, bias, dslots)
    tri = cc.causal_conv1d_update_triton(xd, s_tri, weight, bias, dslots)
    torch.testing.assert_close(tri, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s_tri, s_ref, atol=0, rtol=0)

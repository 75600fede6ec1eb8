"""A Mamba in_proj whose xBC columns go through the causal conv's decode step in a GEMV's
epilogue: the inputs the GEMV tests (tests/ops/test_gemv.py, tests/ops/test_gemv_tma.py) share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from krait.ops.causal_conv1d import causal_conv1d_update_ref


def small_conv_case(seed: int, slot: int, channel_last: bool = False):
    """float32, [gate | xBC | dt]-like columns (K 64, xBC at 12..32 of 38, width 4, 3 slots):
    (x [1, K], w [N, K], conv = (lo, weight, bias, states, slots, silu) for the GEMV, the
    expected output [1, N] and states: F.linear then causal_conv1d_update_ref on a copy; a
    padding row (slot -1) changes nothing)."""
    g_ = torch.Generator().manual_seed(seed)
    k, lo, dim, tail, width = 64, 12, 20, 6, 4
    n = lo + dim + tail
    x = torch.randn(1, k, generator=g_)
    w = torch.randn(n, k, generator=g_) / k**0.5
    cw = torch.randn(dim, width, generator=g_)
    cb = torch.randn(dim, generator=g_)
    states = torch.randn(3, dim, width - 1, generator=g_)
    if channel_last:  # [slots, D, W - 1] with the channels contiguous
        states = states.transpose(1, 2).contiguous().transpose(1, 2)
    slots = torch.tensor([slot], dtype=torch.int32)
    want_states = states.clone()
    proj = F.linear(x, w)
    want = proj.clone()
    conv = causal_conv1d_update_ref(proj[:, lo:lo + dim], want_states, cw, cb, slots, "silu")
    if slot >= 0:
        want[:, lo:lo + dim] = conv
    return x, w, (lo, cw, cb, states, slots, True), want, want_states


def mamba2_conv_case(seed: int):
    """mamba2-1.3b's in_proj in bf16 on the GPU, slot 2 of 4: (x [1, 2048], w [8512, 2048],
    conv = (lo, weight, bias, states, slots, silu))."""
    g_ = torch.Generator().manual_seed(seed)
    hidden, inter, conv_dim, heads = 2048, 4096, 4096 + 2 * 128, 64
    n = inter + conv_dim + heads
    x = torch.randn(1, hidden, generator=g_).cuda().bfloat16()
    w = (torch.randn(n, hidden, generator=g_) / hidden**0.5).cuda().bfloat16()
    cw = torch.randn(conv_dim, 4, generator=g_).cuda().bfloat16()
    cb = torch.randn(conv_dim, generator=g_).cuda().bfloat16()
    states = torch.randn(4, conv_dim, 3, generator=g_).cuda().bfloat16()
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")
    return x, w, (inter, cw, cb, states, slots, True)

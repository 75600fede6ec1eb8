"""Mamba2's causal conv1d over a speculative verify batch: 1 + k tokens a row, a conv state slot a
token.

Row r holds n_r = query_start_loc[r + 1] - query_start_loc[r] packed tokens (1 <= n_r <= S) and
owns S conv state slots state_slots[r, 0..S-1] ([dim, width - 1], the previous width - 1 inputs,
oldest first). Its window starts with slot column num_accepted[idx_mapping[r]] - 1 (the position
its last step accepted); token j's output is the causal conv over that state and tokens 0..j,
and the state as of token j (the last width - 1 inputs up to x_j) goes to slot state_slots[r, j].
A row with idx_mapping -1 or state_slots[r, 0] -1 is skipped: nothing is written and its output
rows are unspecified; so are those of tokens past S. Math is float32; outputs in x's dtype.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton
from krait.ops.causal_conv1d import _check_activation, causal_conv1d_update_ref
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.verify_ref import verify_start_states

# ----------------------------------------------------------------------------- triton


@triton.jit
def _conv_verify_kernel(
    x_ptr, w_ptr, b_ptr, states_ptr, out_ptr,
    qsl_ptr, slots_ptr, num_acc_ptr, idx_ptr,
    dim, num_cols, stride_x_t, stride_x_d, stride_w_d, stride_w_k,
    stride_s_slot, stride_s_d, stride_s_k, stride_o_t, stride_sl_r, stride_sl_c,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # One program: batch row r x BLOCK_D channels, all of the row's tokens at once. A conv
    # carries no recurrence: token j's window (its last WIDTH inputs, oldest first) is read
    # whole, from the row's tokens and the source state, and the state after token j is
    # columns 1.. of that window; so every read lands before the first write.
    r = tl.program_id(0)
    req = tl.load(idx_ptr + r)
    slots_row = slots_ptr + r * stride_sl_r
    first = tl.load(slots_row)
    if (req >= 0) & (first >= 0):
        col = tl.minimum(tl.maximum(tl.load(num_acc_ptr + req) - 1, 0), num_cols - 1)
        src = tl.load(slots_row + col * stride_sl_c)
        start = tl.load(qsl_ptr + r)
        n = tl.minimum(tl.load(qsl_ptr + r + 1) - start, num_cols)
        chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        toks = tl.arange(0, BLOCK_T)  # position j in the row
        taps = tl.arange(0, BLOCK_W)
        ch3 = chans[:, None, None]
        ok = (ch3 < dim) & (toks < n)[None, :, None] & (taps < WIDTH)[None, None, :]
        # [1, BLOCK_T, BLOCK_W]: what tap k of token j reads, the row's token v (or, where
        # v < 0, column v + WIDTH - 1 of the source state)
        v = toks[None, :, None] + taps[None, None, :] - (WIDTH - 1)
        xv = tl.load(x_ptr + (start + v).to(tl.int64) * stride_x_t + ch3 * stride_x_d,
                     mask=ok & (v >= 0), other=0.0)
        sv = tl.load(states_ptr + tl.maximum(src, 0).to(tl.int64) * stride_s_slot
                     + ch3 * stride_s_d + (v + WIDTH - 1) * stride_s_k, mask=ok & (v < 0),
                     other=0.0)
        win = xv.to(tl.float32) + sv.to(tl.float32)  # [BLOCK_D, BLOCK_T, BLOCK_W] the windows
        ch_ok = chans < dim
        w = tl.load(w_ptr + chans[:, None] * stride_w_d + taps[None, :] * stride_w_k,
                    mask=ch_ok[:, None] & (taps < WIDTH)[None, :], other=0.0)
        acc = tl.sum(win * w.to(tl.float32)[:, None, :], axis=2)  # [BLOCK_D, BLOCK_T]
        if HAS_BIAS:
            acc += tl.load(b_ptr + chans, mask=ch_ok, other=0.0).to(tl.float32)[:, None]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tok_ok = toks < n
        tl.store(out_ptr + (start + toks).to(tl.int64)[None, :] * stride_o_t + chans[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=ch_ok[:, None] & tok_ok[None, :])
        dst = tl.load(slots_row + toks * stride_sl_c, mask=tok_ok, other=-1)  # [BLOCK_T]
        dst3 = tl.maximum(dst, 0).to(tl.int64)[None, :, None]
        # the source slot may be a destination too (column 0 when nothing was accepted): every
        # thread's read of it lands before any thread's store
        tl.debug_barrier()
        tl.store(states_ptr + dst3 * stride_s_slot + ch3 * stride_s_d + (taps - 1)[None, None, :]
                 * stride_s_k, win.to(states_ptr.dtype.element_ty),
                 mask=ok & (taps >= 1)[None, None, :] & (dst >= 0)[None, :, None])


def causal_conv1d_verify_triton(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
    query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor, idx_mapping: Tensor,
    activation: str | None = "silu", block_d: int | None = None,
) -> Tensor:
    """Triton launcher of `causal_conv1d_verify`; returns [T, dim]. `block_d` overrides the
    channels a program (scripts/bench_ssm_verify.py sweeps it)."""
    silu = _check_activation(activation)
    num_tokens, dim = x.shape
    width = weight.shape[1]
    rows, num_cols = state_slots.shape
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)  # [T, dim]
    if num_tokens == 0 or rows == 0:
        return out
    slots = state_slots.to(torch.int32)
    # 128 channels (4 warps): 56 registers a thread for a channel-last bf16 state, compiled for
    # sm_90 with tests/ops/sm90.py (96 at 256), and twice the programs at batch 1
    block_d = block_d or min(next_pow2(dim), 1024 if interpreting() else 128)
    _conv_verify_kernel[(rows, cdiv(dim, block_d))](
        x, weight, bias if bias is not None else weight, conv_state, out,
        query_start_loc.to(torch.int32), slots, num_accepted.to(torch.int32),
        idx_mapping.to(torch.int32),
        dim, num_cols, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        *slots.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_T=next_pow2(num_cols), BLOCK_W=next_pow2(width), BLOCK_D=block_d,
        **pdl_args(use_pdl(x)),
    )
    return out


# ----------------------------------------------------------------------------- torch reference


def causal_conv1d_verify_ref(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
    query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor, idx_mapping: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Torch reference of `causal_conv1d_verify`: the rows' running states in a float32 scratch
    [R, dim, width - 1], advanced one token position at a time by `causal_conv1d_update_ref`
    (all rows still holding a token at that position at once)."""
    _check_activation(activation)
    rows, num_cols = state_slots.shape
    out = torch.zeros_like(x)  # [T, dim]
    if rows == 0 or x.shape[0] == 0:
        return out
    qsl = query_start_loc.long()
    # scratch [R, dim, width - 1]
    slots, live, scratch = verify_start_states(conv_state, state_slots, num_accepted, idx_mapping)
    lens = (qsl[1:] - qsl[:-1]).clamp(max=num_cols)  # [R]
    row_ids = torch.arange(rows, device=x.device)
    for j in range(int(lens.max())):
        act = row_ids[live & (lens > j)]  # rows with a token at position j
        if act.numel() == 0:
            continue
        tok = qsl[act] + j  # [n]
        out[tok] = causal_conv1d_update_ref(x[tok], scratch, weight, bias, act.to(torch.int32),
                                            activation)
        dst = slots[act, j]
        keep = dst >= 0
        conv_state[dst[keep]] = scratch[act[keep]].to(conv_state.dtype)
    return out


# ----------------------------------------------------------------------------- public


def causal_conv1d_verify(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
    query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor, idx_mapping: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """The conv of a verify batch (1 + k tokens a row): x [T, dim] -> [T, dim].

    conv_state [num_slots, dim, width - 1] updated in place (any strides: the engine's is a
    transposed channel-last view); weight [dim, width]; bias [dim] or None; activation None or
    "silu"; query_start_loc int32 [R + 1]; state_slots int32 [R, S]: row r's window starts with
    slot state_slots[r, num_accepted[idx_mapping[r]] - 1] and its state after token j goes to
    state_slots[r, j]; num_accepted int32 [max_reqs] (1..S); idx_mapping int32 [R] (-1: skip
    the row, as is a row whose state_slots[r, 0] is -1).
    """
    if use_triton(x):
        return causal_conv1d_verify_triton(x, conv_state, weight, bias, query_start_loc,
                                           state_slots, num_accepted, idx_mapping, activation)
    return causal_conv1d_verify_ref(x, conv_state, weight, bias, query_start_loc, state_slots,
                                    num_accepted, idx_mapping, activation)

"""Depthwise causal conv1d of Mamba2 over packed varlen batches, with per-sequence state slots.

Sequence b covers tokens query_start_loc[b]:query_start_loc[b + 1] and owns conv state slot
state_indices[b] ([dim, width - 1], the previous width - 1 inputs, oldest first). A slot of -1 marks
a padding row: nothing is computed or written for it and its output rows are unspecified. A
sequence whose has_initial_state is False starts from zeros whatever its slot holds. Sequences of
zero tokens are left alone. Math is float32; outputs are in x's dtype.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl


def _activate(y: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


def _check_activation(activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    return activation is not None


# ----------------------------------------------------------------------------- triton


@triton.jit
def _conv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, states_ptr, out_ptr,
    qsl_ptr, token_seq_ptr, slots_ptr, has_init_ptr,
    num_tokens, num_seqs, dim,
    stride_x_t, stride_x_d, stride_w_d, stride_w_k,
    stride_s_slot, stride_s_d, stride_s_k, stride_o_t,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_T packed tokens (possibly of several sequences) x BLOCK_D channels.
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chans < dim
    seq = tl.load(token_seq_ptr + toks, mask=toks < num_tokens, other=num_seqs)
    seq_ok = seq < num_seqs
    seq_c = tl.where(seq_ok, seq, 0)
    slot = tl.load(slots_ptr + seq_c, mask=seq_ok, other=-1)
    row_ok = seq_ok & (slot >= 0)
    start = tl.load(qsl_ptr + seq_c, mask=row_ok, other=0)
    has_init = tl.load(has_init_ptr + seq_c, mask=row_ok, other=0) != 0
    slot64 = tl.where(row_ok, slot, 0).to(tl.int64)

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)  # [tokens, channels]
    if HAS_BIAS:
        acc += tl.load(b_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        src = toks - (WIDTH - 1) + k
        in_seq = src >= start
        m_x = (row_ok & in_seq)[:, None] & chan_ok[None, :]
        xv = tl.load(
            x_ptr + src.to(tl.int64)[:, None] * stride_x_t + chans[None, :] * stride_x_d,
            mask=m_x, other=0.0,
        )
        # Inputs before the sequence start come from the slot: column width - 1 + (src - start).
        col = WIDTH - 1 + src - start
        m_s = (row_ok & ~in_seq & has_init)[:, None] & chan_ok[None, :]
        sv = tl.load(
            states_ptr + slot64[:, None] * stride_s_slot + chans[None, :] * stride_s_d
            + col[:, None] * stride_s_k,
            mask=m_s, other=0.0,
        )
        w = tl.load(w_ptr + chans * stride_w_d + k * stride_w_k, mask=chan_ok, other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w.to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + toks.to(tl.int64)[:, None] * stride_o_t + chans[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & chan_ok[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr, states_ptr, qsl_ptr, slots_ptr, has_init_ptr,
    dim, stride_x_t, stride_x_d, stride_s_slot, stride_s_d, stride_s_k,
    STATE_LEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: the new state of one sequence for BLOCK_D channels (old state read first).
    seq = tl.program_id(0)
    slot = tl.load(slots_ptr + seq)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    if (slot >= 0) & (end > start):
        has_init = tl.load(has_init_ptr + seq) != 0
        chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cols = tl.arange(0, BLOCK_K)
        base = states_ptr + slot.to(tl.int64) * stride_s_slot + chans[:, None] * stride_s_d
        ok = (chans < dim)[:, None] & (cols < STATE_LEN)[None, :]
        src = end - STATE_LEN + cols  # [BLOCK_K] packed token of new column j
        from_x = src >= start
        xv = tl.load(
            x_ptr + src.to(tl.int64)[None, :] * stride_x_t + chans[:, None] * stride_x_d,
            mask=ok & from_x[None, :], other=0.0,
        )
        old_col = cols + (end - start)
        sv = tl.load(
            base + old_col[None, :] * stride_s_k, mask=ok & (~from_x & has_init)[None, :], other=0.0
        )
        new = xv.to(tl.float32) + sv.to(tl.float32)  # [BLOCK_D, BLOCK_K]
        # in place: every thread's reads of the old columns land before any thread writes (the
        # layout may spread a channel's columns over warps, as with channel-last states)
        tl.debug_barrier()
        tl.store(base + cols[None, :] * stride_s_k, new.to(states_ptr.dtype.element_ty), mask=ok)


@triton.jit
def conv_operands(st_ptr, w_ptr, b_ptr, ch, ok, cols, stride_w_d, stride_w_k, stride_s_d,
                  stride_s_k, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """What a decode step of the conv reads besides the new input, for channels `ch`: the
    state as the window's first WIDTH - 1 columns and shifted by one, [C, BLOCK_W] float32
    (0 in the columns the new input fills), the weights [C, BLOCK_W] and the bias [C] float32
    (0 without one). A kernel under PDL may load them before its wait: only this layer's conv
    step of an earlier step wrote the state."""
    base = st_ptr + ch[:, None] * stride_s_d
    win_ok = ok[:, None] & (cols < WIDTH - 1)[None, :]
    window = tl.load(base + cols[None, :] * stride_s_k, mask=win_ok, other=0.0).to(tl.float32)
    shifted_ok = ok[:, None] & (cols < WIDTH - 2)[None, :]
    shifted = tl.load(base + (cols + 1)[None, :] * stride_s_k, mask=shifted_ok,
                      other=0.0).to(tl.float32)
    w = tl.load(w_ptr + ch[:, None] * stride_w_d + cols[None, :] * stride_w_k,
                mask=ok[:, None] & (cols < WIDTH)[None, :], other=0.0).to(tl.float32)
    bias = tl.zeros_like(ch).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + ch, mask=ok, other=0.0).to(tl.float32)
    return window, shifted, w, bias


@triton.jit
def conv_apply(x, window, shifted, w, bias, cols, WIDTH: tl.constexpr, SILU: tl.constexpr):
    """`conv_step` on loaded operands (`conv_operands`)."""
    window = tl.where((cols == WIDTH - 1)[None, :], x[:, None], window)  # [C, BLOCK_W]
    shifted = tl.where((cols == WIDTH - 2)[None, :], x[:, None], shifted)
    acc = tl.sum(window * w, axis=1) + bias  # [C]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc, shifted


@triton.jit
def conv_step(x, st_ptr, w_ptr, b_ptr, ch, ok, cols, stride_w_d, stride_w_k, stride_s_d,
              stride_s_k, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One decode token of the conv for channels `ch` (x [C]: their new inputs in float32;
    st_ptr: the slot's state, column k = input k, oldest first). Returns (the activated output
    [C] float32, the slot's next state [C, BLOCK_W]) for `store_conv_state`."""
    window, shifted, w, bias = conv_operands(st_ptr, w_ptr, b_ptr, ch, ok, cols, stride_w_d,
                                             stride_w_k, stride_s_d, stride_s_k, WIDTH,
                                             HAS_BIAS)
    return conv_apply(x, window, shifted, w, bias, cols, WIDTH, SILU)


@triton.jit
def store_conv_state(st_ptr, shifted, ch, ok, cols, stride_s_d, stride_s_k,
                     WIDTH: tl.constexpr):
    """Writes `conv_step`'s next state in place. The barrier puts every thread's reads of the
    old columns first: the layout may spread a channel's columns over warps (channel-last
    states)."""
    tl.debug_barrier()
    tl.store(st_ptr + ch[:, None] * stride_s_d + cols[None, :] * stride_s_k,
             shifted.to(st_ptr.dtype.element_ty), mask=ok[:, None] & (cols < WIDTH - 1)[None, :])


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, b_ptr, states_ptr, out_ptr, slots_ptr,
    dim, stride_x_b, stride_x_d, stride_w_d, stride_w_k,
    stride_s_slot, stride_s_d, stride_s_k, stride_o_b,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # One program: one batch row x BLOCK_D channels.
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        chan_ok = chans < dim
        cols = tl.arange(0, BLOCK_K)
        st = states_ptr + slot.to(tl.int64) * stride_s_slot
        x = tl.load(x_ptr + row * stride_x_b + chans * stride_x_d, mask=chan_ok, other=0.0)
        acc, shifted = conv_step(x.to(tl.float32), st, w_ptr, b_ptr, chans, chan_ok, cols,
                                 stride_w_d, stride_w_k, stride_s_d, stride_s_k, WIDTH,
                                 HAS_BIAS, SILU)
        tl.store(out_ptr + row * stride_o_b + chans, acc.to(out_ptr.dtype.element_ty), mask=chan_ok)
        store_conv_state(st, shifted, chans, chan_ok, cols, stride_s_d, stride_s_k, WIDTH)


def token_to_seq(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    """int32 [num_tokens]: the sequence of each packed token (B for tokens past the last one)."""
    toks = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), toks, right=True).to(torch.int32)


def causal_conv1d_fn_triton(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    activation: str | None = "silu", token_seq: Tensor | None = None,
) -> Tensor:
    """Triton launcher of `causal_conv1d_fn`. `token_seq`: token_to_seq(...) of this batch when
    the caller already has it."""
    silu = _check_activation(activation)
    num_tokens, dim = x.shape
    width = weight.shape[1]
    num_seqs = state_indices.shape[0]
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)  # [T, dim]
    if num_tokens == 0 or num_seqs == 0:
        return out
    qsl = query_start_loc.to(torch.int32)
    slots = state_indices.to(torch.int32)
    has_init = has_initial_state.to(torch.int32)
    bias_arg = bias if bias is not None else weight
    block_d = min(next_pow2(dim), 256)
    block_t = 32 if interpreting() else 16
    # 8 warps: at 4 the [16, 256] tile with its per-tap pointer tensors took 187 registers a
    # thread (~10 resident warps an SM for a memory-bound kernel; 103 registers at 8 warps,
    # compiled for sm_90 with tests/ops/sm90.py)
    opts = {} if interpreting() else {"num_warps": 8}
    _conv_fwd_kernel[(cdiv(num_tokens, block_t), cdiv(dim, block_d))](
        x, weight, bias_arg, conv_states, out,
        qsl, token_seq if token_seq is not None else token_to_seq(qsl, num_tokens), slots, has_init,
        num_tokens, num_seqs, dim,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=block_t, BLOCK_D=block_d,
        **opts,
    )
    if width > 1:
        block_sd = min(next_pow2(dim), 1024)
        _conv_state_kernel[(num_seqs, cdiv(dim, block_sd))](
            x, conv_states, qsl, slots, has_init,
            dim, x.stride(0), x.stride(1),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            STATE_LEN=width - 1, BLOCK_K=next_pow2(width - 1), BLOCK_D=block_sd,
        )
    return out


def causal_conv1d_update_triton(
    x: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
    state_indices: Tensor, activation: str | None = "silu",
) -> Tensor:
    """Triton launcher of `causal_conv1d_update`."""
    silu = _check_activation(activation)
    batch, dim = x.shape
    width = weight.shape[1]
    out = torch.empty((batch, dim), dtype=x.dtype, device=x.device)  # [B, dim]
    if batch == 0:
        return out
    block_d = min(next_pow2(dim), 1024 if interpreting() else 256)
    pdl = use_pdl(x)
    _conv_update_kernel[(batch, cdiv(dim, block_d))](
        x, weight, bias if bias is not None else weight, conv_states, out,
        state_indices.to(torch.int32),
        dim, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_K=next_pow2(width), BLOCK_D=block_d, **pdl_args(pdl),
    )
    return out


# ----------------------------------------------------------------------------- torch reference


def causal_conv1d_fn_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Torch reference of `causal_conv1d_fn` (one F.conv1d per sequence)."""
    _check_activation(activation)
    dim, width = weight.shape
    out = torch.zeros_like(x)  # [T, dim]
    w = weight.float().unsqueeze(1)  # [dim, 1, width]
    b = bias.float() if bias is not None else None
    bounds = query_start_loc.tolist()
    for i, (slot, init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        start, end = bounds[i], bounds[i + 1]
        if slot < 0 or end <= start:
            continue
        if init:
            prev = conv_states[slot].float()
        else:
            prev = torch.zeros(dim, width - 1, device=x.device)  # [dim, width - 1]
        full = torch.cat([prev, x[start:end].float().t()], dim=1)  # [dim, width - 1 + L]
        y = F.conv1d(full.unsqueeze(0), w, b, groups=dim)[0]  # [dim, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot] = full[:, full.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
    state_indices: Tensor, activation: str | None = "silu",
) -> Tensor:
    """Torch reference of `causal_conv1d_update`."""
    _check_activation(activation)
    out = torch.zeros_like(x)  # [B, dim]
    rows = (state_indices >= 0).nonzero().squeeze(1)
    slots = state_indices[rows].long()
    window = torch.cat([conv_states[slots].float(), x[rows].float().unsqueeze(-1)], dim=-1)
    y = (window * weight.float()).sum(-1)  # [n, dim]
    if bias is not None:
        y = y + bias.float()
    out[rows] = _activate(y, activation).to(x.dtype)
    conv_states[slots] = window[..., 1:].to(conv_states.dtype)
    return out


# ----------------------------------------------------------------------------- public


def causal_conv1d_fn(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    activation: str | None = "silu", token_seq: Tensor | None = None,
) -> Tensor:
    """Varlen causal depthwise conv (prefill) with state slots; returns [T, dim].

    x [T, dim] packed tokens; weight [dim, width]; bias [dim] or None;
    conv_states [num_slots, dim, width - 1] updated in place: afterwards slot state_indices[b]
    holds the last width - 1 inputs of sequence b (older state included when it is shorter);
    query_start_loc int32 [B + 1]; state_indices int32 [B] (-1: skip); has_initial_state bool [B].
    """
    if use_triton(x):
        return causal_conv1d_fn_triton(
            x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state,
            activation, token_seq,
        )
    return causal_conv1d_fn_ref(
        x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state, activation
    )


def causal_conv1d_update(
    x: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
    state_indices: Tensor, activation: str | None = "silu",
) -> Tensor:
    """One decode token per row: x [B, dim] -> [B, dim]; slot state_indices[b] shifts by one.

    Rows with state_indices -1 are skipped (their output rows are unspecified).
    """
    if use_triton(x):
        return causal_conv1d_update_triton(x, conv_states, weight, bias, state_indices, activation)
    return causal_conv1d_update_ref(x, conv_states, weight, bias, state_indices, activation)

"""Mamba2 state update over a speculative verify batch: 1 + k tokens a row, a state slot a token.

Row r holds n_r = query_start_loc[r + 1] - query_start_loc[r] packed tokens (1 <= n_r <= S) and
owns S state slots state_slots[r, 0..S-1]. It starts from the state in slot column
num_accepted[idx_mapping[r]] - 1 (the position its last step accepted), advances it token by
token with `selective_state_update`'s recurrence, and writes the state as of token j to slot
state_slots[r, j]. The running state stays in float32 between tokens (it is rounded to the
state's dtype only where it is stored). A row with idx_mapping -1 or state_slots[r, 0] -1 is
skipped: nothing is written and its output rows are unspecified; so are those of tokens past S.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.selective_state_update import (
    _block_p,
    selective_state_update_ref,
    ssu_advance,
    ssu_warps,
)
from krait.ops.verify_ref import verify_start_states

# ----------------------------------------------------------------------------- triton


@triton.jit
def _ssv_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr,
    qsl_ptr, slots_ptr, num_acc_ptr, idx_ptr,
    head_dim, d_state, heads_per_group, num_cols, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h, stride_sl_r, stride_sl_c,
    DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # One program: batch row r, head h, BLOCK_P rows of the [P, N] state (all of N), over the
    # row's tokens with the state tile in registers.
    r = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(idx_ptr + r)
    slots_row = slots_ptr + r * stride_sl_r
    first = tl.load(slots_row)
    if (req >= 0) & (first >= 0):
        col = tl.minimum(tl.maximum(tl.load(num_acc_ptr + req) - 1, 0), num_cols - 1)
        src = tl.load(slots_row + col * stride_sl_c)
        start = tl.load(qsl_ptr + r)
        n = tl.minimum(tl.load(qsl_ptr + r + 1) - start, num_cols)
        offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        p_ok = offs_p < head_dim
        n_ok = offs_n < d_state
        tile_ok = p_ok[:, None] & n_ok[None, :]
        tile = h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
        state = tl.load(state_ptr + tl.maximum(src, 0).to(tl.int64) * stride_s_slot + tile,
                        mask=tile_ok, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
        a_h = tl.load(A_ptr + h).to(tl.float32)
        d_h = tl.load(D_ptr + h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias_ptr + h).to(tl.float32)
        g = h // heads_per_group
        # the source slot may be a destination too (column 0 when nothing was accepted): every
        # thread's read of it lands before any thread's first store
        tl.debug_barrier()
        for j in range(0, n):
            t = start + j
            x = tl.load(x_ptr + t * stride_x_t + h * stride_x_h + offs_p * stride_x_p,
                        mask=p_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + t * stride_dt_t + h * stride_dt_h).to(tl.float32)
            bv = tl.load(B_ptr + t * stride_B_t + g * stride_B_g + offs_n * stride_B_n,
                         mask=n_ok, other=0.0).to(tl.float32)
            cv = tl.load(C_ptr + t * stride_C_t + g * stride_C_g + offs_n * stride_C_n,
                         mask=n_ok, other=0.0).to(tl.float32)
            state, y = ssu_advance(state, x, dt + dt_bias_h, bv, cv, a_h, d_h, dt_min, dt_max,
                                   DT_SOFTPLUS, DT_CLAMP)
            tl.store(y_ptr + t * stride_y_t + h * stride_y_h + offs_p,
                     y.to(y_ptr.dtype.element_ty), mask=p_ok)
            dst = tl.load(slots_row + j * stride_sl_c)
            tl.store(state_ptr + tl.maximum(dst, 0).to(tl.int64) * stride_s_slot + tile,
                     state.to(state_ptr.dtype.element_ty), mask=tile_ok & (dst >= 0))


def selective_state_verify_triton(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor,
    idx_mapping: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Triton launcher of `selective_state_verify`; returns y [T, H, P]."""
    num_tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    rows, num_cols = state_slots.shape
    y = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)  # [T, H, P]
    if num_tokens == 0 or rows == 0:
        return y
    slots = state_slots.to(torch.int32)
    block_p = _block_p(head_dim, d_state, ssm_state.element_size())
    clamp = dt_limit != (0.0, float("inf"))
    grid = (rows, heads, cdiv(head_dim, block_p))
    _ssv_kernel[grid](
        ssm_state, x, dt, A, B, C, D, dt_bias, y,
        query_start_loc.to(torch.int32), slots, num_accepted.to(torch.int32),
        idx_mapping.to(torch.int32),
        head_dim, d_state, heads // groups, num_cols,
        float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
        *ssm_state.stride(), *x.stride(), *dt.stride()[:2], *B.stride(), *C.stride(),
        *y.stride()[:2], *slots.stride(),
        DT_SOFTPLUS=dt_softplus, DT_CLAMP=clamp, BLOCK_P=block_p,
        BLOCK_N=next_pow2(d_state), **pdl_args(use_pdl(x)),
        num_warps=ssu_warps(grid[0] * grid[1] * grid[2]),
    )
    return y


# ----------------------------------------------------------------------------- torch reference


def selective_state_verify_ref(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor,
    idx_mapping: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Torch reference of `selective_state_verify`: the rows' running states in a float32
    scratch [R, H, P, N], advanced one token position at a time by
    `selective_state_update_ref` (all rows still holding a token at that position at once)."""
    rows, num_cols = state_slots.shape
    y = torch.zeros_like(x)  # [T, H, P]
    if rows == 0 or x.shape[0] == 0:
        return y
    qsl = query_start_loc.long()
    # scratch [R, H, P, N]
    slots, live, scratch = verify_start_states(ssm_state, state_slots, num_accepted, idx_mapping)
    lens = (qsl[1:] - qsl[:-1]).clamp(max=num_cols)  # [R]
    row_ids = torch.arange(rows, device=x.device)
    for j in range(int(lens.max())):
        act = row_ids[live & (lens > j)]  # rows with a token at position j
        if act.numel() == 0:
            continue
        tok = qsl[act] + j  # [n]
        y[tok] = selective_state_update_ref(
            scratch, x[tok], dt[tok], A, B[tok], C[tok], D, dt_bias, act.to(torch.int32),
            dt_softplus, dt_limit,
        )
        dst = slots[act, j]
        keep = dst >= 0
        ssm_state[dst[keep]] = scratch[act[keep]].to(ssm_state.dtype)
    return y


# ----------------------------------------------------------------------------- public


def selective_state_verify(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor,
    idx_mapping: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """The selective state update of a verify batch (1 + k tokens a row); returns y [T, H, P]
    in x's dtype.

    ssm_state [num_slots, H, P, N] (fp32 or bf16) updated in place; x [T, H, P]; dt [T, H]
    raw; A (float32, -exp(A_log)), D, dt_bias [H]; B, C [T, G, N]; query_start_loc int32
    [R + 1]; state_slots int32 [R, S]: row r reads slot state_slots[r, num_accepted[
    idx_mapping[r]] - 1] and writes its state after token j to state_slots[r, j];
    num_accepted int32 [max_reqs] (1..S); idx_mapping int32 [R] (-1: skip the row, as is a
    row whose state_slots[r, 0] is -1).
    """
    if use_triton(x):
        return selective_state_verify_triton(
            ssm_state, x, dt, A, B, C, D, dt_bias, query_start_loc, state_slots, num_accepted,
            idx_mapping, dt_softplus, dt_limit,
        )
    return selective_state_verify_ref(
        ssm_state, x, dt, A, B, C, D, dt_bias, query_start_loc, state_slots, num_accepted,
        idx_mapping, dt_softplus, dt_limit,
    )

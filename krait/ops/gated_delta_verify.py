"""Gated delta rule over a speculative verify batch: 1 + k tokens a row, a state slot a token.

Row r holds n_r = query_start_loc[r + 1] - query_start_loc[r] packed tokens (1 <= n_r <= S) and
owns S state slots state_slots[r, 0..S-1]. It starts from the state in slot column
num_accepted[idx_mapping[r]] - 1 (the position its last step accepted), advances it token by
token with `gated_delta_update`'s step, and writes the state as of token j to slot
state_slots[r, j]. The running state stays float32 between tokens. A row with idx_mapping -1 or
state_slots[r, 0] -1 is skipped: nothing is written and its output rows are unspecified; so are
those of tokens past S. No host synchronisation: usable inside the verify CUDA graphs.
With `A_log` and `dt_bias` given, g and beta are the raw gate inputs a and b, and the kernel forms
the gates as `gated_delta_update` does (`gdn_gate`). Blocks: `gated_delta_update.state_blocks`.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, num_sms, use_triton
from krait.ops.gated_delta_update import (
    gated_delta_update_ref,
    gdn_gate,
    gdn_gate_ref,
    state_blocks,
)
from krait.ops.verify_ref import verify_start_states

# ----------------------------------------------------------------------------- triton


@triton.jit
def _gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, qsl_ptr, slots_ptr, acc_ptr, idx_ptr,
    scale, key_dim, value_dim, v_per_k, num_cols,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_beta_t, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_s_k, stride_slots_r, alog_ptr, dtb_ptr,
    QK_L2NORM: tl.constexpr, GATE: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # One program: verify row r, value head h, BV columns of its [K, V] state; tokens in order.
    r = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(idx_ptr + r)
    slot_row = slots_ptr + r * stride_slots_r
    live = (req >= 0) & (tl.load(slot_row) >= 0)
    bos = tl.load(qsl_ptr + r)
    n = tl.where(live, tl.minimum(tl.load(qsl_ptr + r + 1) - bos, num_cols), 0)
    col = tl.load(acc_ptr + tl.maximum(req, 0), mask=live, other=1) - 1
    col = tl.minimum(tl.maximum(col, 0), num_cols - 1)
    src = tl.load(slot_row + col)
    hk = h // v_per_k
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = offs_k < key_dim
    v_ok = offs_v < value_dim
    tile = h * stride_s_h + offs_k[:, None] * stride_s_k + offs_v[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    S = tl.load(state_ptr + tl.maximum(src, 0).to(tl.int64) * stride_s_slot + tile,
                mask=tile_ok & live & (src >= 0), other=0.0).to(tl.float32)  # [BK, BV]
    if GATE:
        a_log = tl.load(alog_ptr + h).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for j in range(0, n):
        t = (bos + j).to(tl.int64)
        q = tl.load(q_ptr + t * stride_q_t + hk * stride_q_h + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)  # [BK]
        k = tl.load(k_ptr + t * stride_k_t + hk * stride_k_h + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_v_t + h * stride_v_h + offs_v, mask=v_ok,
                    other=0.0).to(tl.float32)  # [BV]
        g = tl.load(g_ptr + t * stride_g_t + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_beta_t + h).to(tl.float32)
        if GATE:
            g, beta = gdn_gate(g, beta, a_log, dt_bias, beta_ptr.dtype.element_ty)
        if QK_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k[:, None], 0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], 0)  # [BV]
        tl.store(o_ptr + t * stride_o_t + h * stride_o_h + offs_v,
                 o.to(o_ptr.dtype.element_ty), mask=v_ok)
        dst = tl.load(slot_row + j)
        tl.store(state_ptr + tl.maximum(dst, 0).to(tl.int64) * stride_s_slot + tile,
                 S.to(state_ptr.dtype.element_ty), mask=tile_ok & (dst >= 0))


def gated_delta_verify_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor, idx_mapping: Tensor,
    scale: float | None = None, qk_l2norm: bool = True,
    A_log: Tensor | None = None, dt_bias: Tensor | None = None,
) -> Tensor:
    """Triton launcher of `gated_delta_verify`."""
    T, hk, K = q.shape
    hv, V = v.shape[1], v.shape[2]
    o = torch.empty(T, hv, V, dtype=v.dtype, device=v.device)  # [T, Hv, V]
    rows, num_cols = state_slots.shape
    if rows == 0 or T == 0:
        return o
    for t in (q, k, v):
        assert t.stride(-1) == 1, "gated_delta_verify: the last dim must be contiguous"
    assert states.stride(-1) == 1 and state_slots.stride(-1) == 1
    bk, bv = state_blocks(K, V, rows * hv, num_sms(v.device))
    gate = A_log is not None
    if gate:
        assert dt_bias is not None and A_log.is_contiguous() and dt_bias.is_contiguous()
    _gdn_verify_kernel[(rows, hv, cdiv(V, bv))](
        q, k, v, g, beta, o, states, query_start_loc, state_slots, num_accepted, idx_mapping,
        float(scale if scale is not None else K ** -0.5), K, V, hv // hk, num_cols,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), states.stride(2), state_slots.stride(0),
        A_log if gate else g, dt_bias if gate else g,
        QK_L2NORM=qk_l2norm, GATE=gate, BK=bk, BV=bv,
    )
    return o


# ----------------------------------------------------------------------------- torch reference


def gated_delta_verify_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor, idx_mapping: Tensor,
    scale: float | None = None, qk_l2norm: bool = True,
    A_log: Tensor | None = None, dt_bias: Tensor | None = None,
) -> Tensor:
    """Torch reference of `gated_delta_verify`: the rows' running states in a float32 scratch
    [R, Hv, K, V], advanced one token position at a time by `gated_delta_update_ref`."""
    if A_log is not None:
        g, beta = gdn_gate_ref(g, beta, A_log, dt_bias)
    rows, num_cols = state_slots.shape
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # [T, Hv, V]
    if rows == 0 or v.shape[0] == 0:
        return o
    qsl = query_start_loc.long()
    # scratch [R, Hv, K, V]
    slots, live, scratch = verify_start_states(states, state_slots, num_accepted, idx_mapping)
    lens = (qsl[1:] - qsl[:-1]).clamp(max=num_cols)  # [R]
    row_ids = torch.arange(rows, device=v.device)
    for j in range(int(lens.max())):
        act = row_ids[live & (lens > j)]  # rows with a token at position j
        if act.numel() == 0:
            continue
        tok = qsl[act] + j  # [n]
        o[tok] = gated_delta_update_ref(q[tok], k[tok], v[tok], g[tok], beta[tok], scratch,
                                        act.to(torch.int32), scale, qk_l2norm)
        dst = slots[act, j]
        keep = dst >= 0
        states[dst[keep]] = scratch[act[keep]].to(states.dtype)
    return o


# ----------------------------------------------------------------------------- public


def gated_delta_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_slots: Tensor, num_accepted: Tensor, idx_mapping: Tensor,
    scale: float | None = None, qk_l2norm: bool = True,
    A_log: Tensor | None = None, dt_bias: Tensor | None = None,
) -> Tensor:
    """Verify rows of 1 + k tokens: q, k [T, Hk, K]; v [T, Hv, V]; g [T, Hv] float32; beta
    [T, Hv]; states [num_slots, Hv, K, V]; query_start_loc int32 [R + 1]; state_slots int32
    [R, S]; num_accepted int32 [max_reqs] (1..S, by req_state_idx); idx_mapping int32 [R] (-1:
    skip); with A_log, dt_bias [Hv]: g and beta are the raw gate inputs a, b [T, Hv]. Returns
    o [T, Hv, V] in v's dtype; the state after token j lands in slot column j."""
    if use_triton(v):
        return gated_delta_verify_triton(q, k, v, g, beta, states, query_start_loc, state_slots,
                                         num_accepted, idx_mapping, scale, qk_l2norm, A_log,
                                         dt_bias)
    return gated_delta_verify_ref(q, k, v, g, beta, states, query_start_loc, state_slots,
                                  num_accepted, idx_mapping, scale, qk_l2norm, A_log, dt_bias)

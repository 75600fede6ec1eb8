"""Gated delta rule over packed varlen prefill batches, with per-sequence state slots
(Gated DeltaNet, Qwen3-Next's linear attention).

Per value head h, with its key head h // (Hv // Hk), for every token t of a sequence:
  q, k = l2norm(q_t), l2norm(k_t) (eps 1e-6 inside the rsqrt), q *= scale (K ** -0.5 by default)
  S = exp(g_t) S;  S += k (beta_t (v_t - S^T k))^T;  o_t = S^T q
S is the head's [K, V] state. Sequence b covers tokens query_start_loc[b]:query_start_loc[b + 1];
it starts from states[state_indices[b]] when has_initial_state[b] (zeros otherwise) and leaves
its final state there (a sequence of zero tokens is left alone). A slot of -1 marks a padding row: nothing is computed or written for it
and its output rows are unspecified. Math is float32; o is in v's dtype; the state is read and
written in its own dtype.

The Triton kernel processes a sequence in chunks of BT tokens: with gamma the in-chunk cumsum of g
and A[t, j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j) (j < t), the chunk's corrected values are
U = (I + A)^-1 (beta V - beta exp(gamma) K S0), its outputs exp(gamma) Q S0 + (Q K^T * decay) U and
its final state exp(gamma_L) S0 + (K exp(gamma_L - gamma))^T U: no division by a decay, so a decay
that underflows stays exact.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton

L2_EPS = 1e-6

# ----------------------------------------------------------------------------- triton


@triton.jit
def l2_rows(x):
    """Each row of the float32 tile x over its last axis: x * rsqrt(sum(x^2) + 1e-6)."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr,
    scale, key_dim, value_dim, v_per_k,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_b_t, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_s_k,
    QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # One program: sequence s, value head h, BV columns of its [K, V] state; chunks in order.
    s = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + s)
    bos = tl.load(qsl_ptr + s)
    length = tl.where(slot >= 0, tl.load(qsl_ptr + s + 1) - bos, 0)
    hk = h // v_per_k
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = offs_k < key_dim
    v_ok = offs_v < value_dim
    s_ok = k_ok[:, None] & v_ok[None, :] & (slot >= 0)
    s_ptrs = (state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_s_slot + h * stride_s_h
              + offs_k[:, None] * stride_s_k + offs_v[None, :])
    init = tl.load(init_ptr + s) != 0
    S = tl.load(s_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)  # [BK, BV]
    eye = offs_t[:, None] == offs_t[None, :]
    lower = offs_t[:, None] >= offs_t[None, :]
    strict = offs_t[:, None] > offs_t[None, :]
    for c0 in range(0, length, BT):
        t_ok = (c0 + offs_t) < length
        rows = (bos + c0 + offs_t).to(tl.int64)
        qk_mask = t_ok[:, None] & k_ok[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_q_t + hk * stride_q_h + offs_k[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # [BT, BK]
        k = tl.load(k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + offs_k[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # [BT, BK]
        v = tl.load(v_ptr + rows[:, None] * stride_v_t + h * stride_v_h + offs_v[None, :],
                    mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        g = tl.load(g_ptr + rows * stride_g_t + h, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
        beta = tl.load(beta_ptr + rows * stride_b_t + h, mask=t_ok, other=0.0).to(tl.float32)
        if QK_L2NORM:
            q = l2_rows(q)
            k = l2_rows(k)
        q = q * scale
        gam = tl.cumsum(g, 0)  # [BT]; flat past the chunk's end (g = 0 there)
        diff = gam[:, None] - gam[None, :]
        decay = tl.where(lower, tl.exp(tl.where(lower, diff, 0.0)), 0.0)  # [BT, BT]
        kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
        A = tl.where(strict, kk * decay * beta[:, None], 0.0)  # strictly lower [BT, BT]
        # Tinv = (I + A)^-1 by forward substitution: row i = e_i - A[i, :] @ Tinv
        Tinv = tl.where(eye, 1.0, 0.0)
        for i in range(1, BT):
            a_i = tl.sum(tl.where(offs_t[:, None] == i, A, 0.0), axis=0)  # [BT]
            row = tl.where(offs_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Tinv, axis=0)
            Tinv = tl.where(offs_t[:, None] == i, row[None, :], Tinv)
        egam = tl.exp(gam)
        u = tl.dot(Tinv, v * beta[:, None], input_precision=DOT_PRECISION)  # [BT, BV]
        w = tl.dot(Tinv, k * (beta * egam)[:, None], input_precision=DOT_PRECISION)  # [BT, BK]
        U = u - tl.dot(w, S, input_precision=DOT_PRECISION)  # [BT, BV]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay  # [BT, BT]
        o = tl.dot(q * egam[:, None], S, input_precision=DOT_PRECISION)
        o = o + tl.dot(qk, U, input_precision=DOT_PRECISION)  # [BT, BV]
        tl.store(o_ptr + rows[:, None] * stride_o_t + h * stride_o_h + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])
        g_last = tl.sum(g, 0)
        k_tail = k * tl.exp(g_last - gam)[:, None]  # [BT, BK]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k_tail), U, input_precision=DOT_PRECISION)
    tl.store(s_ptrs, S.to(s_ptrs.dtype.element_ty), mask=s_ok & (length > 0))


def _tile(n: int) -> int:
    """A power-of-two tile of at least 16 (tl.dot's minimum) covering n."""
    return max(16, next_pow2(n))


def gated_delta_chunk_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    scale: float | None = None, qk_l2norm: bool = True, chunk_size: int = 64,
) -> Tensor:
    """Triton launcher of `gated_delta_chunk`."""
    T, hk, K = q.shape
    hv, V = v.shape[1], v.shape[2]
    o = torch.empty(T, hv, V, dtype=v.dtype, device=v.device)  # [T, Hv, V]
    nseq = state_indices.shape[0]
    if T == 0 or nseq == 0:
        return o
    interp = interpreting()
    bt = 16 if interp else chunk_size
    bv = _tile(V) if interp else min(_tile(V), 64)
    precision = "ieee" if (interp or v.dtype == torch.float32) else "tf32"
    for t in (q, k, v):
        assert t.stride(-1) == 1, "gated_delta_chunk: the last dim must be contiguous"
    assert states.stride(-1) == 1
    _gdn_chunk_kernel[(nseq, hv, cdiv(V, bv))](
        q, k, v, g, beta, o, states, query_start_loc, state_indices, has_initial_state,
        float(scale if scale is not None else K ** -0.5), K, V, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        QK_L2NORM=qk_l2norm, DOT_PRECISION=precision, BT=bt, BK=_tile(K), BV=bv,
    )
    return o


# ----------------------------------------------------------------------------- torch reference


def l2norm_ref(x: Tensor) -> Tensor:
    """x * rsqrt(sum(x^2, -1) + 1e-6), in x's dtype (HF's and FLA's `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_step_ref(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """One token of every head, float32: S [n, Hv, K, V]; q, k [n, Hv, K] (normed and scaled);
    v [n, Hv, V]; g, beta [n, Hv]. Returns (o [n, Hv, V], the new S)."""
    S = S * g.exp()[..., None, None]
    mem = (S * k[..., None]).sum(-2)  # [n, Hv, V]
    delta = (v - mem) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2), S


def prepare_qkv_ref(q: Tensor, k: Tensor, v: Tensor, scale: float | None, qk_l2norm: bool
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """float32 q, k repeated onto the value heads ([n, Hv, K]), normed and q scaled; v float32."""
    rep = v.shape[1] // q.shape[1]
    qf = q.float().repeat_interleave(rep, 1)
    kf = k.float().repeat_interleave(rep, 1)
    if qk_l2norm:
        qf, kf = l2norm_ref(qf), l2norm_ref(kf)
    return qf * (scale if scale is not None else q.shape[-1] ** -0.5), kf, v.float()


def gated_delta_chunk_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    scale: float | None = None, qk_l2norm: bool = True, chunk_size: int = 64,
) -> Tensor:
    """Torch reference of `gated_delta_chunk`: the exact recurrence, token by token (chunk_size
    is unused)."""
    qf, kf, vf = prepare_qkv_ref(q, k, v, scale, qk_l2norm)
    gf, bf = g.float(), beta.float()
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # [T, Hv, V]
    bounds = query_start_loc.tolist()
    for i, (slot, init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        start, end = bounds[i], bounds[i + 1]
        if slot < 0 or end <= start:
            continue
        S = states[slot].float()[None] if init else torch.zeros_like(states[slot:slot + 1],
                                                                    dtype=torch.float32)
        for t in range(start, end):
            out, S = delta_step_ref(S, qf[t:t + 1], kf[t:t + 1], vf[t:t + 1], gf[t:t + 1],
                                    bf[t:t + 1])
            o[t] = out[0].to(o.dtype)
        states[slot] = S[0].to(states.dtype)
    return o


# ----------------------------------------------------------------------------- public


def gated_delta_chunk(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    scale: float | None = None, qk_l2norm: bool = True, chunk_size: int = 64,
) -> Tensor:
    """Varlen gated delta rule (prefill) with state slots; returns o [T, Hv, V] in v's dtype.

    q, k [T, Hk, K] (raw: l2-normed here when qk_l2norm); v [T, Hv, V] (Hv a multiple of Hk);
    g [T, Hv] float32 log-decay (<= 0); beta [T, Hv]; states [num_slots, Hv, K, V] (final states
    written in place); query_start_loc int32 [B + 1]; state_indices int32 [B] (-1: skip);
    has_initial_state int32/bool [B]. chunk_size: the Triton kernel's chunk (tokens).
    """
    if use_triton(v):
        return gated_delta_chunk_triton(q, k, v, g, beta, states, query_start_loc,
                                        state_indices, has_initial_state, scale, qk_l2norm,
                                        chunk_size)
    return gated_delta_chunk_ref(q, k, v, g, beta, states, query_start_loc, state_indices,
                                 has_initial_state, scale, qk_l2norm)

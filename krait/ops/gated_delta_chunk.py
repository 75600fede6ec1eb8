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

The Triton path processes a sequence in chunks: with gamma the in-chunk cumsum of g and
A[t, j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j) (j < t), the chunk's corrected values are
U = (I + A)^-1 (beta V - beta exp(gamma) K S0), its outputs exp(gamma) Q S0 + (Q K^T * decay) U and
its final state exp(gamma_L) S0 + (K exp(gamma_L - gamma))^T U: no division by a decay, so a decay
that underflows stays exact. Two kernels: the chunks are the BT-token windows of the packed batch
cut at sequence starts, so the part that does not depend on S0 — gamma, (I + A)^-1 by forward
substitution (BT - 1 dependent steps), w = (I + A)^-1 (beta exp(gamma) K) and u = (I + A)^-1
(beta V) — runs for every window and head at once (`_gdn_chunk_prep_kernel`, float32 scratch of
(K + V + 1) floats a token and head); the sequential pass (`_gdn_chunk_kernel`, one program a
sequence, head and V block) is then five tensor-core products a chunk: U = u - w S0, the outputs,
the state.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, num_sms, use_triton

L2_EPS = 1e-6
CHUNK_WARPS = 4  # the sequential pass (sm_90 compile checks: tests/ops/test_sm90_compile.py)

# ----------------------------------------------------------------------------- triton


@triton.jit
def l2_rows(x):
    """Each row of the float32 tile x over its last axis: x * rsqrt(sum(x^2) + 1e-6)."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]


@triton.jit
def _gdn_chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, seq_ptr, slots_ptr, w_ptr, u_ptr, gam_ptr,
    num_tokens, num_seqs, key_dim, value_dim, v_per_k, num_heads,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_b_t,
    QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # One program: window c of BT packed tokens, value head h. The window's pieces of different
    # sequences are independent (A, and so (I + A)^-1, block-diagonal by sequence; gamma restarts
    # at a sequence's start): w = Tinv (beta exp(gamma) K) [BT, K], u = Tinv (beta V) [BT, V]
    # and gamma [BT], all float32, for the sequential pass.
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // v_per_k
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    rows = c * BT + offs_t
    t_ok = rows < num_tokens
    rows = rows.to(tl.int64)
    k_ok = offs_k < key_dim
    seq = tl.load(seq_ptr + rows, mask=t_ok, other=-1)  # [BT]
    # only tokens of live sequences are read: padding rows (past the last sequence, or of a -1
    # slot) may hold anything, and a NaN there would reach the others' rows through the
    # window's products (0 * NaN) though their entries are masked
    in_seq = t_ok & (seq >= 0) & (seq < num_seqs)
    t_ok = in_seq & (tl.load(slots_ptr + seq, mask=in_seq, other=-1) >= 0)
    k = tl.load(k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + offs_k[None, :],
                mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BT, BK]
    g = tl.load(g_ptr + rows * stride_g_t + h, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
    beta = tl.load(beta_ptr + rows * stride_b_t + h, mask=t_ok, other=0.0).to(tl.float32)
    if QK_L2NORM:
        k = l2_rows(k)
    same = seq[:, None] == seq[None, :]
    lower = (offs_t[:, None] >= offs_t[None, :]) & same
    strict = (offs_t[:, None] > offs_t[None, :]) & same
    gam = tl.sum(tl.where(lower, g[None, :], 0.0), axis=1)  # [BT] per-piece cumsum
    decay = tl.where(lower, tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
    A = tl.where(strict, kk * decay * beta[:, None], 0.0)  # strictly lower [BT, BT]
    # Tinv = (I + A)^-1 by forward substitution: row i = e_i - A[i, :] @ Tinv
    Tinv = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(offs_t[:, None] == i, A, 0.0), axis=0)  # [BT]
        row = tl.where(offs_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Tinv, axis=0)
        Tinv = tl.where(offs_t[:, None] == i, row[None, :], Tinv)
    w = tl.dot(Tinv, k * (beta * tl.exp(gam))[:, None], input_precision=DOT_PRECISION)
    out_rows = rows * num_heads + h  # w [T, Hv, K], u [T, Hv, V], gamma [T, Hv], contiguous
    tl.store(w_ptr + out_rows[:, None] * key_dim + offs_k[None, :], w,
             mask=t_ok[:, None] & k_ok[None, :])
    tl.store(gam_ptr + out_rows, gam, mask=t_ok)
    for v0 in range(0, value_dim, BV):
        offs_v = v0 + tl.arange(0, BV)
        vt_ok = t_ok[:, None] & (offs_v < value_dim)[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_v_t + h * stride_v_h + offs_v[None, :],
                    mask=vt_ok, other=0.0).to(tl.float32)  # [BT, BV]
        u = tl.dot(Tinv, v * beta[:, None], input_precision=DOT_PRECISION)
        tl.store(u_ptr + out_rows[:, None] * value_dim + offs_v[None, :], u, mask=vt_ok)


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, gam_ptr, o_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr,
    scale, key_dim, value_dim, v_per_k, num_heads,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_s_k,
    QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # One program: sequence s, value head h, BV columns of its [K, V] state; the sequence's
    # pieces of the packed BT-token windows in order (the first and last may be partial),
    # from `_gdn_chunk_prep_kernel`'s w, u and gamma.
    s = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + s)
    bos = tl.load(qsl_ptr + s)
    eos = tl.where(slot >= 0, tl.load(qsl_ptr + s + 1), bos)
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
    lower = offs_t[:, None] >= offs_t[None, :]
    for c0 in range((bos // BT) * BT, eos, BT):
        rows = c0 + offs_t
        t_ok = (rows >= bos) & (rows < eos)
        rows = rows.to(tl.int64)
        qk_mask = t_ok[:, None] & k_ok[None, :]
        tv_mask = t_ok[:, None] & v_ok[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_q_t + hk * stride_q_h + offs_k[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # [BT, BK]
        k = tl.load(k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + offs_k[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # [BT, BK]
        hrows = rows * num_heads + h
        w = tl.load(w_ptr + hrows[:, None] * key_dim + offs_k[None, :], mask=qk_mask,
                    other=0.0)  # [BT, BK]
        u = tl.load(u_ptr + hrows[:, None] * value_dim + offs_v[None, :], mask=tv_mask,
                    other=0.0)  # [BT, BV]
        gam = tl.load(gam_ptr + hrows, mask=t_ok, other=0.0)  # [BT]
        if QK_L2NORM:
            q = l2_rows(q)
            k = l2_rows(k)
        q = q * scale
        live = lower & t_ok[:, None] & t_ok[None, :]
        decay = tl.where(live, tl.exp(tl.where(live, gam[:, None] - gam[None, :], 0.0)), 0.0)
        U = u - tl.dot(w, S, input_precision=DOT_PRECISION)  # [BT, BV]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay  # [BT, BT]
        o = tl.dot(q * tl.exp(gam)[:, None], S, input_precision=DOT_PRECISION)
        o = o + tl.dot(qk, U, input_precision=DOT_PRECISION)  # [BT, BV]
        tl.store(o_ptr + rows[:, None] * stride_o_t + h * stride_o_h + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=tv_mask)
        last = tl.minimum(eos, c0 + BT) - 1 - c0
        g_last = tl.sum(tl.where(offs_t == last, gam, 0.0), 0)
        k_tail = k * tl.where(t_ok, tl.exp(g_last - gam), 0.0)[:, None]  # [BT, BK]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k_tail), U, input_precision=DOT_PRECISION)
    tl.store(s_ptrs, S.to(s_ptrs.dtype.element_ty), mask=s_ok & (eos > bos))


def _tile(n: int) -> int:
    """A power-of-two tile of at least 16 (tl.dot's minimum) covering n."""
    return max(16, next_pow2(n))


def chunk_blocks(K: int, V: int, num_seqs: int, num_heads: int, sms: int,
                 interp: bool = False) -> dict:
    """The two kernels' tiles and the sequential pass's pipeline depth: windows of BT = 64
    tokens (16 interpreted); the sequential pass over BV = 64 state columns, 32 while the grid
    would leave SMs idle (one long sequence: 32 heads x 2 blocks on 132 SMs); the prep kernel's
    u in blocks of 64 columns. Shared memory at K = 128 on sm_90 (the compile checks): BV 32
    with 2 stages 194 KiB, BV 64 with 1 stage 129 KiB (2 stages would be 226 of the 227 KiB)."""
    if interp:
        return dict(BT=16, BK=_tile(K), BV=_tile(V), BV_PREP=_tile(V), STAGES=1)
    bv = min(_tile(V), 64)
    if bv > 32 and num_seqs * num_heads * cdiv(V, bv) < sms:
        bv = 32
    return dict(BT=64, BK=_tile(K), BV=bv, BV_PREP=min(_tile(V), 64),
                STAGES=2 if bv <= 32 else 1)


def gated_delta_chunk_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    scale: float | None = None, qk_l2norm: bool = True, chunk_size: int = 64,
    token_seq: Tensor | None = None,
) -> Tensor:
    """Triton launcher of `gated_delta_chunk`: the prep kernel over every BT-token window of
    the packed batch (parallel), then the sequential pass a (sequence, head, V block).
    `token_seq`: `token_to_seq(query_start_loc, n)` for n >= T when the caller has it.
    chunk_size is fixed by the kernels (`chunk_blocks`); the argument is kept for the API."""
    from krait.ops.causal_conv1d import token_to_seq

    T, hk, K = q.shape
    hv, V = v.shape[1], v.shape[2]
    o = torch.empty(T, hv, V, dtype=v.dtype, device=v.device)  # [T, Hv, V]
    nseq = state_indices.shape[0]
    if T == 0 or nseq == 0:
        return o
    interp = interpreting()
    blk = chunk_blocks(K, V, nseq, hv, num_sms(v.device), interp)
    bt = blk["BT"]
    precision = "ieee" if (interp or v.dtype == torch.float32) else "tf32"
    for t in (q, k, v):
        assert t.stride(-1) == 1, "gated_delta_chunk: the last dim must be contiguous"
    assert states.stride(-1) == 1
    if token_seq is None or token_seq.shape[0] < T:
        token_seq = token_to_seq(query_start_loc, T)
    w = torch.empty(T, hv, K, dtype=torch.float32, device=v.device)
    u = torch.empty(T, hv, V, dtype=torch.float32, device=v.device)
    gam = torch.empty(T, hv, dtype=torch.float32, device=v.device)
    _gdn_chunk_prep_kernel[(cdiv(T, bt), hv)](
        k, v, g, beta, token_seq, state_indices, w, u, gam, T, nseq, K, V, hv // hk, hv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        QK_L2NORM=qk_l2norm, DOT_PRECISION=precision, BT=bt, BK=blk["BK"], BV=blk["BV_PREP"],
        num_warps=4,
    )
    _gdn_chunk_kernel[(nseq, hv, cdiv(V, blk["BV"]))](
        q, k, w, u, gam, o, states, query_start_loc, state_indices, has_initial_state,
        float(scale if scale is not None else K ** -0.5), K, V, hv // hk, hv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        QK_L2NORM=qk_l2norm, DOT_PRECISION=precision, BT=bt, BK=blk["BK"], BV=blk["BV"],
        num_warps=CHUNK_WARPS, num_stages=blk["STAGES"],
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
    token_seq: Tensor | None = None,
) -> Tensor:
    """Varlen gated delta rule (prefill) with state slots; returns o [T, Hv, V] in v's dtype.

    q, k [T, Hk, K] (raw: l2-normed here when qk_l2norm); v [T, Hv, V] (Hv a multiple of Hk);
    g [T, Hv] float32 log-decay (<= 0); beta [T, Hv]; states [num_slots, Hv, K, V] (final states
    written in place); query_start_loc int32 [B + 1]; state_indices int32 [B] (-1: skip);
    has_initial_state int32/bool [B]. token_seq: int32 [>= T], each packed token's sequence
    (`causal_conv1d.token_to_seq`; the Triton path builds it when not given).
    """
    if use_triton(v):
        return gated_delta_chunk_triton(q, k, v, g, beta, states, query_start_loc,
                                        state_indices, has_initial_state, scale, qk_l2norm,
                                        chunk_size, token_seq)
    return gated_delta_chunk_ref(q, k, v, g, beta, states, query_start_loc, state_indices,
                                 has_initial_state, scale, qk_l2norm)

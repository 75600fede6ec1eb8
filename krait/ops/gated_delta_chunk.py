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

The Triton path processes a sequence in chunks (the chunked algorithm of flash-linear-attention's
`chunk_gated_delta_rule`, krait's own kernels): with gamma the in-chunk cumsum of g and
A[t, j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j) (j < t), the chunk's corrected values are
U = u - w S0 with u = (I + A)^-1 (beta V) and w = (I + A)^-1 (beta exp(gamma) K), its outputs
exp(gamma) Q S0 + (Q K^T * decay) U and its final state exp(gamma_L) S0 + K^T (exp(gamma_L -
gamma) U): no division by a decay, so a decay that underflows stays exact. The chunks are the
BT-token windows of the packed batch cut at sequence starts (a window's pieces of different
sequences are independent: A is block-diagonal by sequence and gamma restarts), so that grids
and scratch are sized by the token and sequence counts alone (no host sync: graph-safe).
Four kernels:
- `_gdn_diag_inv_kernel` (every BC = 16 tokens and head at once, one warp each): the inverses
  Dinv of (I + A)'s diagonal BC x BC blocks by BC - 1 steps of forward elimination;
- `_gdn_prep_kernel` (every window and head at once): gamma, (I + A)^-1 blocked — the
  strictly block-lower rest M = Dinv L (nilpotent: M^(BT/BC) = 0) folded in by products,
  (I + A)^-1 = (I - M + M^2 - M^3) Dinv, not BT - 1 dependent row steps — then w, u and the
  normed keys into scratch;
- `_gdn_state_kernel` (the one sequential kernel, a program per sequence, head and BV value
  columns): per chunk only the recurrence, two products: U = u - w S and S = exp(gamma_L) S +
  K^T (exp(gamma_L - gamma) U), each chunk's starting state S stored (h, a [pieces, Hv, K, V]
  scratch; piece c + b for window c of sequence b);
- `_gdn_out_kernel` (every window and head at once): U = u - w h again (from the same h: no
  store of U in the sequential loop), o = exp(gamma) Q h + (Q K^T * decay) U.
Scratch (w, u, h) is in the activations' dtype for bf16 / fp16 inputs (their products on the
tensor cores at that precision, as fla does), float32 otherwise.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton

L2_EPS = 1e-6
# (name, start event, end event) of each launch while a list (scripts/bench_gdn_prefill.py
# --breakdown); None: no events
KERNEL_EVENTS: list | None = None

# ----------------------------------------------------------------------------- triton


@triton.jit
def l2_rows(x):
    """Each row of the float32 tile x over its last axis: x * rsqrt(sum(x^2) + 1e-6)."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]


@triton.jit
def _gram(k, QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(k_t . k_j of the normed rows [n, n], the rows' norm factors [n]) of k [n, K] in its
    own dtype: the product of the raw rows (bf16 ones exactly, on the tensor cores), then
    scaled by rsqrt(|k_t|^2 + 1e-6) rsqrt(|k_j|^2 + 1e-6) (1 without QK_L2NORM)."""
    kk = _dot(k, tl.trans(k), DOT_PRECISION)
    if QK_L2NORM:
        kf = k.to(tl.float32)
        rn = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    else:
        rn = tl.full([k.shape[0]], 1.0, tl.float32)
    return kk * rn[:, None] * rn[None, :], rn


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """tl.dot at PRECISION ('tf32' or 'ieee' for float32 operands; bf16 / fp16 operands on
    the tensor cores at their precision), or 'upcast': both operands to float32, products in
    ieee (the interpreter, whose bf16 products are wrong; its rounding stays the scratch's)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def seq_of_rows(qsl_ptr, rows, num_seqs, STEPS: tl.constexpr):
    """The sequence of each packed token of rows (int32), `causal_conv1d.token_to_seq`'s: the
    last b in [0, num_seqs] with qsl[b] <= row (num_seqs past the last sequence), by a binary
    search over query_start_loc (int32 [num_seqs + 1], from 0, nondecreasing) in STEPS steps
    (num_seqs' bit length)."""
    pos = tl.zeros(rows.shape, tl.int32)
    for i in tl.static_range(STEPS):
        cand = pos + (1 << (STEPS - 1 - i))
        ok = cand <= num_seqs
        ok = ok & (tl.load(qsl_ptr + cand, mask=ok, other=0) <= rows)
        pos = tl.where(ok, cand, pos)
    return pos


@triton.jit
def _live_rows(seq_ptr, slots_ptr, rows, num_tokens, num_seqs, SEQ_STEPS: tl.constexpr = 0):
    """(sequence, live) of the window's rows: live rows are tokens of sequences with a slot.
    Only those are read: padding rows (past the last sequence, or of a -1 slot) may hold
    anything, and a NaN there would reach the others' rows through the window's products
    (0 * NaN) though their entries are masked. seq_ptr: token_seq (SEQ_STEPS 0) or
    query_start_loc, searched in SEQ_STEPS steps (`seq_of_rows`); -1 for rows past
    num_tokens either way."""
    t_ok = rows < num_tokens
    if SEQ_STEPS == 0:
        seq = tl.load(seq_ptr + rows, mask=t_ok, other=-1)
    else:
        seq = tl.where(t_ok, seq_of_rows(seq_ptr, rows, num_seqs, SEQ_STEPS), -1)
    in_seq = t_ok & (seq >= 0) & (seq < num_seqs)
    live = in_seq & (tl.load(slots_ptr + seq, mask=in_seq, other=-1) >= 0)
    return seq, live


@triton.jit
def _window_rows(seq_ptr, slots_ptr, num_tokens, num_seqs, key_dim, BT: tl.constexpr,
                 BK: tl.constexpr, SEQ_STEPS: tl.constexpr):
    """The rows of program_id(0)'s BT-token window: (offs_t, offs_k, rows (int64), their
    sequences, live rows, live key columns, live [BT, BK] entries); seq_ptr, SEQ_STEPS:
    `_live_rows`'."""
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    rows = tl.program_id(0) * BT + offs_t
    seq, t_ok = _live_rows(seq_ptr, slots_ptr, rows, num_tokens, num_seqs, SEQ_STEPS)
    k_ok = offs_k < key_dim
    return offs_t, offs_k, rows.to(tl.int64), seq, t_ok, k_ok, t_ok[:, None] & k_ok[None, :]


@triton.jit
def _gdn_diag_inv_kernel(
    k_ptr, g_ptr, beta_ptr, seq_ptr, slots_ptr, dinv_ptr,
    num_tokens, num_seqs, key_dim, v_per_k, num_heads,
    stride_k_t, stride_k_h, stride_g_t, stride_b_t,
    QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, SEQ_STEPS: tl.constexpr = 0,
):
    # One program (one warp: every reduction stays in it): BC packed tokens, value head h,
    # (I + D)^-1 of the block's D[t, j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j), j < t in
    # the same sequence (gamma differences: a cumsum local to the block does), by BC - 1 steps
    # of forward elimination: step j subtracts D[r, j] times row j of the result from every
    # row r (the multipliers are D's own entries: each pivot row of the reduced I + D is a
    # unit row). Stored [T, Hv, BC] float32: row t, column t's block-local index.
    h = tl.program_id(1)
    hk = h // v_per_k
    offs_t, offs_k, rows, seq, t_ok, k_ok, tk_ok = _window_rows(
        seq_ptr, slots_ptr, num_tokens, num_seqs, key_dim, BC, BK, SEQ_STEPS)
    k = tl.load(k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + offs_k[None, :],
                mask=tk_ok, other=0.0)  # [BC, BK]
    g = tl.load(g_ptr + rows * stride_g_t + h, mask=t_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_b_t + h, mask=t_ok, other=0.0).to(tl.float32)
    kk, _ = _gram(k, QK_L2NORM, DOT_PRECISION)
    same = seq[:, None] == seq[None, :]
    strict = (offs_t[:, None] > offs_t[None, :]) & same
    gam = tl.sum(tl.where((offs_t[:, None] >= offs_t[None, :]) & same, g[None, :], 0.0), 1)
    decay = tl.exp(tl.where(strict, gam[:, None] - gam[None, :], 0.0))
    D = tl.where(strict, kk * decay * beta[:, None], 0.0)
    X = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0)
    for j in range(BC - 1):
        x_piv = tl.sum(tl.where(offs_t[:, None] == j, X, 0.0), axis=0)  # row j
        d_piv = tl.sum(tl.where(offs_t[None, :] == j, D, 0.0), axis=1)  # column j of D
        X = X - d_piv[:, None] * x_piv[None, :]
    tl.store(dinv_ptr + (rows * num_heads + h)[:, None] * BC + offs_t[None, :], X,
             mask=t_ok[:, None])


@triton.jit
def _gdn_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, seq_ptr, slots_ptr, dinv_ptr, kn_ptr, w_ptr, u_ptr,
    gam_ptr, num_tokens, num_seqs, key_dim, value_dim, v_per_k, num_heads,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_b_t,
    QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    WU_LOWP: tl.constexpr = False, SEQ_STEPS: tl.constexpr = 0,
):
    # One program: window c of BT packed tokens, value head h: gamma [BT] (float32),
    # w = Tinv (beta exp(gamma) K) [BT, K] and u = Tinv (beta V) [BT, V] (scratch dtype), for
    # Tinv = (I + A)^-1 from the diagonal blocks' inverses Dinv (`_gdn_diag_inv_kernel`); the
    # first value head of each key head also stores the normed k (kn [T, Hk, K], scratch).
    # WU_LOWP: the w and u products' operands (Tinv, the scaled k and v) in the scratch dtype
    # (bf16 products, float32 accumulation, as fla's recompute_w_u), float32 otherwise.
    h = tl.program_id(1)
    hk = h // v_per_k
    offs_t, offs_k, rows, seq, t_ok, k_ok, tk_ok = _window_rows(
        seq_ptr, slots_ptr, num_tokens, num_seqs, key_dim, BT, BK, SEQ_STEPS)
    k_ptrs = k_ptr + rows[:, None] * stride_k_t + hk * stride_k_h + offs_k[None, :]
    k = tl.load(k_ptrs, mask=tk_ok, other=0.0)  # [BT, BK]
    g = tl.load(g_ptr + rows * stride_g_t + h, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
    beta = tl.load(beta_ptr + rows * stride_b_t + h, mask=t_ok, other=0.0).to(tl.float32)
    kk, rn = _gram(k, QK_L2NORM, DOT_PRECISION)
    if h % v_per_k == 0:
        tl.store(kn_ptr + (rows * (num_heads // v_per_k) + hk)[:, None] * key_dim
                 + offs_k[None, :], (k.to(tl.float32) * rn[:, None]).to(kn_ptr.dtype.element_ty),
                 mask=tk_ok)
    same = seq[:, None] == seq[None, :]
    lower = (offs_t[:, None] >= offs_t[None, :]) & same
    gam = tl.sum(tl.where(lower, g[None, :], 0.0), axis=1)  # [BT] per-piece cumsum
    blk = offs_t // BC
    diag = blk[:, None] == blk[None, :]
    # L: A's strictly block-lower part (A = D + L)
    off = (blk[:, None] > blk[None, :]) & same
    out_rows = rows * num_heads + h  # [T, Hv, ...] scratch rows
    decay = tl.exp(tl.where(off, gam[:, None] - gam[None, :], 0.0))
    L = tl.where(off, kk * decay * beta[:, None], 0.0)
    Dinv = tl.load(dinv_ptr + out_rows[:, None] * BC + (offs_t % BC)[None, :],
                   mask=t_ok[:, None] & diag, other=0.0)  # [BT, BT] block-diagonal
    # I + A = (I + D)(I + M), M = Dinv L strictly block-lower: (I + M)^-1 = sum (-M)^n,
    # n < BT / BC (the terms of block forward substitution)
    M = _dot(Dinv, L, SOLVE_PRECISION)
    P = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0) - M
    Mn = M
    for n in tl.static_range(2, BT // BC):
        Mn = _dot(Mn, M, SOLVE_PRECISION)
        if n % 2 == 0:
            P = P + Mn
        else:
            P = P - Mn
    Tinv = _dot(P, Dinv, SOLVE_PRECISION)  # [BT, BT]
    wu_dt = w_ptr.dtype.element_ty if WU_LOWP else tl.float32
    Tinv = Tinv.to(wu_dt)
    k = tl.load(k_ptrs, mask=tk_ok, other=0.0).to(tl.float32)  # again: fewer live registers
    w = _dot(Tinv, (k * (rn * beta * tl.exp(gam))[:, None]).to(wu_dt), DOT_PRECISION)
    tl.store(w_ptr + out_rows[:, None] * key_dim + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=tk_ok)
    tl.store(gam_ptr + out_rows, gam, mask=t_ok)
    for v0 in range(0, value_dim, BV):
        offs_v = v0 + tl.arange(0, BV)
        vt_ok = t_ok[:, None] & (offs_v < value_dim)[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_v_t + h * stride_v_h + offs_v[None, :],
                    mask=vt_ok, other=0.0).to(tl.float32)  # [BT, BV]
        u = _dot(Tinv, (v * beta[:, None]).to(wu_dt), DOT_PRECISION)
        tl.store(u_ptr + out_rows[:, None] * value_dim + offs_v[None, :],
                 u.to(u_ptr.dtype.element_ty), mask=vt_ok)


@triton.jit
def _gdn_state_kernel(
    kn_ptr, w_ptr, u_ptr, gam_ptr, h_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr,
    key_dim, value_dim, v_per_k, num_heads,
    stride_s_slot, stride_s_h, stride_s_k,
    DOT_PRECISION: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # One program: sequence s, value head h, BV columns of its [K, V] state; the sequence's
    # pieces of the packed BT-token windows in order (the first and last may be partial). Per
    # chunk only the recurrence: h[piece] = S; U = u - w S; S = exp(g_L) S + K^T (exp(g_L -
    # gamma) U), K the normed keys (kn). The output kernel forms U again from h[piece].
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
    kv_ok = k_ok[:, None] & v_ok[None, :]
    s_ok = kv_ok & (slot >= 0)
    s_ptrs = (state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_s_slot + h * stride_s_h
              + offs_k[:, None] * stride_s_k + offs_v[None, :])
    init = tl.load(init_ptr + s) != 0
    S = tl.load(s_ptrs, mask=s_ok & init, other=0.0).to(tl.float32)  # [BK, BV]
    h_off = offs_k[:, None] * value_dim + offs_v[None, :]  # h [pieces, Hv, K, V]
    num_k_heads = num_heads // v_per_k
    # no chunk for an empty or skipped sequence (a window start before bos would be one)
    start = tl.where(eos > bos, (bos // BT) * BT, eos)
    for c0 in range(start, eos, BT):
        rows = c0 + offs_t
        t_ok = (rows >= bos) & (rows < eos)
        rows = rows.to(tl.int64)
        hrows = rows * num_heads + h
        tk_ok = t_ok[:, None] & k_ok[None, :]
        tv_ok = t_ok[:, None] & v_ok[None, :]
        w = tl.load(w_ptr + hrows[:, None] * key_dim + offs_k[None, :], mask=tk_ok, other=0.0)
        u = tl.load(u_ptr + hrows[:, None] * value_dim + offs_v[None, :], mask=tv_ok,
                    other=0.0)  # [BT, BV]
        kn = tl.load(kn_ptr + (rows * num_k_heads + hk)[:, None] * key_dim + offs_k[None, :],
                     mask=tk_ok, other=0.0)  # [BT, BK]
        gam = tl.load(gam_ptr + hrows, mask=t_ok, other=0.0)  # [BT]
        g_last = tl.load(gam_ptr + (tl.minimum(eos, c0 + BT) - 1).to(tl.int64) * num_heads + h)
        Sc = S.to(h_ptr.dtype.element_ty)
        piece = (c0 // BT + s).to(tl.int64) * num_heads + h
        tl.store(h_ptr + piece * key_dim * value_dim + h_off, Sc, mask=kv_ok)
        U = u.to(tl.float32) - _dot(w, Sc, DOT_PRECISION)
        U = U * tl.where(t_ok, tl.exp(g_last - gam), 0.0)[:, None]
        S = S * tl.exp(g_last) + _dot(tl.trans(kn), U.to(kn.dtype), DOT_PRECISION)
    tl.store(s_ptrs, S.to(s_ptrs.dtype.element_ty), mask=s_ok & (eos > bos))


@triton.jit
def _gdn_out_kernel(
    q_ptr, kn_ptr, w_ptr, u_ptr, gam_ptr, h_ptr, o_ptr, seq_ptr, slots_ptr,
    scale, num_tokens, num_seqs, key_dim, value_dim, v_per_k, num_heads,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SEQ_STEPS: tl.constexpr = 0,
):
    # One program: window c, value head h, all of V in blocks of BV: o = exp(gamma) Q h[piece]
    # + (Q K^T * decay) U, U = u - w h[piece] (each piece of the window its own starting state
    # h, the bf16 one the state pass took its U from).
    h = tl.program_id(1)
    hk = h // v_per_k
    offs_t, offs_k, rows, seq, t_ok, k_ok, tk_ok = _window_rows(
        seq_ptr, slots_ptr, num_tokens, num_seqs, key_dim, BT, BK, SEQ_STEPS)
    q = tl.load(q_ptr + rows[:, None] * stride_q_t + hk * stride_q_h + offs_k[None, :],
                mask=tk_ok, other=0.0).to(tl.float32)  # [BT, BK]
    kn = tl.load(kn_ptr + (rows * (num_heads // v_per_k) + hk)[:, None] * key_dim
                 + offs_k[None, :], mask=tk_ok, other=0.0)
    hrows = rows * num_heads + h
    gam = tl.load(gam_ptr + hrows, mask=t_ok, other=0.0)  # [BT]
    w = tl.load(w_ptr + hrows[:, None] * key_dim + offs_k[None, :], mask=tk_ok, other=0.0)
    if QK_L2NORM:
        q = l2_rows(q)
    q = q * scale
    live = ((offs_t[:, None] >= offs_t[None, :]) & (seq[:, None] == seq[None, :])
            & t_ok[:, None] & t_ok[None, :])
    decay = tl.where(live, tl.exp(tl.where(live, gam[:, None] - gam[None, :], 0.0)), 0.0)
    lowp = h_ptr.dtype.element_ty
    qk = (_dot(q.to(lowp), tl.trans(kn), DOT_PRECISION) * decay).to(lowp)  # [BT, BT]
    qg = q * tl.exp(gam)[:, None]  # [BT, BK]
    # the window's live sequences: most windows hold one
    s_lo = tl.min(tl.where(t_ok, seq, num_seqs), 0)
    s_hi = tl.max(tl.where(t_ok, seq, -1), 0)
    for v0 in range(0, value_dim, BV):
        offs_v = v0 + tl.arange(0, BV)
        v_ok = offs_v < value_dim
        tv_ok = t_ok[:, None] & v_ok[None, :]
        U = tl.load(u_ptr + hrows[:, None] * value_dim + offs_v[None, :], mask=tv_ok,
                    other=0.0).to(tl.float32)  # [BT, BV]
        o = tl.zeros([BT, BV], dtype=tl.float32)
        for b in range(s_lo, s_hi + 1):
            mine = t_ok & (seq == b)
            if tl.sum(mine.to(tl.int32), 0) > 0:  # a piece h holds (not a -1 or empty one)
                piece = (tl.program_id(0) + b).to(tl.int64) * num_heads + h
                hs = tl.load(h_ptr + piece * key_dim * value_dim + offs_k[:, None] * value_dim
                             + offs_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0)
                U -= tl.where(mine[:, None], _dot(w, hs, DOT_PRECISION), 0.0)
                o += _dot(tl.where(mine[:, None], qg, 0.0).to(lowp), hs, DOT_PRECISION)
        o += _dot(qk, U.to(lowp), DOT_PRECISION)  # [BT, BV]
        tl.store(o_ptr + rows[:, None] * stride_o_t + h * stride_o_h + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=tv_ok)


def _tile(n: int) -> int:
    """A power-of-two tile of at least 16 (tl.dot's minimum) covering n."""
    return max(16, next_pow2(n))


def chunk_config(K: int, V: int, dtype: torch.dtype, interp: bool = False) -> dict:
    """The kernels' tiles and launch options. Windows of BT = 64 tokens, the diagonal blocks of
    the triangular solve BC = 16 (interpreted: windows of 32, so the blocked solve runs on CPU
    fast enough); the sequential pass over BV = 32 state columns (one long sequence: 32 heads
    x 4 blocks = 128 programs; 64 columns measured 0.233 against 0.190 ms at 8k tokens on the
    H200), its next chunks' loads issued early (STATE_STAGES); the prep and output kernels over
    V in blocks of 64 at 4 warps, their registers left to ptxas (*_MAXNREG None; at 8k tokens
    on the H200 the output kernel took 0.234 ms against 0.392 at 8 warps capped at 128
    registers, the prep kernel 0.357 against 0.406: docs/benchmarks.md). LOWP: scratch in the
    activations' dtype (bf16 / fp16 inputs, compiled), float32 otherwise. PRECISION: float32 products (tf32
    for bf16 / fp16 inputs, ieee for float32 ones; 'upcast' interpreted: `_dot`);
    SOLVE_PRECISION: the triangular solve's merge products (tf32 for bf16 / fp16 inputs: 0.401
    against 0.674 ms for tf32x3, outputs as close to fla's, 0.52%, as with tf32x3; the
    scratch's bf16 rounding dominates). WU_LOWP: the prep kernel's w and u products on
    operands in the scratch dtype (bf16 with LOWP, as fla's), not float32 (tf32): at 8k tokens
    on the H200 the prep kernel took 0.257 against 0.356 ms, outputs 0.39% from tf32's.
    SEQ_FROM_QSL: without a token_seq the kernels find each token's sequence by a
    binary search over query_start_loc (`seq_of_rows`), not a token_to_seq built first (its
    torch launches)."""
    lowp = dtype in (torch.bfloat16, torch.float16) and not interp
    half = dtype != torch.float32
    cfg = dict(BT=64, BC=16, BK=_tile(K), BV=min(_tile(V), 32), BV_PREP=min(_tile(V), 64),
               BV_OUT=min(_tile(V), 64), DIAG_WARPS=1, PREP_WARPS=4, PREP_MAXNREG=None,
               STATE_WARPS=4, STATE_STAGES=3 if lowp else 2, OUT_WARPS=4, OUT_STAGES=2,
               OUT_MAXNREG=None, LOWP=lowp, PRECISION="tf32" if half else "ieee",
               SOLVE_PRECISION="tf32" if half else "ieee", WU_LOWP=True, SEQ_FROM_QSL=True)
    if interp:
        cfg.update(BT=32, PRECISION="upcast", SOLVE_PRECISION="upcast")
    return cfg


def gated_delta_chunk_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    scale: float | None = None, qk_l2norm: bool = True, chunk_size: int = 64,
    token_seq: Tensor | None = None, config: dict | None = None,
) -> Tensor:
    """Triton launcher of `gated_delta_chunk`: the diagonal-block inverses and the prep kernel
    over every window of the packed batch, the sequential state pass a (sequence, head, V
    block), the output kernel over every window. `token_seq`: `token_to_seq(query_start_loc,
    n)` for n >= T when the caller has it (else the kernels search query_start_loc:
    SEQ_FROM_QSL). chunk_size is fixed by the kernels (`chunk_config`;
    `config` overrides its entries: tests, benchmarks); the argument is kept for the API."""
    from krait.ops.causal_conv1d import token_to_seq

    T, hk, K = q.shape
    hv, V = v.shape[1], v.shape[2]
    o = torch.empty(T, hv, V, dtype=v.dtype, device=v.device)  # [T, Hv, V]
    nseq = state_indices.shape[0]
    if T == 0 or nseq == 0:
        return o
    cfg = chunk_config(K, V, v.dtype, interpreting())
    if config:
        cfg.update(config)
    bt, bc = cfg["BT"], cfg["BC"]
    for t in (q, k, v):
        assert t.stride(-1) == 1, "gated_delta_chunk: the last dim must be contiguous"
    assert states.stride(-1) == 1
    seq_steps = 0  # the kernels load token_seq
    if token_seq is None or token_seq.shape[0] < T:
        if cfg["SEQ_FROM_QSL"]:
            token_seq, seq_steps = query_start_loc, nseq.bit_length()
        else:
            token_seq = token_to_seq(query_start_loc, T)
    sd = v.dtype if cfg["LOWP"] else torch.float32  # scratch
    nw = cdiv(T, bt)
    dev = v.device
    kn = torch.empty(T, hk, K, dtype=sd, device=dev)  # normed keys
    w = torch.empty(T, hv, K, dtype=sd, device=dev)
    u = torch.empty(T, hv, V, dtype=sd, device=dev)
    gam = torch.empty(T, hv, dtype=torch.float32, device=dev)
    hs = torch.empty(nw + nseq, hv, K, V, dtype=sd, device=dev)  # chunks' starting states
    prec, bk, rep = cfg["PRECISION"], cfg["BK"], hv // hk
    ev = _event()
    dinv = torch.empty(T, hv, bc, dtype=torch.float32, device=dev)
    _gdn_diag_inv_kernel[(cdiv(T, bc), hv)](
        k, g, beta, token_seq, state_indices, dinv, T, nseq, K, rep, hv,
        k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
        QK_L2NORM=qk_l2norm, DOT_PRECISION=prec, BC=bc, BK=bk, SEQ_STEPS=seq_steps,
        num_warps=cfg["DIAG_WARPS"],
    )
    ev = _record("diag_inv", ev)
    _gdn_prep_kernel[(nw, hv)](
        k, v, g, beta, token_seq, state_indices, dinv, kn, w, u, gam, T, nseq, K, V, rep, hv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        QK_L2NORM=qk_l2norm, DOT_PRECISION=prec, SOLVE_PRECISION=cfg["SOLVE_PRECISION"],
        BT=bt, BC=bc, BK=bk, BV=cfg["BV_PREP"], WU_LOWP=bool(cfg["WU_LOWP"]),
        SEQ_STEPS=seq_steps, num_warps=cfg["PREP_WARPS"],
        maxnreg=cfg["PREP_MAXNREG"],
    )
    ev = _record("prep", ev)
    _gdn_state_kernel[(nseq, hv, cdiv(V, cfg["BV"]))](
        kn, w, u, gam, hs, states, query_start_loc, state_indices, has_initial_state,
        K, V, rep, hv, states.stride(0), states.stride(1), states.stride(2),
        DOT_PRECISION=prec, BT=bt, BK=bk, BV=cfg["BV"], num_warps=cfg["STATE_WARPS"],
        num_stages=cfg["STATE_STAGES"],
    )
    ev = _record("state", ev)
    _gdn_out_kernel[(nw, hv)](
        q, kn, w, u, gam, hs, o, token_seq, state_indices,
        float(scale if scale is not None else K ** -0.5), T, nseq, K, V, rep, hv,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        QK_L2NORM=qk_l2norm, DOT_PRECISION=prec, BT=bt, BK=bk, BV=cfg["BV_OUT"],
        SEQ_STEPS=seq_steps, num_warps=cfg["OUT_WARPS"], num_stages=cfg["OUT_STAGES"],
        maxnreg=cfg["OUT_MAXNREG"],
    )
    _record("out", ev)
    return o


def _event():
    """A recorded CUDA event while KERNEL_EVENTS is a list, else None."""
    if KERNEL_EVENTS is None:
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _record(name: str, start):
    """Files (name, start, end) in KERNEL_EVENTS; returns end (the next launch's start)."""
    if start is None:
        return None
    end = _event()
    KERNEL_EVENTS.append((name, start, end))
    return end


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
    (`causal_conv1d.token_to_seq`; the Triton path finds it from query_start_loc when not
    given).
    """
    if use_triton(v):
        return gated_delta_chunk_triton(q, k, v, g, beta, states, query_start_loc,
                                        state_indices, has_initial_state, scale, qk_l2norm,
                                        chunk_size, token_seq)
    return gated_delta_chunk_ref(q, k, v, g, beta, states, query_start_loc, state_indices,
                                 has_initial_state, scale, qk_l2norm)

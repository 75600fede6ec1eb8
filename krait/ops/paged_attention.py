"""Paged attention over a block KV cache: one varlen kernel for prefill chunks and decode rows.

Row b's q_len = qsl[b+1] - qsl[b] query tokens are its last tokens: token i sits at absolute
position seq_len - q_len + i and attends causally to keys 0..that position, restricted to keys with
pos > query_pos - sliding_window when a window is given (HF semantics). The key/value of position p
live in block block_table[b, p // block_size] at offset p % block_size. GQA: query head h reads kv
head h // (Hq // Hkv).

The Triton grid is (batch rows, kv heads, query tiles). A program takes BLOCK_Q query tokens times
the Hq // Hkv query heads that share its kv head (BLOCK_M rows of the score matrix), so each key
tile is read once per group, and runs an online softmax over key tiles up to its last query's
position — the loop is bound by the row's real seq_len, never by max_seq_len.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, num_sms, use_triton
from krait.ops.kv_write import from_cache
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.rope_kv_write import store_rope_kv
from krait.ops.rotary import norm_rope_loaded, rope_constants
from krait.ops.timeline import ENTRY, EXIT, LOOPED, WAITED, stamp, timeline_args


@triton.jit
def _kv_tile_offsets(start_n, hi, kv_head, bt_row, block_size,
                     stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                     BLOCK_N: tl.constexpr):
    """Key positions [start_n, start_n + BLOCK_N), which of them are < hi, and their K and V
    row offsets in the paged caches (through the block table)."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_ok = k_pos < hi
    blk = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
    off = k_pos % block_size
    k_off = blk * stride_kc_b + off * stride_kc_o + kv_head * stride_kc_h
    v_off = blk * stride_vc_b + off * stride_vc_o + kv_head * stride_vc_h
    return k_pos, k_ok, k_off, v_off


@triton.jit
def _load_k(k_cache_ptr, k_off, d, d_ok, ok, dt):
    """The K tile [BLOCK_D, BLOCK_N] of the keys where `ok`, in dtype dt (an fp8 cache widens
    to q's dtype for the dots); 0 elsewhere."""
    mask = ok[None, :] & d_ok[:, None]
    return from_cache(tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=mask, other=0.0),
                      mask, dt)


@triton.jit
def _load_v(v_cache_ptr, v_off, d, d_ok, ok, dt):
    """The V tile [BLOCK_N, BLOCK_D] of the keys where `ok`, in dtype dt; 0 elsewhere."""
    mask = ok[:, None] & d_ok[None, :]
    return from_cache(tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=mask, other=0.0),
                      mask, dt)


@triton.jit
def _scores(q, k, k_pos, k_ok, q_pos, qk_scale, sliding_window,
            MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q [BLOCK_M, D] . k [D, BLOCK_N] in log2 units, causal (and window) masked."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    """Folds one tile's scores s [BLOCK_M, BLOCK_N] and values v [BLOCK_N, D] into the running
    (max, sum, unnormalised output)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start_n, hi, q_pos, kv_head, qk_scale, sliding_window,
    k_cache_ptr, v_cache_ptr, bt_row, block_size, d, d_ok,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N)."""
    k_pos, k_ok, k_off, v_off = _kv_tile_offsets(
        start_n, hi, kv_head, bt_row, block_size,
        stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h, BLOCK_N)
    k = _load_k(k_cache_ptr, k_off, d, d_ok, k_ok, q.dtype)
    s = _scores(q, k, k_pos, k_ok, q_pos, qk_scale, sliding_window, MASKED, USE_WINDOW,
                DOT_PRECISION)
    v = _load_v(v_cache_ptr, v_off, d, d_ok, k_ok, q.dtype)
    return _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, head_dim, block_size, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kc_b, stride_kc_o, stride_kc_h,
    stride_vc_b, stride_vc_o, stride_vc_h,
    stride_bt,
    GROUP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    tile_q0 = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    if (tile_q0 < q_len) & (seq_len > 0):
        context_len = seq_len - q_len
        m = tl.arange(0, BLOCK_M)
        tok = tile_q0 + m // GROUP  # query token within the row
        head = kv_head * GROUP + m % GROUP
        row_ok = (m < BLOCK_Q * GROUP) & (tok < q_len)
        q_pos = context_len + tok
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim

        q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite, so fully masked rows stay NaN-free
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        hi = context_len + tl.minimum(tile_q0 + BLOCK_Q, q_len)  # one past the tile's last query
        bt_row = block_table_ptr + row * stride_bt
        if USE_WINDOW:
            lo = tl.maximum(context_len + tile_q0 - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
            mid = lo
        else:
            # Keys below the tile's first query position are visible to every row: no mask there.
            lo = 0
            mid = (context_len + tile_q0 + 1) // BLOCK_N * BLOCK_N
            for start_n in range(lo, mid, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, start_n, hi, q_pos, kv_head, qk_scale, sliding_window,
                    k_cache_ptr, v_cache_ptr, bt_row, block_size, d, d_ok,
                    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                    False, False, DOT_PRECISION, BLOCK_N,
                )
        for start_n in range(mid, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start_n, hi, q_pos, kv_head, qk_scale, sliding_window,
                k_cache_ptr, v_cache_ptr, bt_row, block_size, d, d_ok,
                stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                True, USE_WINDOW, DOT_PRECISION, BLOCK_N,
            )

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, head_dim, block_size, sliding_window,
    stride_qt, stride_qh,
    stride_kc_b, stride_kc_o, stride_kc_h,
    stride_vc_b, stride_vc_o, stride_vc_h,
    stride_bt,
    GROUP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
    Q_FIRST: tl.constexpr = False, ROPE: tl.constexpr = False, NORM: tl.constexpr = False,
    IS_NEOX: tl.constexpr = False, Q_MAX: tl.constexpr = 1,
    k_new_ptr=None, v_new_ptr=None, pos_ptr=None, cs_ptr=None, qw_ptr=None, kw_ptr=None, eps=0.0,
    slot_ptr=None, rot_dim=0, stride_cs=0, stride_knt=0, stride_knh=0, stride_vnt=0, stride_vnh=0,
    TL: tl.constexpr = False, tl_ptr=None,
):
    """Flash-decoding, part 1: one program per (row, kv head, split of the row's keys); writes the
    split's unnormalised output and (max, sum) in log2 units. Q_MAX 1: rows of exactly one query
    token (others skipped), partials per row. Q_MAX > 1 (speculative verify rows): rows of 1 to
    Q_MAX query tokens, partials per query token; the program scores all the row's tokens x the
    GROUP query heads (BLOCK_M >= Q_MAX * GROUP score rows) against each K/V tile it loads, token
    i seeing keys j <= seq_len - q_len + i (and inside the window from its own position); a row
    with seq_len 0 stores empty splits.
    With ROPE, q is the projection's raw output and this kernel does `rope_kv_write`'s work for
    its rows: each program normalises (NORM) and rotates its query heads itself, and the split
    holding the row's newest key normalises and rotates that key from k_new and writes it and
    v_new into the cache at the row's slot (one writer per (row, kv head)) before it reads it.
    With PREFETCH (and PDL), the split's first K/V tile is loaded before waiting on the kernel
    before: every key but the row's newest was written by earlier steps, and the step's metadata
    (query starts, lengths, block table) by its input preparation, which completed before the
    step's first non-PDL kernel; the newest key is loaded after the wait. Q_FIRST: q is loaded
    (with ROPE: normalised and rotated) before that reload, else after it."""
    pdl_trigger(PDL)
    stamp(TL, tl_ptr, ENTRY)
    if not PREFETCH:
        pdl_wait(PDL)
        stamp(TL, tl_ptr, WAITED)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    tl.static_assert((Q_MAX == 1) or not ROPE, "ROPE takes one-token rows")
    if Q_MAX == 1:
        runs = (q_len == 1) & (seq_len > 0)
    else:
        runs = (q_len > 0) & (q_len <= Q_MAX)
    if runs:
        m = tl.arange(0, BLOCK_M)
        if Q_MAX == 1:
            tok = 0
            head = kv_head * GROUP + m
            row_ok = m < GROUP
        else:
            tok = m // GROUP  # the score row's query token within the row
            head = kv_head * GROUP + m % GROUP
            row_ok = tok < q_len
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        if Q_MAX == 1:
            new_lo = seq_len - 1  # the row's first key written this step
            q_pos = tl.zeros([BLOCK_M], tl.int32) + (seq_len - 1)
            q_off = q_start.to(tl.int64) * stride_qt + head * stride_qh
        else:
            new_lo = seq_len - q_len
            q_pos = new_lo + tok
            q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q_ptrs = q_ptr + q_off[:, None] + d[None, :]
        q_mask = row_ok[:, None] & d_ok[None, :]
        lo_all = 0
        if USE_WINDOW:  # the keys the row's first query token sees
            if Q_MAX == 1:
                lo_all = tl.maximum(seq_len - sliding_window, 0)
            else:
                lo_all = tl.maximum(new_lo + 1 - sliding_window, 0)
        per = tl.cdiv(tl.cdiv(seq_len - lo_all, NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_lo = lo_all + split * per
        s_hi = tl.minimum(s_lo + per, seq_len)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = block_table_ptr + row * stride_bt
        rest = s_lo  # the first key the tile loop below starts at
        qp, qr, qcos, qsin, qw, qwp = 0, 0, 0, 0, 0, 0  # ROPE's q constants (unused without)
        if ROPE:  # the step's inputs and constants: before the wait
            cs_row = cs_ptr + tl.load(pos_ptr + q_start) * stride_cs
            slot = tl.load(slot_ptr + q_start)
            qp, qr, qcos, qsin, qw, qwp = rope_constants(cs_row, qw_ptr, head_dim, rot_dim, NORM,
                                                         IS_NEOX, BLOCK_D)
            kp, kr, kcos, ksin, kw, kwp = rope_constants(cs_row, kw_ptr, head_dim, rot_dim, NORM,
                                                         IS_NEOX, BLOCK_D)
        if PREFETCH:
            cdt = q_ptr.dtype.element_ty
            k_pos, k_ok, k_off, v_off = _kv_tile_offsets(
                s_lo, s_hi, kv_head, bt_row, block_size, stride_kc_b, stride_kc_o, stride_kc_h,
                stride_vc_b, stride_vc_o, stride_vc_h, BLOCK_N)
            if Q_MAX == 1:
                fresh = k_ok & (k_pos == seq_len - 1)  # written by the kernel before
            else:
                fresh = k_ok & (k_pos >= new_lo)
            k = _load_k(k_cache_ptr, k_off, d, d_ok, k_ok & ~fresh, cdt)  # [D, BLOCK_N]
            v = _load_v(v_cache_ptr, v_off, d, d_ok, k_ok & ~fresh, cdt)  # [BLOCK_N, D]
            pdl_wait(PDL)
            stamp(TL, tl_ptr, WAITED)
        if ROPE:  # writes the newest key where this split holds it: before anything reads it
            holds_newest = (seq_len - 1 >= s_lo) & (seq_len - 1 < s_hi)
            _rope_write_kv(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, q_start, kv_head,
                           holds_newest & (slot >= 0), slot, block_size, eps, head_dim,
                           stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kc_b,
                           stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                           kp, kr, kcos, ksin, kw, kwp, NORM, BLOCK_D)
        # Q_FIRST: q before the newest key's reload (8-warp programs), else after it; either
        # way the other order lost on the H200 (docs/benchmarks.md)
        if Q_FIRST:
            q = _split_q(q_ptr, q_start, head, row_ok, q_mask, q_ptrs, GROUP * tl.num_programs(1),
                         eps, head_dim, stride_qt, stride_qh, qp, qr, qcos, qsin, qw, qwp,
                         ROPE, NORM, BLOCK_D)
        if PREFETCH:
            if (seq_len - 1 >= s_lo) & (new_lo < s_lo + BLOCK_N):
                k = tl.where(fresh[None, :], _load_k(k_cache_ptr, k_off, d, d_ok, fresh, cdt), k)
                v = tl.where(fresh[:, None], _load_v(v_cache_ptr, v_off, d, d_ok, fresh, cdt), v)
        if not Q_FIRST:
            q = _split_q(q_ptr, q_start, head, row_ok, q_mask, q_ptrs, GROUP * tl.num_programs(1),
                         eps, head_dim, stride_qt, stride_qh, qp, qr, qcos, qsin, qw, qwp,
                         ROPE, NORM, BLOCK_D)
        if PREFETCH:
            sc = _scores(q, k, k_pos, k_ok, q_pos, qk_scale, sliding_window, True, USE_WINDOW,
                         DOT_PRECISION)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, sc, v, DOT_PRECISION)
            rest = s_lo + BLOCK_N
        for start_n in range(rest, s_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start_n, s_hi, q_pos, kv_head, qk_scale, sliding_window,
                k_cache_ptr, v_cache_ptr, bt_row, block_size, d, d_ok,
                stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                True, USE_WINDOW, DOT_PRECISION, BLOCK_N,
            )
        stamp(TL, tl_ptr, LOOPED)
        # partials: [rows (Q_MAX 1) or tokens, Hq, NUM_SPLITS, D] and [..., NUM_SPLITS, 2]
        if Q_MAX == 1:
            part = (row * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        else:
            part = ((q_start + tok).to(tl.int64) * (GROUP * tl.num_programs(1)) + head
                    ) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    stamp(TL, tl_ptr, EXIT)


@triton.jit
def _split_q(q_ptr, q_start, head, row_ok, q_mask, q_ptrs, num_q_heads, eps, head_dim,
             stride_qt, stride_qh, q_partner, q_rotated, q_cos, q_sin, q_w, q_wp,
             ROPE: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's query heads [BLOCK_M, BLOCK_D]: loaded, or with ROPE normalised and
    rotated from the projection's output (in q's dtype, as rope_kv_write would have stored
    them)."""
    if ROPE:
        q = norm_rope_loaded(q_ptr + q_start.to(tl.int64) * stride_qt, head, num_q_heads, eps,
                             head_dim, stride_qh, q_partner, q_rotated, q_cos, q_sin, q_w, q_wp,
                             NORM, BLOCK_D)
        q = tl.where(row_ok[:, None], q, 0.0).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    return q


@triton.jit
def _rope_write_kv(
    k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, q_start, kv_head, writes, slot, block_size,
    eps, head_dim, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
    k_partner, k_rotated, k_cos, k_sin, k_w, k_wp, NORM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """ROPE's cache write after the PDL wait: where `writes`, the row's new key (normalised,
    rotated) and value of this kv head stored at `slot` (`store_rope_kv`). A barrier follows,
    so that every thread's later load of that key sees it."""
    if writes:
        kh = kv_head + tl.arange(0, 2)  # the kv head, and one masked row (two-row tiles)
        store_rope_kv(k_new_ptr + q_start.to(tl.int64) * stride_knt,
                      v_new_ptr + q_start.to(tl.int64) * stride_vnt, kh, kv_head + 1, eps,
                      head_dim, stride_knh, stride_vnh, k_partner, k_rotated, k_cos, k_sin, k_w,
                      k_wp, slot, block_size, k_cache_ptr, v_cache_ptr, stride_kc_b, stride_kc_o,
                      stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                      k_new_ptr.dtype.element_ty, NORM, BLOCK_D)
    tl.debug_barrier()


@triton.jit
def _merge_splits(part_acc_ptr, part_ml_ptr, idx, head, num_q_heads, head_dim,
                  NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The log-sum-exp merge of the NUM_SPLITS partials of (idx, head), idx a row or a query
    token of the partials [idx, Hq, NUM_SPLITS, D | 2]: its normalised output [BLOCK_D] in
    float32 (zeros where every split is empty)."""
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    base = (idx * num_q_heads + head) * NUM_SPLITS
    m_s = tl.load(part_ml_ptr + (base + sp) * 2)
    l_s = tl.load(part_ml_ptr + (base + sp) * 2 + 1)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * BLOCK_D + d[None, :],
                  mask=d_ok[None, :], other=0.0)  # [NUM_SPLITS, BLOCK_D]
    m_all = tl.max(m_s, 0)
    w = tl.exp2(m_s - m_all)
    w = tl.where(l_s > 0.0, w, 0.0)  # empty splits
    total = tl.sum(l_s * w, 0)
    return tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)


@triton.jit
def _decode_combine_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, seq_lens_ptr, head_dim, num_q_heads,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, TL: tl.constexpr = False, tl_ptr=None,
    PER_TOKEN: tl.constexpr = False, num_rows=None,
):
    """Flash-decoding, part 2: merge a (row, head)'s splits (one-token rows, grid (rows, Hq)),
    or with PER_TOKEN a (query token, head)'s (the split kernel's Q_MAX > 1 form, grid (tokens,
    Hq)): a token past the last of the `num_rows` rows (padding) gets zeros."""
    pdl_trigger(PDL)
    stamp(TL, tl_ptr, ENTRY)
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    if PER_TOKEN:
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        out = tl.zeros([BLOCK_D], tl.float32)
        if tok < tl.load(qsl_ptr + num_rows):
            out = _merge_splits(part_acc_ptr, part_ml_ptr, tok, head, num_q_heads, head_dim,
                                NUM_SPLITS, BLOCK_D)
        d = tl.arange(0, BLOCK_D)
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < head_dim)
    else:
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        q_start = tl.load(qsl_ptr + row)
        q_len = tl.load(qsl_ptr + row + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + row)
        if (q_len == 1) & (seq_len > 0):
            out = _merge_splits(part_acc_ptr, part_ml_ptr, row, head, num_q_heads, head_dim,
                                NUM_SPLITS, BLOCK_D)
            d = tl.arange(0, BLOCK_D)
            tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
                     out.to(out_ptr.dtype.element_ty), mask=d < head_dim)
    stamp(TL, tl_ptr, EXIT)


# split-KV decode aims at this many programs per SM (more splits cost their merge, fewer leave
# SMs idle), each split taking at least SPLIT_MIN_KEYS keys (one key tile: long splits gave
# short rows too few programs); keys per tile of the decode programs (64 on the H200 with a
# bf16 cache); software-pipeline stages of the split program's key loop (docs/benchmarks.md)
SPLIT_WAVES = 2
SPLIT_MIN_KEYS = 64
DECODE_BLOCK_N = 64
SPLIT_STAGES = 2
# rows of at most this many query tokens may take the split-KV kernel (all of a row's tokens in
# one program: `_decode_split_kernel`'s Q_MAX form)
SHORT_QUERY_ROWS = 8


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, device) -> int:
    """Splits per decode row so that rows x kv heads x splits fills the GPU SPLIT_WAVES times; 1
    when the batch already does or the rows are short (a split takes at least SPLIT_MIN_KEYS
    keys). In a decode graph the splits are fixed at capture, from max_model_len."""
    want = cdiv(SPLIT_WAVES * num_sms(device), max(num_rows * num_kv_heads, 1))
    by_len = cdiv(max_seq_len, SPLIT_MIN_KEYS)
    return max(1, min(16, next_pow2(min(want, by_len))))


def decode_split_warps(num_programs: int, device) -> int:
    """Warps of a split-KV decode program: 8 when the grid fits on the GPU one program an SM
    (each program streams its keys alone: more loads in flight), else 4 (8-warp programs lost
    once the grid holds several programs an SM)."""
    return 8 if num_programs <= num_sms(device) else 4


def split_tiles(q_max: int, group: int, block_d: int, num_programs: int, device,
                block_n: int | None = None) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, warps, prefetch) of a split-KV program taking q_max query tokens of a
    row, its score tile [BLOCK_M = q_max x group (>= 16), BLOCK_D]; block_n: the keys a tile
    when given (the interpreter's). One-token rows: the grid's warps (`decode_split_warps`),
    DECODE_BLOCK_N keys a tile, `decode_prefetch`. A verify row's tile wider than [16, 256]
    takes 8 warps ([32, 256]: 255 registers at 4, 168 at 8); past [32, 256] also 32-key tiles
    and no prefetch ([64, 256]: 255 at 64 keys, 242 at 32 prefetching, 181 not). From sm_90
    compiles (tests/ops/test_sm90_compile.py), not yet timed on the GPU."""
    block_m = max(16, next_pow2(q_max * group))
    warps, wide = decode_split_warps(num_programs, device), False
    if q_max > 1 and block_m * block_d > 16 * 256:
        warps, wide = 8, block_m * block_d > 32 * 256
    block_n = block_n or (32 if wide else DECODE_BLOCK_N)
    return block_m, block_n, warps, decode_prefetch(warps, block_n, block_d) and not wide


def decode_prefetch(warps: int, block_n: int, block_d: int) -> bool:
    """Whether split-KV programs load their first K/V tile before the PDL wait: when that tile
    (K and V, 2 x block_n x block_d elements) is at most 64 elements a thread, i.e. it does not
    cost the program its occupancy (past it the registers it holds made the program slower)."""
    return 2 * block_n * block_d <= 64 * 32 * warps


def _launch_config(max_query_len: int, group: int, interpret: bool,
                   head_dim: int = 128) -> dict[str, int]:
    """Tile sizes and launch options. BLOCK_M = query tokens per program x group, >= 16 for tl.dot.
    head_dim past 128 (Qwen3-Next's 256): 64-key tiles under full query tiles, or the two stages'
    K/V buffers overflow shared memory (320 KiB asked at 128 x 128 x 256, of sm_90's 227; 192
    KiB at 128 x 64: tests/ops/test_sm90_compile.py)."""
    block_m = min(max(16, next_pow2(max_query_len * group)), 128)
    block_m = max(block_m, next_pow2(group))
    if interpret:  # few, large programs: each one costs ~0.5 ms under the interpreter
        return dict(BLOCK_M=block_m, BLOCK_N=128)
    # Measured on an H200 (bf16, D 128): decode rows like 64-key tiles and 4 warps, full
    # 128-row prefill tiles like 128-key tiles and 8 warps.
    if block_m >= 128:
        return dict(BLOCK_M=block_m, BLOCK_N=128 if head_dim <= 128 else 64, num_warps=8,
                    num_stages=2)
    return dict(BLOCK_M=block_m, BLOCK_N=DECODE_BLOCK_N, num_warps=4, num_stages=2)


def paged_attention_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
    max_query_len: int, max_seq_len: int, scale: float,
    sliding_window: int | None = None, num_splits: int | None = None,
    prefetch: bool | None = None,
) -> Tensor:
    """Triton launcher of `paged_attention`. Batches of decode rows (max_query_len 1) and of
    short query rows (at most SHORT_QUERY_ROWS tokens: speculative verify rows) split each row's
    keys over `num_splits` programs (flash-decoding; chosen from the rows when None) when too
    few (row, kv head) programs would otherwise run; a short row's program takes all its query
    tokens (`_decode_split_kernel`'s Q_MAX form). prefetch: see `_decode_split`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # [T, Hq, D]: every token of a row is written (a row with q_len >= 1 has seq_len >= 1);
    # tokens after the last row are left as they are (no memset per layer), but for the split
    # kernel's short query rows, whose combine writes zeros there
    out = torch.empty_like(q)
    num_rows = seq_lens.shape[0]
    if num_tokens == 0 or num_rows == 0 or max_query_len <= 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_table.stride(-1) == 1
    interpret = q.device.type == "cpu"
    if max_query_len <= SHORT_QUERY_ROWS:
        # decode rows, and short query rows (speculative verify rows, small chunks): split like
        # decode rows when the rows alone would leave the GPU idle (the varlen kernel runs one
        # program a row and KV head)
        if num_splits is None:
            num_splits = decode_num_splits(num_rows, num_kv_heads, max_seq_len, q.device)
        if num_splits > 1:
            _decode_split(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                          scale, sliding_window, num_splits, interpret, prefetch,
                          q_max=next_pow2(max_query_len))
            return out
    config = _launch_config(max_query_len, group, interpret, head_dim)
    grid = (num_rows, num_kv_heads, cdiv(max_query_len, config["BLOCK_M"] // group))
    pdl = use_pdl(q)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_table,
        scale * math.log2(math.e), head_dim, k_cache.shape[1], sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=next_pow2(head_dim), **config, **pdl_args(pdl),
    )
    return out


def decode_split_rope(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, scale: float,
    sliding_window: int | None, num_splits: int, prefetch: bool | None = None,
) -> Tensor:
    """`rope_kv_write` then split-KV `paged_attention` for a batch of decode rows (every row
    at most one token), in the split kernel's launch and its combine's: q [T, Hq, D] and k/v
    [T, Hkv, D] as the projection left them (contiguous last dim), the rest as in
    `rope_kv_write` and `paged_attention`. Returns the attention output [T, Hq, D]."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    norm = q_norm_weight is not None
    rope = dict(
        ROPE=True, NORM=norm, IS_NEOX=is_neox, k_new_ptr=k, v_new_ptr=v, pos_ptr=positions,
        cs_ptr=cos_sin_cache, qw_ptr=q_norm_weight if norm else q,
        kw_ptr=k_norm_weight if norm else k, eps=eps, slot_ptr=slot_mapping,
        rot_dim=cos_sin_cache.shape[-1], stride_cs=cos_sin_cache.stride(0),
        stride_knt=k.stride(0), stride_knh=k.stride(1), stride_vnt=v.stride(0),
        stride_vnh=v.stride(1))
    _decode_split(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale,
                  sliding_window, num_splits, q.device.type == "cpu", prefetch, rope)
    return out


def _decode_split(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale,
                  sliding_window, num_splits, interpret, prefetch: bool | None = None,
                  rope: dict | None = None, q_max: int = 1) -> None:
    """Flash-decoding launches: the split kernel, then the combine kernel. prefetch: each
    split's first K/V tile loaded before the PDL wait (None: `decode_prefetch`). rope: the
    split kernel's ROPE arguments (`decode_split_rope`), None for a q already rotated. q_max:
    1 for rows of one query token (others skipped); past 1, every row has at most q_max tokens,
    each program takes all of its row's, and q's tokens past the last row get zeros."""
    num_rows = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    per_token = q_max > 1
    num_parts = q.shape[0] if per_token else num_rows
    # [rows or tokens, Hq, splits, D] unnormalised outputs and [..., splits, 2] (max, sum)
    part_acc = torch.empty(num_parts, num_q_heads, num_splits, block_d, dtype=torch.float32,
                           device=q.device)
    part_ml = torch.empty(num_parts, num_q_heads, num_splits, 2, dtype=torch.float32,
                          device=q.device)
    grid = (num_rows, num_kv_heads, num_splits)
    block_m, block_n, warps, may_prefetch = split_tiles(
        q_max, group, block_d, num_rows * num_kv_heads * num_splits, q.device,
        128 if interpret else None)
    opts = {} if interpret else dict(num_warps=warps, num_stages=SPLIT_STAGES)
    pdl = use_pdl(q)
    if prefetch is None:
        prefetch = may_prefetch
    _decode_split_kernel[grid](
        q, k_cache, v_cache, part_acc, part_ml,
        query_start_loc, seq_lens, block_table,
        scale * math.log2(math.e), head_dim, k_cache.shape[1], sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_splits, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, PREFETCH=prefetch, Q_FIRST=warps == 8, Q_MAX=q_max,
        **(rope or {}), **opts, **pdl_args(pdl),
        **timeline_args("decode_split", grid, q.device),
    )
    _decode_combine_kernel[(num_parts, num_q_heads)](
        out, part_acc, part_ml, query_start_loc, seq_lens, head_dim, num_q_heads,
        out.stride(0), out.stride(1), NUM_SPLITS=num_splits, BLOCK_D=block_d,
        **pdl_args(pdl), **timeline_args("decode_combine", (num_parts, num_q_heads), q.device),
        **(dict(PER_TOKEN=True, num_rows=num_rows) if per_token else {}),
    )


def paged_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
    max_query_len: int, max_seq_len: int, scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Torch reference of `paged_attention`: per row, one gather of its blocks + a masked matmul."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)  # [T, Hq, D]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len <= 0 or seq_len <= 0:
            continue
        blocks = block_table[b, : (seq_len + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float()  # [S, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float()  # [S, Hkv, D]
        qb = q[start:end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qb, k) * scale  # [Hkv, G, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos  # [q_len, S]
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)  # [q_len, Hkv, G, D]
        out[start:end] = o.reshape(q_len, num_q_heads, head_dim).to(q.dtype)
    return out


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
    max_query_len: int, max_seq_len: int, scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Varlen causal paged attention; returns [T, Hq, D] in q's dtype.

    q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; query_start_loc int32 [B+1];
    seq_lens int32 [B] (total length including this step's tokens); block_table int32
    [B, max_blocks_per_seq]. Rows with q_len 0 or seq_len 0 produce nothing; output tokens that
    no row covers (padding after the last row) are zero here and where the Triton path's split-KV
    kernel takes short query rows; its other kernels leave them unwritten.
    """
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                      max_query_len, max_seq_len, scale, sliding_window)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                               max_query_len, max_seq_len, scale, sliding_window)

"""Mamba2 state update over a speculative verify batch (1 + k tokens a row) with a deferred
commit: a verify row's state after its positions is not written; its inputs are kept, and the
next step replays the accepted ones onto the committed state before its own tokens.

Row r holds n_r = query_start_loc[r + 1] - query_start_loc[r] packed tokens (1 <= n_r <= S)
and owns the state slot state_slots[r, 0] (the committed state) and its request's replay
entries. Each request row q = idx_mapping[r] has a control word replay_ctl[q] = count |
parity << 16: `count` tokens of the previous step, kept in the replay buffers at `parity`,
were accepted and are not yet in the committed state.

A program of row r:
1. loads the committed state, replays the `count` kept tokens (x, raw dt, B: the state
   update's own inputs, so the result is the state the step before would have written), and
   writes it back when it replayed anything and the row has drafts (n_r > 1);
2. advances through the row's own tokens, writing y for each;
3. n_r > 1 (a row with drafts): keeps the tokens' x, dt and B at parity 1 - parity (the
   programs of this step still read the other half) and writes no state; n_r == 1 (a decode
   row without drafts): writes the state after its token, as a decode step would.

`fill_replay_ctl` (after sampling) sets each row's next control word: the accepted count and the
flipped parity for rows with drafts, 0 (nothing kept) for the others. A state slot so holds the
state at the request's last committed position; rows are written 1 + (count > 0) times a step at
most, against 1 + k for a state after every verified position (docs/architecture.md,
invariant 2). The running state stays in float32 between tokens and is rounded to the state's
dtype only where it is stored. A row with idx_mapping -1 or state_slots[r, 0] -1 is skipped:
nothing is written and its output rows are unspecified; so are those of tokens past S.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton
from krait.ops.mamba_ssd import softplus_clamp
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.selective_state_update import (
    _block_p,
    selective_state_update_ref,
    ssu_warps,
)

# grids of fewer (row, head) pairs than this run both token loops unrolled over the kept
# buffers' columns, masked (UNROLL): each token's loads need not wait for the token before,
# which matters where few programs hide no latency. H100, mamba2-1.3b, k = 3: the verify graph
# 2.072 -> 2.022 ms at batch 1 (64 pairs); the kernel 161 -> 170 us at batch 64 (4 096 pairs)
UNROLL_MAX_PAIRS = 1024
# registers a thread for the looped form (many pairs: batch 64). Uncapped ptxas takes 86 and
# the SM holds 5 programs; the kernel is bound by instruction issue, and more resident warps
# hide its L1 waits (no spills down to 56). H100, mamba2-1.3b, k = 3, batch 64: the verify
# graph 10.66 ms uncapped, 10.15 at 72, 9.65 at 64, 9.97 at 56 (docs/benchmarks.md)
LOOP_MAXNREG = 64
PARITY_SHIFT = 16  # replay_ctl = count | parity << PARITY_SHIFT
COUNT_MASK = (1 << PARITY_SHIFT) - 1

# ----------------------------------------------------------------------------- triton


def verify_tile(rows: int, heads: int, head_dim: int, d_state: int,
                state_bytes: int) -> tuple[int, int]:
    """(state rows a program, warps). Few (row, head) pairs (batch 1): the decode update's 4 KB
    tiles and warps, for programs enough to fill the SMs (16 KB tiles on 4 warps made the
    unrolled kernel faster alone but mamba2-1.3b's verify graph 1.6% slower, session 36);
    many: 8 KB tiles on 4 warps (H100, mamba2-1.3b's sizes at batch 64, fp32 state, 4 tokens
    replayed and 4 run a row: 161 us a call against 217 for 4 KB and 168 for 16 KB tiles;
    docs/benchmarks.md, session 30)."""

    def rows_of(tile_bytes: int) -> int:
        return max(1, min(next_pow2(head_dim), tile_bytes // (next_pow2(d_state) * state_bytes)))

    if not interpreting() and rows * heads >= 1024:
        return rows_of(8192), 4
    block_p = _block_p(head_dim, d_state, state_bytes)
    return block_p, ssu_warps(rows * heads * cdiv(head_dim, block_p))


@triton.jit
def _kept_token(x_ptrs, b_ptrs, p_ok, n_ok):
    """A kept token's x [P] and B [N], in float32."""
    x = tl.load(x_ptrs, mask=p_ok, other=0.0).to(tl.float32)
    return x, tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)


@triton.jit
def _token_dts(dt_ptrs, ok, dt_bias_h, a_h, dt_min, dt_max, DT_SOFTPLUS: tl.constexpr,
               DT_CLAMP: tl.constexpr):
    """The tokens' raw dt [COLS_P2] (0 where not `ok`), their dt after softplus and clamp (0
    where not `ok`: no change to the state) and decays exp(dt * A), in float32: computed once a
    program, not once a token in every thread."""
    raw = tl.load(dt_ptrs, mask=ok, other=0.0)
    dt = softplus_clamp(raw.to(tl.float32) + dt_bias_h, DT_SOFTPLUS, DT_CLAMP, dt_min, dt_max)
    dt = tl.where(ok, dt, 0.0)
    return raw, dt, tl.exp(dt * a_h)


@triton.jit
def _at(vec, cols, j):
    """Element j of a [COLS_P2] vector, as a scalar."""
    return tl.sum(tl.where(cols == j, vec, 0.0), axis=0)


@triton.jit
def _replay_one(state, x, dt, decay, bv):
    """One kept token onto the state tile: a decay multiply and an FMA an element. dt 0
    (decay 1) leaves the state as it is."""
    return state * decay + (dt * x)[:, None] * bv[None, :]


@triton.jit
def _own_token(state, t, ok, dt, decay, x_ptr, B_ptr, C_ptr, h, g, offs_p, offs_n, p_ok, n_ok,
               d_h, stride_x_t, stride_x_h, stride_x_p, stride_B_t, stride_B_g, stride_B_n,
               stride_C_t, stride_C_g, stride_C_n):
    """Token t through the state tile (its dt and decay from `_token_dts`), nothing stored:
    returns (the state after it, y [P], and its inputs as loaded to be kept: x [P], B [N]).
    `ok` False (past the row's tokens, unrolled loops): inputs 0, dt 0, the state as it was."""
    x_raw = tl.load(x_ptr + t * stride_x_t + h * stride_x_h + offs_p * stride_x_p,
                    mask=p_ok & ok, other=0.0)
    b_raw = tl.load(B_ptr + t * stride_B_t + g * stride_B_g + offs_n * stride_B_n,
                    mask=n_ok & ok, other=0.0)
    cv = tl.load(C_ptr + t * stride_C_t + g * stride_C_g + offs_n * stride_C_n,
                 mask=n_ok & ok, other=0.0).to(tl.float32)
    x = x_raw.to(tl.float32)
    state = state * decay + (dt * x)[:, None] * b_raw.to(tl.float32)[None, :]
    y = tl.sum(state * cv[None, :], axis=1) + d_h * x
    return state, y, x_raw, b_raw


@triton.jit
def _ssv_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr,
    qsl_ptr, slots_ptr, ctl_ptr, idx_ptr, rx_ptr, rdt_ptr, rb_ptr,
    head_dim, d_state, heads_per_group, num_cols, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h, stride_sl_r,
    stride_rx_par, stride_rx_q, stride_rx_j, stride_rx_h,
    stride_rdt_par, stride_rdt_q, stride_rdt_j,
    stride_rb_par, stride_rb_q, stride_rb_j, stride_rb_g,
    DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, COLS: tl.constexpr,
    COLS_P2: tl.constexpr, PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # One program: batch row r, head h, BLOCK_P rows of the [P, N] state (all of N), over the
    # kept tokens, then the row's own, with the state tile in registers. UNROLL: both loops
    # run all COLS (= num_cols) positions, masked past the row's count, as straight-line code
    # whose loads need not wait for the token before (COLS_P2: COLS to a power of two).
    r = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    req = tl.load(idx_ptr + r)
    slot = tl.load(slots_ptr + r * stride_sl_r)
    if (req >= 0) & (slot >= 0):
        ctl = tl.load(ctl_ptr + req)
        count = ctl & 0xFFFF
        par = ctl >> 16
        start = tl.load(qsl_ptr + r)
        n = tl.minimum(tl.load(qsl_ptr + r + 1) - start, num_cols)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        p_ok = offs_p < head_dim
        n_ok = offs_n < d_state
        tile_ok = p_ok[:, None] & n_ok[None, :]
        tile = h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
        s_ptrs = state_ptr + slot.to(tl.int64) * stride_s_slot + tile
        state = tl.load(s_ptrs, mask=tile_ok, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
        a_h = tl.load(A_ptr + h).to(tl.float32)
        d_h = tl.load(D_ptr + h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias_ptr + h).to(tl.float32)
        g = h // heads_per_group
        q64 = req.to(tl.int64)
        kept_x = rx_ptr + q64 * stride_rx_q + h * stride_rx_h + offs_p
        kept_dt = rdt_ptr + q64 * stride_rdt_q + h
        kept_b = rb_ptr + q64 * stride_rb_q + g * stride_rb_g + offs_n
        # 1. the previous step's accepted tokens (kept at parity `par`); every token's dt and
        # decay computed once a program (the own tokens' too, below)
        rx = kept_x + par * stride_rx_par
        rb = kept_b + par * stride_rb_par
        cols = tl.arange(0, COLS_P2)
        _, kdt, kdecay = _token_dts(kept_dt + par * stride_rdt_par + cols * stride_rdt_j,
                                    cols < count, dt_bias_h, a_h, dt_min, dt_max, DT_SOFTPLUS,
                                    DT_CLAMP)
        if UNROLL:
            for j in tl.static_range(COLS):  # (past count: x and B 0, dt 0, no change)
                x, bv = _kept_token(rx + j * stride_rx_j, rb + j * stride_rb_j,
                                    p_ok & (j < count), n_ok & (j < count))
                state = _replay_one(state, x, _at(kdt, cols, j), _at(kdecay, cols, j), bv)
        else:
            for j in range(0, count):
                x, bv = _kept_token(rx + j * stride_rx_j, rb + j * stride_rb_j, p_ok, n_ok)
                state = _replay_one(state, x, _at(kdt, cols, j), _at(kdecay, cols, j), bv)
        # 2. the row's own tokens, kept at the other parity when it has drafts
        odt_raw, odt, odecay = _token_dts(dt_ptr + (start + cols) * stride_dt_t
                                          + h * stride_dt_h, cols < n, dt_bias_h, a_h, dt_min,
                                          dt_max, DT_SOFTPLUS, DT_CLAMP)
        keep = n > 1
        out = 1 - par
        keep_dt = keep & (pb == 0)  # one program a (row, head)
        keep_b = keep_dt & (h % heads_per_group == 0)  # one program a (row, group)
        kx = kept_x + out * stride_rx_par
        kb = kept_b + out * stride_rb_par
        tl.store(kept_dt + out * stride_rdt_par + cols * stride_rdt_j,
                 odt_raw.to(rdt_ptr.dtype.element_ty), mask=(cols < n) & keep_dt)
        if UNROLL:
            # nothing stored between the tokens' loads (a store may alias them, so no later load
            # would be issued ahead of it): outputs and kept inputs gather in [COLS_P2, .] tiles
            # and the state, as replayed and after the tokens, stays in registers
            committed = state
            ys = tl.zeros([COLS_P2, BLOCK_P], tl.float32)
            xs = tl.zeros([COLS_P2, BLOCK_P], tl.float32)
            bs = tl.zeros([COLS_P2, BLOCK_N], tl.float32)
            for j in tl.static_range(COLS):
                state, y, x, bv = _own_token(
                    state, start + j, j < n, _at(odt, cols, j), _at(odecay, cols, j), x_ptr,
                    B_ptr, C_ptr, h, g, offs_p, offs_n, p_ok, n_ok, d_h, stride_x_t,
                    stride_x_h, stride_x_p, stride_B_t, stride_B_g, stride_B_n, stride_C_t,
                    stride_C_g, stride_C_n)
                here = cols == j
                ys = tl.where(here[:, None], y[None, :], ys)
                xs = tl.where(here[:, None], x.to(tl.float32)[None, :], xs)
                bs = tl.where(here[:, None], bv.to(tl.float32)[None, :], bs)
            mine = cols < n
            tl.store(y_ptr + (start + cols)[:, None] * stride_y_t + h * stride_y_h
                     + offs_p[None, :], ys.to(y_ptr.dtype.element_ty),
                     mask=mine[:, None] & p_ok[None, :])
            tl.store(kx[None, :] + cols[:, None] * stride_rx_j, xs.to(rx_ptr.dtype.element_ty),
                     mask=mine[:, None] & p_ok[None, :] & keep)
            tl.store(kb[None, :] + cols[:, None] * stride_rb_j, bs.to(rb_ptr.dtype.element_ty),
                     mask=mine[:, None] & n_ok[None, :] & keep_b)
            # a row without drafts: the state after its token; with drafts: the replayed one
            tl.store(s_ptrs, tl.where(n == 1, state, committed).to(state_ptr.dtype.element_ty),
                     mask=tile_ok & ((n == 1) | ((count > 0) & (n > 1))))
        else:
            if (count > 0) & (n > 1):
                tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
            for j in range(0, n):
                t = start + j
                state, y, x_raw, b_raw = _own_token(
                    state, t, j < n, _at(odt, cols, j), _at(odecay, cols, j), x_ptr, B_ptr,
                    C_ptr, h, g, offs_p, offs_n, p_ok, n_ok, d_h, stride_x_t, stride_x_h,
                    stride_x_p, stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g,
                    stride_C_n)
                tl.store(y_ptr + t * stride_y_t + h * stride_y_h + offs_p,
                         y.to(y_ptr.dtype.element_ty), mask=p_ok)
                tl.store(kx + j * stride_rx_j, x_raw.to(kx.dtype.element_ty), mask=p_ok & keep)
                tl.store(kb + j * stride_rb_j, b_raw.to(kb.dtype.element_ty),
                         mask=n_ok & keep_b)
            if n == 1:
                tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)


def selective_state_verify_triton(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, idx_mapping: Tensor,
    replay: tuple[Tensor, Tensor, Tensor, Tensor], dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")), block_p: int | None = None,
    num_warps: int | None = None, unroll: bool | None = None, maxnreg: int | None = None,
) -> Tensor:
    """Triton launcher of `selective_state_verify`; returns y [T, H, P]. `block_p` and
    `num_warps` override `verify_tile`'s choice, `unroll` UNROLL_MAX_PAIRS', `maxnreg` the
    looped form's LOOP_MAXNREG (scripts/bench_ssm_verify.py sweeps them)."""
    num_tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    rows = state_slots.shape[0]
    y = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)  # [T, H, P]
    if num_tokens == 0 or rows == 0:
        return y
    kept_x, kept_dt, kept_b, ctl = replay
    num_cols = kept_x.shape[2]  # S: the most tokens a row keeps (and runs)
    assert kept_x.stride(-1) == 1 and kept_b.stride(-1) == 1, "kept x and B: unit last stride"
    slots = state_slots.to(torch.int32)
    unroll = rows * heads < UNROLL_MAX_PAIRS if unroll is None else unroll
    tile_p, warps = verify_tile(rows, heads, head_dim, d_state, ssm_state.element_size())
    block_p = block_p or tile_p
    clamp = dt_limit != (0.0, float("inf"))
    grid = (rows, heads, cdiv(head_dim, block_p))
    _ssv_kernel[grid](
        ssm_state, x, dt, A, B, C, D, dt_bias, y,
        query_start_loc.to(torch.int32), slots, ctl, idx_mapping.to(torch.int32),
        kept_x, kept_dt, kept_b,
        head_dim, d_state, heads // groups, num_cols,
        float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
        *ssm_state.stride(), *x.stride(), *dt.stride()[:2], *B.stride(), *C.stride(),
        *y.stride()[:2], slots.stride(0),
        *kept_x.stride()[:4], *kept_dt.stride()[:3], *kept_b.stride()[:4],
        DT_SOFTPLUS=dt_softplus, DT_CLAMP=clamp, BLOCK_P=block_p,
        BLOCK_N=next_pow2(d_state),
        UNROLL=unroll, COLS=num_cols, COLS_P2=next_pow2(num_cols),
        **({"maxnreg": maxnreg or LOOP_MAXNREG} if not unroll and not interpreting() else {}),
        **pdl_args(use_pdl(x)),
        num_warps=num_warps or warps,
    )
    return y


# ----------------------------------------------------------------------------- torch reference


def selective_state_verify_ref(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, idx_mapping: Tensor,
    replay: tuple[Tensor, Tensor, Tensor, Tensor], dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Torch reference of `selective_state_verify`: the live rows' states in a float32 scratch
    [R, H, P, N], advanced one position at a time by `selective_state_update_ref` (every row
    still holding a kept token, then a token of its own, at that position at once)."""
    rows = state_slots.shape[0]
    y = torch.zeros_like(x)  # [T, H, P]
    if rows == 0 or x.shape[0] == 0:
        return y
    kept_x, kept_dt, kept_b, ctl = replay
    num_cols = kept_x.shape[2]  # S
    qsl = query_start_loc.long()
    req = idx_mapping.long()
    slot = state_slots[:, 0].long()
    live = (req >= 0) & (slot >= 0)  # [R]
    q = req.clamp(min=0)
    word = ctl[q].long()
    count = torch.where(live, word & COUNT_MASK, 0)  # [R]
    par = word >> PARITY_SHIFT  # [R]
    lens = torch.where(live, (qsl[1:] - qsl[:-1]).clamp(max=num_cols), 0)  # [R]
    scratch = torch.zeros((rows, *ssm_state.shape[1:]), dtype=torch.float32,
                          device=ssm_state.device)  # [R, H, P, N]
    scratch[live] = ssm_state[slot[live]].float()
    row_ids = torch.arange(rows, device=x.device)
    no_c = torch.zeros_like(kept_b[0, 0, 0])  # [G, N]: the replay's outputs are not used
    for j in range(int(count.max())):
        act = row_ids[count > j]  # rows with a kept token at position j
        selective_state_update_ref(
            scratch, kept_x[par[act], q[act], j], kept_dt[par[act], q[act], j], A,
            kept_b[par[act], q[act], j], no_c.expand(act.numel(), -1, -1), D, dt_bias,
            act.to(torch.int32), dt_softplus, dt_limit)
    commit = (count > 0) & (lens > 1)
    ssm_state[slot[commit]] = scratch[commit].to(ssm_state.dtype)
    for j in range(int(lens.max())):
        act = row_ids[lens > j]  # rows with a token at position j
        tok = qsl[act] + j  # [n]
        y[tok] = selective_state_update_ref(
            scratch, x[tok], dt[tok], A, B[tok], C[tok], D, dt_bias, act.to(torch.int32),
            dt_softplus, dt_limit,
        )
        kept = act[lens[act] > 1]
        if kept.numel():
            t = qsl[kept] + j
            out = 1 - par[kept]
            kept_x[out, q[kept], j] = x[t].to(kept_x.dtype)
            kept_dt[out, q[kept], j] = dt[t].to(kept_dt.dtype)
            kept_b[out, q[kept], j] = B[t].to(kept_b.dtype)
    single = lens == 1
    ssm_state[slot[single]] = scratch[single].to(ssm_state.dtype)
    return y


# ----------------------------------------------------------------------------- public


def selective_state_verify(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, idx_mapping: Tensor,
    replay: tuple[Tensor, Tensor, Tensor, Tensor], dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """The selective state update of a verify batch (1 + k tokens a row) with the deferred
    commit of the module docstring; returns y [T, H, P] in x's dtype.

    ssm_state [num_slots, H, P, N] (fp32 or bf16) updated in place; x [T, H, P]; dt [T, H]
    raw; A (float32, -exp(A_log)), D, dt_bias [H]; B, C [T, G, N]; query_start_loc int32
    [R + 1]; state_slots int32 [R, >= 1] (column 0: the row's committed state); idx_mapping
    int32 [R] (-1: skip the row, as is a row whose state_slots[r, 0] is -1); replay = (kept x
    [2, max_reqs, S, H, P], kept dt [2, max_reqs, S, H], kept B [2, max_reqs, S, G, N] in x's,
    dt's and B's dtypes, replay_ctl int32 [max_reqs]), written by rows with drafts.
    """
    fn = selective_state_verify_triton if use_triton(x) else selective_state_verify_ref
    return fn(ssm_state, x, dt, A, B, C, D, dt_bias, query_start_loc, state_slots, idx_mapping,
              replay, dt_softplus, dt_limit)

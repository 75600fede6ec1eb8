"""One decode row of a Mamba2 mixer after its in_proj, in one launch: the state update, the
gated RMSNorm and out_proj (`ssu_out_proj`).

At batch 1 the state update is its own kernel between the in_proj GEMV and the out_proj GEMV
(`selective_state_update_triton(gate=...)`, then `gated_norm_linear`): ~3.2 µs a layer on the
H200 for ~1 µs of state bytes (session 19's timeline), most of it a kernel boundary. Here every
program first does one piece of the state update (a head's BLOCK_P state rows, read before the
PDL wait as the state update kernel does), writes its g = y * silu(z) and the sum of g^2, then
waits at a grid-wide barrier for every piece, and streams its BLOCK_N columns of out_proj
with the gated norm in the prologue (its first weight tile requested before the PDL wait).

The barrier: each program adds one to an arrival counter, then spins (volatile loads) until all
programs have arrived; after it, a departure counter, whose last program resets both (zero
between launches: graph-safe, no memset). Spinning programs wait for programs that must be
resident too: the launcher keeps the grid at most two programs an SM, of eight warps capped at
128 registers a thread (`maxnreg`: two fill an SM's 64K registers), so every program is
resident at once.
The interpreter runs programs one after another: there the two phases go as two launches
(PHASE 1, then 2), and one program alone passes the barrier (the CPU tests use both).

Numerics equal the two-kernel path's: the same state update arithmetic (`ssu_step`), y rounded
to x's dtype before the gate, the norm's 1/rms from the same partial sums in the same order,
the products in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, env, interpreting, next_pow2, num_sms, use_triton
from krait.ops.arrival import arrival_counters
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.selective_state_update import gated_part_size, ssu_advance
from krait.ops.timeline import ENTRY, EXIT, LOOPED, WAITED, stamp, timeline_args

_COUNTERS: dict[torch.device, Tensor] = {}  # [arrivals, departures], always back to zero
WARPS = 8
MAX_REGISTERS = 128  # a thread: two programs of WARPS warps fill an SM's 64K registers
PROGRAMS_PER_SM = 2  # resident at once (see the module docstring)


@triton.jit
def _arrive(count_ptr):
    """This program's arrival at the grid barrier: its writes before it are visible to the
    programs past `_wait_all`."""
    tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _wait_all(count_ptr, programs):
    """Returns once all `programs` programs have arrived (`_arrive`), with the departure count
    (the last program to depart, count programs - 1, resets the counters: `_reset_barrier`).
    One thread of each program polls (a masked volatile load; every warp polling one L2 line
    slowed the grid)."""
    lane = tl.arange(0, 32)
    seen = 0
    while seen < programs:
        seen = tl.max(tl.load(count_ptr + lane * 0, mask=lane == 0, other=0, volatile=True),
                      axis=0)
    tl.atomic_add(count_ptr, 0, sem="acquire")  # orders the loads after it
    return tl.atomic_add(count_ptr + 1, 1, sem="relaxed")


@triton.jit
def _reset_barrier(count_ptr, departed, programs):
    if departed == programs - 1:  # every program is past the spin
        tl.atomic_xchg(count_ptr, 0)
        tl.atomic_xchg(count_ptr + 1, 0)


@triton.jit
def _gated_piece(state, s_ptrs, s_ok, piece, h, offs_p, p_ok, offs_s, s_n_ok, a_h, d_h, dtb_h,
                 x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, g_ptr, part_ptr, head_dim,
                 heads_per_group, stride_x_h, stride_dt_h, stride_B_g, stride_C_g,
                 dt_min, dt_max, DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
                 STORE_STATE: tl.constexpr):
    """One piece of the gated state update (head h, state rows offs_p; its state tile already
    loaded): writes g = y * silu(z) of its channels and their sum of g^2 at `piece`, and the
    new state with STORE_STATE. Returns the new state (float32)."""
    grp = h // heads_per_group
    x = tl.load(x_ptr + h * stride_x_h + offs_p, mask=p_ok, other=0.0)
    dt = tl.load(dt_ptr + h * stride_dt_h).to(tl.float32)
    bv = tl.load(B_ptr + grp * stride_B_g + offs_s, mask=s_n_ok, other=0.0).to(tl.float32)
    cv = tl.load(C_ptr + grp * stride_C_g + offs_s, mask=s_n_ok, other=0.0).to(tl.float32)
    col = h * head_dim + offs_p  # channel within the row [H * P]
    z = tl.load(z_ptr + col, mask=p_ok, other=0.0).to(tl.float32)
    state, y = ssu_advance(state, x.to(tl.float32), dt + dtb_h, bv, cv, a_h, d_h, dt_min,
                           dt_max, DT_SOFTPLUS, DT_CLAMP)
    if STORE_STATE:
        tl.store(s_ptrs, state.to(s_ptrs.dtype.element_ty), mask=s_ok)
    gv = y.to(x.dtype).to(tl.float32) * (z * tl.sigmoid(z))  # y rounded as the norm reads it
    gv = tl.where(p_ok, gv, 0.0)
    tl.store(g_ptr + col, gv, mask=p_ok)
    tl.store(part_ptr + piece, tl.sum(gv * gv, axis=0))
    return state


@triton.jit
def _ssu_out_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, z_ptr, slots_ptr,
    g_ptr, part_ptr, w_ptr, b_ptr, norm_ptr, y_ptr, count_ptr,
    head_dim, d_state, heads_per_group, p_blocks, num_pieces, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_h, stride_dt_h, stride_B_g, stride_C_g,
    N, K, stride_wn, group_size, eps,
    DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr,
    TL: tl.constexpr = False, tl_ptr=None, MARK: tl.constexpr = 2,
):
    """PHASE 0: both phases with the grid barrier between them; 1: the state update only; 2:
    out_proj only (the interpreter's two launches). The timeline's LOOPED stamp marks the
    end of the program's state-update piece (MARK 0), its barrier arrival (1) or its passing
    of the barrier (2). Program i does pieces i, i + grid, ... of
    the state update (piece = head * p_blocks + row block), then output columns
    [i * BLOCK_N, (i + 1) * BLOCK_N) of out_proj over all of K, the gated norm per group of
    group_size channels (ONE_GROUP: the whole row)."""
    stamp(TL, tl_ptr, ENTRY)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = g_ptr + 0 * offs_n[:, None]  # g broadcast over N by its pointers, as gemv.py
    norm_rows = norm_ptr + 0 * offs_n[:, None]
    w_ok = n_ok[:, None]
    if PHASE != 1:  # weights never change: the first tile streams while the kernel before ends
        w = tl.load(w_rows + offs_k[None, :], mask=w_ok & (offs_k < K)[None, :], other=0.0)
    # the first piece's state tile before the wait too (only this layer's update writes it)
    slot = tl.load(slots_ptr)
    h = pid // p_blocks
    offs_p = (pid % p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    p_ok = offs_p < head_dim
    s_n_ok = offs_s < d_state
    mine = (pid < num_pieces) & (slot >= 0)
    s_ok = p_ok[:, None] & s_n_ok[None, :] & mine
    s_rows = state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_s_slot
    hc = tl.minimum(h, num_pieces // p_blocks - 1)  # a head in range (programs past pieces)
    s_ptrs = (s_rows + hc * stride_s_h + offs_p[:, None] * stride_s_p
              + offs_s[None, :] * stride_s_n)
    state = tl.load(s_ptrs, mask=s_ok, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_S]
    a_h = tl.load(A_ptr + hc).to(tl.float32)
    d_h = tl.load(D_ptr + hc).to(tl.float32)
    dtb_h = tl.load(dt_bias_ptr + hc).to(tl.float32)
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    if PHASE != 2:
        if mine:  # the new state is written after the arrival (off the release's wait)
            state = _gated_piece(state, s_ptrs, s_ok, pid, h, offs_p, p_ok, offs_s, s_n_ok,
                                 a_h, d_h, dtb_h, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, g_ptr,
                                 part_ptr, head_dim, heads_per_group, stride_x_h, stride_dt_h,
                                 stride_B_g, stride_C_g, dt_min, dt_max, DT_SOFTPLUS, DT_CLAMP,
                                 False)
        if MARK == 0:
            stamp(TL, tl_ptr, LOOPED)
        # more pieces than programs (small grids): the rest, state read after the wait
        for piece in range(pid + programs, num_pieces, programs):
            hp = piece // p_blocks
            op = (piece % p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
            pok = op < head_dim
            sok = pok[:, None] & s_n_ok[None, :] & (slot >= 0)
            sp = (s_rows + hp * stride_s_h + op[:, None] * stride_s_p
                  + offs_s[None, :] * stride_s_n)
            st = tl.load(sp, mask=sok, other=0.0).to(tl.float32)
            if slot >= 0:
                _gated_piece(st, sp, sok, piece, hp, op, pok, offs_s, s_n_ok,
                             tl.load(A_ptr + hp).to(tl.float32), tl.load(D_ptr + hp).to(tl.float32),
                             tl.load(dt_bias_ptr + hp).to(tl.float32), x_ptr, dt_ptr, B_ptr,
                             C_ptr, z_ptr, g_ptr, part_ptr, head_dim, heads_per_group,
                             stride_x_h, stride_dt_h, stride_B_g, stride_C_g, dt_min, dt_max,
                             DT_SOFTPLUS, DT_CLAMP, True)
    if PHASE == 0:
        _arrive(count_ptr)
    if MARK == 1:
        stamp(TL, tl_ptr, LOOPED)
    if PHASE != 2:
        tl.store(s_ptrs, state.to(s_ptrs.dtype.element_ty), mask=s_ok)
    if PHASE != 1:  # the second tile in flight across the barrier
        w1 = tl.load(w_rows + BLOCK_K + offs_k[None, :],
                     mask=w_ok & (BLOCK_K + offs_k < K)[None, :], other=0.0)
    departed = 0
    if PHASE == 0:
        departed = _wait_all(count_ptr, programs)
    if MARK == 2:
        stamp(TL, tl_ptr, LOOPED)
    if PHASE != 1:
        j = tl.arange(0, PARTS)
        parts_per_group = group_size // BLOCK_P
        rstd = 1.0
        if ONE_GROUP:  # the whole row one norm group: its 1 / rms once, the dots scaled after
            ps = tl.load(part_ptr + j, mask=j < parts_per_group, other=0.0, cache_modifier=".cg")
            rstd = tl.rsqrt(tl.sum(ps, axis=0) / group_size + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = (k0 + offs_k)[None, :]
            k_ok = k < K
            x = tl.load(x_rows + k, mask=w_ok & k_ok, other=0.0) * tl.load(
                norm_rows + k, mask=w_ok & k_ok, other=0.0).to(tl.float32)
            if not ONE_GROUP:  # the tile lies in one group (BLOCK_K divides the group)
                ps = tl.load(part_ptr + (k0 // group_size) * parts_per_group + j,
                             mask=j < parts_per_group, other=0.0, cache_modifier=".cg")
                x = x * tl.rsqrt(tl.sum(ps, axis=0) / group_size + eps)
            k_next = k + 2 * BLOCK_K  # two tiles ahead
            w_next = tl.load(w_rows + k_next, mask=w_ok & (k_next < K), other=0.0)
            acc += x * w.to(tl.float32)
            w = w1
            w1 = w_next
        pdl_trigger(PDL)
        dots = tl.sum(acc, axis=1) * rstd
        if HAS_BIAS:
            dots += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, dots.to(y_ptr.dtype.element_ty), mask=n_ok)
    if PHASE == 0:
        _reset_barrier(count_ptr, departed, programs)
    stamp(TL, tl_ptr, EXIT)


def ssu_out_config(n: int, group_size: int, device: torch.device) -> dict[str, int] | None:
    """Tiles for an out_proj of n columns whose norm groups span group_size channels: BLOCK_N,
    the smallest power of two from 8 that keeps the grid within PROGRAMS_PER_SM programs an
    SM; BLOCK_K, up to 1024 dividing the group (few and large weight loads a program: its
    loop waits on each). None past 256 columns a program or below 16 channels a K tile."""
    limit = PROGRAMS_PER_SM * num_sms(device)
    block_n = 8
    while cdiv(n, block_n) > limit:
        block_n *= 2
    block_k = 1024 // block_n * 8
    while group_size % block_k:
        block_k //= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k) if block_n <= 256 and block_k >= 16 else None


def ssu_out_ok(rows: Tensor, weight: Tensor, group_size: int, head_dim: int,
               d_state: int) -> bool:
    """Does `ssu_out_proj` serve this decode row? One row through Triton, norm groups of whole
    state-update row blocks, head_dim a multiple of that block, a grid that fits
    (`ssu_out_config`); only with KRAIT_SSU_OUT=1 (an opt-in: slower than the two kernels on
    the H200, session 20, batch-1 graph ms mamba2-1.3b 1.138 -> 1.306, granite-micro 2.180 ->
    2.311)."""
    if env("KRAIT_SSU_OUT", "0") != "1" or rows.shape[0] != 1 or not use_triton(rows):
        return False
    block_p = gated_part_size(head_dim, d_state)
    if weight.shape[1] % group_size or group_size % block_p or head_dim % block_p:
        return False
    return ssu_out_config(weight.shape[0], group_size, rows.device) is not None


def ssu_out_proj(ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                 D: Tensor, dt_bias: Tensor, slots: Tensor, gate: Tensor, weight: Tensor,
                 bias: Tensor | None, norm_weight: Tensor, eps: float, group_size: int,
                 dt_limit: tuple[float, float] = (0.0, float("inf")),
                 dt_softplus: bool = True) -> Tensor:
    """out_proj(gated_rms_norm(selective_state_update(...), gate)) of one decode row in one
    launch (the gated RMSNorm over groups of group_size channels): ssm_states [slots, H, P, N] updated
    in place at slots[0] (-1: padding, the state untouched and the output unspecified); x
    [1, H, P], dt [1, H], B, C [1, G, N] (views: row strides followed, unit stride inside), A,
    D, dt_bias [H], gate [1, H * P], weight [hidden, H * P], norm_weight [H * P] -> [1, hidden]
    in the weight's dtype, as `gated_norm_linear` returns it. Where `ssu_out_ok` holds."""
    _, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    n, k = weight.shape
    cfg = ssu_out_config(n, group_size, x.device)
    block_p = gated_part_size(head_dim, d_state)
    if (cfg is None or k != heads * head_dim or head_dim % block_p or k % group_size
            or group_size % block_p):
        raise ValueError("ssu_out_proj: out_proj must take the H * P channels, head_dim and "
                         "the norm groups multiples of the state update's row block, and the "
                         "grid must fit")
    for name, t in (("x", x), ("B", B), ("C", C), ("gate", gate), ("weight", weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"ssu_out_proj: {name} needs unit stride along its last dim")
    p_blocks = head_dim // block_p
    pieces = heads * p_blocks
    scratch = torch.empty(k + pieces, dtype=torch.float32, device=x.device)  # [g | parts]
    y = torch.empty(1, n, dtype=weight.dtype, device=x.device)  # [1, hidden]
    grid = cdiv(n, cfg["BLOCK_N"])
    clamp = dt_limit != (0.0, float("inf"))
    pdl = use_pdl(x)
    common = dict(
        DT_SOFTPLUS=dt_softplus, DT_CLAMP=clamp, BLOCK_P=block_p, BLOCK_S=next_pow2(d_state),
        PARTS=next_pow2(group_size // block_p), ONE_GROUP=group_size == k, HAS_BIAS=bias is not None, **cfg,
    )
    if x.is_cuda:
        common.update(num_warps=WARPS, maxnreg=MAX_REGISTERS)
    counters = arrival_counters(_COUNTERS, x.device, 2)
    phases = (1, 2) if interpreting() and grid > 1 else (0,)
    for phase in phases:
        _ssu_out_kernel[(grid,)](
            ssm_states, x, dt, A, B, C, D, dt_bias, gate, slots, scratch, scratch[k:], weight,
            bias if bias is not None else weight, norm_weight, y, counters,
            head_dim, d_state, heads // groups, p_blocks, pieces,
            float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
            *ssm_states.stride(), x.stride(1), dt.stride(1), B.stride(1), C.stride(1),
            n, k, weight.stride(0), group_size, float(eps), PHASE=phase,
            **common, **pdl_args(pdl and phase == 0),
            **timeline_args("ssu_out", (grid,), x.device),
            MARK=("piece", "arrival", "barrier").index(env("KRAIT_TIMELINE_SSU_MARK", "barrier")),
        )
    return y

"""Mamba2 SSD chunked scan (prefill) over packed varlen batches with per-sequence state slots.

dt' = clamp(softplus(dt + dt_bias), *dt_limit); h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T;
y_t = h_t C_t + D x_t, per head (h: [P, N]). Sequences are cut into chunks of `chunk_size` that
restart at every sequence boundary; within a chunk the output is a masked matrix product, and the
state is passed from chunk to chunk. Sequence b starts from ssm_states[state_indices[b]] (or zeros
when has_initial_state[b] is False) and its final state is written back there. A slot of -1 marks
a padding row (nothing computed or written, output rows unspecified); sequences of zero tokens are
left alone. Internal math is float32; y is in x's dtype; the state tensor may be fp32 or bf16.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton

# ----------------------------------------------------------------------------- triton


@triton.jit
def softplus_clamp(dt, DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr, dt_min, dt_max):
    """float32 dt -> clamp(softplus(dt), dt_min, dt_max) (torch's softplus threshold of 20)."""
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if DT_CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. DOT_PRECISION "upcast" (the interpreter, whose tl.dot multiplies the bit
    patterns of bf16 operands) does the product in float32 on the already-rounded operands."""
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, dt_out_ptr, dA_cs_ptr, chunk_start_ptr, chunk_len_ptr,
    heads, chunk_size, max_chunks, dt_min, dt_max,
    stride_dt_t, stride_dt_h,
    DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_CS: tl.constexpr,
):
    # One program: one chunk x BLOCK_H heads. Writes dt' and cumsum(dt' A) as [H, chunks, cs];
    # positions past the chunk's length get dt' = 0 (the cumsum stays flat there).
    c = tl.program_id(0)
    start = tl.load(chunk_start_ptr + c)
    clen = tl.load(chunk_len_ptr + c)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_CS)
    h_ok = offs_h < heads
    ld = h_ok[:, None] & (offs_l < clen)[None, :]
    dt = tl.load(
        dt_ptr + (start + offs_l).to(tl.int64)[None, :] * stride_dt_t
        + offs_h[:, None] * stride_dt_h,
        mask=ld, other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_CS]
    dt += tl.load(dt_bias_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)[:, None]
    dt = softplus_clamp(dt, DT_SOFTPLUS, DT_CLAMP, dt_min, dt_max)
    dt = tl.where(ld, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    dA_cs = tl.cumsum(dt * A[:, None], axis=1)
    out = (offs_h[:, None] * max_chunks + c).to(tl.int64) * chunk_size + offs_l[None, :]
    st = h_ok[:, None] & (offs_l < chunk_size)[None, :]
    tl.store(dt_out_ptr + out, dt, mask=st)
    tl.store(dA_cs_ptr + out, dA_cs, mask=st)


@triton.jit
def _chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, dA_cs_ptr, states_ptr, chunk_start_ptr, chunk_len_ptr,
    heads, head_dim, d_state, heads_per_group, chunk_size, max_chunks,
    stride_x_t, stride_x_h, stride_x_p, stride_B_t, stride_B_g, stride_B_n,
    DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program: chunk c, head h, a [BLOCK_P, BLOCK_N] tile of the state the chunk's own
    # tokens leave at its end: sum_k exp(a_last - a_k) dt_k x_k B_k^T.
    h = tl.program_id(0)
    c = tl.program_id(2)
    num_n = tl.cdiv(d_state, BLOCK_N)
    offs_p = (tl.program_id(1) // num_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (tl.program_id(1) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(chunk_start_ptr + c)
    clen = tl.load(chunk_len_ptr + c)
    if clen > 0:
        g = h // heads_per_group
        row = (h * max_chunks + c).to(tl.int64) * chunk_size
        a_last = tl.load(dA_cs_ptr + row + chunk_size - 1)
        x_base = x_ptr + start.to(tl.int64) * stride_x_t + h * stride_x_h
        b_base = B_ptr + start.to(tl.int64) * stride_B_t + g * stride_B_g
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)  # [P, N]
        for k0 in range(0, clen, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < clen
            xt = tl.load(
                x_base + offs_k[None, :] * stride_x_t + offs_p[:, None] * stride_x_p,
                mask=k_ok[None, :] & (offs_p < head_dim)[:, None], other=0.0,
            )  # [BLOCK_P, BLOCK_K]
            b = tl.load(
                b_base + offs_k[:, None] * stride_B_t + offs_n[None, :] * stride_B_n,
                mask=k_ok[:, None] & (offs_n < d_state)[None, :], other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            a_k = tl.load(dA_cs_ptr + row + offs_k, mask=k_ok, other=0.0)
            dt_k = tl.load(dt_ptr + row + offs_k, mask=k_ok, other=0.0)
            scale = tl.exp(tl.minimum(a_last - a_k, 0.0)) * dt_k
            b = (b.to(tl.float32) * scale[:, None]).to(xt.dtype)
            acc = _mma(xt, b, acc, DOT_PRECISION)
        out = states_ptr + (c.to(tl.int64) * heads + h) * head_dim * d_state
        tl.store(
            out + offs_p[:, None] * d_state + offs_n[None, :], acc,
            mask=(offs_p < head_dim)[:, None] & (offs_n < d_state)[None, :],
        )


@triton.jit
def _state_passing_kernel(
    states_ptr, start_ptr, dA_cs_ptr, ssm_ptr, seq_chunk_start_ptr, slots_ptr, has_init_ptr,
    heads, head_dim, d_state, chunk_size, max_chunks,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    BLOCK: tl.constexpr,
):
    # One program: sequence b, head h, BLOCK entries of the flattened [P, N] state. Writes the
    # state entering each chunk to start_ptr, and the final state to the slot.
    b = tl.program_id(2)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    c0 = tl.load(seq_chunk_start_ptr + b)
    c1 = tl.load(seq_chunk_start_ptr + b + 1)
    if (slot >= 0) & (c1 > c0):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < head_dim * d_state
        slot_ptrs = (
            ssm_ptr + slot.to(tl.int64) * stride_s_slot + h * stride_s_h
            + (offs // d_state) * stride_s_p + (offs % d_state) * stride_s_n
        )
        has_init = tl.load(has_init_ptr + b) != 0
        s = tl.load(slot_ptrs, mask=ok & has_init, other=0.0).to(tl.float32)  # [BLOCK]
        for c in range(c0, c1):
            off = (c * heads + h).to(tl.int64) * head_dim * d_state + offs
            own = tl.load(states_ptr + off, mask=ok, other=0.0)
            decay = tl.exp(tl.load(dA_cs_ptr + (h * max_chunks + c).to(tl.int64) * chunk_size
                                   + chunk_size - 1))
            tl.store(start_ptr + off, s.to(start_ptr.dtype.element_ty), mask=ok)
            s = decay * s + own
        tl.store(slot_ptrs, s.to(ssm_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bmm_chunk_kernel(
    C_ptr, B_ptr, cb_ptr, chunk_start_ptr, chunk_len_ptr,
    groups, d_state, chunk_size,
    stride_C_t, stride_C_g, stride_C_n, stride_B_t, stride_B_g, stride_B_n,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program: chunk c, group g, a [BLOCK_M, BLOCK_S] tile of C_l . B_s (lower triangle only).
    c = tl.program_id(2)
    g = tl.program_id(1)
    num_s = tl.cdiv(chunk_size, BLOCK_S)
    m0 = (tl.program_id(0) // num_s) * BLOCK_M
    s0 = (tl.program_id(0) % num_s) * BLOCK_S
    start = tl.load(chunk_start_ptr + c)
    clen = tl.load(chunk_len_ptr + c)
    if (m0 < clen) & (s0 < m0 + BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_s = s0 + tl.arange(0, BLOCK_S)
        c_base = C_ptr + start.to(tl.int64) * stride_C_t + g * stride_C_g
        b_base = B_ptr + start.to(tl.int64) * stride_B_t + g * stride_B_g
        acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)  # [l, s]
        for n0 in range(0, d_state, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < d_state
            cm = tl.load(
                c_base + offs_m[:, None] * stride_C_t + offs_n[None, :] * stride_C_n,
                mask=(offs_m < clen)[:, None] & n_ok[None, :], other=0.0,
            )
            bt = tl.load(
                b_base + offs_s[None, :] * stride_B_t + offs_n[:, None] * stride_B_n,
                mask=(offs_s < clen)[None, :] & n_ok[:, None], other=0.0,
            )
            acc = _mma(cm, bt, acc, DOT_PRECISION)
        out = cb_ptr + (c.to(tl.int64) * groups + g) * chunk_size * chunk_size
        tl.store(
            out + offs_m[:, None] * chunk_size + offs_s[None, :], acc,
            mask=(offs_m < chunk_size)[:, None] & (offs_s < chunk_size)[None, :],
        )


@triton.jit
def _chunk_scan_kernel(
    x_ptr, C_ptr, cb_ptr, dt_ptr, dA_cs_ptr, states_ptr, D_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    heads, head_dim, d_state, groups, heads_per_group, chunk_size, max_chunks,
    stride_x_t, stride_x_h, stride_x_p, stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program: chunk c, head h, rows [m0, m0 + BLOCK_M) of the chunk x BLOCK_P channels.
    # y_l = exp(a_l) C_l . h_start + sum_{k<=l} (C_l . B_k) exp(a_l - a_k) dt_k x_k + D x_l.
    h = tl.program_id(0)
    c = tl.program_id(2)
    num_p = tl.cdiv(head_dim, BLOCK_P)
    m0 = (tl.program_id(1) // num_p) * BLOCK_M
    offs_p = (tl.program_id(1) % num_p) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(chunk_start_ptr + c)
    clen = tl.load(chunk_len_ptr + c)
    if m0 < clen:
        g = h // heads_per_group
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < clen
        p_ok = offs_p < head_dim
        row = (h * max_chunks + c).to(tl.int64) * chunk_size
        a_m = tl.load(dA_cs_ptr + row + offs_m, mask=offs_m < chunk_size, other=0.0)
        x_base = x_ptr + start.to(tl.int64) * stride_x_t + h * stride_x_h
        c_base = C_ptr + start.to(tl.int64) * stride_C_t + g * stride_C_g
        s_base = states_ptr + (c.to(tl.int64) * heads + h) * head_dim * d_state

        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)  # [rows, channels]
        for n0 in range(0, d_state, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < d_state
            cm = tl.load(
                c_base + offs_m[:, None] * stride_C_t + offs_n[None, :] * stride_C_n,
                mask=m_ok[:, None] & n_ok[None, :], other=0.0,
            )  # [BLOCK_M, BLOCK_N]
            st = tl.load(
                s_base + offs_p[None, :] * d_state + offs_n[:, None],
                mask=p_ok[None, :] & n_ok[:, None], other=0.0,
            )  # [BLOCK_N, BLOCK_P]
            acc = _mma(cm, st.to(cm.dtype), acc, DOT_PRECISION)
        acc *= tl.exp(a_m)[:, None]

        cb_base = cb_ptr + (c.to(tl.int64) * groups + g) * chunk_size * chunk_size
        k_hi = tl.minimum(m0 + BLOCK_M, clen)
        for k0 in range(0, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < clen
            cb = tl.load(
                cb_base + offs_m[:, None] * chunk_size + offs_k[None, :],
                mask=m_ok[:, None] & k_ok[None, :], other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            a_k = tl.load(dA_cs_ptr + row + offs_k, mask=k_ok, other=0.0)
            dt_k = tl.load(dt_ptr + row + offs_k, mask=k_ok, other=0.0)
            w = cb * tl.exp(tl.minimum(a_m[:, None] - a_k[None, :], 0.0)) * dt_k[None, :]
            w = tl.where((offs_m[:, None] >= offs_k[None, :]) & k_ok[None, :], w, 0.0)
            xk = tl.load(
                x_base + offs_k[:, None] * stride_x_t + offs_p[None, :] * stride_x_p,
                mask=k_ok[:, None] & p_ok[None, :], other=0.0,
            )  # [BLOCK_K, BLOCK_P]
            acc = _mma(w.to(xk.dtype), xk, acc, DOT_PRECISION)

        xm = tl.load(
            x_base + offs_m[:, None] * stride_x_t + offs_p[None, :] * stride_x_p,
            mask=m_ok[:, None] & p_ok[None, :], other=0.0,
        )
        acc += tl.load(D_ptr + h).to(tl.float32) * xm.to(tl.float32)
        y_base = y_ptr + start.to(tl.int64) * stride_y_t + h * stride_y_h
        tl.store(
            y_base + offs_m[:, None] * stride_y_t + offs_p[None, :],
            acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & p_ok[None, :],
        )


def chunk_layout(
    query_start_loc: Tensor, state_indices: Tensor, chunk_size: int, num_tokens: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Cut every live sequence into chunks, on the device and without a host sync.

    Returns (chunk_start, chunk_len) int32 [max_chunks] with max_chunks = T // chunk_size + B (an
    upper bound; unused chunks have length 0) and seq_chunk_start int32 [B + 1]: sequence b owns
    chunks seq_chunk_start[b]:seq_chunk_start[b + 1]. Skipped (-1) sequences own none.
    """
    num_seqs = state_indices.shape[0]
    qsl = query_start_loc.long()
    lens = torch.where(state_indices >= 0, qsl[1:] - qsl[:-1], 0)  # [B]
    counts = (lens + chunk_size - 1) // chunk_size
    seq_chunk_start = torch.zeros(num_seqs + 1, dtype=torch.long, device=qsl.device)
    seq_chunk_start[1:] = counts.cumsum(0)
    chunk_ids = torch.arange(num_tokens // chunk_size + num_seqs, device=qsl.device)
    seq = torch.searchsorted(seq_chunk_start[1:], chunk_ids, right=True)  # [max_chunks]
    live = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    chunk_start = qsl[seq] + (chunk_ids - seq_chunk_start[seq]) * chunk_size
    chunk_len = torch.where(live, (qsl[seq + 1] - chunk_start).clamp(max=chunk_size), 0)
    return (
        torch.where(live, chunk_start, 0).to(torch.int32),
        chunk_len.to(torch.int32),
        seq_chunk_start.to(torch.int32),
    )


# GPU launch parameters per kernel, swept on an H200 at mamba2-1.3b shapes (8 x 2048 tokens, bf16);
# block sizes are clipped to the problem. The interpreter instead takes each dimension whole, to
# keep the number of programs small.
GPU_CONFIG: dict[str, dict[str, int]] = {
    "cumsum": {"BLOCK_H": 8, "num_warps": 8},
    "state": {"BLOCK_P": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    "passing": {"BLOCK": 1024, "num_warps": 8},
    "bmm": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    "scan": {"BLOCK_M": 64, "BLOCK_P": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
}


def _block(cap: int, size: int, interp: bool) -> int:
    """A power-of-two block of at least 16 (tl.dot's minimum) covering `size` up to `cap`."""
    full = max(16, next_pow2(size))
    return full if interp else min(cap, full)


@functools.lru_cache(maxsize=64)
def _scan_plan(heads: int, head_dim: int, d_state: int, chunk_size: int, interp: bool,
               precision: str) -> dict[str, dict]:
    """Each kernel's constexprs and launch options for these dimensions (grids follow from
    them and the step's chunk count): computed once per shape, not per layer and step (an
    eager prefill pays the launcher's Python for every Mamba layer)."""
    cfg = {k: ({} if interp else dict(v)) for k, v in GPU_CONFIG.items()}
    block_cs = max(16, next_pow2(chunk_size))
    kw = cfg["cumsum"]
    block_h = next_pow2(heads) if interp else min(kw.pop("BLOCK_H"), heads)
    cumsum = dict(BLOCK_H=next_pow2(block_h), BLOCK_CS=block_cs, **kw)
    kw = cfg["state"]
    state = dict(DOT_PRECISION=precision, BLOCK_P=_block(kw.pop("BLOCK_P", 0), head_dim, interp),
                 BLOCK_N=_block(kw.pop("BLOCK_N", 0), d_state, interp),
                 BLOCK_K=_block(kw.pop("BLOCK_K", 0), chunk_size, interp), **kw)
    kw = cfg["passing"]
    passing = dict(BLOCK=min(next_pow2(head_dim * d_state), kw.pop("BLOCK", 4096)), **kw)
    kw = cfg["bmm"]
    block_m = _block(kw.pop("BLOCK_M", 0), chunk_size, interp)
    bmm = dict(DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_S=block_m,
               BLOCK_N=_block(kw.pop("BLOCK_N", 0), d_state, interp), **kw)
    kw = cfg["scan"]
    scan = dict(DOT_PRECISION=precision, BLOCK_M=_block(kw.pop("BLOCK_M", 0), chunk_size, interp),
                BLOCK_P=_block(kw.pop("BLOCK_P", 0), head_dim, interp),
                BLOCK_N=max(16, next_pow2(d_state)),
                BLOCK_K=_block(kw.pop("BLOCK_K", 0), chunk_size, interp), **kw)
    return dict(
        cumsum=cumsum, state=state, passing=passing, bmm=bmm, scan=scan,
        grids=dict(  # per chunk, head or sequence: the step multiplies them out
            cumsum=cdiv(heads, block_h),
            state=cdiv(head_dim, state["BLOCK_P"]) * cdiv(d_state, state["BLOCK_N"]),
            passing=cdiv(head_dim * d_state, passing["BLOCK"]),
            bmm=cdiv(chunk_size, block_m) ** 2,
            scan=cdiv(chunk_size, scan["BLOCK_M"]) * cdiv(head_dim, scan["BLOCK_P"]),
        ),
    )


def mamba_chunk_scan_triton(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
    ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
    has_initial_state: Tensor, chunk_size: int, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    layout: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Triton launcher of `mamba_chunk_scan`: chunk cumsum, chunk states, state passing,
    C.B per chunk, chunk scan. `layout`: chunk_layout(...) of this batch when the caller
    already has it (it is the same for every layer of a step)."""
    num_tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    num_seqs = state_indices.shape[0]
    y = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)  # [T, H, P]
    if num_tokens == 0 or num_seqs == 0:
        return y
    dev = x.device
    chunk_start, chunk_len, seq_chunk_start = layout or chunk_layout(
        query_start_loc, state_indices, chunk_size, num_tokens
    )
    max_chunks = chunk_start.shape[0]
    f32 = torch.float32
    dt_out = torch.empty(heads, max_chunks, chunk_size, dtype=f32, device=dev)  # [H, c, cs]
    dA_cs = torch.empty(heads, max_chunks, chunk_size, dtype=f32, device=dev)  # [H, c, cs]
    states = torch.empty(max_chunks, heads, head_dim, d_state, dtype=f32, device=dev)  # [c,H,P,N]
    cb = torch.empty(max_chunks, groups, chunk_size, chunk_size, dtype=f32, device=dev)
    interp = interpreting()
    precision = "upcast" if interp else ("ieee" if x.dtype == f32 else "tf32")
    plan = _scan_plan(heads, head_dim, d_state, chunk_size, interp, precision)
    grids = plan["grids"]
    clamp = dt_limit != (0.0, float("inf"))
    xs, bs, cs = x.stride(), B.stride(), C.stride()  # one call each: strides are host calls

    _chunk_cumsum_kernel[(max_chunks, grids["cumsum"])](
        dt, dt_bias, A, dt_out, dA_cs, chunk_start, chunk_len,
        heads, chunk_size, max_chunks, float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
        *dt.stride()[:2], DT_SOFTPLUS=dt_softplus, DT_CLAMP=clamp, **plan["cumsum"],
    )
    _chunk_state_kernel[(heads, grids["state"], max_chunks)](
        x, B, dt_out, dA_cs, states, chunk_start, chunk_len,
        heads, head_dim, d_state, heads // groups, chunk_size, max_chunks,
        *xs, *bs, **plan["state"],
    )
    # The scan multiplies the start states in C's dtype: store them so.
    start_states = torch.empty(states.shape, dtype=C.dtype, device=dev)  # [c, H, P, N]
    _state_passing_kernel[(grids["passing"], heads, num_seqs)](
        states, start_states, dA_cs, ssm_states, seq_chunk_start, state_indices.to(torch.int32),
        has_initial_state.to(torch.int32), heads, head_dim, d_state, chunk_size, max_chunks,
        *ssm_states.stride(), **plan["passing"],
    )
    _bmm_chunk_kernel[(grids["bmm"], groups, max_chunks)](
        C, B, cb, chunk_start, chunk_len, groups, d_state, chunk_size, *cs, *bs, **plan["bmm"],
    )
    _chunk_scan_kernel[(heads, grids["scan"], max_chunks)](
        x, C, cb, dt_out, dA_cs, start_states, D, y, chunk_start, chunk_len,
        heads, head_dim, d_state, groups, heads // groups, chunk_size, max_chunks,
        *xs, *cs, *y.stride()[:2], **plan["scan"],
    )
    return y


# ----------------------------------------------------------------------------- torch reference


def discretize_dt_ref(
    dt: Tensor, dt_bias: Tensor, dt_softplus: bool, dt_limit: tuple[float, float]
) -> Tensor:
    """float32 clamp(softplus(dt + dt_bias), *dt_limit); dt [..., H], dt_bias [H]."""
    d = dt.float() + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    return d.clamp(min=dt_limit[0], max=dt_limit[1])


def _chunked(t: Tensor, chunk_size: int) -> Tensor:
    """[L, ...] -> [num_chunks, chunk_size, ...], zero-padded at the end."""
    pad = -t.shape[0] % chunk_size
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, chunk_size, *t.shape[1:])


def ssd_sequence_ref(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunked SSD of one sequence, all float32, without the D term.

    x [L, H, P], dt [L, H] (discretized), A [H], B and C [L, H, N] (per head), state [H, P, N]
    -> (y [L, H, P], final state [H, P, N]).
    """
    length = x.shape[0]
    xc = _chunked(x, chunk_size)  # [c, l, H, P]
    dtc = _chunked(dt, chunk_size)  # [c, l, H]; padding has dt = 0: no decay, no input
    bc, cc = _chunked(B, chunk_size), _chunked(C, chunk_size)  # [c, l, H, N]
    a_cum = torch.cumsum(dtc * A, dim=1)  # [c, l, H]

    # Intra-chunk (diagonal blocks): y_l += sum_{s<=l} (C_l . B_s) exp(a_l - a_s) dt_s x_s.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    seg = a_cum[:, :, None, :] - a_cum[:, None, :, :]  # [c, l, s, H]
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", cc, bc) * decay * dtc[:, None, :, :]
    y = torch.einsum("clsh,cshp->clhp", scores, xc)

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[:, -1:, :] - a_cum) * dtc  # [c, l, H]
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", bc, to_end, xc)  # [c, H, P, N]

    # State passing: the state entering each chunk.
    chunk_decay = torch.exp(a_cum[:, -1, :])  # [c, H]
    starts = []
    for c in range(xc.shape[0]):
        starts.append(state)
        state = chunk_decay[c, :, None, None] * state + chunk_states[c]
    start_states = torch.stack(starts)  # [c, H, P, N]

    # Off-diagonal blocks: y_l += exp(a_l) C_l . h_start.
    y = y + torch.einsum("clhn,chpn->clhp", cc, start_states) * torch.exp(a_cum)[..., None]
    return y.reshape(-1, *y.shape[2:])[:length], state


def mamba_chunk_scan_ref(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
    ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
    has_initial_state: Tensor, chunk_size: int, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Torch reference of `mamba_chunk_scan` (chunked SSD form, one sequence at a time)."""
    num_tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    y = torch.zeros_like(x)  # [T, H, P]
    dt_all = discretize_dt_ref(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    A32, D32 = A.float(), D.float()
    bounds = query_start_loc.tolist()
    for i, (slot, init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        start, end = bounds[i], bounds[i + 1]
        if slot < 0 or end <= start:
            continue
        xs = x[start:end].float()  # [L, H, P]
        bs = B[start:end].float().repeat_interleave(heads // groups, dim=1)  # [L, H, N]
        cs = C[start:end].float().repeat_interleave(heads // groups, dim=1)  # [L, H, N]
        if init:
            state = ssm_states[slot].float()
        else:
            state = torch.zeros(heads, head_dim, d_state, device=x.device)  # [H, P, N]
        ys, state = ssd_sequence_ref(xs, dt_all[start:end], A32, bs, cs, state, chunk_size)
        y[start:end] = (ys + D32[:, None] * xs).to(x.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return y


# ----------------------------------------------------------------------------- public


def mamba_chunk_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
    ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
    has_initial_state: Tensor, chunk_size: int, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    layout: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Varlen Mamba2 SSD prefill; returns y [T, H, P] in x's dtype.

    x [T, H, P]; dt [T, H] raw (before dt_bias / softplus); A [H] (negative); B, C [T, G, N]
    (head h reads group h // (H // G)); D, dt_bias [H]; ssm_states [num_slots, H, P, N] (final
    states written in place); query_start_loc int32 [B + 1]; state_indices int32 [B] (-1: skip);
    has_initial_state bool [B].
    """
    if use_triton(x):
        return mamba_chunk_scan_triton(
            x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, state_indices,
            has_initial_state, chunk_size, dt_softplus, dt_limit, layout,
        )
    return mamba_chunk_scan_ref(
        x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, state_indices,
        has_initial_state, chunk_size, dt_softplus, dt_limit,
    )

"""Mamba2 single-token state update (decode) with per-row state slots.

dt' = clamp(softplus(dt + dt_bias), *dt_limit); h = exp(dt' A) h + dt' x B^T; y = h C + D x,
per head (h: [P, N]); head h reads group h // (H // G) of B and C. Row b reads and writes
ssm_states[state_indices[b]]; -1 skips the row (nothing written, its output rows unspecified).
Math is float32 (the state is read and written in its own dtype, fp32 or bf16); y is in x's dtype.
"""


import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton
from krait.ops.mamba_ssd import discretize_dt_ref, softplus_clamp
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.timeline import ENTRY, EXIT, WAITED, stamp, timeline_args

# ----------------------------------------------------------------------------- triton


@triton.jit
def ssu_advance(state, x, dt, bv, cv, a_h, d_h, dt_min, dt_max,
                DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr):
    """One token of a head's update of the [P, N] state tile `state` (float32): x [P], bv, cv
    [N], dt (raw plus the head's dt bias), the head's A and D, float32. Returns (the new state
    [P, N], y [P]) in float32."""
    dt = softplus_clamp(dt, DT_SOFTPLUS, DT_CLAMP, dt_min, dt_max)
    decay = tl.exp(dt * a_h)
    state = state * decay + (dt * x)[:, None] * bv[None, :]
    return state, tl.sum(state * cv[None, :], axis=1) + d_h * x


@triton.jit
def ssu_step(state, s_ptrs, s_ok, x, dt, bv, cv, a_h, d_h, dt_min, dt_max,
             DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr):
    """`ssu_advance` with the new state written back in place (s_ptrs, as it was loaded).
    Returns y [P] float32."""
    state, y = ssu_advance(state, x, dt, bv, cv, a_h, d_h, dt_min, dt_max, DT_SOFTPLUS,
                           DT_CLAMP)
    tl.store(s_ptrs, state.to(s_ptrs.dtype.element_ty), mask=s_ok)
    return y


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr, slots_ptr,
    head_dim, d_state, heads_per_group, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
    stride_y_b, stride_y_h,
    DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
    z_ptr=None, g_ptr=None, part_ptr=None, stride_z_b=0, stride_g_b=0, stride_part_b=0,
    GATED: tl.constexpr = False,
    TL: tl.constexpr = False, tl_ptr=None,
):
    pdl_trigger(PDL)
    stamp(TL, tl_ptr, ENTRY)
    if not PDL:
        pdl_wait(PDL)
        stamp(TL, tl_ptr, WAITED)
    # One program: batch row b, head h, BLOCK_P rows of the [P, N] state (all of N).
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_ok = offs_p < head_dim
    n_ok = offs_n < d_state
    s_ok = p_ok[:, None] & n_ok[None, :] & (slot >= 0)
    s_ptrs = (
        state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_s_slot + h * stride_s_h
        + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
    )
    # [BLOCK_P, BLOCK_N]: with PDL read before the wait for the kernel before (see
    # `selective_state_update_triton`), as are the head's constants
    state = tl.load(s_ptrs, mask=s_ok, other=0.0).to(tl.float32)
    a_h = tl.load(A_ptr + h).to(tl.float32)
    d_h = tl.load(D_ptr + h).to(tl.float32)
    dt_bias_h = tl.load(dt_bias_ptr + h).to(tl.float32)
    if PDL:
        pdl_wait(PDL)
        stamp(TL, tl_ptr, WAITED)
    if slot >= 0:
        g = h // heads_per_group
        # every input the kernel before wrote, loaded at once (z too: after the stores below
        # it would wait for them, another round trip)
        x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p * stride_x_p, mask=p_ok,
                    other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
        bv = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + offs_n * stride_B_n, mask=n_ok,
                     other=0.0).to(tl.float32)
        cv = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n * stride_C_n, mask=n_ok,
                     other=0.0).to(tl.float32)
        col = h * head_dim + offs_p  # channel within the row [H * P]
        z = x
        if GATED:
            z = tl.load(z_ptr + b * stride_z_b + col, mask=p_ok, other=0.0).to(tl.float32)
        y = ssu_step(state, s_ptrs, s_ok, x, dt + dt_bias_h, bv, cv, a_h, d_h, dt_min, dt_max,
                     DT_SOFTPLUS, DT_CLAMP)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + b * stride_y_b + h * stride_y_h + offs_p, y, mask=p_ok)
        if GATED:  # the gated norm's input y * silu(z) in float32 and its sum of squares
            gv = y.to(tl.float32) * (z * tl.sigmoid(z))
            gv = tl.where(p_ok, gv, 0.0)
            tl.store(g_ptr + b * stride_g_b + col, gv, mask=p_ok)
            part = h * tl.num_programs(2) + tl.program_id(2)  # channel run col // BLOCK_P
            tl.store(part_ptr + b * stride_part_b + part, tl.sum(gv * gv, axis=0))
    stamp(TL, tl_ptr, EXIT)


def _block_p(head_dim: int, d_state: int, state_bytes: int = 2) -> int:
    """State rows (of P) per program, a 4 KB tile of the state (all rows under the interpreter):
    fp32 states take half the rows of bf16 ones (faster on the H200: docs/benchmarks.md)."""
    if interpreting():
        return next_pow2(head_dim)
    return max(1, min(next_pow2(head_dim), 4096 // (next_pow2(d_state) * state_bytes)))


def ssu_warps(num_programs: int) -> int:
    """Warps a program: 8 for a grid of at most a few programs an SM (batch 1; faster on the
    H200: docs/benchmarks.md), else 4."""
    return 8 if num_programs <= 1024 else 4


def gated_part_size(head_dim: int, d_state: int) -> int:
    """Channels per partial sum of `selective_state_update_triton(gate=...)`: its P block."""
    return min(_block_p(head_dim, d_state), head_dim)


def selective_state_update_triton(
    ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor, dt_bias: Tensor, state_indices: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")), gate: Tensor | None = None,
    g_out: Tensor | None = None, parts_out: Tensor | None = None,
) -> Tensor:
    """Triton launcher of `selective_state_update`; returns y. With `gate` (z [B, H * P]) the
    kernel also writes g_out [B, H * P] float32 = y * silu(z) (y rounded to x's dtype first, as
    the gated norm reads it) and parts_out [B, H * P / part_size] float32, the sums of g^2 over
    each run of `gated_part_size(P, N)` channels: what a consumer needs for the gated norm's
    statistics without a pass of its own (row strides are followed, so both may be views).

    With PDL each program reads its state tile before waiting for the kernel before: a slot's
    state is written only by this layer's update, one token a step, and the slots by the
    step's input preparation, both finished before the step's first kernel without PDL; so the
    state read, the kernel's largest, overlaps the tail of the projection that feeds it."""
    batch, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    y = torch.empty((batch, heads, head_dim), dtype=x.dtype, device=x.device)  # [B, H, P]
    if batch == 0:
        return y
    block_n = next_pow2(d_state)
    if gate is None:
        block_p = _block_p(head_dim, d_state, ssm_states.element_size())
    else:  # the partial sums' run length, which the consumer is built for
        block_p = gated_part_size(head_dim, d_state)
        if head_dim % block_p or gate.stride(-1) != 1 or g_out.stride(-1) != 1:
            raise ValueError("gated state update: head_dim must be a multiple of its P block "
                             "and the gate and g rows contiguous")
    clamp = dt_limit != (0.0, float("inf"))
    pdl = use_pdl(x)
    gated = gate is not None
    grid = (batch, heads, cdiv(head_dim, block_p))
    _ssu_kernel[grid](
        ssm_states, x, dt, A, B, C, D, dt_bias, y, state_indices.to(torch.int32),
        head_dim, d_state, heads // groups,
        float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
        *ssm_states.stride(), *x.stride(), *dt.stride()[:2], *B.stride(), *C.stride(),
        *y.stride()[:2],
        DT_SOFTPLUS=dt_softplus, DT_CLAMP=clamp, BLOCK_P=block_p, BLOCK_N=block_n,
        z_ptr=gate if gated else y, g_ptr=g_out if gated else y,
        part_ptr=parts_out if gated else y, stride_z_b=gate.stride(0) if gated else 0,
        stride_g_b=g_out.stride(0) if gated else 0,
        stride_part_b=parts_out.stride(0) if gated else 0, GATED=gated,
        **pdl_args(pdl),
        num_warps=ssu_warps(grid[0] * grid[1] * grid[2]),
        **timeline_args("ssu", grid, x.device),
    )
    return y


# ----------------------------------------------------------------------------- torch reference


def selective_state_update_ref(
    ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor, dt_bias: Tensor, state_indices: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Torch reference of `selective_state_update`."""
    heads, groups = x.shape[1], B.shape[1]
    out = torch.zeros_like(x)  # [B, H, P]
    rows = (state_indices >= 0).nonzero().squeeze(1)
    slots = state_indices[rows].long()
    d = discretize_dt_ref(dt[rows], dt_bias, dt_softplus, dt_limit)  # [n, H]
    bh = B[rows].float().repeat_interleave(heads // groups, dim=1)  # [n, H, N]
    ch = C[rows].float().repeat_interleave(heads // groups, dim=1)  # [n, H, N]
    xs = x[rows].float()  # [n, H, P]
    decay = torch.exp(d * A.float())[..., None, None]  # [n, H, 1, 1]
    state = ssm_states[slots].float() * decay + (d[..., None] * xs)[..., None] * bh[:, :, None, :]
    y = (state @ ch.unsqueeze(-1)).squeeze(-1) + D.float()[:, None] * xs  # [n, H, P]
    ssm_states[slots] = state.to(ssm_states.dtype)
    out[rows] = y.to(x.dtype)
    return out


# ----------------------------------------------------------------------------- public


def selective_state_update(
    ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor, dt_bias: Tensor, state_indices: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """One decode token per row; returns y [B, H, P] in x's dtype.

    ssm_states [num_slots, H, P, N] updated in place; x [B, H, P]; dt [B, H] raw; A, D,
    dt_bias [H]; B, C [B, G, N]; state_indices int32 [B] (-1: skip the row).
    """
    if use_triton(x):
        return selective_state_update_triton(
            ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_softplus, dt_limit
        )
    return selective_state_update_ref(
        ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_softplus, dt_limit
    )

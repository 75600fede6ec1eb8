"""One launch for a Mamba2 layer's decode tokens: causal conv update, selective state update and
the gated, grouped RMSNorm (what `causal_conv1d_update`, `selective_state_update` and
`gated_rms_norm` do one after the other, with the same roundings).

At batch 1 each of those three is a ~3 us kernel plus a launch gap, once per Mamba layer
(docs/benchmarks.md): fusing them removes two launches a layer. Program (b, h, pb) owns head h's
rows pb * BLOCK_P.. of row b: it runs the conv for its own x channels (and writes their conv
state), recomputes its group's B and C convs (cheap: d_state channels of width d_conv), updates
its [BLOCK_P, N] slice of the SSM state, and writes silu(z)-gated outputs plus their partial sum
of squares to scratch. Two cross-program steps use the last-arriver pattern of `gemv.py`
(per-key counters that the last program resets; deterministic: partial sums are added in a fixed
order):
- the last program of (row, norm group) sums the partials and writes the normalized group;
- the last program of a row shifts the B/C conv states, which every program of the row reads
  (with one norm group a row, the same program: one atomic a program).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import use_triton
from krait.ops.arrival import arrival_counters
from krait.ops.causal_conv1d import causal_conv1d_update_ref, conv_step, store_conv_state
from krait.ops.gated_rms_norm import gated_rms_norm_ref
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.selective_state_update import selective_state_update_ref, ssu_step

_COUNTERS: dict[torch.device, Tensor] = {}  # arrival counters, always back to zero after a launch


@triton.jit
def _conv_at(row_ptr, st_ptr, w_ptr, b_ptr, ch, ok, cols, stride_w_d, stride_w_k, stride_s_d,
             stride_s_k, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """`conv_step` of channels `ch` of this row's xBC: (output [C] float32, next state)."""
    x = tl.load(row_ptr + ch, mask=ok, other=0.0).to(tl.float32)
    return conv_step(x, st_ptr, w_ptr, b_ptr, ch, ok, cols, stride_w_d, stride_w_k, stride_s_d,
                     stride_s_k, WIDTH, HAS_BIAS, SILU)


@triton.jit
def _shift_bc_states(row_ptr, st_ptr, w_ptr, cols, stride_s_d, stride_s_k, FIRST: tl.constexpr,
                     COUNT: tl.constexpr, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
    """The conv-state shift of channels FIRST .. FIRST + COUNT (a row's B and C)."""
    for c0 in range(0, COUNT, BLOCK_C):
        ch = FIRST + c0 + tl.arange(0, BLOCK_C)
        ch_ok = ch < FIRST + COUNT
        out_c, next_c = _conv_at(row_ptr, st_ptr, w_ptr, w_ptr, ch, ch_ok, cols, 0, 0,
                                 stride_s_d, stride_s_k, WIDTH, False, False)
        store_conv_state(st_ptr, next_c, ch, ch_ok, cols, stride_s_d, stride_s_k, WIDTH)


@triton.jit
def _mamba_decode_kernel(
    xbc_ptr, dt_ptr, z_ptr, conv_ptr, cw_ptr, cb_ptr, ssm_ptr, A_ptr, D_ptr, dt_bias_ptr,
    nw_ptr, out_ptr, gz_ptr, part_ptr, count_ptr, slots_ptr,
    batch, eps, dt_min, dt_max,
    stride_xbc_b, stride_dt_b, stride_z_b, stride_out_b,
    stride_c_slot, stride_c_d, stride_c_k, stride_cw_d, stride_cw_k,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, GROUPS: tl.constexpr,
    NORM_GROUP: tl.constexpr, WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    NPB: tl.constexpr = (HEAD_DIM + BLOCK_P - 1) // BLOCK_P
    INTER: tl.constexpr = HEADS * HEAD_DIM
    NUM_NORM: tl.constexpr = INTER // NORM_GROUP
    PER_NORM: tl.constexpr = (NORM_GROUP // HEAD_DIM) * NPB  # programs of one norm group
    slot = tl.load(slots_ptr + b)
    if slot >= 0:
        dtype = out_ptr.dtype.element_ty
        g = h // (HEADS // GROUPS)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_W)
        p_ok = offs_p < HEAD_DIM
        n_ok = offs_n < D_STATE
        row = xbc_ptr + b * stride_xbc_b
        conv = conv_ptr + slot.to(tl.int64) * stride_c_slot

        # causal conv: this program's x channels (state written here), its group's B and C
        ch_x = h * HEAD_DIM + offs_p
        x, x_next = _conv_at(row, conv, cw_ptr, cb_ptr, ch_x, p_ok, cols, stride_cw_d,
                             stride_cw_k, stride_c_d, stride_c_k, WIDTH, HAS_BIAS, SILU)
        store_conv_state(conv, x_next, ch_x, p_ok, cols, stride_c_d, stride_c_k, WIDTH)
        ch_b = INTER + g * D_STATE + offs_n
        bv, b_next = _conv_at(row, conv, cw_ptr, cb_ptr, ch_b, n_ok, cols, stride_cw_d,
                              stride_cw_k, stride_c_d, stride_c_k, WIDTH, HAS_BIAS, SILU)
        cv, c_next = _conv_at(row, conv, cw_ptr, cb_ptr, ch_b + GROUPS * D_STATE, n_ok, cols,
                              stride_cw_d, stride_cw_k, stride_c_d, stride_c_k, WIDTH, HAS_BIAS,
                              SILU)
        # the conv outputs reach the state update rounded to the activation dtype, as unfused
        x = x.to(dtype).to(tl.float32)
        bv = bv.to(dtype).to(tl.float32)
        cv = cv.to(dtype).to(tl.float32)

        # selective state update of head h, rows offs_p
        s_ptrs = (ssm_ptr + slot.to(tl.int64) * stride_s_slot + h * stride_s_h
                  + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n)
        dt = tl.load(dt_ptr + b * stride_dt_b + h).to(tl.float32)
        y = ssu_step(s_ptrs, p_ok[:, None] & n_ok[None, :], x, dt, bv, cv, h, A_ptr, D_ptr,
                     dt_bias_ptr, dt_min, dt_max, DT_SOFTPLUS, DT_CLAMP)
        y = y.to(dtype).to(tl.float32)

        # gate, then this program's share of its norm group's sum of squares
        z = tl.load(z_ptr + b * stride_z_b + ch_x, mask=p_ok, other=0.0).to(tl.float32)
        gz = tl.where(p_ok, y * z * tl.sigmoid(z), 0.0)
        tl.store(gz_ptr + b * INTER + ch_x, gz, mask=p_ok)
        ng = (h * HEAD_DIM) // NORM_GROUP
        j = (h - ng * (NORM_GROUP // HEAD_DIM)) * NPB + pb
        key = b * NUM_NORM + ng
        tl.store(part_ptr + key * PER_NORM + j, tl.sum(gz * gz, axis=0))
        arrived = tl.atomic_add(count_ptr + key, 1)  # acq_rel: orders the stores above
        if arrived == PER_NORM - 1:  # the last program of the group normalizes all of it
            offs_j = tl.arange(0, BLOCK_J)
            parts = tl.load(part_ptr + key * PER_NORM + offs_j, mask=offs_j < PER_NORM,
                            other=0.0, cache_modifier=".cg")
            rstd = tl.rsqrt(tl.sum(parts, axis=0) / NORM_GROUP + eps)
            for c0 in range(0, NORM_GROUP, BLOCK_C):
                c = ng * NORM_GROUP + c0 + tl.arange(0, BLOCK_C)
                c_ok = c < (ng + 1) * NORM_GROUP
                v = tl.load(gz_ptr + b * INTER + c, mask=c_ok, other=0.0, cache_modifier=".cg")
                hn = (v * rstd).to(dtype).to(tl.float32)
                w = tl.load(nw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
                tl.store(out_ptr + b * stride_out_b + c, (w * hn).to(dtype), mask=c_ok)
            if NUM_NORM == 1:  # one group: this is also the row's last program
                _shift_bc_states(row, conv, cw_ptr, cols, stride_c_d, stride_c_k, INTER,
                                 2 * GROUPS * D_STATE, WIDTH, BLOCK_C)
            tl.atomic_xchg(count_ptr + key, 0)
        if NUM_NORM > 1:
            # every program of the row has read the B/C conv state: the last one shifts it
            row_key = batch * NUM_NORM + b
            arrived_row = tl.atomic_add(count_ptr + row_key, 1)
            if arrived_row == HEADS * NPB - 1:
                _shift_bc_states(row, conv, cw_ptr, cols, stride_c_d, stride_c_k, INTER,
                                 2 * GROUPS * D_STATE, WIDTH, BLOCK_C)
                tl.atomic_xchg(count_ptr + row_key, 0)


def fusable(head_dim: int, intermediate: int, norm_group: int) -> bool:
    """The fused kernel needs every norm group to hold whole heads."""
    return norm_group % head_dim == 0 and intermediate % norm_group == 0


def mamba_decode_triton(
    xbc: Tensor, dt: Tensor, z: Tensor, conv_state: Tensor, conv_weight: Tensor,
    conv_bias: Tensor | None, ssm_state: Tensor, A: Tensor, D: Tensor, dt_bias: Tensor,
    norm_weight: Tensor, state_indices: Tensor, n_groups: int, head_dim: int, eps: float,
    norm_group: int, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")), activation: str | None = "silu",
) -> Tensor:
    """Triton launcher of `mamba_decode`."""
    batch = xbc.shape[0]
    heads, _, d_state = ssm_state.shape[1:]
    inter = heads * head_dim
    width = conv_weight.shape[1]
    if not fusable(head_dim, inter, norm_group):
        raise ValueError(f"mamba_decode: norm group {norm_group} must hold whole heads of {head_dim}")
    out = torch.empty(batch, inter, dtype=xbc.dtype, device=xbc.device)  # [B, intermediate]
    if batch == 0:
        return out
    for t, name in ((xbc, "xbc"), (z, "z"), (dt, "dt")):
        if t.stride(-1) != 1:
            raise ValueError(f"mamba_decode: {name} needs unit stride along its last dim")
    block_n = triton.next_power_of_2(d_state)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        block_p = triton.next_power_of_2(head_dim)
    else:
        block_p = max(1, min(triton.next_power_of_2(head_dim), 2048 // block_n))
    npb = triton.cdiv(head_dim, block_p)
    num_norm = inter // norm_group
    per_norm = (norm_group // head_dim) * npb
    gz = torch.empty(batch, inter, dtype=torch.float32, device=xbc.device)  # [B, intermediate]
    parts = torch.empty(batch * num_norm * per_norm, dtype=torch.float32, device=xbc.device)
    counters = arrival_counters(_COUNTERS, xbc.device, batch * (num_norm + 1))
    clamp = dt_limit != (0.0, float("inf"))
    pdl = use_pdl(xbc)
    _mamba_decode_kernel[(batch, heads, npb)](
        xbc, dt, z, conv_state, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        ssm_state, A, D, dt_bias, norm_weight, out, gz, parts, counters,
        state_indices.to(torch.int32),
        batch, eps, float(dt_limit[0]), float(dt_limit[1]) if clamp else 0.0,
        xbc.stride(0), dt.stride(0), z.stride(0), out.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_weight.stride(0), conv_weight.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        HEADS=heads, HEAD_DIM=head_dim, D_STATE=d_state, GROUPS=n_groups,
        NORM_GROUP=norm_group, WIDTH=width,
        HAS_BIAS=conv_bias is not None, SILU=activation is not None,
        DT_SOFTPLUS=dt_softplus, DT_CLAMP=clamp,
        BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_W=triton.next_power_of_2(width),
        BLOCK_J=triton.next_power_of_2(per_norm),
        BLOCK_C=min(256, triton.next_power_of_2(norm_group)), **pdl_args(pdl),
    )
    return out


def mamba_decode_ref(
    xbc: Tensor, dt: Tensor, z: Tensor, conv_state: Tensor, conv_weight: Tensor,
    conv_bias: Tensor | None, ssm_state: Tensor, A: Tensor, D: Tensor, dt_bias: Tensor,
    norm_weight: Tensor, state_indices: Tensor, n_groups: int, head_dim: int, eps: float,
    norm_group: int, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")), activation: str | None = "silu",
) -> Tensor:
    """Torch reference of `mamba_decode`: the three unfused references in a row."""
    batch = xbc.shape[0]
    heads, _, d_state = ssm_state.shape[1:]
    inter = heads * head_dim
    conv = causal_conv1d_update_ref(xbc, conv_state, conv_weight, conv_bias, state_indices,
                                    activation)
    xs, B, C = conv.split([inter, n_groups * d_state, n_groups * d_state], dim=-1)
    y = selective_state_update_ref(
        ssm_state, xs.reshape(batch, heads, head_dim), dt, A,
        B.reshape(batch, n_groups, d_state), C.reshape(batch, n_groups, d_state), D, dt_bias,
        state_indices, dt_softplus, dt_limit,
    )
    return gated_rms_norm_ref(y.reshape(batch, inter), z, norm_weight, eps, norm_group)


def mamba_decode(
    xbc: Tensor, dt: Tensor, z: Tensor, conv_state: Tensor, conv_weight: Tensor,
    conv_bias: Tensor | None, ssm_state: Tensor, A: Tensor, D: Tensor, dt_bias: Tensor,
    norm_weight: Tensor, state_indices: Tensor, n_groups: int, head_dim: int, eps: float,
    norm_group: int, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")), activation: str | None = "silu",
) -> Tensor:
    """One decode token per row of a Mamba2 layer, up to the out projection.

    xbc [B, conv_dim] (pre-conv x | B | C), dt [B, H] raw, z [B, H*P] the gate; conv_state
    [num_slots, conv_dim, W - 1] and ssm_state [num_slots, H, P, N] updated in place at slot
    state_indices[b] (int32, -1: the row is skipped and its output unspecified); conv_weight
    [conv_dim, W]; A (= -exp(A_log)), D, dt_bias [H]; norm_weight [H*P]. Returns the gated,
    group-normalized y [B, H*P] in xbc's dtype.
    """
    fn = mamba_decode_triton if use_triton(xbc) else mamba_decode_ref
    return fn(xbc, dt, z, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias,
              norm_weight, state_indices, n_groups, head_dim, eps, norm_group, dt_softplus,
              dt_limit, activation)

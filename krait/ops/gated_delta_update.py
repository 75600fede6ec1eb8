"""Gated delta rule, one decode token per row, with per-row state slots (Gated DeltaNet decode).

The step of `gated_delta_chunk` for one token: q, k l2-normed (optionally), q scaled;
S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q, per value head h (key head h // (Hv // Hk)).
Row b reads and writes states[state_indices[b]]; -1 skips the row (nothing written, its output
rows unspecified). No host synchronisation and shapes fixed by the batch: safe inside the decode
CUDA graph. Math is float32; o is in v's dtype; the state keeps its own dtype.

With `A_log` and `dt_bias` given, g and beta are the layer's raw gate inputs a and b and the
kernel forms g = -exp(A_log) softplus(a + dt_bias) (float32) and beta = sigmoid(b) (rounded to
b's dtype, as HF rounds it) itself (`gdn_gate_ref` is the same in torch): two elementwise
launches fewer a layer in the decode step.

One program a (row, value head, BV columns of the [K, V] state): all of K in the program (the
reductions over K stay in it), V split so that the float32 tile stays near 4096 elements (32
registers a thread at 4 warps; a whole 128 x 128 tile would be 128 and spill).

With `norm` = (z, norm weight [V], eps) the kernel also applies the layer's output norm
(`gated_rms_norm(o, z, w, eps, V, gate_after=True)`, HF's Qwen3NextRMSNormGated): each program
stores its rounded o columns and their sum of squares in scratch and bumps its (row, head)
arrival counter; the head's last program to arrive normalises the whole head, weights and gates
it (the decode step's norm launch, and the zero fill and copy of the mixer's output, gone). A -1
row's output is then 0.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, num_sms, use_triton
from krait.ops.arrival import arrival_counters
from krait.ops.gated_delta_chunk import delta_step_ref, prepare_qkv_ref
from krait.ops.gated_rms_norm import gated_rms_norm_ref
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl

_COUNTERS: dict[torch.device, Tensor] = {}  # the fused norm's (row, head) arrival counters

# ----------------------------------------------------------------------------- triton


@triton.jit
def gdn_gate(a, b, A_log, dt_bias, beta_ty: tl.constexpr):
    """(g, beta) of one token and head from the raw gate inputs (float32 scalars): g =
    -exp(A_log) softplus(a + dt_bias) (torch's softplus: x past 20, exp(x) below -15 where
    log(1 + exp(x)) loses it), beta = sigmoid(b) rounded to `beta_ty`."""
    x = a + dt_bias
    sp = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
    g = -tl.exp(A_log) * sp
    beta = 1.0 / (1.0 + tl.exp(-b))
    if beta_ty == tl.bfloat16:
        # round to nearest even by hand: Triton's interpreter truncates in .to(tl.bfloat16)
        u = beta.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        beta = u.to(tl.float32, bitcast=True)
    elif beta_ty != tl.float32:
        beta = beta.to(beta_ty).to(tl.float32)
    return g, beta


@triton.jit
def _gdn_update_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr,
    scale, key_dim, value_dim, v_per_k,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    stride_g_b, stride_beta_b, stride_o_b, stride_o_h,
    stride_s_slot, stride_s_h, stride_s_k, alog_ptr, dtb_ptr,
    z_ptr=None, stride_z_b=0, nw_ptr=None, eps=0.0, scr_ptr=None, part_ptr=None,
    count_ptr=None,
    QK_L2NORM: tl.constexpr = True, GATE: tl.constexpr = False, NORM: tl.constexpr = False,
    BK: tl.constexpr = 128, BV: tl.constexpr = 16, VP: tl.constexpr = 128,
    NVB: tl.constexpr = 1, NVBP: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    # One program: batch row b, value head h, BV columns of its [K, V] state (all of K).
    # GATE: g_ptr / beta_ptr hold the raw a / b, and g, beta are formed here. NORM: the head's
    # gated output norm by its last program to arrive (NVB programs a head, VP >= V).
    pdl_trigger(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    hk = h // v_per_k
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = offs_k < key_dim
    v_ok = offs_v < value_dim
    s_ok = k_ok[:, None] & v_ok[None, :] & (slot >= 0)
    s_ptrs = (state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_s_slot + h * stride_s_h
              + offs_k[:, None] * stride_s_k + offs_v[None, :])
    # with PDL read before the wait for the kernel before, as the head's constants
    # (`gated_delta_update_triton`)
    S = tl.load(s_ptrs, mask=s_ok, other=0.0).to(tl.float32)  # [BK, BV]
    if GATE:
        a_log = tl.load(alog_ptr + h).to(tl.float32)
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    pdl_wait(PDL)
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_q_b + hk * stride_q_h + offs_k, mask=k_ok,
                other=0.0).to(tl.float32)  # [BK]
    k = tl.load(k_ptr + b64 * stride_k_b + hk * stride_k_h + offs_k, mask=k_ok,
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b64 * stride_v_b + h * stride_v_h + offs_v, mask=v_ok,
                other=0.0).to(tl.float32)  # [BV]
    g = tl.load(g_ptr + b64 * stride_g_b + h).to(tl.float32)
    beta = tl.load(beta_ptr + b64 * stride_beta_b + h).to(tl.float32)
    if GATE:
        g, beta = gdn_gate(g, beta, a_log, dtb, beta_ptr.dtype.element_ty)
    if QK_L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    q = q * scale
    S = S * tl.exp(g)
    mem = tl.sum(S * k[:, None], 0)  # [BV]
    delta = (v - mem) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], 0)  # [BV]
    tl.store(s_ptrs, S.to(s_ptrs.dtype.element_ty), mask=s_ok)
    dtype = o_ptr.dtype.element_ty
    if NORM:
        o_r = tl.where(slot >= 0, o.to(dtype).to(tl.float32), 0.0)  # a -1 row's output: 0
        _norm_head(o_r, b64, h, offs_v, v_ok, value_dim,
                   o_ptr + b64 * stride_o_b + h * stride_o_h,
                   z_ptr + b64 * stride_z_b + h * value_dim, nw_ptr, eps, scr_ptr, part_ptr,
                   count_ptr, tl.num_programs(1), VP, NVB, NVBP)
    else:
        tl.store(o_ptr + b64 * stride_o_b + h * stride_o_h + offs_v, o.to(dtype),
                 mask=v_ok & (slot >= 0))


@triton.jit
def _norm_head(o, b, h, offs_v, v_ok, value_dim, out_ptr, z_ptr, nw_ptr, eps, scr_ptr,
               part_ptr, count_ptr, num_heads, VP: tl.constexpr, NVB: tl.constexpr,
               NVBP: tl.constexpr):
    """NORM: this program's rounded o columns (float32 [BV], 0 past V) and their sum of squares
    into scratch (scr [B, Hv, V], part [B, Hv, NVB] float32); the head's last program to
    arrive writes out = (w * (o * rsqrt(mean(o^2) + eps)).to(dt)).to(dt) * silu(z), in dt."""
    head = b * num_heads + h
    tl.store(scr_ptr + head * value_dim + offs_v, o, mask=v_ok)
    tl.store(part_ptr + head * NVB + tl.program_id(2), tl.sum(o * o, 0))
    tl.debug_barrier()  # every thread's stores before the arrival
    counter = count_ptr + head
    arrived = tl.atomic_add(counter, 1)  # acq_rel: orders the stores above
    if arrived == NVB - 1:
        offs_p = tl.arange(0, NVBP)
        parts = tl.load(part_ptr + head * NVB + offs_p, mask=offs_p < NVB, other=0.0,
                        cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(parts, 0) / value_dim + eps)
        offs = tl.arange(0, VP)
        ok = offs < value_dim
        x = tl.load(scr_ptr + head * value_dim + offs, mask=ok, other=0.0, cache_modifier=".cg")
        dtype = out_ptr.dtype.element_ty
        y = (tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
             * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (y * (z / (1.0 + tl.exp(-z)))).to(dtype), mask=ok)
        tl.atomic_xchg(counter, 0)


def state_blocks(K: int, V: int, programs_per_v_block: int, sms: int) -> tuple[int, int]:
    """(BK, BV) of the decode and verify kernels: all of K, V in blocks of a float32 tile of
    about 4096 elements (BV 32 at K = 128); halved to 16 while the grid (`programs_per_v_block`
    programs for each V block) would not fill the SMs twice (batch 1: 32 heads x 4 blocks on
    132 SMs), so that more programs stream the state."""
    bk = next_pow2(K)
    bv = max(1, min(next_pow2(V), 4096 // bk))
    if bv > 16 and programs_per_v_block * cdiv(V, bv) < 2 * sms:
        bv = 16
    return bk, bv


def gated_delta_update_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    state_indices: Tensor, scale: float | None = None, qk_l2norm: bool = True,
    A_log: Tensor | None = None, dt_bias: Tensor | None = None, norm: tuple | None = None,
) -> Tensor:
    """Triton launcher of `gated_delta_update`. With PDL each program reads its state tile
    before waiting for the kernel before (as `selective_state_update_triton` does: a slot's
    state is written only by this layer's update, once a step, and the slots by the step's input
    preparation), so that the state read overlaps the tail of in_proj."""
    B, hk, K = q.shape
    hv, V = v.shape[1], v.shape[2]
    o = torch.empty(B, hv, V, dtype=v.dtype, device=v.device)  # [B, Hv, V]
    if B == 0:
        return o
    for t in (q, k, v):
        assert t.stride(-1) == 1, "gated_delta_update: the last dim must be contiguous"
    assert states.stride(-1) == 1
    bk, bv = state_blocks(K, V, B * hv, num_sms(v.device))
    gate = A_log is not None
    if gate:
        assert dt_bias is not None and A_log.is_contiguous() and dt_bias.is_contiguous()
    nvb = cdiv(V, bv)
    norm_args = {}
    if norm is not None:
        z, norm_weight, eps = norm
        assert z.shape == (B, hv * V) and z.stride(-1) == 1 and norm_weight.numel() == V
        scratch = torch.empty(B * hv * (V + nvb), dtype=torch.float32, device=v.device)
        norm_args = dict(z_ptr=z, stride_z_b=z.stride(0), nw_ptr=norm_weight.contiguous(),
                         eps=float(eps), scr_ptr=scratch, part_ptr=scratch[B * hv * V:],
                         count_ptr=arrival_counters(_COUNTERS, v.device, B * hv), NORM=True,
                         VP=next_pow2(V), NVB=nvb, NVBP=next_pow2(nvb))
    _gdn_update_kernel[(B, hv, nvb)](
        q, k, v, g, beta, o, states, state_indices,
        float(scale if scale is not None else K ** -0.5), K, V, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        A_log if gate else g, dt_bias if gate else g,
        QK_L2NORM=qk_l2norm, GATE=gate, BK=bk, BV=bv, **norm_args, **pdl_args(use_pdl(v)),
    )
    return o


# ----------------------------------------------------------------------------- torch reference


def gdn_gate_ref(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's gates from the raw projections a, b [n, Hv]: g = -exp(A_log)
    softplus(a + dt_bias) float32, beta = sigmoid(b) in b's dtype (HF's arithmetic)."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_delta_update_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    state_indices: Tensor, scale: float | None = None, qk_l2norm: bool = True,
    A_log: Tensor | None = None, dt_bias: Tensor | None = None, norm: tuple | None = None,
) -> Tensor:
    """Torch reference of `gated_delta_update`."""
    if A_log is not None:
        g, beta = gdn_gate_ref(g, beta, A_log, dt_bias)
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # [B, Hv, V]
    rows = (state_indices >= 0).nonzero().squeeze(1)
    slots = state_indices[rows].long()
    qf, kf, vf = prepare_qkv_ref(q[rows], k[rows], v[rows], scale, qk_l2norm)
    out, S = delta_step_ref(states[slots].float(), qf, kf, vf, g[rows].float(),
                            beta[rows].float())
    o[rows] = out.to(o.dtype)
    states[slots] = S.to(states.dtype)
    if norm is not None:
        z, norm_weight, eps = norm
        B, hv, V = o.shape
        o = gated_rms_norm_ref(o.reshape(B, -1), z, norm_weight, eps, V,
                               gate_after=True).view(B, hv, V)
    return o


# ----------------------------------------------------------------------------- public


def gated_delta_update(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
    state_indices: Tensor, scale: float | None = None, qk_l2norm: bool = True,
    A_log: Tensor | None = None, dt_bias: Tensor | None = None, norm: tuple | None = None,
) -> Tensor:
    """One token per row: q, k [B, Hk, K]; v [B, Hv, V]; g [B, Hv] float32 log-decay; beta
    [B, Hv]; states [num_slots, Hv, K, V] updated in place at state_indices int32 [B] (-1: skip).
    With A_log, dt_bias [Hv]: g and beta are the raw gate inputs a, b [B, Hv] (`gdn_gate_ref`).
    With norm = (z [B, Hv * V] (last dim contiguous), norm weight [V], eps): o goes through
    `gated_rms_norm(o, z, weight, eps, V, gate_after=True)` in the same launch (-1 rows: 0).
    Returns o [B, Hv, V] in v's dtype."""
    if use_triton(v):
        return gated_delta_update_triton(q, k, v, g, beta, states, state_indices, scale,
                                         qk_l2norm, A_log, dt_bias, norm)
    return gated_delta_update_ref(q, k, v, g, beta, states, state_indices, scale, qk_l2norm,
                                  A_log, dt_bias, norm)

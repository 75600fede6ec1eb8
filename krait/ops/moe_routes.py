"""The MoE's few-route path on the Triton path: decode batches whose routes mostly hit distinct
experts (granite-4.0-h-tiny's decode graph about a quarter shorter at batch 1 on the H200 than
through the grouped GEMM: docs/benchmarks.md).

`fused_moe`'s grouped GEMM sorts the routes by expert and pads each expert's run to BLOCK_M
rows: at batch 1 that is five launches of layout work before two GEMMs that use one row of
sixteen, then the k-sum and the routing glue in torch — about 19 launches per MoE layer for
~5 MB of expert weights. Here:

- `route_topk`: the router's softmax and top-k in one launch (one program per token),
- `moe_routes`: program (route, n-tile) of the first projection streams its expert's rows as a
  GEMV (gate and up, the activation, the intermediate rounded to x's dtype); program
  (token, n-tile) of the second streams the k experts' rows of that token, applies the routing
  weights, sums the k routes in float32 and adds `add` (the shared expert's output) — two
  launches, no sort. An expert hit by several routes is read once per route: the path pays
  only while routes mostly hit distinct experts (`use_moe_routes`: at most num_experts / 2
  routes).

Rounding follows `fused_moe_ref`: each projection's output rounded to x's dtype, the weighted
route rounded, routes summed in float32, the sum rounded, then the add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, num_sms, use_triton
from krait.ops.arrival import arrival_counters
from krait.ops.gemv_tma import _descriptor, _x_tile, tma_readable
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl


def use_moe_routes(x: Tensor, num_routes: int, num_experts: int) -> bool:
    """Whether `fused_moe` takes the per-route GEMVs for `num_routes` (token, expert) pairs."""
    return use_triton(x) and 0 < 2 * num_routes <= num_experts


# ----------------------------------------------------------------------------- router top-k


@triton.jit
def _softmax_or_zero(x):
    """softmax(x) over a 1-D block; zeros where every entry is -inf (a NaN row) instead of NaN.
    A real row's sum is at least 1 (its maximum's exp), so the guard never changes it."""
    m = tl.max(x, 0)
    ex = tl.exp(x - tl.where(m == float("-inf"), 0.0, m))
    return ex / tl.maximum(tl.sum(ex, 0), 1e-30)


@triton.jit
def _route_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, RENORM: tl.constexpr, ROUND_W: tl.constexpr,
    BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    pdl_trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    jj = tl.arange(0, TOPK_PAD)
    pdl_wait(PDL)
    v = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    # a NaN (a padded graph row's garbage) ranks last: the ids stay valid expert indices
    v = tl.where(v != v, float("-inf"), v)
    if not RENORM:  # the top-k of the softmax over every expert
        v = _softmax_or_zero(v)
    vals = tl.full([TOPK_PAD], float("-inf"), tl.float32)
    ids = tl.zeros([TOPK_PAD], tl.int32)
    for j in tl.static_range(TOPK):  # the k largest, the lowest index first on ties
        best = tl.max(v, 0)
        at = tl.minimum(tl.min(tl.where(v == best, e, BLOCK_E), 0), E - 1)
        vals = tl.where(jj == j, best, vals)
        ids = tl.where(jj == j, at, ids)
        v = tl.where(e == at, float("-inf"), v)
    if RENORM:  # the softmax over the k picked logits (the padding's exp is 0)
        vals = _softmax_or_zero(vals)
    if ROUND_W:
        vals = vals.to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(w_ptr + t * TOPK + jj, vals, mask=jj < TOPK)
    tl.store(ids_ptr + t * TOPK + jj, ids, mask=jj < TOPK)


def route_topk_triton(
    logits: Tensor, k: int, renormalize: bool, round_to_dtype: bool = False
) -> tuple[Tensor, Tensor]:
    """Triton launcher of `route_topk`."""
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)  # [T, k]
    ids = torch.empty(T, k, dtype=torch.int32, device=logits.device)  # [T, k]
    if T == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_topk_kernel[(T,)](
        logits, weights, ids, E, logits.stride(0), TOPK=k, TOPK_PAD=next_pow2(k),
        RENORM=renormalize, ROUND_W=round_to_dtype, BLOCK_E=next_pow2(E),
        # one warp up to 1024 experts: its k rounds of reductions stay in the warp (shuffles,
        # no shared-memory barriers): 2.76 against 3.43 us at 4 warps for Qwen3-Next's 512
        # experts, top-10, on the H200
        num_warps=1 if E <= 1024 else 4, **pdl_args(use_pdl(logits)),
    )
    return weights, ids


def route_topk_ref(
    logits: Tensor, k: int, renormalize: bool, round_to_dtype: bool = False
) -> tuple[Tensor, Tensor]:
    """Torch reference of `route_topk`."""
    lf = logits.float()
    if renormalize:
        top, ids = lf.topk(k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        weights, ids = torch.softmax(lf, dim=-1).topk(k, dim=-1)
    if round_to_dtype:
        weights = weights.to(logits.dtype).float()
    return weights, ids.to(torch.int32)


def route_topk(
    logits: Tensor, k: int, renormalize: bool, round_to_dtype: bool = False
) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], ids int32 [T, k]).

    renormalize=True: the softmax of the k largest logits (Mixtral, GraniteMoe); False: the top-k
    of the softmax over all experts. round_to_dtype: the weights rounded to the logits' dtype
    (HF's Granite `.type_as(hidden_states)`), returned in float32. The Triton kernel wherever
    Triton runs."""
    if use_triton(logits):
        return route_topk_triton(logits, k, renormalize, round_to_dtype)
    return route_topk_ref(logits, k, renormalize, round_to_dtype)


# ----------------------------------------------------------------------------- expert GEMVs


@triton.jit
def _rows_dot(w_ptr, expert, stride_we, stride_wn, row, row_ok, x_row, K,
              BLOCK_K: tl.constexpr):
    """w[expert, row[i], :] . x_row for the program's rows `row` (int [R], `row_ok` masking
    them): fp32 [R]. x is loaded broadcast over the rows ([R, BLOCK_K] pointers, repeated reads
    hit L1), so that it is born in the weight tile's layout: a [BLOCK_K] load broadcast later
    costs a shared-memory conversion with barriers in every K step."""
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + expert * stride_we + row.to(tl.int64)[:, None] * stride_wn
    x_rows = x_row + 0 * row[:, None]  # [R, 1]
    acc = tl.zeros([row.shape[0], BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = (k0 + offs_k)[None, :]
        k_ok = k < K
        x = tl.load(x_rows + k, mask=k_ok, other=0.0)  # [R, BLOCK_K]
        w = tl.load(rows + k, mask=row_ok[:, None] & k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
    return tl.sum(acc, 1)


@triton.jit
def _expert_rows_dot(w_ptr, expert, stride_we, stride_wn, row0, x_row, N, K,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w[expert, row0 + n, :] . x_row for the BLOCK_N rows n of this program: fp32 [BLOCK_N]."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return _rows_dot(w_ptr, expert, stride_we, stride_wn, row0 + offs_n, offs_n < N, x_row, K,
                     BLOCK_K)


@triton.jit
def _gate_up_rows_dot(w_ptr, expert, stride_we, stride_wn, x_row, N, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(gate, up) fp32 [BLOCK_N] each: the program's BLOCK_N gate rows w[expert, n, :] and the
    up rows w[expert, N + n, :] against x_row, streamed in one loop as one [2 BLOCK_N, BLOCK_K]
    tile (both row sets' loads in flight together, not one loop after the other)."""
    offs_r = tl.arange(0, 2 * BLOCK_N)
    n = tl.program_id(1) * BLOCK_N + offs_r % BLOCK_N
    row = n + (offs_r >= BLOCK_N).to(tl.int32) * N
    dots = _rows_dot(w_ptr, expert, stride_we, stride_wn, row, n < N, x_row, K, BLOCK_K)
    return tl.split(tl.trans(tl.reshape(dots, [2, BLOCK_N])))  # [BLOCK_N, 2]: gate, up


@triton.jit
def _route_up_kernel(
    x_ptr, w_ptr, ids_ptr, mid_ptr, ws_ptr, N, K, num_routes, stride_x, stride_we, stride_wn,
    stride_wsn, stride_mid,
    TOPK: tl.constexpr, ACT: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # Program (r, n): route r = token * TOPK + j, intermediate columns [n * BLOCK_N, +BLOCK_N).
    # SHARED: programs r >= num_routes are token r - num_routes's shared expert (ws [2N, K]).
    # Gated SiLU: the gate and up rows streamed in one loop (`_gate_up_rows_dot`), not the up
    # rows' loop after the gate rows': Qwen3-Next-8l's decode graph at batch 1 on the H200,
    # same run, 0.670 against 0.714 ms (though scripts/bench_moe_routes.py's isolated calls
    # time it 26.8 against 23.9 us at one token, 41.4 against 43.3 at two)
    pdl_trigger(PDL)
    r = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    base, expert, row_stride, token = w_ptr, r * 0, stride_wn, r // TOPK
    if SHARED and r >= num_routes:
        base, row_stride, token = ws_ptr, stride_wsn, r - num_routes
    else:
        expert = tl.load(ids_ptr + r).to(tl.int64)
    x_row = x_ptr + token * stride_x
    dtype = mid_ptr.dtype.element_ty
    if ACT == 1:  # the up rows sit N rows below the gate rows
        h, up = _gate_up_rows_dot(base, expert, stride_we, row_stride, x_row, N, K, BLOCK_N,
                                  BLOCK_K)
    else:
        h = _expert_rows_dot(base, expert, stride_we, row_stride, 0, x_row, N, K, BLOCK_N,
                             BLOCK_K)
        up = h
    h = _activate(h, up, ACT, dtype)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(mid_ptr + r * stride_mid + offs_n, h.to(dtype), mask=offs_n < N)


@triton.jit
def _activate(h, up, ACT: tl.constexpr, dtype: tl.constexpr):
    """The intermediate row from the first projection's fp32 dots, each projection rounded as
    F.linear's output: silu(gate) * up (ACT 1; h the gate's dots) or relu(h)^2 (ACT 2; `up`
    unused)."""
    h = h.to(dtype).to(tl.float32)
    if ACT == 1:
        return h / (1.0 + tl.exp(-h)) * up.to(dtype).to(tl.float32)
    h = tl.maximum(h, 0.0)
    return h * h


@triton.jit
def _route_down_kernel(
    mid_ptr, w_ptr, ids_ptr, tw_ptr, add_ptr, gate_ptr, out_ptr, part_ptr, count_ptr, ws_ptr,
    N, K, num_routes, stride_mid, stride_we, stride_wn, stride_add, stride_gate, stride_out,
    stride_wsn,
    TOPK: tl.constexpr, HAS_ADD: tl.constexpr, ADD_GATE: tl.constexpr, SHARED: tl.constexpr,
    SPLIT_ROUTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (t, n): token t's output columns [n * BLOCK_N, +BLOCK_N), its TOPK routes in turn.
    # SPLIT_ROUTES: program (r, n) of route r = t * TOPK + j computes its weighted route alone,
    # stores it in float32 partials [rows, N] and bumps the (t, n) counter; the last of the
    # token's programs to arrive sums the routes' partials in route order (as the loop does).
    # SHARED (split only): program r >= num_routes is token r - num_routes's shared expert
    # (ws [N, K]), whose partial is the add: its output times sigmoid(gate) with ADD_GATE.
    pdl_trigger(PDL)
    pid = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    dtype = out_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    t = pid
    if SPLIT_ROUTES:
        t = pid // TOPK
        if SHARED and pid >= num_routes:
            t = pid - num_routes
            val = _expert_rows_dot(ws_ptr, 0, 0, stride_wsn, 0, mid_ptr + pid * stride_mid, N,
                                   K, BLOCK_N, BLOCK_K).to(dtype).to(tl.float32)
            val = _gated(val, t, gate_ptr, stride_gate, dtype, ADD_GATE)
        else:
            val = _weighted_route(pid, mid_ptr, w_ptr, ids_ptr, tw_ptr, stride_mid, stride_we,
                                  stride_wn, N, K, dtype, BLOCK_N, BLOCK_K)
        _split_arrive(val, pid, t, offs_n, n_ok, part_ptr, count_ptr, out_ptr, add_ptr,
                      gate_ptr, N, num_routes, stride_add, stride_gate, stride_out, TOPK,
                      HAS_ADD, ADD_GATE, SHARED)
    else:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            total += _weighted_route(t * TOPK + j, mid_ptr, w_ptr, ids_ptr, tw_ptr, stride_mid,
                                     stride_we, stride_wn, N, K, dtype, BLOCK_N, BLOCK_K)
        out = total.to(dtype)
        if HAS_ADD:
            out = _plus_add(out, t, offs_n, n_ok, add_ptr, gate_ptr, stride_add, stride_gate,
                            ADD_GATE)
        tl.store(out_ptr + t * stride_out + offs_n, out, mask=n_ok)


@triton.jit
def _split_arrive(val, pid, t, offs_n, n_ok, part_ptr, count_ptr, out_ptr, add_ptr, gate_ptr,
                  N, num_routes, stride_add, stride_gate, stride_out, TOPK: tl.constexpr,
                  HAS_ADD: tl.constexpr, ADD_GATE: tl.constexpr, SHARED: tl.constexpr):
    """The split down projection's finish: program pid's columns `val` (float32, of token t)
    into the partials [rows, N], then a bump of the (t, column tile) counter; the token's last
    program to arrive sums its routes' partials in route order, adds the add (the shared
    route's partial, or `add`), writes the output row's columns and resets the counter."""
    tl.store(part_ptr + pid * N + offs_n, val, mask=n_ok)
    counter = count_ptr + t * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(counter, 1)  # acq_rel: orders the store above
    if arrived == TOPK - 1 + SHARED:
        dtype = out_ptr.dtype.element_ty
        total = tl.zeros(val.shape, dtype=tl.float32)
        for j in tl.static_range(TOPK):
            total += tl.load(part_ptr + (t * TOPK + j) * N + offs_n, mask=n_ok, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)
        out = total.to(dtype)
        if SHARED:
            add = tl.load(part_ptr + (num_routes + t) * N + offs_n, mask=n_ok, other=0.0,
                          cache_modifier=".cg")
            out = (out.to(tl.float32) + add).to(dtype)
        elif HAS_ADD:
            out = _plus_add(out, t, offs_n, n_ok, add_ptr, gate_ptr, stride_add, stride_gate,
                            ADD_GATE)
        tl.store(out_ptr + t * stride_out + offs_n, out, mask=n_ok)


@triton.jit
def _weighted_route(r, mid_ptr, w_ptr, ids_ptr, tw_ptr, stride_mid, stride_we, stride_wn, N, K,
                    dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Route r's down projection of its intermediate row times its routing weight, each
    rounded to the output's dtype: float32 [BLOCK_N] (this program's columns)."""
    expert = tl.load(ids_ptr + r).to(tl.int64)
    routed = _expert_rows_dot(w_ptr, expert, stride_we, stride_wn, 0, mid_ptr + r * stride_mid,
                              N, K, BLOCK_N, BLOCK_K)
    routed = routed.to(dtype).to(tl.float32)
    return (routed * tl.load(tw_ptr + r)).to(dtype).to(tl.float32)


@triton.jit
def _gated(val, t, gate_ptr, stride_gate, dtype: tl.constexpr, ADD_GATE: tl.constexpr):
    """val (float32, already in the output's dtype's values) times sigmoid(token t's gate
    logit) with ADD_GATE, each rounded to the dtype as torch's ops would."""
    if ADD_GATE:
        g = tl.load(gate_ptr + t * stride_gate).to(tl.float32)
        val = (val * tl.sigmoid(g).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return val


@triton.jit
def _plus_add(out, t, offs_n, n_ok, add_ptr, gate_ptr, stride_add, stride_gate,
              ADD_GATE: tl.constexpr):
    """out (the routes' sum in the output's dtype) plus token t's `add` row (gated: `_gated`),
    rounded to the dtype."""
    add = tl.load(add_ptr + t * stride_add + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    add = _gated(add, t, gate_ptr, stride_gate, out.dtype, ADD_GATE)
    return (out.to(tl.float32) + add).to(out.dtype)


# ----------------------------------------------------------------------------- TMA forms


@triton.jit
def _box(desc, expert, row, k0, STACKED: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr):
    """Weight box [row:row + BLOCK_N, k0:k0 + BLOCK_K] (zeros past the weight's edges) of a
    stacked [E, rows, K] weight's expert (STACKED) or of a plain [rows, K] one."""
    if STACKED:
        box = desc.load([expert, row, k0]).reshape([BLOCK_N, BLOCK_K])
    else:
        box = desc.load([row, k0])
    return box


@triton.jit
def _box_dots(desc, expert, row, row2, x_row, K, STACKED: tl.constexpr, TWO: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """(w[row + n, :] . x_row, w[row2 + n, :] . x_row) float32 [BLOCK_N] each (the second
    only with TWO, else the first again): the boxes come through the TMA descriptor into a
    STAGES-deep shared-memory ring (krait/ops/gemv_tma.py's loop), both row sets' boxes of a
    K step together."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = _x_tile(x_row, k0, K, offs_k)  # [1, BLOCK_K]
        acc += x * _box(desc, expert, row, k0, STACKED, BLOCK_N, BLOCK_K).to(tl.float32)
        if TWO:
            acc2 += x * _box(desc, expert, row2, k0, STACKED, BLOCK_N, BLOCK_K).to(tl.float32)
    dots = tl.sum(acc, 1)
    dots2 = dots
    if TWO:
        dots2 = tl.sum(acc2, 1)
    return dots, dots2


@triton.jit
def _route_up_tma_kernel(
    x_ptr, w_desc, ws_desc, ids_ptr, mid_ptr, N, K, num_routes, stride_x, stride_mid,
    TOPK: tl.constexpr, ACT: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):
    # `_route_up_kernel` with the expert rows through TMA boxes: program (r, n), route r (or
    # with SHARED, r >= num_routes: token r - num_routes's shared expert, ws_desc [2N, K])
    pdl_trigger(PDL)
    r = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    pdl_wait(PDL)
    if SHARED and r >= num_routes:
        x_row = x_ptr + (r - num_routes) * stride_x
        h, up = _box_dots(ws_desc, 0, n0, N + n0, x_row, K, False, True, BLOCK_N, BLOCK_K,
                          STAGES)
    else:
        expert = tl.load(ids_ptr + r)
        h, up = _box_dots(w_desc, expert, n0, N + n0, x_ptr + (r // TOPK) * stride_x, K, True,
                          ACT == 1, BLOCK_N, BLOCK_K, STAGES)
    dtype = mid_ptr.dtype.element_ty
    h = _activate(h, up, ACT, dtype)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(mid_ptr + r * stride_mid + offs_n, h.to(dtype), mask=offs_n < N)


@triton.jit
def _route_down_tma_kernel(
    mid_ptr, w_desc, ws_desc, ids_ptr, tw_ptr, add_ptr, gate_ptr, out_ptr, part_ptr, count_ptr,
    N, K, num_routes, stride_mid, stride_add, stride_gate, stride_out,
    TOPK: tl.constexpr, HAS_ADD: tl.constexpr, ADD_GATE: tl.constexpr, SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):
    # `_route_down_kernel`'s split form (SPLIT_ROUTES) with the expert rows through TMA boxes
    pdl_trigger(PDL)
    pid = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    pdl_wait(PDL)
    dtype = out_ptr.dtype.element_ty
    mid_row = mid_ptr + pid * stride_mid
    if SHARED and pid >= num_routes:
        t = pid - num_routes
        val, _ = _box_dots(ws_desc, 0, n0, n0, mid_row, K, False, False, BLOCK_N, BLOCK_K,
                           STAGES)
        val = _gated(val.to(dtype).to(tl.float32), t, gate_ptr, stride_gate, dtype, ADD_GATE)
    else:
        t = pid // TOPK
        expert = tl.load(ids_ptr + pid)
        val, _ = _box_dots(w_desc, expert, n0, n0, mid_row, K, True, False, BLOCK_N, BLOCK_K,
                           STAGES)
        val = (val.to(dtype).to(tl.float32) * tl.load(tw_ptr + pid)).to(dtype).to(tl.float32)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    _split_arrive(val, pid, t, offs_n, offs_n < N, part_ptr, count_ptr, out_ptr, add_ptr,
                  gate_ptr, N, num_routes, stride_add, stride_gate, stride_out, TOPK, HAS_ADD,
                  ADD_GATE, SHARED)


_COUNTERS: dict[torch.device, Tensor] = {}  # the split down's arrival counters, back to zero

# the split down projection (one program a route and column tile) while the unsplit grid (one
# a token and column tile) would cover the SMs fewer than this many times
SPLIT_ROUTES_BELOW_WAVES = 4


def routes_config(T: int, k: int, hidden: int, inter: int, num_sms: int = 132) -> dict:
    """Tiles of the two launches: {"up": (BLOCK_N, BLOCK_K, num_warps), "down": (BLOCK_N,
    BLOCK_K, num_warps, split_routes), "up_tma", "down_tma": (BLOCK_N, BLOCK_K, num_warps,
    STAGES) or None}; small tiles under the interpreter. On the H200
    (`scripts/bench_moe_routes.py`, docs/benchmarks.md) the plain up launch streams fastest
    with 8 gate and 8 up rows a program at 8 warps, K 512 wide for one token, 256 for more; the
    down launch with 16 rows, K 256 wide, split by route while few tokens leave the SMs idle.
    One token takes both launches' TMA forms: Qwen3-Next-8l's batch-1 decode graph 0.671 /
    0.675 ms on the plain kernels, 0.646 with up (16, 128, 8, 3) and down (16, 256, 4, 2)
    (session 28; other boxes 0.649-0.720)."""
    if interpreting():
        up_bn, up_bk = min(16, next_pow2(inter)), min(32, next_pow2(hidden))
        dn_bn, dn_bk = min(16, next_pow2(hidden)), min(32, next_pow2(inter))
        return dict(up=(up_bn, up_bk, 4), down=(dn_bn, dn_bk, 4, T < 3), up_tma=None,
                    down_tma=None)
    split = T * cdiv(hidden, 16) < SPLIT_ROUTES_BELOW_WAVES * num_sms and k > 1
    one = T == 1
    return dict(up=(8, min(512 if one else 256, next_pow2(hidden)), 8),
                down=(16, min(256, next_pow2(inter)), 4, split),
                up_tma=(16, 128, 8, 3) if one else None,
                down_tma=(16, 256, 4, 2) if one and k > 1 else None)


def moe_routes_triton(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: int,
    add: Tensor | None = None, config: dict | None = None, add_gate: Tensor | None = None,
    shared: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """`fused_moe` (plus `add`, times sigmoid(`add_gate`) when given) through the per-route
    GEMVs: two launches. act: 1 gated SiLU (w13 holds gate rows then up rows), 2 relu2.
    shared = (gate_up [2I, H], down [H, I]): a gated-SiLU shared expert of the experts'
    intermediate size run as one more route a token, its output the add (instead of `add`).
    config: `routes_config`'s form (its choice by default; split by route with `shared`);
    its "up_tma" / "down_tma" entries, (BLOCK_N, BLOCK_K, num_warps, STAGES) or None, put a
    launch on its TMA form where every weight is TMA-readable (the down one split by route)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    inter = w2.shape[2]
    out = torch.empty_like(x)  # [T, H]
    if T == 0:
        return out
    if shared is not None and (add is not None or act != 1
                               or shared[0].shape != (2 * inter, H)
                               or shared[1].shape != (H, inter)):
        raise ValueError("moe_routes: a shared expert takes the place of `add` and needs the "
                         "experts' gated-SiLU shapes")
    cfg = config or routes_config(T, k, H, inter, num_sms(x.device))
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32)  # [T*k] (reshape(-1) has unit stride)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    rows = T * k + (T if shared is not None else 0)  # routes, then the shared experts'
    mid = torch.empty(rows, inter, dtype=x.dtype, device=x.device)  # [rows, I]
    ws13, ws2 = shared if shared is not None else (w13, w2)
    pdl = pdl_args(use_pdl(x))
    tma_ok = all(tma_readable(w) for w in (w13, w2, ws13, ws2))
    up_tma, down_tma = (cfg.get("up_tma"), cfg.get("down_tma")) if tma_ok else (None, None)
    if up_tma is not None:
        bn, bk, nw, stages = up_tma
        _route_up_tma_kernel[(rows, cdiv(inter, bn))](
            x, _descriptor(w13, bn, bk), _descriptor(ws13, bn, bk), ids, mid, inter, H, T * k,
            x.stride(0), mid.stride(0), TOPK=k, ACT=act, SHARED=shared is not None,
            BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, **pdl, **_warps(x, nw),
        )
    else:
        bn, bk, nw = cfg["up"]
        _route_up_kernel[(rows, cdiv(inter, bn))](
            x, w13, ids, mid, ws13, inter, H, T * k, x.stride(0), w13.stride(0),
            w13.stride(1), ws13.stride(-2), mid.stride(0), TOPK=k, ACT=act,
            SHARED=shared is not None, BLOCK_N=bn, BLOCK_K=bk, **pdl, **_warps(x, nw),
        )
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    if down_tma is not None:  # split by route
        bn, bk, nw, stages = down_tma
        split = True
    else:
        bn, bk, nw, split = cfg["down"]
        split = split or shared is not None
    tiles = cdiv(H, bn)
    part, counters = out, out
    if split:
        part = torch.empty(rows, H, dtype=torch.float32, device=x.device)  # [rows, H]
        counters = arrival_counters(_COUNTERS, x.device, T * tiles)
    add_arg = add if add is not None else out
    gate_arg = add_gate if add_gate is not None else out
    stride_add = add.stride(0) if add is not None else 0
    stride_gate = add_gate.stride(0) if add_gate is not None else 0
    flags = dict(TOPK=k, HAS_ADD=add is not None, ADD_GATE=add_gate is not None,
                 SHARED=shared is not None, BLOCK_N=bn, BLOCK_K=bk, **pdl, **_warps(x, nw))
    if down_tma is not None:
        _route_down_tma_kernel[(rows, tiles)](
            mid, _descriptor(w2, bn, bk), _descriptor(ws2, bn, bk), ids, tw, add_arg, gate_arg,
            out, part, counters, H, inter, T * k, mid.stride(0), stride_add, stride_gate,
            out.stride(0), STAGES=stages, **flags,
        )
    else:
        _route_down_kernel[(rows if split else T, tiles)](
            mid, w2, ids, tw, add_arg, gate_arg, out, part, counters, ws2, H, inter, T * k,
            mid.stride(0), w2.stride(0), w2.stride(1), stride_add, stride_gate,
            out.stride(0), ws2.stride(-2), SPLIT_ROUTES=bool(split), **flags,
        )
    return out


def _warps(x: Tensor, num_warps: int) -> dict:
    return {} if x.device.type == "cpu" else {"num_warps": num_warps}

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
    # each projection rounded as F.linear's output
    if ACT == 1:  # the up rows sit N rows below the gate rows
        h, up = _gate_up_rows_dot(base, expert, stride_we, row_stride, x_row, N, K, BLOCK_N,
                                  BLOCK_K)
        h = h.to(dtype).to(tl.float32)
        h = h / (1.0 + tl.exp(-h)) * up.to(dtype).to(tl.float32)
    else:
        h = _expert_rows_dot(base, expert, stride_we, row_stride, 0, x_row, N, K, BLOCK_N,
                             BLOCK_K).to(dtype).to(tl.float32)
        h = tl.maximum(h, 0.0)
        h = h * h
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(mid_ptr + r * stride_mid + offs_n, h.to(dtype), mask=offs_n < N)


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
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
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
        tl.store(part_ptr + pid * N + offs_n, val, mask=n_ok)
        counter = count_ptr + t * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1)  # acq_rel: orders the store above
        if arrived == TOPK - 1 + SHARED:
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
                out = _plus_add(out, t, offs_n, n_ok, add_ptr, gate_ptr, stride_add,
                                stride_gate, ADD_GATE)
            tl.store(out_ptr + t * stride_out + offs_n, out, mask=n_ok)
    else:
        for j in tl.static_range(TOPK):
            total += _weighted_route(t * TOPK + j, mid_ptr, w_ptr, ids_ptr, tw_ptr, stride_mid,
                                     stride_we, stride_wn, N, K, dtype, BLOCK_N, BLOCK_K)
        out = total.to(dtype)
        if HAS_ADD:
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


_COUNTERS: dict[torch.device, Tensor] = {}  # the split down's arrival counters, back to zero

# the split down projection (one program a route and column tile) while the unsplit grid (one
# a token and column tile) would cover the SMs fewer than this many times
SPLIT_ROUTES_BELOW_WAVES = 4


def routes_config(T: int, k: int, hidden: int, inter: int, num_sms: int = 132) -> dict:
    """Tiles of the two launches: {"up": (BLOCK_N, BLOCK_K, num_warps), "down": (BLOCK_N,
    BLOCK_K, num_warps, split_routes)}; small tiles under the interpreter. On the H200
    (`scripts/bench_moe_routes.py`, docs/benchmarks.md) the up launch streams fastest with 8
    gate and 8 up rows a program at 8 warps, K 512 wide for one token, 256 for more; the down
    launch with 16 rows, K 256 wide, split by route while few tokens leave the SMs idle."""
    if interpreting():
        up_bn, up_bk = min(16, next_pow2(inter)), min(32, next_pow2(hidden))
        dn_bn, dn_bk = min(16, next_pow2(hidden)), min(32, next_pow2(inter))
        return dict(up=(up_bn, up_bk, 4), down=(dn_bn, dn_bk, 4, T < 3))
    split = T * cdiv(hidden, 16) < SPLIT_ROUTES_BELOW_WAVES * num_sms and k > 1
    return dict(up=(8, min(512 if T == 1 else 256, next_pow2(hidden)), 8),
                down=(16, min(256, next_pow2(inter)), 4, split))


def moe_routes_triton(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: int,
    add: Tensor | None = None, config: dict | None = None, add_gate: Tensor | None = None,
    shared: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """`fused_moe` (plus `add`, times sigmoid(`add_gate`) when given) through the per-route
    GEMVs: two launches. act: 1 gated SiLU (w13 holds gate rows then up rows), 2 relu2.
    shared = (gate_up [2I, H], down [H, I]): a gated-SiLU shared expert of the experts'
    intermediate size run as one more route a token, its output the add (instead of `add`).
    config: `routes_config`'s form (its choice by default; split by route with `shared`)."""
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
    bn, bk, nw = cfg["up"]
    _route_up_kernel[(rows, cdiv(inter, bn))](
        x, w13, ids, mid, ws13, inter, H, T * k, x.stride(0), w13.stride(0), w13.stride(1),
        ws13.stride(-2), mid.stride(0), TOPK=k, ACT=act, SHARED=shared is not None,
        BLOCK_N=bn, BLOCK_K=bk, **pdl, **_warps(x, nw),
    )
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    bn, bk, nw, split = cfg["down"]
    split = split or shared is not None
    tiles = cdiv(H, bn)
    part, counters = out, out
    if split:
        part = torch.empty(rows, H, dtype=torch.float32, device=x.device)  # [rows, H]
        counters = arrival_counters(_COUNTERS, x.device, T * tiles)
    _route_down_kernel[(rows if split else T, tiles)](
        mid, w2, ids, tw, add if add is not None else out,
        add_gate if add_gate is not None else out, out, part, counters, ws2, H, inter, T * k,
        mid.stride(0), w2.stride(0), w2.stride(1), add.stride(0) if add is not None else 0,
        add_gate.stride(0) if add_gate is not None else 0, out.stride(0), ws2.stride(-2),
        TOPK=k, HAS_ADD=add is not None, ADD_GATE=add_gate is not None,
        SHARED=shared is not None, SPLIT_ROUTES=bool(split), BLOCK_N=bn, BLOCK_K=bk, **pdl,
        **_warps(x, nw),
    )
    return out


def _warps(x: Tensor, num_warps: int) -> dict:
    return {} if x.device.type == "cpu" else {"num_warps": num_warps}

"""Fused mixture-of-experts MLP over routed tokens.

out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), where an expert is
  gated ("silu"):     w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))
  non-gated ("relu2"): w2[e] @ relu(w13[e] @ x) ** 2
Products accumulate in float32; the intermediate and the per-route outputs are rounded to x's
dtype; the k routes of a token are summed in float32 and the result returned in x's dtype.

Triton path: the T*k (token, route) pairs are sorted by expert and each expert's run is padded to
BLOCK_M (`moe_align`, torch ops, no host sync), then one grouped-GEMM launch per projection: the
first computes x @ w13^T with the activation fused, the second intermediate @ w2^T with the
routing weight applied. Each program owns BLOCK_M rows of one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2, use_triton
from krait.ops.activation import relu2_ref, silu_and_mul_ref
from krait.ops.moe_routes import moe_routes_triton, use_moe_routes

_ACTIVATIONS = {"silu": 1, "relu2": 2}

# ----------------------------------------------------------------------------- triton


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_valid, N, K, a_row_div,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program (m, n): sorted rows [m * BLOCK_M, +BLOCK_M), all of one expert, x columns n-block.
    # Row r of the sorted list is a flat route id (token * k + j); A's row is id // a_row_div.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    m_ok = ids < num_valid
    a_rows = (ids // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
              + offs_k[:, None] * stride_bk)  # [BLOCK_K, BLOCK_N] tile of w[e]^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, DOT_PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = _mma(a, b_up, acc_up, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif ACT == 2:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + ids, mask=m_ok, other=0.0).to(tl.float32)
        # round the product first, as the reference does
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
    c_ptrs = c_ptr + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. "upcast" (the interpreter, whose tl.dot mishandles bf16 operands) multiplies
    in float32 on the already-rounded operands."""
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def _gpu_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in [
            (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3),
            (32, 128, 4, 4), (256, 64, 8, 3), (128, 32, 4, 4),
        ]
    ]


# BLOCK_M is picked on the host from the routed-token count (it shapes the alignment); the tuned
# tile options are keyed on the weight shape and that BLOCK_M bucket, never on the token count.
_moe_gemm_tuned = triton.autotune(
    configs=_gpu_configs(), key=["N", "K", "BLOCK_M", "GATED", "MUL_WEIGHT", "DOT_PRECISION"]
)(_moe_gemm_kernel)


def pick_block_m(num_routes: int, num_experts: int) -> int:
    """Rows per program: small when experts see few tokens each (decode), larger for prefill."""
    if interpreting():
        return 16
    avg = num_routes / max(num_experts, 1)
    return 16 if avg <= 16 else 32 if avg <= 48 else 64


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Sorts the flat routes of `topk_ids` [T, k] by expert, each expert's run padded to a
    multiple of block_m, without a host sync.

    Returns sorted_ids (int32 [num_blocks * block_m]: flat route ids, padding = T*k) and
    expert_ids (int32 [num_blocks]: the expert of each block, -1 past the last used block).
    num_blocks is an upper bound from T*k and E alone."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    max_padded = n + min(n, num_experts) * (block_m - 1)
    num_blocks = cdiv(max_padded, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[pad_start[sorted_e] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=dev) * block_m
    expert_ids = torch.searchsorted(pad_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    e = tl.load(ids_ptr + offs, mask=m, other=0)
    tl.atomic_add(counts_ptr + e, 1, mask=m)


@triton.jit
def _moe_layout_kernel(
    counts_ptr, cursor_ptr, expert_ids_ptr, sorted_ids_ptr, num_experts, num_blocks, n,
    block_m, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """One program: each expert's padded run start (into cursor), the expert of every block,
    and sorted_ids filled with the padding id n."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    c = tl.load(counts_ptr + e, mask=e_ok, other=0)
    padded = (c + block_m - 1) // block_m * block_m
    pad_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, pad_end - padded, mask=e_ok)
    pad_end = tl.where(e_ok, pad_end, 1 << 30)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        start = b * block_m
        owner = tl.sum((pad_end[None, :] <= start[:, None]).to(tl.int32), 1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(expert_ids_ptr + b, owner, mask=b < num_blocks)
    for r0 in range(0, num_blocks * block_m, BLOCK_B):
        r = r0 + tl.arange(0, BLOCK_B)
        tl.store(sorted_ids_ptr + r, tl.zeros([BLOCK_B], tl.int32) + n,
                 mask=r < num_blocks * block_m)


@triton.jit
def _moe_scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    e = tl.load(ids_ptr + offs, mask=m, other=0)
    dst = tl.atomic_add(cursor_ptr + e, 1, mask=m)
    tl.store(sorted_ids_ptr + dst, offs.to(tl.int32), mask=m)


def moe_align_triton(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """`moe_align` in four launches (counts, layout, scatter; one memset). Routes of one expert
    may come in any order within its run: each route's row is computed on its own."""
    flat = topk_ids.reshape(-1)
    flat = flat if flat.dtype == torch.int32 else flat.to(torch.int32)
    n = flat.numel()
    dev = flat.device
    max_padded = n + min(n, num_experts) * (block_m - 1)
    num_blocks = cdiv(max_padded, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)  # [E]
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)  # [E]
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)  # [num_blocks]
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block = 1024
    grid = (cdiv(n, block),)
    _moe_count_kernel[grid](flat, counts, n, BLOCK=block)
    _moe_layout_kernel[(1,)](
        counts, cursor, expert_ids, sorted_ids, num_experts, num_blocks, n, block_m,
        BLOCK_E=next_pow2(num_experts), BLOCK_B=256,
    )
    _moe_scatter_kernel[grid](flat, cursor, sorted_ids, n, BLOCK=block)
    return sorted_ids, expert_ids


def _launch_gemm(
    a: Tensor, w: Tensor, out: Tensor, topk_w: Tensor, sorted_ids: Tensor, expert_ids: Tensor,
    num_valid: int, a_row_div: int, gated: bool, act: int, mul_weight: bool, block_m: int,
) -> None:
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    interp = interpreting()
    precision = "upcast" if interp else ("ieee" if a.dtype == torch.float32 else "tf32")
    args = (
        a, w, out, topk_w, sorted_ids, expert_ids,
        num_valid, n_out, k_dim, a_row_div,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
    )
    kw = dict(GATED=gated, ACT=act, MUL_WEIGHT=mul_weight, DOT_PRECISION=precision,
              BLOCK_M=block_m)
    num_blocks = expert_ids.shape[0]
    if interp:
        block_n = min(64, max(16, next_pow2(n_out)))
        block_k = min(64, max(16, next_pow2(k_dim)))
        grid = (num_blocks, cdiv(n_out, block_n))
        _moe_gemm_kernel[grid](*args, BLOCK_N=block_n, BLOCK_K=block_k, **kw)
    else:
        def grid(meta):
            return (num_blocks, cdiv(n_out, meta["BLOCK_N"]))

        _moe_gemm_tuned[grid](*args, **kw)


def fused_moe_triton(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
    activation: str = "silu",
) -> Tensor:
    """Triton launcher of `fused_moe`."""
    act = _check(x, w13, w2, topk_ids, activation)
    T, H = x.shape
    k = topk_ids.shape[1]
    E, inter = w2.shape[0], w2.shape[2]
    if T == 0:
        return torch.zeros_like(x)
    n = T * k
    block_m = pick_block_m(n, E)
    sorted_ids, expert_ids = moe_align_triton(topk_ids, E, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    mid = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    _launch_gemm(x, w13, mid, tw, sorted_ids, expert_ids, n, k, act == 1, act, False, block_m)
    routed = torch.empty(n, H, dtype=x.dtype, device=x.device)  # [T*k, H]
    _launch_gemm(mid, w2, routed, tw, sorted_ids, expert_ids, n, 1, False, 0, True, block_m)
    return routed.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


# ----------------------------------------------------------------------------- torch reference


def fused_moe_ref(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
    activation: str = "silu",
) -> Tensor:
    """Torch reference of `fused_moe`: routes grouped by expert, one matmul pair per used expert."""
    act = _check(x, w13, w2, topk_ids, activation)
    T, H = x.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    routed = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [T*k, H]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        routes = order[start : start + c]
        h = F.linear(x[routes // k], w13[e])
        h = silu_and_mul_ref(h) if act == 1 else relu2_ref(h)
        routed[routes] = F.linear(h, w2[e])
        start += c
    weighted = (routed.float() * topk_weights.reshape(-1, 1).float()).to(x.dtype)
    return weighted.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
    activation: str = "silu", add: Tensor | None = None, add_gate: Tensor | None = None,
    shared: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows) for "silu", [E, I, H] for "relu2";
    w2 [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int32 -> [T, H] in x's dtype,
    plus `add` [T, H] when given (rounded once more, as a separate add would be), first
    multiplied by sigmoid(add_gate) ([T, 1] logits: Qwen3-Next's gated shared expert) when
    that is given. Batches of few routes take `krait.ops.moe_routes` (the add and its gate
    fused); only they take `shared` = (gate_up [2I, H], down [H, I]): a shared expert run as
    one more route a token, whose output is the add (`moe_routes_triton`)."""
    if add_gate is not None and add is None and shared is None:
        raise ValueError("fused_moe: add_gate scales `add`, which is missing")
    few = use_moe_routes(x, topk_ids.numel(), w13.shape[0])
    if shared is not None and not few:
        raise ValueError("fused_moe: a shared expert as a route needs a few-route batch "
                         "(use_moe_routes)")
    if few:
        act = _check(x, w13, w2, topk_ids, activation)
        return moe_routes_triton(x, w13, w2, topk_weights, topk_ids, act, add,
                                 add_gate=add_gate, shared=shared)
    if add_gate is not None:
        add = add * torch.sigmoid(add_gate)
    if use_triton(x):
        out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation)
    else:
        out = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation)
    return out if add is None else out + add


def _check(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, activation: str) -> int:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {list(_ACTIVATIONS)}")
    act = _ACTIVATIONS[activation]
    inter = w2.shape[2]
    rows = 2 * inter if act == 1 else inter
    if w13.shape != (w2.shape[0], rows, x.shape[1]) or w2.shape[1] != x.shape[1]:
        raise ValueError(
            f"fused_moe: shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
            f"do not fit activation {activation!r}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError("fused_moe: topk_ids must have one row per token")
    return act

"""Which decode projections go to the GEMV (krait/ops/gemv.py) and which to cuBLAS: `linear`,
`silu_mul_linear` (silu_and_mul fused into the GEMV's prologue) and `silu_mlp` (a gated MLP,
its activation in the gate_up GEMV's epilogue). All fall back to the torch ops, so callers never
check the conditions themselves."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from krait.ops._dispatch import env, use_triton
from krait.ops.activation import silu_and_mul
from krait.ops.gemv import MAX_M, gemv_triton

# one-row calls up to this many weight elements go to the GEMV with KRAIT_GEMV=wide: with the
# one-row config of session 4 it beat cuBLAS at every projection shape up to 17M elements in
# isolation on the H200 (docs/benchmarks.md, run 10) and lost at granite's gate_up (32M);
# lm_heads (100M+) stay on cuBLAS
ROW_GEMV_MAX_ELEMENTS = 20 << 20
# the default rule's bound (session 6: with the late PDL trigger, every one-row projection up to
# this size through the GEMV; granite's 17M in_proj and down lost there); weights with at least
# as many rows as columns (Mamba's in_proj) go up to ROW_GEMV_MAX_ELEMENTS (session 11: mamba2
# batch 1 -4% with its 17M in_proj on the GEMV, granite's 17M down lost 4 us a layer)
ROW_GEMV_DEFAULT_MAX_ELEMENTS = 8 << 20
# gate_up weights up to this size take the GEMV with the activation in its epilogue (granite's
# 33.5M, llama-3.2-1b's 33.5M; each program streams its columns' gate rows and up rows)
GATE_UP_GEMV_MAX_ELEMENTS = 64 << 20


def _gemv_allowed(x: Tensor) -> bool:
    """The GEMV serves x at all: at most MAX_M rows, Triton on, KRAIT_GEMV not 0."""
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_M:  # shape first: prefill pays no lookup
        return False
    return env("KRAIT_GEMV") != "0" and use_triton(x)


def _use_gemv(x: Tensor, weight: Tensor) -> bool:
    """A plain projection through the GEMV? KRAIT_GEMV=1: every call with M <= 8; =0: never;
    unset: one row against a weight of at most 8M elements, or of at most 20M with N >= K. With
    the GEMV's PDL trigger after its weight loop (the default since session 6) the 8M rule made
    qwen3's batch-1 step 8% faster on the H200 (1.11-1.14 vs 1.22-1.25 ms: its qkv and gate_up
    join o and down); the N >= K widening took mamba2's batch 1 from 1.442 to 1.384 ms (graph,
    session 11). The A/B rules: KRAIT_GEMV=narrow (session 5's default: only N <= K/2, at most
    8M), =small (session 6's: at most 8M, any shape), =wide (at most 20M, any shape: granite's
    down too, 5% slower there). With more rows the GEMV re-reads W per row tile and loses."""
    if not _gemv_allowed(x):
        return False
    mode = env("KRAIT_GEMV")
    if mode == "1":
        return True
    if x.shape[0] != 1:
        return False
    n, k = weight.shape
    if mode == "wide":
        return weight.numel() <= ROW_GEMV_MAX_ELEMENTS
    if mode == "narrow":
        return 2 * n <= k and n * k <= ROW_GEMV_DEFAULT_MAX_ELEMENTS
    if n * k <= ROW_GEMV_DEFAULT_MAX_ELEMENTS:
        return True
    return mode != "small" and n >= k and n * k <= ROW_GEMV_MAX_ELEMENTS


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through gemv_triton for the decode shapes `_use_gemv` picks."""
    if _use_gemv(x, weight):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear(silu_and_mul(x)) for x [T, 2I]: one fused launch for the decode shapes
    `_use_gemv` picks."""
    if _use_gemv(x, weight):
        return gemv_triton(x, weight, bias, silu_mul=True)
    return F.linear(silu_and_mul(x), weight, bias)


def _use_gate_up_epilogue(x: Tensor, gate_up: Tensor) -> bool:
    """A gated MLP's activation in the gate_up GEMV's epilogue? One row (any row count up to 8
    with KRAIT_GEMV=1) against a gate_up of at most GATE_UP_GEMV_MAX_ELEMENTS, unless
    KRAIT_MLP_EPILOGUE=0 (the activation then rides in the down projection's prologue, or in
    its own launch) or KRAIT_GEMV is narrow or small (the rules before session 11)."""
    if not _gemv_allowed(x) or env("KRAIT_MLP_EPILOGUE") == "0":
        return False
    mode = env("KRAIT_GEMV")
    if mode in ("narrow", "small"):
        return False
    return (x.shape[0] == 1 or mode == "1") and gate_up.numel() <= GATE_UP_GEMV_MAX_ELEMENTS


def silu_mlp(x: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None = None,
             down_bias: Tensor | None = None) -> Tensor:
    """down(silu_and_mul(gate_up(x))): x [T, H], gate_up [2I, H] (the gate's rows, then the
    up's), down [H, I] -> [T, H]. Decode rows `_use_gate_up_epilogue` picks run the gate_up
    GEMV with the activation in its epilogue, then `linear`; the rest `silu_mul_linear`."""
    if _use_gate_up_epilogue(x, gate_up):
        act = gemv_triton(x, gate_up, gate_up_bias, silu_mul_out=True)  # [T, I]
        return linear(act, down, down_bias)
    return silu_mul_linear(linear(x, gate_up, gate_up_bias), down, down_bias)

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

# one-row calls up to this many weight elements go to the GEMV: every projection of the
# benchmarked models but granite's gate_up (33.5M, which takes the GEMV with its activation
# epilogue: GATE_UP_GEMV_MAX_ELEMENTS); lm_heads (100M+) stay on cuBLAS. Session 11 on the H200,
# batch 1 graph ms against session 10's 8M bound: mamba2 1.442 -> 1.385 (its 17M in_proj),
# granite-micro 2.682 -> 2.565 with the MLP epilogue (its in_proj and MLP down)
ROW_GEMV_MAX_ELEMENTS = 20 << 20
# session 6's bound (KRAIT_GEMV=small): with the late PDL trigger every one-row projection up
# to this size; granite's 17M in_proj and down lost then, the down with silu-and-mul in its
# prologue (8 redundant exps per input element)
ROW_GEMV_SMALL_MAX_ELEMENTS = 8 << 20
# gate_up weights up to this size take the GEMV with the activation in its epilogue (granite's
# 33.5M, llama-3.2-1b's 33.5M; each program streams its columns' gate rows and up rows).
# Session 11, batch 1 graph ms: qwen3 1.013 -> 0.958, granite-micro 2.682 -> 2.605 (down still
# on cuBLAS) -> 2.565 (down on the GEMV too)
GATE_UP_GEMV_MAX_ELEMENTS = 64 << 20


def _gemv_allowed(x: Tensor) -> bool:
    """The GEMV serves x at all: at most MAX_M rows, Triton on, KRAIT_GEMV not 0."""
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_M:  # shape first: prefill pays no lookup
        return False
    return env("KRAIT_GEMV") != "0" and use_triton(x)


def _use_gemv(x: Tensor, weight: Tensor) -> bool:
    """A plain projection through the GEMV? KRAIT_GEMV=1: every call with M <= 8; =0: never;
    unset: one row against a weight of at most ROW_GEMV_MAX_ELEMENTS. The A/B rules:
    KRAIT_GEMV=narrow (session 5's default: only N <= K/2, at most 8M), =small (session 6's:
    at most 8M). With more rows the GEMV re-reads W per row tile and loses."""
    if not _gemv_allowed(x):
        return False
    mode = env("KRAIT_GEMV")
    if mode == "1":
        return True
    if x.shape[0] != 1:
        return False
    n, k = weight.shape
    if mode == "narrow":
        return 2 * n <= k and n * k <= ROW_GEMV_SMALL_MAX_ELEMENTS
    if mode == "small":
        return n * k <= ROW_GEMV_SMALL_MAX_ELEMENTS
    return n * k <= ROW_GEMV_MAX_ELEMENTS


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

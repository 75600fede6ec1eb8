"""Which decode projections go to the GEMV (krait/ops/gemv.py) and which to cuBLAS: `linear`,
`silu_mul_linear` (silu_and_mul fused into the GEMV's prologue) and `silu_mlp` (a gated MLP,
its activation in the gate_up GEMV's epilogue). All fall back to the torch ops, so callers never
check the conditions themselves."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from krait.ops._dispatch import env, num_sms, use_triton
from krait.ops.activation import silu_and_mul
from krait.ops.gemv import MAX_M, default_config, gemv_triton, norm_one_group
from krait.ops.gemv_tma import config_from_text, gemv_tma, tma_config, tma_readable

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


# TMA GEMVs over weights this large load their first box before the PDL wait (EARLY_BOX).
# H200, session 19, batch-1 graph ms, default -> early box on every TMA weight, two runs:
# granite-micro 2.231 -> 2.191 and 2.215 -> 2.175, llama-3.2-1b 0.901 -> 0.896, mamba2-1.3b
# 1.148 -> 1.146; qwen3-0.6b (its 6.3M gate_up the only TMA weight) 0.912 -> 0.945
TMA_EARLY_BOX_MIN_ELEMENTS = 12 << 20


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


def _tma(x: Tensor, weight: Tensor, bias: Tensor | None,
         silu_mul_out: bool = False) -> dict | None:
    """The TMA GEMV's config (krait/ops/gemv_tma.py) for a one-row call the GEMV serves,
    where `tma_config` says it streams faster, or None. KRAIT_GEMV_TMA=0 turns it off;
    =prefetch adds its L2 prefetch before the PDL wait (A/B knobs). Weights of at least
    TMA_EARLY_BOX_MIN_ELEMENTS load their first box before the wait (KRAIT_TMA_EARLY_BOX=0/1
    forces it off/on for every TMA weight). H200, session 14, batch-1
    graph ms off -> on: granite-micro 2.427 -> 2.287, llama-3.2-1b 0.998 -> 0.930, qwen3
    0.964 -> 0.943 (with the prefetch: 2.341, 0.956, 0.952)."""
    mode = env("KRAIT_GEMV_TMA", "1")
    if mode == "0" or bias is not None or x.shape[0] != 1 or not tma_readable(weight):
        return None
    cfg = tma_config(weight.shape[0], weight.shape[1], silu_mul_out, num_sms(x.device))
    if cfg is not None and mode == "prefetch":
        cfg["PREFETCH_LINES"] = None
    early = env("KRAIT_TMA_EARLY_BOX", "")
    if cfg is not None and (early == "1" or (early != "0"
                                             and weight.numel() >= TMA_EARLY_BOX_MIN_ELEMENTS)):
        cfg["EARLY_BOX"] = True
    return cfg


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through gemv_triton (or the TMA GEMV, `_tma`) for the decode shapes
    `_use_gemv` picks."""
    if _use_gemv(x, weight):
        cfg = _tma(x, weight, bias)
        if cfg is not None:
            return gemv_tma(x, weight, cfg)
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def _one_slice_tma(x: Tensor, weight: Tensor, bias: Tensor | None,
                   conv: tuple | None) -> dict | None:
    """`_tma`'s config for a projection whose epilogue (the conv) or prologue (the norm) needs
    each program to stream all of K, or None where it splits K. With `conv` (a Mamba in_proj):
    KRAIT_INPROJ_TMA="BLOCK_N,BLOCK_K,STAGES,WARPS" replaces the config (an A/B knob) and
    KRAIT_GEMV_TMA=noconv keeps it on gemv.py."""
    cfg = _tma(x, weight, bias)
    if cfg is None or conv is None:
        return cfg if cfg is not None and cfg["SPLIT_K"] == 1 else None
    forced = env("KRAIT_INPROJ_TMA", "")
    if forced:
        cfg = dict(config_from_text(forced), **{k: v for k, v in cfg.items()
                                                if k in ("PREFETCH_LINES", "EARLY_BOX")})
    if cfg["SPLIT_K"] != 1 or env("KRAIT_GEMV_TMA") == "noconv":
        return None
    return cfg


def conv_linear(x: Tensor, weight: Tensor, bias: Tensor | None, conv: tuple) -> Tensor:
    """A one-row Mamba in_proj with its conv in the epilogue (`gemv_triton(conv=...)`), through
    the TMA GEMV where `_one_slice_tma` picks it."""
    cfg = _one_slice_tma(x, weight, bias, conv)
    if cfg is not None:
        return gemv_tma(x, weight, cfg, conv=conv)
    return gemv_triton(x, weight, bias, conv=conv)


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
        cfg = _tma(x, gate_up, gate_up_bias, silu_mul_out=True)
        if cfg is not None:
            act = gemv_tma(x, gate_up, cfg, silu_mul_out=True)  # [1, I]
        else:
            act = gemv_triton(x, gate_up, gate_up_bias, silu_mul_out=True)  # [T, I]
        return linear(act, down, down_bias)
    return silu_mul_linear(linear(x, gate_up, gate_up_bias), down, down_bias)


def _norm_config(weight: Tensor, group_size: int) -> dict[str, int] | None:
    """The one-row GEMV config with K tiles inside one norm group (halved from the default
    until they divide the group), or None below 16 columns a tile."""
    cfg = default_config(1, weight.shape[0], weight.shape[1])
    while group_size % cfg["BLOCK_K"]:
        cfg["BLOCK_K"] //= 2
    return cfg if cfg["BLOCK_K"] >= 16 else None


def gated_norm_in_gemv(x: Tensor, weight: Tensor, group_size: int, part_size: int) -> bool:
    """A Mamba mixer's gated RMSNorm in its out_proj GEMV's prologue, from the gated state
    update's partial sums? It saves the norm's launch a layer at batch 1 (H200, session 12:
    mamba2-1.3b 1.397 -> 1.324 ms a step, granite-4.0-h-micro 2.563 -> 2.502). On by default
    where each GEMV program's columns lie in one norm group (the measured form);
    KRAIT_MAMBA_NORM_PROLOGUE=0 turns it off, =1 takes it for any group layout. x: a
    [rows, ...] stand-in for the out_proj input; the GEMV must serve it, and the partials must
    tile the norm groups."""
    knob = env("KRAIT_MAMBA_NORM_PROLOGUE")
    if knob == "0" or not _use_gemv(x, weight) or group_size % part_size:
        return False
    cfg = _norm_config(weight, group_size)
    return cfg is not None and (knob == "1" or norm_one_group(weight.shape[1], group_size, cfg))


def gated_norm_linear(packed: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor,
                      group_size: int, eps: float, part_size: int,
                      residual: Tensor | None = None, residual_scale: float = 1.0):
    """linear(gated_rms_norm(y, z, norm_weight, eps, group_size), weight, bias) from packed
    [1, I + I / part_size] float32 = [y * silu(z) | partial sums of its squares] (what the gated
    state update writes): one GEMV launch, the norm in its prologue. With `residual`: (h,
    partials) as gemv_triton(residual=..., residual_scale=...) returns them."""
    inter = weight.shape[1]
    return gemv_triton(packed[:, :inter], weight, bias, config=_norm_config(weight, group_size),
                       norm=(norm_weight, packed[:, inter:], group_size, eps, part_size),
                       residual=residual, residual_scale=residual_scale)


# columns a GEMV tile sums its squares over (the one-row config's BLOCK_N): the partials' run
RESIDUAL_PART = 8


def norm_linear(h: Tensor, parts: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                bias: Tensor | None, conv: tuple | None = None) -> Tensor:
    """linear(rms_norm(h, norm_weight, eps), weight, bias) for one row h [1, H] whose sums of
    squares per run of RESIDUAL_PART columns are `parts` (a residual-folding GEMV wrote both):
    the norm in the GEMV's prologue (and `conv` as gemv_triton takes it in its epilogue)."""
    cfg = _one_slice_tma(h, weight, bias, conv)
    if cfg is not None:
        return gemv_tma(h, weight, cfg, conv=conv, norm=(norm_weight, eps))
    hidden = h.shape[1]
    return gemv_triton(h, weight, bias, config=_norm_config(weight, hidden),
                       norm=(norm_weight, parts, hidden, eps, RESIDUAL_PART), conv=conv)


def conv_in_gemv(x: Tensor, weight: Tensor, conv_width: int) -> bool:
    """A Mamba layer's decode conv in its in_proj GEMV's epilogue? It saves the conv update's
    launch a layer at batch 1 (H200, session 13: mamba2-1.3b 1.330 -> 1.273 ms a step,
    granite-4.0-h-micro 2.513 -> 2.475). On by default; KRAIT_CONV_EPILOGUE=0 turns it off.
    x: the one-row in_proj input (or a stand-in); the GEMV must serve it."""
    if env("KRAIT_CONV_EPILOGUE") == "0" or x.shape[0] != 1:
        return False
    return _use_gemv(x, weight) and conv_width & (conv_width - 1) == 0


def block_fold_ok(x: Tensor, normed_inputs: list[Tensor], outputs: list[Tensor],
                  gate_up: Tensor | None = None) -> bool:
    """Fold a block's residual adds and RMSNorms into its GEMVs (KRAIT_NORM_PROLOGUE=1; off
    until measured on the GPU: it saves the RMSNorm launches at batch 1)? x: a one-row
    stand-in. Every weight that takes a normalized input (`normed_inputs`) applies the RMSNorm
    in its GEMV's prologue, every weight whose output adds the residual (`outputs`) folds it in
    its epilogue and sums each tile's squares, and a gated MLP's gate_up (in normed_inputs too)
    keeps its activation epilogue."""
    if env("KRAIT_NORM_PROLOGUE") != "1" or x.shape[0] != 1:
        return False
    if gate_up is not None and not _use_gate_up_epilogue(x, gate_up):
        return False
    for w in normed_inputs:
        if w is not gate_up and not _use_gemv(x, w):
            return False
        if w.shape[1] % RESIDUAL_PART or _norm_config(w, w.shape[1]) is None:
            return False
    return all(_use_gemv(x, w) and default_config(1, *w.shape)["BLOCK_N"] == RESIDUAL_PART
               for w in outputs)


def norm_silu_mlp(h: Tensor, parts: Tensor, norm_weight: Tensor, eps: float, gate_up: Tensor,
                  down: Tensor, gate_up_bias: Tensor | None, down_bias: Tensor | None,
                  residual: Tensor, residual_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """A gated MLP over rms_norm(h) for one row, the residual added after it: the gate_up GEMV
    with the norm in its prologue and the activation in its epilogue, then the down GEMV
    folding `residual` (returns gemv_triton(residual=..., residual_scale=...)'s (h',
    partials))."""
    hidden = h.shape[1]
    cfg = _tma(h, gate_up, gate_up_bias, silu_mul_out=True)
    if cfg is not None:
        act = gemv_tma(h, gate_up, cfg, silu_mul_out=True, norm=(norm_weight, eps))  # [1, I]
    else:
        act = gemv_triton(h, gate_up, gate_up_bias, config=_norm_config(gate_up, hidden),
                          silu_mul_out=True,
                          norm=(norm_weight, parts, hidden, eps, RESIDUAL_PART))  # [1, I]
    return gemv_triton(act, down, down_bias, residual=residual, residual_scale=residual_scale)

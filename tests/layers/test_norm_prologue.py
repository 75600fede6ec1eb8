"""Norms folded into the GEMVs at batch 1, through the Triton kernels on CPU (interpreted): greedy
tokens and logprobs equal the unfused path's.
- KRAIT_MAMBA_NORM_PROLOGUE=1: the state update hands over y * silu(z) and partial sums of its
  squares, and out_proj's GEMV applies the gated RMSNorm from them;
- KRAIT_NORM_PROLOGUE=1 (mamba2 blocks, llama-family layers): the GEMV that ends a residual
  branch (out_proj; o_proj, down) adds the residual and sums each tile's squares, and the next
  GEMV that reads the stream (in_proj; qkv, gate_up) applies the RMSNorm from them."""

from __future__ import annotations

import pytest
import torch

from krait import LLM, SamplingParams
from krait.layers import mamba2 as mamba2_layer
from krait.models import granitemoehybrid as granite_model
from krait.models import llama as llama_model
from krait.models import mamba2 as mamba2_model
from tests.utils import make_tiny_hybrid, make_tiny_llama

PROMPTS = [[5, 6, 7, 8], list(range(3, 20))]


def _batch1(model_dir: str) -> list[tuple[list[int], list[float]]]:
    """PROMPTS' greedy tokens and logprobs, every decode step one row."""
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=1)
    # the checkpoints' norm weights are all ones: make each its own, so that a norm applied
    # with another's weight would show (the same values in every engine of a test)
    g = torch.Generator().manual_seed(0)
    for name, p in sorted(llm.llm_engine.runner.model.named_parameters()):
        if "norm" in name:
            p.data = 1 + 0.5 * torch.randn(p.shape, generator=g)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0), use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _plain(model_dir: str, monkeypatch) -> list[tuple[list[int], list[float]]]:
    """`_batch1` through the torch references (no Triton kernel, so no fusion): what every fused
    path must equal, at a fraction of the interpreter's time."""
    with monkeypatch.context() as m:
        m.delenv("KRAIT_TRITON_CPU", raising=False)
        return _batch1(model_dir)


def _close(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def _count(monkeypatch, module, name: str, taken=lambda result: True) -> list:
    """Wraps module.name, recording each call whose result `taken` accepts."""
    calls = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        if taken(result):
            calls.append(1)
        return result

    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("arch", ["mamba2", "granitemoehybrid"])
def test_gated_norm_in_out_proj_prologue(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    d = make_tiny_hybrid(tmp_path / arch, arch)
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "0")
    want = _plain(d, monkeypatch)
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "1")
    calls = _count(monkeypatch, mamba2_layer, "gated_norm_linear")
    _close(_batch1(d), want)
    assert calls  # the decode steps of every Mamba layer took it


@pytest.mark.parametrize("gated", [False, True])
def test_folded_residual_and_rms_norm_in_in_proj_prologue(gated, tmp_path, monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    d = make_tiny_hybrid(tmp_path / "m", "mamba2")
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "0")
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "0")
    want = _plain(d, monkeypatch)
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "1")
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "1" if gated else "0")
    folds = _count(monkeypatch, mamba2_model, "block_fold_ok", taken=bool)
    _close(_batch1(d), want)
    assert folds  # every block of the decode steps folded


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_folded_residual_through_llama_layers(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    d = make_tiny_llama(tmp_path / arch, arch=arch)
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "0")
    want = _plain(d, monkeypatch)
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "1")
    folds = _count(monkeypatch, llama_model, "block_fold_ok", taken=bool)
    _close(_batch1(d), want)
    assert folds  # every layer of the decode steps folded


def test_gated_norm_prologue_default_takes_only_the_one_group_form(monkeypatch):
    """On by default where every out_proj GEMV program streams one norm group (the form measured
    faster on the H200); 4 groups of 1024 under programs of 2048 columns each (out_proj
    [2048, 4096] splits K in two) take it only when asked (KRAIT_MAMBA_NORM_PROLOGUE=1); =0
    turns it off."""
    from krait.ops.linear import gated_norm_in_gemv

    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.delenv("KRAIT_MAMBA_NORM_PROLOGUE", raising=False)
    row = torch.empty(1, 8, dtype=torch.bfloat16)
    mamba2_out = torch.empty(2048, 4096, dtype=torch.bfloat16)  # mamba2-1.3b, one group
    assert gated_norm_in_gemv(row, mamba2_out, 4096, 16)
    assert not gated_norm_in_gemv(row, mamba2_out, 1024, 16)
    assert not gated_norm_in_gemv(row, mamba2_out, 4096, 24)  # partials must tile the group
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "1")
    assert gated_norm_in_gemv(row, mamba2_out, 1024, 16)
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "0")
    assert not gated_norm_in_gemv(row, mamba2_out, 4096, 16)


@pytest.mark.parametrize("arch,fold,gated", [("mamba2", False, "0"),
                                             ("granitemoehybrid", False, "1"),
                                             ("mamba2", True, "1")])
def test_conv_update_in_in_proj_epilogue(arch, fold, gated, tmp_path, monkeypatch):
    """KRAIT_CONV_EPILOGUE=1: at batch 1 the in_proj GEMV convolves its xBC columns with the
    slot's conv state (and shifts it): no conv update launch, the same tokens and logprobs as
    the conv kernel, step after step (each step reads the state the one before wrote). Through
    the plain decode path and the gated one (the norm in out_proj's prologue); with the fold,
    in_proj also normalizes its input in its prologue."""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "1" if fold else "0")
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", gated)
    d = make_tiny_hybrid(tmp_path / arch, arch)
    monkeypatch.setenv("KRAIT_CONV_EPILOGUE", "0")
    want = _plain(d, monkeypatch)
    monkeypatch.setenv("KRAIT_CONV_EPILOGUE", "1")
    fused = _count(monkeypatch, mamba2_layer, "conv_in_gemv", taken=bool)
    separate = _count(monkeypatch, mamba2_layer, "causal_conv1d_update")
    _close(_batch1(d), want)
    assert fused and not separate  # every decode step of every Mamba layer took the epilogue


@pytest.mark.parametrize("gated", ["0", "1"])
def test_folded_residual_through_dense_granite_layers(gated, tmp_path, monkeypatch):
    """KRAIT_NORM_PROLOGUE=1 on GraniteMoeHybrid without routed experts (granite-4.0-h-micro's
    shape): Mamba and attention layers fold their residual adds, scaled by the residual
    multiplier (0.5 here), and RMSNorms into their GEMVs; equal to the unfused path."""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", gated)
    d = make_tiny_hybrid(tmp_path / "g", "granitemoehybrid", num_local_experts=0)
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "0")
    want = _plain(d, monkeypatch)
    monkeypatch.setenv("KRAIT_NORM_PROLOGUE", "1")
    folds = _count(monkeypatch, granite_model, "block_fold_ok", taken=bool)
    _close(_batch1(d), want)
    assert folds  # the decode steps' layers folded

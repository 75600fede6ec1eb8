"""The Mamba mixer's gated RMSNorm in its out_proj GEMV's prologue (KRAIT_MAMBA_NORM_PROLOGUE=1):
a batch-1 decode row's state update hands over y * silu(z) and partial sums of its squares, and
the GEMV normalizes from them (one launch fewer a layer). Through the Triton kernels on CPU
(interpreted), greedy tokens and logprobs equal the unfused path's."""

from __future__ import annotations

import pytest

from krait import LLM, SamplingParams
from krait.layers import mamba2 as mamba2_layer
from tests.utils import make_tiny_hybrid

PROMPTS = [[5, 6, 7, 8], list(range(3, 20))]


def _run(model_dir: str, monkeypatch, fused: bool) -> tuple[list, int]:
    monkeypatch.setenv("KRAIT_MAMBA_NORM_PROLOGUE", "1" if fused else "0")
    calls = []
    real = mamba2_layer.gated_norm_linear
    monkeypatch.setattr(mamba2_layer, "gated_norm_linear",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=1)  # batch-1 decodes
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0), use_tqdm=False)
    got = [(o.outputs[0].token_ids,
            [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    return got, len(calls)


@pytest.mark.parametrize("arch", ["mamba2", "granitemoehybrid"])
def test_norm_in_out_proj_prologue_matches_the_unfused_decode(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    d = make_tiny_hybrid(tmp_path / arch, arch)
    want, none = _run(d, monkeypatch, False)
    got, calls = _run(d, monkeypatch, True)
    assert none == 0 and calls > 0  # the decode steps of every Mamba layer took it
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4

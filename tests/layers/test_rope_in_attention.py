"""KRAIT_ROPE_IN_ATTENTION=1: decode batches whose keys split run the q/k norms, the rotary and
the K/V write inside the split attention kernel (no `rope_kv_write` launch). Through the Triton
kernels on CPU (interpreted): greedy tokens and logprobs equal the separate kernels', with
CUDA-graph-style padding rows and a sliding window."""

from __future__ import annotations

import pytest

from krait import LLM, SamplingParams
from krait.layers import attention as attention_layer
from tests.utils import make_tiny_llama

PROMPTS = [[5, 6, 7, 8], list(range(3, 40)), [9] * 21]


def _run(model_dir: str, max_num_seqs: int) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=max_num_seqs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0), use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("arch,overrides,max_num_seqs", [
    ("qwen3", {}, 1), ("qwen3", {}, 3), ("llama", {}, 3),
    ("mistral", {"sliding_window": 7}, 3),  # every layer windowed
])
def test_rope_in_attention_equals_separate_kernels(arch, overrides, max_num_seqs, tmp_path,
                                                   monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setenv("KRAIT_DECODE_SPLIT_KEYS", "16")  # short rows split on CPU too
    d = make_tiny_llama(tmp_path / arch, arch, **overrides)
    monkeypatch.setenv("KRAIT_ROPE_IN_ATTENTION", "0")
    want = _run(d, max_num_seqs)
    monkeypatch.setenv("KRAIT_ROPE_IN_ATTENTION", "1")
    fused, separate = [], []
    real_fused, real_sep = attention_layer.decode_rope_attention, attention_layer.rope_kv_write
    monkeypatch.setattr(attention_layer, "decode_rope_attention",
                        lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    monkeypatch.setattr(attention_layer, "rope_kv_write",
                        lambda *a, **k: separate.append(1) or real_sep(*a, **k))
    got = _run(d, max_num_seqs)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert fused and separate  # decode steps took the fused kernel, prefills the separate one

"""kv_cache_dtype="fp8" end to end (CPU, the torch paths): the cache is allocated in float8
e4m3, a block counts a quarter of a float32 block's bytes, and generation reads it back
(outputs close to, but not bit-equal with, the model-dtype cache); bad values are refused."""

from __future__ import annotations

import pytest
import torch

from krait import LLM, SamplingParams
from krait.layers.attention import Attention
from tests.utils import make_tiny_hybrid, make_tiny_llama

PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 100, 7, 7, 31, 60, 2, 9], [11, 12, 13, 14, 15]]


def _model(arch: str, path) -> str:
    return make_tiny_llama(path) if arch == "llama" else make_tiny_hybrid(path, arch)


def _attention_layers(llm: LLM) -> list[Attention]:
    model = llm.llm_engine.runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("arch", ["llama", "granitemoehybrid"])
def test_fp8_cache_generates_close_to_the_model_dtype_cache(arch, tmp_path):
    d = _model(arch, tmp_path / arch)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    kw = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(d, kv_cache_dtype=kv, **kw)
        caches = [a.kv_cache for a in _attention_layers(llm)]
        assert caches and all(
            c.dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float32) for c in caches)
        outs[kv] = (llm.llm_engine.runner.model_state.kv_bytes_per_block(),
                    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                 use_tqdm=False))
    (bytes32, ref), (bytes8, got) = outs["auto"], outs["fp8"]
    assert bytes8 * 4 == bytes32  # the cache sizing counts a quarter of the bytes a block
    diffs = []
    for p, a, b in zip(PROMPTS, ref, got):
        for q in range(1, len(p)):  # teacher-forced: the same tokens, so comparable
            diffs.append(abs(a.prompt_logprobs[q][p[q]].logprob
                             - b.prompt_logprobs[q][p[q]].logprob))
    assert 0 < max(diffs) < 0.1, max(diffs)  # read back from fp8: close, not identical


def test_bad_kv_cache_dtype_is_refused(tmp_path):
    d = make_tiny_llama(tmp_path / "m")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(d, device="cpu", dtype="float32", kv_cache_dtype="int8")

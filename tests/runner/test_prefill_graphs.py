"""Whole-forward graphs for steps of one prefill row (krait/runner/prefill_graphs.py). On the
CPU with record=False: each lone prefill (and each chunk of one) runs the padded forward over the
captured tensors, the step's inputs and metadata copied in, and gives the same tokens and
logprobs as the plain forward, dense and hybrid, through the torch references and through the
Triton kernels (interpreted). Steps with more rows, or with a decode row, never take them. The
capture and replay themselves need a GPU (the `gpu` tests, `gpu_check.sh kernels`)."""

from __future__ import annotations

import gc

import pytest
import torch

from krait import LLM, SamplingParams
from krait.runner.prefill_graphs import (
    PrefillGraphs,
    prefill_graph_rows_knob,
    prefill_graphs_enabled,
)
from tests.utils import make_tiny_model

PROMPTS = [[5, 6, 7], [9] * 20, list(range(3, 50))]


def _model(tmp_path, arch: str) -> str:
    return make_tiny_model(tmp_path / arch, arch)


def _one_by_one(llm: LLM, prompts=PROMPTS, max_tokens: int = 5
                ) -> list[tuple[list[int], list[float]]]:
    """Each prompt alone (every prefill step has one row): greedy tokens and their logprobs."""
    got = []
    for p in prompts:
        (o,) = llm.generate([{"prompt_token_ids": p}], SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
            use_tqdm=False)
        c = o.outputs[0]
        got.append((c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)]))
    return got


def _close(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@pytest.mark.parametrize("arch,chunk", [
    (arch, chunk) for arch in ("qwen3", "granitemoehybrid", "mamba2", "nemotronh", "qwen3next")
    for chunk in (None, 7)] + [("granitemoehybrid+triton", 7), ("qwen3next+triton", 7)])
def test_padded_prefill_graph_forward_matches_the_plain_one(arch, chunk, tmp_path, monkeypatch):
    prompts, new, triton = PROMPTS, 5, arch.endswith("+triton")
    if triton:  # the GPU's kernels (interpreted) over the padded tokens
        arch = arch.removesuffix("+triton")
        prompts, new = PROMPTS[1:2], 2  # interpreted kernels are slow: one prompt, 3 chunks
    d = _model(tmp_path, arch)
    args = {"max_num_batched_tokens": chunk} if chunk else {}
    # the plain forward through the torch references (greedy: the same tokens, logprobs
    # within float32 rounding), then the graphs' forward through the kernels
    want = _one_by_one(LLM(d, device="cpu", dtype="float32", **args), prompts, new)
    if triton:
        monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    llm = LLM(d, device="cpu", dtype="float32", **args)
    runner = llm.llm_engine.runner
    runner.prefill_graphs = graphs = PrefillGraphs(runner, [16, 32, 64], record=False)
    graphs.capture_all()
    assert sorted(graphs.graphs) == [16, 32, 64]
    served = []
    real_run = graphs.run
    graphs.run = lambda batch, meta: served.append(
        (batch.num_tokens, batch.num_tokens_padded)) or real_run(batch, meta)
    got = _one_by_one(llm, prompts, new)
    _close(got, want)
    # every prefill step (each chunk with max_num_batched_tokens=7) was served, padded to the
    # smallest bucket that holds it; decode steps were not
    lens = [len(p) for p in prompts]
    steps = ([min(7, n - i) for n in lens for i in range(0, n, 7)] if chunk else lens)
    assert [n for n, _ in served] == steps
    assert all(b == next(x for x in (16, 32, 64) if x >= n) for n, b in served)


def test_only_lone_prefill_rows_take_them(tmp_path):
    d = _model(tmp_path, "granitemoehybrid")
    llm = LLM(d, device="cpu", dtype="float32")
    runner = llm.llm_engine.runner
    runner.prefill_graphs = graphs = PrefillGraphs(runner, [16, 32, 64], record=False)
    graphs.capture_all()
    assert graphs.bucket_for([20], 1) == (32, 1)
    assert graphs.bucket_for([65], 1) is None  # past the largest bucket
    assert graphs.bucket_for([1], 0) is None  # a decode row
    assert graphs.bucket_for([3, 20], 2) is None  # two prefill rows
    assert graphs.bucket_for([1, 20], 1) is None  # a decode row beside the prefill
    served = []
    real_run = graphs.run
    graphs.run = lambda batch, meta: served.append(batch.num_reqs) or real_run(batch, meta)
    # three prompts at once: their first step holds three rows
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs) == 3 and served == []


def test_buckets_stop_below_max_model_len(tmp_path):
    d = _model(tmp_path, "qwen3")
    llm = LLM(d, device="cpu", dtype="float32", max_model_len=40)
    runner = llm.llm_engine.runner
    assert PrefillGraphs(runner, [16, 32, 64], record=False).buckets == [16, 32]


def test_with_the_piecewise_graphs_and_one_row(tmp_path):
    """The runner's calls: prefill graphs come with the piecewise graphs, one row each."""
    assert prefill_graphs_enabled() and prefill_graph_rows_knob() == 1
    llm = LLM(_model(tmp_path, "qwen3"), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="one row"):
        PrefillGraphs(llm.llm_engine.runner, [16], record=False, max_rows=4)


def _gpu_llm(model_dir: str, on: bool, **engine_args):
    """A float32 GPU engine with the prefill graphs (off: enforce_eager, no graphs at all), and
    the list its prefill graph replays append (real tokens, (real rows, graph rows)) to."""
    gc.collect()  # the previous engine's cache
    torch.cuda.empty_cache()
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=4,
              gpu_memory_utilization=0.3, enforce_eager=not on, **engine_args)
    graphs = llm.llm_engine.runner.prefill_graphs
    served = []
    if graphs is not None:
        real_run = graphs.run
        graphs.run = lambda batch, meta: served.append(
            (batch.num_tokens, (batch.num_reqs, batch.num_reqs_padded))) or real_run(batch, meta)
    return llm, served


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "granitemoehybrid", "mamba2", "qwen3next"])
def test_gpu_capture_and_replay_match_the_plain_forward(arch, tmp_path):
    """On the GPU, float32: buckets 16-128 captured at start-up; every lone prefill (and each
    chunk of 24 tokens at most) replays one, with the state slots and KV written as eagerly."""
    d = _model(tmp_path, arch)

    def generate(on: bool):
        llm, served = _gpu_llm(d, on, max_num_batched_tokens=24, max_model_len=128)
        graphs = llm.llm_engine.runner.prefill_graphs
        assert (sorted(graphs.graphs) == [16, 32]) if on else graphs is None
        return _one_by_one(llm), [n for n, _ in served]

    want, _ = generate(False)
    got, served = generate(True)
    assert served == [3, 20, 24, 23]  # the 47-token prompt in two chunks
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3


def test_a_prefix_cache_hit_replays_over_its_cached_context(tmp_path):
    """The second request shares 32 tokens (two blocks) with the first: its lone prefill starts
    past them (context > 0), through the same captured metadata."""
    d = _model(tmp_path, "qwen3")
    prompts = [list(range(3, 43)), list(range(3, 35)) + [7, 8, 9, 10, 11]]
    opts = dict(device="cpu", dtype="float32", enable_prefix_caching=True, block_size=16)

    def run(llm: LLM):
        return [o.outputs[0].token_ids for p in prompts for o in llm.generate(
            [{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=4,
                                                      ignore_eos=True), use_tqdm=False)]

    want = run(LLM(d, **opts))
    llm = LLM(d, **opts)
    runner = llm.llm_engine.runner
    runner.prefill_graphs = graphs = PrefillGraphs(runner, [16, 32, 64], record=False)
    graphs.capture_all()
    computed = []
    real_run = graphs.run
    graphs.run = lambda batch, meta: computed.append(
        int(batch.num_computed_tokens_np[0])) or real_run(batch, meta)
    assert run(llm) == want
    assert computed == [0, 32]  # the second prompt's first 32 tokens came from the cache

"""Piecewise graphs for eager steps (krait/runner/piecewise_graphs.py) on CPU: the padded forward
with the mixers fed their real rows (record=False keeps the pieces eager; a bucket's later steps
run their mixers through the recorded `_Mixer`s, as a replay does; poison=True makes every
padded row of a mixer's output NaN) gives the same tokens and logprobs as the plain forward, for
prefills, chunked prefills, mixed batches and decodes, dense and hybrid; the graph capture and
replay themselves need a GPU (the `gpu` test here, `gpu_check.sh piecewise`)."""

from __future__ import annotations

import gc

import pytest
import torch

from krait import LLM, SamplingParams
from krait.runner import piecewise_graphs as pw
from tests.utils import make_tiny_llama, make_tiny_model

PROMPTS = [[5, 6, 7], [9] * 20, list(range(3, 50))]


def test_token_buckets():
    assert pw.token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert pw.token_buckets(100) == [16, 32, 64, 128]
    assert pw.token_buckets(5) == [16]


def test_mixer_call_is_a_plain_call_without_a_recorder():
    calls = []
    out = pw.mixer_call(lambda a, meta, extra: calls.append((a, meta, extra)) or a + 1,
                        (torch.zeros(3),), "meta", "attn", "extra")
    assert torch.equal(out, torch.ones(3)) and calls[0][1:] == ("meta", "extra")


def _greedy(llm: LLM, prompts=PROMPTS, max_tokens: int = 6) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens with their logprobs."""
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    return [(o.outputs[0].token_ids,
             [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _generate(model_dir: str, piecewise: bool, prompts=PROMPTS, max_tokens: int = 6,
              **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", **engine_args)
    runner = llm.llm_engine.runner
    served = []
    if piecewise:
        runner.piecewise = pw.PiecewiseGraphs(runner.model, 128, runner.device, record=False,
                                              poison=True)
        real_run = runner.piecewise.run
        runner.piecewise.run = lambda *a: served.append(a[2]) or real_run(*a)
    got = _greedy(llm, prompts, max_tokens)
    return got, served


@pytest.mark.parametrize("arch,chunk", [
    (arch, chunk) for arch in ("qwen3", "granitemoehybrid", "mamba2", "nemotronh", "qwen3next")
    for chunk in (None, 7)] + [("granitemoehybrid+triton", 7)])
def test_padded_piecewise_forward_matches_the_plain_one(arch, chunk, tmp_path, monkeypatch):
    d = make_tiny_model(tmp_path / arch, arch.removesuffix("+triton"))
    args = {"max_num_batched_tokens": chunk} if chunk else {}
    if arch.endswith("+triton"):  # interpreted kernels are slow: two prompts (the 20 tokens in
        # chunks of 7, 7 and 6 beside the 3-token one's decodes), 4 tokens each
        args.update(prompts=PROMPTS[:2], max_tokens=4)
    want, _ = _generate(d, False, **args)  # the plain forward through the torch references
    if arch.endswith("+triton"):  # the GPU's kernels, interpreted: NaN rows through them too
        monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    replayed = []
    real_run = pw._Mixer.run
    monkeypatch.setattr(pw._Mixer, "run", lambda self, n, m: replayed.append(self.kind)
                        or real_run(self, n, m))
    got, served = _generate(d, True, **args)
    # a bucket's later steps served their mixers as a replay does (recorded _Mixer objects)
    assert replayed and set(replayed) <= {"attn", "mamba"}
    # padded rows change the GEMM shapes, hence float32 rounding, never a token
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        assert max(abs(a - b) for a, b in zip(lp_got, lp_want)) < 1e-4
    # every step went through it: prefills (padded to 16-128 rows), mixed steps, decodes
    assert served and max(served) <= 128 and min(served) < 16


@pytest.mark.parametrize("arch", ["qwen3", "granitemoehybrid"])
def test_start_up_capture_through_dummy_prefills(arch, tmp_path, monkeypatch):
    """What the engine does at start-up on the GPU (ModelRunner._capture_piecewise: two dummy
    prefills a bucket, largest first), with the pieces eager: every bucket's mixers are
    recorded from the dummy requests' steps, and the real requests after them (their state
    slots and KV blocks written by the dummies before) get the plain forward's tokens through
    those recorded mixers."""
    d = make_tiny_model(tmp_path / arch, arch)
    want, _ = _generate(d, False)
    llm = LLM(d, device="cpu", dtype="float32", max_num_batched_tokens=64)
    runner = llm.llm_engine.runner
    runner.piecewise = pw.PiecewiseGraphs(runner.model, 64, runner.device, record=False,
                                          poison=True)
    runner._capture_piecewise()
    recorded = {b: s.mixers for b, s in runner.piecewise.state.items()}
    assert all(recorded.values()) and [s.steps for s in runner.piecewise.state.values()] == [2] * 3
    replayed = []
    real_run = pw._Mixer.run
    monkeypatch.setattr(pw._Mixer, "run",
                        lambda self, n, m: replayed.append(self) or real_run(self, n, m))
    got = _greedy(llm)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        assert max(abs(a - b) for a, b in zip(lp_got, lp_want)) < 1e-4
    # every mixer of the real steps was one recorded at start-up
    starts = {id(m) for ms in recorded.values() for m in ms}
    assert replayed and all(id(m) in starts for m in replayed)


def test_steps_past_the_largest_bucket_run_the_plain_forward(tmp_path):
    d = make_tiny_llama(tmp_path / "q", arch="qwen3")
    llm = LLM(d, device="cpu", dtype="float32")
    runner = llm.llm_engine.runner
    runner.piecewise = pw.PiecewiseGraphs(runner.model, 16, runner.device, record=False)
    assert runner.piecewise.run(torch.zeros(17, dtype=torch.int64),
                                torch.zeros(17, dtype=torch.int64), 17, None) is None
    outs = llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3


def test_mixer_activations_must_be_padded_rows():
    owner = pw.PiecewiseGraphs(torch.nn.Identity(), 16, torch.device("cpu"), record=False)
    rec = pw._Recorder(owner, num_real=3, num_padded=16, capture=False)
    with pytest.raises(ValueError, match="16 rows"):
        rec.mixer(lambda a, meta: a, (torch.zeros(3, 2),), None, "attn", ())
    out = rec.mixer(lambda a, meta: a * 2, (torch.ones(16, 2),), None, "attn", ())
    assert out.shape == (16, 2) and torch.equal(out[:3], torch.full((3, 2), 2.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "granitemoehybrid", "qwen3next"])
def test_gpu_capture_and_replay_match_the_plain_forward(arch, tmp_path, monkeypatch):
    """On the GPU, float32: bucket 16 (steps of at most 7 tokens) is captured at start-up
    through two dummy prefills; every chunk of the prompts then replays it."""
    d = make_tiny_model(tmp_path / arch, arch)

    def generate(piecewise: bool):
        monkeypatch.setenv("KRAIT_PIECEWISE_GRAPHS", "1" if piecewise else "0")
        gc.collect()  # the previous engine's cache
        torch.cuda.empty_cache()
        llm = LLM(d, device="cuda", dtype="float32", max_num_batched_tokens=7, max_num_seqs=4,
                  max_model_len=128, gpu_memory_utilization=0.3)
        pw = llm.llm_engine.runner.piecewise
        if piecewise:  # captured at start-up, before any request
            assert pw.buckets == [16] and pw.state[16].steps == 2 and pw.state[16].graphs
            assert pw.pool_bytes > 0
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
        return llm.llm_engine.runner.piecewise, [
            (o.outputs[0].token_ids,
             [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]

    none, want = generate(False)
    pieces, got = generate(True)
    assert none is None and pieces is not None
    assert pieces.state[16].graphs and pieces.state[16].mixers  # captured, then replayed
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3


def test_piecewise_default_and_largest_bucket(monkeypatch):
    """On by default (the diagnostic KRAIT_PIECEWISE_GRAPHS=0 turns it off); the largest step it
    serves is bounded by the step budget, PIECEWISE_MAX_TOKENS and what max_num_seqs rows can
    hold; off without CUDA or with enforce_eager."""
    from types import SimpleNamespace

    from krait.runner.model_runner import ModelRunner
    from krait.runner.piecewise_graphs import PIECEWISE_MAX_TOKENS, piecewise_enabled

    monkeypatch.delenv("KRAIT_PIECEWISE_GRAPHS", raising=False)
    assert piecewise_enabled()

    def largest(device="cuda", eager=False, batched=8192, seqs=256, max_len=4096):
        sched = SimpleNamespace(max_num_batched_tokens=batched, max_num_seqs=seqs)
        config = SimpleNamespace(enforce_eager=eager, scheduler=sched)
        runner = SimpleNamespace(device=torch.device(device), max_model_len=max_len, config=config)
        return ModelRunner.piecewise_max_tokens(runner)

    assert largest() == PIECEWISE_MAX_TOKENS
    assert largest(batched=512) == 512
    assert largest(seqs=4, max_len=128) == 4 * 127
    assert largest(device="cpu") == 0 and largest(eager=True) == 0
    monkeypatch.setenv("KRAIT_PIECEWISE_GRAPHS", "0")
    assert not piecewise_enabled() and largest() == 0

"""Asynchronous speculative steps (DESIGN.md runner invariant 7): with device-side input
preparation (the GPU's path, here through the Triton interpreter on CPU) an ngram-speculative
engine keeps async scheduling — step N+1 is planned and launched before step N's accepted counts
are read back — and stays lossless: greedy tokens equal HF transformers' token for token.

The drafter is the device one (krait/ops/ngram_propose.py) or, to force both accepted and
rejected drafts on tiny random models, a scripted stand-in with its interface that writes HF's
continuation into the device token table with its first j drafts right, j cycling 0..k."""

from __future__ import annotations

import pytest
import torch

import krait.runner.model_runner as model_runner_mod
from krait import LLM, SamplingParams
from tests.utils import hf_greedy, make_tiny_hybrid, make_tiny_llama, structured_reference

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 4, 11, 30, 3], [12, 13] * 4 + [40]]
MAX_NEW = 9


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            if arch == "llama":
                d = make_tiny_llama(path, arch="llama")
            elif arch == "llama_repeating":  # (as mamba2_repeating: drafts often accepted)
                d = make_tiny_llama(path, arch="llama", tie_word_embeddings=True,
                                    initializer_range=0.01)
            elif arch == "mamba2_repeating":
                # tied embeddings and tiny weights: the residual stream stays near the input
                # embedding, so greedy repeats the last token and ngram drafts get accepted
                d = make_tiny_hybrid(path, "mamba2", tie_word_embeddings=True,
                                     initializer_range=0.002)
            else:
                d = make_tiny_hybrid(path, arch)
            cache[arch] = (d, hf_greedy(d, PROMPTS, MAX_NEW)[0])
        return cache[arch]

    return get


def _scripted_drafter(want: list[list[int]], log: list, prompts: list[list[int]] = PROMPTS):
    """ngram_propose's interface: drafts the known continuation (`want` of `prompts`), the
    first j of them right."""
    calls = {}

    def propose(table, rows, num_tokens, counts, k, min_n, max_n):
        counts.fill_(k)
        for i, n in zip(rows.tolist(), num_tokens.tolist()):
            p = next(p for p, prompt in enumerate(prompts)
                     if table[i, : len(prompt)].tolist() == prompt)
            out = n - len(prompts[p])
            cont = (want[p] + [0] * (k + 1))[out : out + k]
            right = calls.get(p, 0) % (k + 1)
            calls[p] = calls.get(p, 0) + 1
            drafts = cont[:right] + [(t + 1) % 500 for t in cont[right:]]
            for q, d in enumerate(drafts):
                if n + q < table.shape[1]:
                    table[i, n + q] = d
            log.append(right)

    return propose


def test_async_structured_rows_verify_device_drafts(tmp_path, monkeypatch):
    """Asynchronous steps with structured rows: the device's drafts for them are read back
    with the step (which a structured row reads back anyway) and each verified position is
    masked by the grammar after the drafts before it (past a forbidden draft every token is
    allowed: it is rejected there). Greedy output equals the output without speculation;
    drafts accepted and rejected."""
    pytest.importorskip("xgrammar")
    import json

    model_dir, so, texts, ref = structured_reference(tmp_path / "m")
    want = [o.outputs[0].token_ids for o in ref]
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    log: list[int] = []
    monkeypatch.setattr(model_runner_mod, "ngram_propose",
                        _scripted_drafter(want, log, [o.prompt_token_ids for o in ref]))
    # two rows at a time: the third request starts (a row new to the runner, sampling at its
    # prompt's end) while a structured row verifies device drafts
    llm = _llm(model_dir, max_model_len=256, max_num_seqs=2)
    outs = llm.generate(texts, so, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics["spec_num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["spec_num_accepted_tokens"] for o in outs)
    assert 0 < accepted < drafted, (accepted, drafted)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert set(json.loads(o.outputs[0].text)) == {"k", "n"}


def _llm(model_dir: str, **kw) -> LLM:
    llm = LLM(model_dir, device="cpu", dtype="float32", speculative_config=SPEC, **kw)
    engine = llm.llm_engine
    assert engine.runner.async_spec and engine.async_scheduling
    return llm


def _generate(llm: LLM, params: SamplingParams | None = None,
              prompts: list[list[int]] = PROMPTS):
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _count_overlapped_steps(llm: LLM) -> list[int]:
    """Counts the verify steps launched while another step was still unread (the engine's
    in-flight step), i.e. planned without that step's accepted counts."""
    engine, seen = llm.llm_engine, [0]
    run = engine.executor.execute_model

    def execute(sched):
        if sched.scheduled_spec_decode_tokens and engine._inflight is not None:
            seen[0] += 1
        return run(sched)

    engine.executor.execute_model = execute
    return seen


@pytest.mark.parametrize("arch", ["llama", "mamba2", "mamba2_loops"])
def test_async_verify_steps_are_lossless_and_overlapped(arch, models, monkeypatch):
    """mamba2 runs the verify SSM kernel unrolled (UNROLL: few (row, head) pairs);
    mamba2_loops its other form, the token loops as loops (UNROLL_MAX_PAIRS 0)."""
    kernel_calls, forms = [], arch == "mamba2_loops"
    if forms:
        from krait.ops import selective_state_verify as ssv

        monkeypatch.setattr(ssv, "UNROLL_MAX_PAIRS", 0)
        real = ssv.selective_state_verify_triton
        monkeypatch.setattr(ssv, "selective_state_verify_triton",
                            lambda *a, **kw: (kernel_calls.append(1), real(*a, **kw))[1])
        arch = "mamba2"
    model_dir, want = models(arch)
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    log: list[int] = []
    monkeypatch.setattr(model_runner_mod, "ngram_propose", _scripted_drafter(want, log))
    monkeypatch.setattr(model_runner_mod, "FUSED_GREEDY_COMMIT", False)  # (drafts its own)
    llm = _llm(model_dir, max_num_seqs=2, max_num_batched_tokens=9)  # chunked, staggered
    overlapped = _count_overlapped_steps(llm)
    assert _generate(llm) == want
    stats = llm.llm_engine.get_stats()
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)
    assert overlapped[0] > 0  # the host planned verify steps without the counts (invariant 7)
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    # nothing left unread: the host knows every rejection the device counted, so a row's next
    # request starts from true counters
    runner = llm.llm_engine.runner
    assert runner.spec_rejected.sum() > 0
    assert torch.equal(torch.from_numpy(runner.spec_known), runner.spec_rejected.cpu())
    assert kernel_calls or not forms  # (the Triton kernel, interpreted, in that form)


def test_async_device_ngram_with_preemption_and_stops(models, monkeypatch):
    """The device ngram drafter end to end, with preemption (the resumed requests recompute
    from host tokens that arrived one step late) and max_tokens cutting inside accepted runs."""
    model_dir, want = models("llama")
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    llm = _llm(model_dir, block_size=4, num_kv_blocks=9, max_model_len=32)
    seen = []
    add = llm.llm_engine.scheduler.add_request
    llm.llm_engine.scheduler.add_request = lambda req: (seen.append(req), add(req))[1]
    lens = [MAX_NEW, 7, 4]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                         for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w[:n] for w, n in zip(want, lens)]
    assert sum(r.num_preemptions for r in seen) > 0
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0


def test_async_seeded_rows_sample_what_they_would_without_speculation(models, monkeypatch):
    """Seeded sampled rows in asynchronous verify steps: the host's output counts run ahead by
    the rejections it has not read back, so each row's seed offset is corrected on the device
    (`batch.spec_delta`, mixed there: sampler.mix_seeds). With the rejection sampler's coupled
    test for point-mass drafts the rows then emit exactly what they emit without speculation.
    (Before, their offsets skipped ahead after a rejection: found in session 36.)"""
    model_dir, _ = models("llama_repeating")
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")  # both runs: the same noise kernel
    params = [SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
              for t, s in ((0.08, 1234), (0.12, 7), (0.2, 3))]
    plain = LLM(model_dir, device="cpu", dtype="float32")
    want = _generate(plain, params)
    llm = _llm(model_dir)
    assert _generate(llm, params) == want
    stats = llm.llm_engine.get_stats()
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize("arch", ["llama", "mamba2_repeating"])
def test_fused_greedy_commit_equals_the_separate_ops(arch, models, monkeypatch):
    """Greedy verify steps through ops/spec_commit.commit_greedy (acceptance, commit and the
    next drafts in one launch) and through the rejection sampler, commit_sampled and
    ngram_propose in turn: HF's tokens, and the same drafts and acceptances (long enough for
    the tiny model to repeat itself, so some drafts are accepted). mamba2: the accepted
    counts the fused launch returns also pick each row's recurrent state slot (a model that
    repeats its last token, so that some drafts are accepted)."""
    import krait.ops.spec_commit as spec_commit_mod

    model_dir, _ = models(arch)
    # (the last prompt: a repeating model's ngram drafts for it may start with a wrong 9)
    prompts = PROMPTS + [[8, 9, 10, 8]]
    want = hf_greedy(model_dir, prompts, 24)[0]
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    fused_calls = [0]
    commit_greedy = spec_commit_mod.commit_greedy

    def counted(*args):
        fused_calls[0] += 1
        return commit_greedy(*args)

    monkeypatch.setattr(model_runner_mod, "commit_greedy", counted)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    stats = []
    for fused in (True, False):
        monkeypatch.setattr(model_runner_mod, "FUSED_GREEDY_COMMIT", fused)
        llm = _llm(model_dir)
        assert _generate(llm, params, prompts) == want
        s = llm.llm_engine.get_stats()
        stats.append({k: v for k, v in s.items() if k.startswith("spec_decode")})
        if fused:
            assert fused_calls[0] > 0
            calls = fused_calls[0]
    assert fused_calls[0] == calls  # the second run took the separate ops
    assert stats[0] == stats[1]
    accepted, drafted = (stats[0]["spec_decode_num_accepted_tokens"],
                         stats[0]["spec_decode_num_draft_tokens"])
    assert 0 < accepted < drafted

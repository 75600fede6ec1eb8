"""Speculative decoding is lossless: krait's greedy tokens with drafts equal HF transformers'
`generate` token for token (logprobs within 1e-3: they are the target model's) for every
supported architecture, under chunked prefill, few sequences, preemption, requests arriving
while others verify drafts, n > 1, and max_tokens / stop tokens cutting inside an accepted run.

Tiny random models rarely repeat themselves, so an ngram drafter's drafts are mostly rejected
there. Most cases therefore use a scripted drafter that knows HF's continuation and proposes a
correct prefix of it followed by a wrong token, the correct part's length cycling through 0..k:
every case checks that drafts were both accepted and rejected, so the state rollback of the
recurrent layers ran. The ngram drafter itself runs end to end once per architecture."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from krait import LLM, SamplingParams
from krait.outputs import CompletionOutput
from tests.utils import ARCHS, device_options, hf_greedy, make_tiny_llama

MAX_NEW = 24
NUM_LOGPROBS = 2
TOL = 1e-3
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
ALL_ARCHS = [*ARCHS, "llama"]


def _prompts() -> list[list[int]]:
    # repeated phrases (the drafter finds them) and plain varied ones
    rep = [[5 + (11 * i + 3 * j) % 400 for j in range(n)] * r
           for i, (n, r) in enumerate([(3, 4), (5, 3), (2, 6)])]
    plain = [[3 + (7 * i + 13 * j * j) % 500 for j in range(n)] for i, n in enumerate([1, 9, 17])]
    return rep + plain


PROMPTS = _prompts()


@dataclass
class Reference:
    model_dir: str
    tokens: list[list[int]]
    logprobs: list[torch.Tensor]  # per prompt: [MAX_NEW, vocab]


@pytest.fixture(scope="module")
def references(checkpoints, tmp_path_factory) -> Callable[[str], Reference]:
    cache: dict[str, Reference] = {}

    def get(arch: str) -> Reference:
        if arch not in cache:
            if arch == "llama":
                model_dir = make_tiny_llama(tmp_path_factory.mktemp("llama"), arch="llama")
            else:
                model_dir = checkpoints(arch)
            tokens, _, rows = hf_greedy(model_dir, PROMPTS, MAX_NEW)
            cache[arch] = Reference(model_dir, tokens, rows)
        return cache[arch]

    return get


def _params(**kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS)
    return SamplingParams(**{**base, **kw})


def assert_matches(ref: Reference, i: int, out: CompletionOutput, n: int = MAX_NEW) -> None:
    assert out.token_ids == ref.tokens[i][:n], f"prompt {i}"
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref.logprobs[i][step]
        assert entry[tok].rank == 1
        assert set(entry) == set(row.topk(NUM_LOGPROBS).indices.tolist()), f"prompt {i} {step}"
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < TOL, f"prompt {i} step {step} id {tid}"


class ScriptedDrafter:
    """Proposes HF's continuation with its first `j` drafts right and the next one wrong,
    j = 0, 1, ..., k, 0, ... per request (identified by its prompt)."""

    def __init__(self, ref: Reference, k: int) -> None:
        self.ref, self.k = ref, k
        self.calls: dict[int, int] = {}

    def propose(self, token_table, rows, num_tokens, max_drafts):
        drafts = np.full((len(rows), self.k), -1, dtype=np.int32)
        counts = np.zeros(len(rows), dtype=np.int32)
        for j, (row, n, cap) in enumerate(zip(rows, num_tokens, max_drafts)):
            i = next(i for i, p in enumerate(PROMPTS)
                     if n >= len(p) and token_table[row, : len(p)].tolist() == p)
            out = int(n) - len(PROMPTS[i])
            want = (self.ref.tokens[i] + [0] * (self.k + 1))[out : out + self.k]
            step = self.calls.get(i, 0)
            self.calls[i] = step + 1
            right = step % (self.k + 1)
            got = want[:right] + [(t + 1) % 500 for t in want[right:]]
            counts[j] = min(int(cap), self.k)
            drafts[j, : counts[j]] = got[: counts[j]]
        return drafts, counts


def make_llm(ref: Reference, spec: dict | None = None, scripted: bool = True, **options) -> LLM:
    spec = spec or SPEC
    llm = LLM(ref.model_dir, **device_options(), speculative_config=spec, **options)
    if scripted:
        llm.llm_engine.runner.drafter = ScriptedDrafter(ref, spec["num_speculative_tokens"])
    return llm


def assert_spec_ran(llm: LLM) -> None:
    """Drafts were verified, some accepted and some rejected; every block and slot came back."""
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.num_free_slots == kv.num_state_slots


def generate(llm: LLM, params: SamplingParams | list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return outs


CONFIGS = {
    "defaults": {},
    "chunked_7_seqs_3": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "block_size_1_seqs_2": dict(block_size=1, max_num_seqs=2),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_spec_parity(references, arch: str, config: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, **CONFIGS[config])
    for i, out in enumerate(generate(llm, _params())):
        assert_matches(ref, i, out.outputs[0])
    assert_spec_ran(llm)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_spec_parity_ngram_drafter(references, arch: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, scripted=False)
    for i, out in enumerate(generate(llm, _params())):
        assert_matches(ref, i, out.outputs[0])
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("arch", ["mamba2", "granitemoehybrid", "nemotronh", "llama"])
def test_spec_parity_k1_and_k5(references, arch: str) -> None:
    ref = references(arch)
    for k in (1, 5):
        llm = make_llm(ref, {**SPEC, "num_speculative_tokens": k})
        for i, out in enumerate(generate(llm, _params())):
            assert_matches(ref, i, out.outputs[0])
        assert_spec_ran(llm)


@pytest.mark.parametrize("arch", ["mamba2", "bamba", "falconh1", "llama"])
def test_spec_parity_with_preemption(references, arch: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, block_size=4, num_kv_blocks=14, max_model_len=56)
    engine = llm.llm_engine
    if not engine.kv.uses_blocks:
        pytest.skip("a pure state-space model is never preempted")
    seen = []
    add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda r: (seen.append(r), add(r))
    for i, out in enumerate(generate(llm, _params())):
        assert_matches(ref, i, out.outputs[0])
    assert sum(r.num_preemptions for r in seen) > 0, "the pool was meant to force preemption"
    assert_spec_ran(llm)


@pytest.mark.parametrize("arch", ["mamba2", "nemotronh", "llama"])
def test_spec_parity_requests_added_while_verifying(references, arch: str) -> None:
    ref = references(arch)
    engine = make_llm(ref, max_num_batched_tokens=9).llm_engine
    done: dict[str, CompletionOutput] = {}
    for i in range(len(PROMPTS)):
        engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, _params())
        for _ in range(3):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    for i in range(len(PROMPTS)):
        assert_matches(ref, i, done[str(i)])


@pytest.mark.parametrize("arch", ["granitemoehybrid", "llama"])
def test_spec_max_tokens_and_stop_tokens_inside_an_accepted_run(references, arch: str) -> None:
    ref = references(arch)
    llm = make_llm(ref)
    # max_tokens: every length from 1 up, so that some end inside an accepted run
    lens = [1 + (3 * i) % MAX_NEW for i in range(len(PROMPTS))]
    outs = generate(llm, [_params(max_tokens=n) for n in lens])
    for i, (out, n) in enumerate(zip(outs, lens)):
        assert_matches(ref, i, out.outputs[0], n)
        assert out.outputs[0].finish_reason == "length"
    # a stop token: the output ends at its first occurrence in the reference
    params = []
    for i in range(len(PROMPTS)):
        stop = ref.tokens[i][MAX_NEW // 2]
        params.append(_params(stop_token_ids=[stop], ignore_eos=True))
    outs = generate(llm, params)
    for i, out in enumerate(outs):
        first = ref.tokens[i].index(ref.tokens[i][MAX_NEW // 2])
        assert_matches(ref, i, out.outputs[0], first + 1)
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("arch", ["bamba", "llama"])
def test_spec_n_greater_than_one(references, arch: str) -> None:
    ref = references(arch)
    llm = make_llm(ref)
    outs = generate(llm, _params(n=2))
    for i, out in enumerate(outs):
        assert len(out.outputs) == 2
        for o in out.outputs:
            assert_matches(ref, i, o)
    m = outs[0].metrics
    assert m["spec_num_draft_tokens"] >= m["spec_num_accepted_tokens"] >= 0
    assert 1.0 <= m["spec_mean_accepted_length"] <= 1 + SPEC["num_speculative_tokens"]


@pytest.mark.parametrize("arch", ["granitemoehybrid", "llama"])
def test_spec_seeded_sampling_is_reproducible(references, arch: str) -> None:
    # sampled rows verify drafts too; a per-request seed gives the same text run after run,
    # whatever else shares the batch
    ref = references(arch)
    params = [_params(temperature=0.9, seed=11 + i, logprobs=None) for i in range(len(PROMPTS))]
    first = [o.outputs[0].token_ids for o in generate(make_llm(ref), params)]
    llm = make_llm(ref, max_num_seqs=2)
    again = [o.outputs[0].token_ids for o in generate(llm, params)]
    assert first == again
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_spec_stop_strings_inside_an_accepted_run(references, arch: str) -> None:
    # the same tokens and text as one token a step: tokens after the stop string's end go
    ref = references(arch)
    plain = LLM(ref.model_dir, **device_options())
    full = generate(plain, _params(logprobs=None))
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in full]
    params = [_params(stop=[s] if s else None, logprobs=1) for s in stops]
    want = generate(plain, params)
    got = generate(make_llm(ref), params)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert len(g.logprobs) == len(g.token_ids)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert sum(o.outputs[0].finish_reason == "stop" for o in got) >= len(PROMPTS) // 2


def test_spec_parity_through_the_split_attention_kernel(references, monkeypatch) -> None:
    """The Triton kernels on CPU (KRAIT_TRITON_CPU=1) with every decode and verify batch's
    attention split 2 ways: verify steps take the split-KV kernel's multi-token form (a row's
    1 + k tokens in one program a split) and decode steps its one-token form; the greedy
    tokens and logprobs still equal HF's."""
    import krait.ops.paged_attention as pa

    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setattr(pa, "decode_num_splits", lambda *args: 2)
    q_maxes: list[int] = []
    split = pa._decode_split
    monkeypatch.setattr(pa, "_decode_split", lambda *a, **k: (
        q_maxes.append(k.get("q_max", 1)), split(*a, **k))[1])
    ref = references("llama")
    n = 8  # the interpreter is slow
    llm = make_llm(ref)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], _params(max_tokens=n),
                        use_tqdm=False)
    for i, out in enumerate(outs):
        assert_matches(ref, i, out.outputs[0], n)
    assert_spec_ran(llm)
    assert 4 in q_maxes, q_maxes  # verify rows of 1 + 3 tokens

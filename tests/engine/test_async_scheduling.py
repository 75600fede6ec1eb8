"""Async scheduling: step N+1 is scheduled before step N's tokens are known.

Scheduler level with a fake runner that answers one step late, and end to end: the same
requests give the same outputs with async scheduling on and off (stops, seeds, logprobs,
preemption, n > 1, the Triton path with device-side input preparation)."""

from __future__ import annotations

import pytest

from krait import LLM, SamplingParams
from krait.engine.request import RequestStatus
from tests.engine.test_scheduler import (
    EOS,
    TOKEN,
    check_block_accounting,
    make_req,
    make_sched,
    sample_for,
)
from tests.utils import make_tiny_hybrid, make_tiny_llama


def run_async(sched, tokens=None, max_steps: int = 500):
    """Schedules step N+1, then applies step N's result: the order of an async engine.
    `tokens(req_id, step)` picks what the fake runner samples (default TOKEN)."""
    inflight = None
    steps = 0
    outs = []
    while sched.has_unfinished_requests() or inflight is not None:
        assert steps < max_steps, "no progress"
        out = sched.schedule()
        sampled = {}
        for rid, got in sample_for(sched, out).items():
            if got.token_ids and tokens is not None:
                got.token_ids = [tokens(rid, steps)]
            sampled[rid] = got
        if inflight is not None:
            sched.update_from_output(*inflight)
        check_block_accounting(sched)
        inflight = (out, sampled) if out.total_num_scheduled_tokens else None
        outs.append(out)
        steps += 1
    return outs


def test_async_decode_reads_in_flight_tokens_and_matches_counts() -> None:
    sched = make_sched(budget=64)
    reqs = [make_req(f"r{i}", n, max_tokens=6) for i, n in enumerate([3, 9, 17])]
    for r in reqs:
        sched.add_request(r)
    outs = run_async(sched)
    for r in reqs:
        assert r.finish_reason == "length" and r.output_token_ids == [TOKEN] * 6
        assert r.num_inflight == 0
    # max_tokens is known ahead: no request is scheduled past its last token
    total = sum(o.total_num_scheduled_tokens for o in outs)
    assert total == sum(len(r.prompt_token_ids) + 6 - 1 for r in reqs)


def test_async_eos_drops_the_extra_step() -> None:
    sched = make_sched()
    a, b = make_req("a", 4, max_tokens=20), make_req("b", 4, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    # "a" samples EOS on its third token; "b" runs on
    run_async(sched, tokens=lambda rid, step: EOS if rid == "a" and step == 2 else TOKEN)
    assert a.finish_reason == "stop" and a.output_token_ids == [TOKEN, TOKEN, EOS]
    assert b.finish_reason == "length" and len(b.output_token_ids) == 20
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_async_preempted_request_keeps_its_in_flight_token() -> None:
    # 6 usable blocks of 4 tokens: two growing requests cannot both fit
    sched = make_sched(num_blocks=6, block_size=4, budget=64)
    a, b = make_req("a", 7, max_tokens=12), make_req("b", 7, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    seen_preempted_inflight = []
    orig = sched._preempt

    def recording(req):
        seen_preempted_inflight.append(req.num_inflight)
        orig(req)

    sched._preempt = recording
    run_async(sched, tokens=lambda rid, step: 100 + step)
    assert seen_preempted_inflight and max(seen_preempted_inflight) == 1
    for r in (a, b):
        assert r.finish_reason == "length" and len(r.output_token_ids) == 12
        assert r.num_preemptions >= 0 and r.status == RequestStatus.FINISHED_LENGTH
    assert b.num_preemptions >= 1


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("async_llama"), arch="llama")


def _generate(model_dir: str, async_scheduling: bool, prompts, params, **kw):
    llm = LLM(model_dir, async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[_Completion(c.token_ids, c.text, c.finish_reason, _logprobs(c.logprobs))
             for c in o.outputs] for o in outs]


class _Completion(tuple):
    """(token ids, text, finish reason, logprobs) compared exactly but for the logprob values:
    batch neighbours differ between the two modes, which moves float32 results by rounding
    only (rounding them to 4 decimals still split a value lying on a boundary)."""

    def __new__(cls, *fields):
        return super().__new__(cls, fields)

    def __eq__(self, other) -> bool:
        if tuple(self[:3]) != tuple(other[:3]) or (self[3] is None) != (other[3] is None):
            return False
        for mine, theirs in zip(self[3] or [], other[3] or []):
            if mine.keys() != theirs.keys():
                return False
            for t, (lp, rank) in mine.items():
                if rank != theirs[t][1] or abs(lp - theirs[t][0]) > 1e-3:
                    return False
        return len(self[3] or []) == len(other[3] or [])

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


def _logprobs(logprobs):
    """Each step's {token: (logprob, rank)}."""
    if logprobs is None:
        return None
    return [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in logprobs]


def _mixed_params(tok_a: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=17),
        SamplingParams(temperature=0.9, seed=3, max_tokens=11, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[tok_a]),
        SamplingParams(temperature=0.0, max_tokens=25, stop=["e"]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, n=3),
        SamplingParams(temperature=0.0, max_tokens=13, presence_penalty=0.5,
                       frequency_penalty=0.3, min_tokens=4),
    ]


def test_async_engine_matches_sync_engine(llama_dir: str) -> None:
    prompts = ["Hello, my name is", "The capital of France", "a", "Once upon a time",
               {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}, "xyz"]
    base = _generate(llama_dir, False, prompts, [SamplingParams(temperature=0.0, max_tokens=30)] * 6)
    stop_tok = base[2][0][0][5]  # a token prompt 2 emits in the middle of its output
    params = _mixed_params(stop_tok)
    sync = _generate(llama_dir, False, prompts, params)
    assert len(sync[2][0][0]) == 6  # the stop token id ended it
    assert _generate(llama_dir, True, prompts, params) == sync
    # under preemption (a KV pool too small for all six) and tiny chunks
    small = dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=5, max_model_len=64)
    assert _generate(llama_dir, True, prompts, params, **small) == sync


def test_async_engine_matches_sync_on_the_triton_path(tmp_path, monkeypatch) -> None:
    """KRAIT_TRITON_CPU runs the device-side input preparation: the decode rows of step N+1
    read step N's tokens from the device token table before the host has seen them."""
    import krait.ops.seeded_noise as seeded_noise

    model = make_tiny_hybrid(tmp_path / "h", "granitemoehybrid")
    prompts = [{"prompt_token_ids": [3, 4, 5, 6, 7]}, {"prompt_token_ids": [9, 8, 7]}]
    # interpreted steps are slow: 3 and 2 decode steps after the prefill, each reading the
    # previous step's in-flight token
    params = [SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.7, seed=1, max_tokens=3)]
    # the sync reference through the torch ops (the interpreter is slow), with the Triton
    # kernel's seeded noise stream so that the seeded row draws alike; then async on the
    # Triton path
    real_use_triton = seeded_noise.use_triton
    monkeypatch.setattr(seeded_noise, "use_triton", lambda t: True)
    sync = _generate(model, False, prompts, params)
    monkeypatch.setattr(seeded_noise, "use_triton", real_use_triton)
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    assert _generate(model, True, prompts, params) == sync


def test_async_engine_stops_at_max_model_len_like_sync(llama_dir: str) -> None:
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 10, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    sync = _generate(llama_dir, False, prompts, params, max_model_len=24)
    assert [len(o[0][0]) for o in sync] == [21, 14, 5]  # each fills max_model_len exactly
    assert all(o[0][2] == "length" for o in sync)
    assert _generate(llama_dir, True, prompts, params, max_model_len=24) == sync

"""Scheduler with fake requests and a fake runner: budget, order, chunks, preemption, stops."""

from __future__ import annotations

from krait.engine.kv_cache_manager import KVCacheManager
from krait.engine.request import Request, RequestStatus
from krait.engine.scheduler import SampledTokens, Scheduler, SchedulerOutput
from krait.sampling_params import SamplingParams

EOS = 1
TOKEN = 7  # what the fake runner samples unless told otherwise


def make_req(rid: str, n_prompt: int, max_tokens: int = 8, **params) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(rid, [3 + (i % 50) for i in range(n_prompt)], sp, eos_token_ids=[EOS])


def make_sched(
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 16,
    budget: int = 64,
    max_model_len: int = 512,
) -> Scheduler:
    kv = KVCacheManager(num_blocks + 1, block_size)  # + the null block
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def sample_for(sched: Scheduler, out: SchedulerOutput, token: int = TOKEN) -> dict:
    """What a runner returns: a token for each row whose chunk reaches its last known token
    (the scheduler counted it in flight when it scheduled the chunk)."""
    sampled = {}
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_inflight:
            sampled[rid] = SampledTokens([token])
        else:
            sampled[rid] = SampledTokens([])
    return sampled


def step(sched: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, sample_for(sched, out, token))
    return out


def check_block_accounting(sched: Scheduler) -> None:
    """Every usable block is either free or held by exactly one live request."""
    held = [b for r in sched.requests.values() for b in r.block_ids]
    assert len(held) == len(set(held))
    assert len(held) + sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    for r in sched.waiting:
        assert r.block_ids == []


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched))
        check_block_accounting(sched)
    return outs


def test_token_budget_respected() -> None:
    sched = make_sched(budget=10, max_num_seqs=4)
    reqs = [make_req(f"r{i}", n, max_tokens=5) for i, n in enumerate([1, 9, 10, 11, 23, 4, 37])]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched)
    for out in outs:
        assert 0 < out.total_num_scheduled_tokens <= 10
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert len(out.num_scheduled_tokens) <= 4
    for r in reqs:
        assert r.num_output_tokens == 5 and r.finish_reason == "length"
    # every prompt token and every output token but the last is computed exactly once
    total = sum(o.total_num_scheduled_tokens for o in outs)
    assert total == sum(len(r.prompt_token_ids) + 4 for r in reqs)


def test_decode_before_prefill() -> None:
    sched = make_sched(budget=8)
    a, b = make_req("a", 3), make_req("b", 2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefilled, one token each
    assert a.num_output_tokens == b.num_output_tokens == 1
    sched.add_request(make_req("c", 20))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    assert list(out.num_scheduled_tokens)[:2] == ["a", "b"]
    assert [c.req_id for c in out.cached_reqs] == ["a", "b"]
    assert [n.req_id for n in out.new_reqs] == ["c"]


def test_long_prompt_chunked_and_mixed_with_decodes() -> None:
    sched = make_sched(budget=8, block_size=4)
    a, b = make_req("a", 2, max_tokens=30), make_req("b", 3, max_tokens=30)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    long = make_req("long", 50, max_tokens=3)
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(sched)
        assert out.num_scheduled_tokens["a"] == 1 and out.num_scheduled_tokens["b"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        assert long.num_computed_tokens == sum(chunks)
        assert len(long.block_ids) == -(-long.num_computed_tokens // 4)
    assert chunks == [6] * 8 + [2]  # 50 tokens in chunks of budget - 2 decodes
    assert long.num_output_tokens == 1  # sampled only when the last chunk ran
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "long": 1}


def test_new_request_data_describes_the_request() -> None:
    sched = make_sched(budget=5, block_size=2)
    req = make_req("a", 7)
    sched.add_request(req)
    out = sched.schedule()
    (new,) = out.new_reqs
    assert new.req_id == "a" and new.token_ids == req.prompt_token_ids
    assert new.num_prompt_tokens == 7 and new.num_computed_tokens == 0
    assert new.block_ids == req.block_ids and len(new.block_ids) == 3  # 5 tokens, 2 per block
    sched.update_from_output(out, sample_for(sched, out))
    out = sched.schedule()
    (cached,) = out.cached_reqs
    assert cached.num_computed_tokens == 5
    assert len(cached.new_block_ids) == 1  # tokens 5, 6 go in block 3
    assert req.block_ids[-1] == cached.new_block_ids[0]


def test_max_num_seqs() -> None:
    sched = make_sched(max_num_seqs=2)
    reqs = [make_req(f"r{i}", 4, max_tokens=3 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched)
    for out in outs:
        assert len(out.num_scheduled_tokens) <= 2
    admitted = [n.req_id for o in outs for n in o.new_reqs]
    assert admitted == [r.request_id for r in reqs]
    # the third request starts only once the first finished
    first_finish = next(i for i, o in enumerate(outs) if "r0" in o.finished_req_ids)
    r2_start = next(i for i, o in enumerate(outs) if "r2" in o.num_scheduled_tokens)
    assert r2_start == first_finish  # the runner learns of r0's end in the step r2 starts


def test_fcfs_admission_and_no_skipping() -> None:
    # 6 usable blocks of 4 tokens; "big" needs 5 blocks, so "small" (behind it) must wait
    sched = make_sched(num_blocks=6, block_size=4, budget=64)
    first = make_req("first", 8, max_tokens=4)  # 2 blocks, 3 with its outputs
    big = make_req("big", 20, max_tokens=2)
    small = make_req("small", 1, max_tokens=2)
    for r in (first, big, small):
        sched.add_request(r)
    out = step(sched)
    assert [n.req_id for n in out.new_reqs] == ["first"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    outs = [out, *run_to_completion(sched)]
    first_admissions = list(dict.fromkeys(n.req_id for o in outs for n in o.new_reqs))
    assert first_admissions == ["first", "big", "small"]


def test_preemption_picks_newest_frees_blocks_and_resumes() -> None:
    # 8 usable blocks of 2 tokens = 16 tokens; three requests outgrow it
    sched = make_sched(num_blocks=8, block_size=2, budget=64)
    reqs = [make_req(f"r{i}", 4, max_tokens=6) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # 3 x 4 prompt tokens: 6 blocks
    newest = reqs[2]
    seen_preemption = False
    outs = []
    while not seen_preemption:
        free_before = sched.kv.num_free_blocks
        held_by_newest = len(newest.block_ids)
        out = sched.schedule()
        outs.append(out)
        if out.preempted_req_ids:
            seen_preemption = True
            assert out.preempted_req_ids == {"r2"}
            assert newest.status == RequestStatus.WAITING
            assert newest.block_ids == [] and newest.num_computed_tokens == 0
            assert newest.num_preemptions == 1
            assert sched.waiting[0] is newest
            assert "r2" not in out.num_scheduled_tokens
            grown = sum(len(c.new_block_ids) for c in out.cached_reqs)
            assert sched.kv.num_free_blocks == free_before + held_by_newest - grown
            assert reqs[0].num_preemptions == reqs[1].num_preemptions == 0
        sched.update_from_output(out, sample_for(sched, out))
        check_block_accounting(sched)
    outputs_before = list(newest.output_token_ids)
    assert outputs_before  # it had generated before it was preempted
    resumed = None
    while sched.has_unfinished_requests():
        out = step(sched)
        check_block_accounting(sched)
        for new in out.new_reqs:
            if new.req_id == "r2":
                resumed = new
    assert resumed is not None
    # it resumes by recomputing its prompt and the outputs it already had
    assert resumed.token_ids == newest.prompt_token_ids + outputs_before
    assert resumed.num_prompt_tokens == 4 + len(outputs_before)
    assert resumed.num_computed_tokens == 0
    assert resumed.num_output_tokens == len(outputs_before)
    for r in reqs:
        assert r.num_output_tokens == 6 and r.finish_reason == "length"


def test_preempted_request_is_not_rescheduled_in_the_same_step() -> None:
    sched = make_sched(num_blocks=4, block_size=2, budget=64)
    a, b = make_req("a", 4, max_tokens=4), make_req("b", 4, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out = sched.schedule()  # a needs a third block: b goes
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.new_reqs == []


def test_no_starvation_under_steady_stream() -> None:
    """A request arrives every 4 steps into a pool so tight that preemption is routine; every
    request finishes within a bounded number of steps of its arrival, early and late alike."""
    sched = make_sched(num_blocks=10, block_size=4, budget=16, max_num_seqs=8)
    arrival: dict[str, int] = {}
    finish: dict[str, int] = {}
    reqs: list[Request] = []
    num_preemptions = 0
    for t in range(2000):
        if t < 320 and t % 4 == 0:
            r = make_req(f"r{t}", 5 + (t * 7) % 13, max_tokens=4 + (t * 5) % 9)
            reqs.append(r)
            arrival[r.request_id] = t
            sched.add_request(r)
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        num_preemptions += len(out.preempted_req_ids)
        check_block_accounting(sched)
        for r in sched.running:
            assert r.num_tokens <= len(r.prompt_token_ids) + r.params.max_tokens
        for r in reqs:
            if r.is_finished and r.request_id not in finish:
                finish[r.request_id] = t
    assert len(finish) == len(reqs) == 80
    assert num_preemptions > 20  # the pool really was tight
    waits = [finish[r.request_id] - arrival[r.request_id] for r in reqs]
    assert max(waits) < 40, waits  # about 20 measured; the wait does not grow over time
    for r in reqs:
        assert r.num_output_tokens == r.params.max_tokens


def test_abort_frees_blocks_and_tells_the_runner() -> None:
    sched = make_sched(budget=4, block_size=2)
    a, b = make_req("a", 10), make_req("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a is mid-prefill; b waits and was never seen by the runner
    assert a.block_ids and b.status == RequestStatus.WAITING
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("nope", RequestStatus.FINISHED_ABORTED)  # unknown ids are ignored
    assert a.finish_reason == "abort" and b.finish_reason == "abort"
    assert a.block_ids == [] and sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}  # b never reached the runner
    assert out.total_num_scheduled_tokens == 0


def test_mid_prefill_chunk_appends_nothing() -> None:
    sched = make_sched(budget=4)
    req = make_req("a", 10)
    sched.add_request(req)
    out = sched.schedule()
    progressed = sched.update_from_output(out, {"a": SampledTokens([])})
    assert progressed == [] and req.output_token_ids == []
    assert req.num_computed_tokens == 4


def _finish_one(token: int, **params) -> Request:
    sched = make_sched()
    req = make_req("a", 3, **params)
    sched.add_request(req)
    while not req.is_finished:
        step(sched, token)
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    return req


def test_eos_stops_unless_ignored() -> None:
    req = _finish_one(EOS)
    assert req.output_token_ids == [EOS] and req.finish_reason == "stop"
    req = _finish_one(EOS, ignore_eos=True, max_tokens=3)
    assert req.output_token_ids == [EOS] * 3 and req.finish_reason == "length"


def test_stop_token_ids_and_min_tokens() -> None:
    req = _finish_one(9, stop_token_ids=[9])
    assert req.output_token_ids == [9] and req.finish_reason == "stop" and req.stop_reason == 9
    req = _finish_one(9, stop_token_ids=[9], min_tokens=3)
    assert req.output_token_ids == [9] * 3 and req.finish_reason == "stop"
    req = _finish_one(EOS, min_tokens=2)
    assert req.output_token_ids == [EOS] * 2 and req.finish_reason == "stop"


def test_max_model_len_ends_a_request() -> None:
    sched = make_sched(max_model_len=12)
    req = make_req("a", 9, max_tokens=None)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.num_tokens == 12 and req.finish_reason == "length"


def _logprobs_of(entry: dict[int, float], token: int, rank: int, k: int):
    sched = make_sched()
    req = make_req("a", 3, max_tokens=1, logprobs=k)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {"a": SampledTokens([token], [entry], ranks=[rank])})
    (lp,) = req.logprobs
    assert req.cumulative_logprob == entry[token]
    return {tid: (x.logprob, x.rank) for tid, x in lp.items()}


def test_logprobs_sampled_token_outside_top_k() -> None:
    # the runner's entry: sampled token first, then the top-K by value
    entry = {9: -3.0, 4: -0.5, 5: -1.0, 6: -2.0}
    assert _logprobs_of(entry, 9, rank=4, k=3) == {
        9: (-3.0, 4), 4: (-0.5, 1), 5: (-1.0, 2), 6: (-2.0, 3)
    }
    assert _logprobs_of(entry, 9, rank=4, k=1) == {9: (-3.0, 4), 4: (-0.5, 1)}
    assert _logprobs_of(entry, 9, rank=4, k=0) == {9: (-3.0, 4)}


def test_logprobs_sampled_token_inside_top_k() -> None:
    # greedy: the sampled token is also the best one, so the entry holds it once
    entry = {4: -0.5, 5: -1.0, 6: -2.0}
    assert _logprobs_of(entry, 4, rank=1, k=3) == {4: (-0.5, 1), 5: (-1.0, 2), 6: (-2.0, 3)}
    assert _logprobs_of(entry, 4, rank=1, k=2) == {4: (-0.5, 1), 5: (-1.0, 2)}
    # sampled token second best
    entry = {5: -1.0, 4: -0.5, 6: -2.0}
    assert _logprobs_of(entry, 5, rank=2, k=3) == {5: (-1.0, 2), 4: (-0.5, 1), 6: (-2.0, 3)}
    assert _logprobs_of(entry, 5, rank=2, k=1) == {5: (-1.0, 2), 4: (-0.5, 1)}

"""The scheduler of pipeline micro-batches (num_microbatches = P): a request is in at most one
batch in flight, a batch takes a 1/P share of the requests, every request still finishes with
the tokens of one batch at a time, and cached rows carry the output tokens at their scheduled
positions for the stages that did not sample them."""

from __future__ import annotations

from collections import deque

from krait.engine.kv_cache_manager import KVCacheManager
from krait.engine.scheduler import Scheduler
from tests.engine.test_scheduler import check_block_accounting, make_req, sample_for


def _sched(num_blocks: int = 256, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks + 1, 4)
    return Scheduler(kv, 8, budget, 512, num_microbatches=2, send_token_ids=True)


def _run(sched: Scheduler, reqs) -> list:
    """The engine's batch queue over a fake runner that samples 7, 8, 9, ... per request."""
    for r in reqs:
        sched.add_request(r)
    queue: deque = deque()
    launched, nxt = [], {r.request_id: 7 for r in reqs}
    while sched.has_unfinished_requests() or queue:
        assert len(launched) < 500
        if len(queue) < 2:
            out = sched.schedule()
            if out.total_num_scheduled_tokens:
                others = {rid for o, _ in queue for rid in o.num_scheduled_tokens}
                assert not others & set(out.num_scheduled_tokens)
                # a fake sample, fixed at launch (what the device computes)
                sampled = sample_for(sched, out)
                for rid, got in sampled.items():
                    if got.token_ids:
                        got.token_ids = [nxt[rid]]
                        nxt[rid] += 1
                queue.append((out, sampled))
                launched.append(out)
                if len(queue) < 2:
                    continue
        if queue:
            out, sampled = queue.popleft()
            sched.update_from_output(out, sampled)
            check_block_accounting(sched)
    return launched


def test_microbatches_are_disjoint_and_balanced() -> None:
    sched = _sched()
    reqs = [make_req(f"r{i}", n, max_tokens=5) for i, n in enumerate([3, 9, 5, 12])]
    launched = _run(sched, reqs)
    assert all(r.output_token_ids == [7, 8, 9, 10, 11] for r in reqs)
    assert max(len(o.num_scheduled_tokens) for o in launched) == 2  # a half of 4
    # a decode row carries the token its step reads (the last one sampled); a prefill chunk none
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in reqs}
    for o in launched:
        for c in o.cached_reqs:
            out_pos = c.num_computed_tokens - prompt_len[c.req_id]
            if out_pos >= 0:
                assert c.new_token_ids == [7 + out_pos]
            else:
                assert c.new_token_ids is None


def test_microbatches_with_preemption() -> None:
    """Few blocks: requests are preempted, some while in flight in the other batch; each still
    gets the tokens it would have."""
    sched = _sched(num_blocks=10, budget=8)
    reqs = [make_req(f"r{i}", n, max_tokens=6) for i, n in enumerate([5, 13, 9, 7])]
    _run(sched, reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(r.output_token_ids == [7, 8, 9, 10, 11, 12] for r in reqs)

"""The scheduler under speculative decoding, with fake requests: drafts become 1 + k token
decode steps with KV blocks reserved for every lookahead token, capped by the token budget,
max_model_len and max_tokens; rejected positions roll num_computed_tokens back; the tallies
count drafts, accepted tokens and accepted tokens per position."""

from __future__ import annotations

from krait.engine.scheduler import SampledTokens, Scheduler
from tests.engine.test_scheduler import make_req, make_sched


def _decoding(sched: Scheduler, rid: str, n_prompt: int, **kw):
    """A request past its prefill (one token sampled), its next step a decode."""
    req = make_req(rid, n_prompt, **kw)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {rid: SampledTokens([9])})
    assert req.num_computed_tokens == n_prompt and req.num_tokens == n_prompt + 1
    return req


def test_drafts_are_scheduled_with_their_blocks() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    req = _decoding(sched, "a", 7, max_tokens=20)
    req.spec_token_ids = [4, 5, 6]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [4, 5, 6]}
    # positions 7..10 computed: 11 tokens need 3 blocks of 4
    assert len(req.block_ids) == 3
    assert req.spec_token_ids == []  # drafts are used once


def test_rejected_drafts_roll_back_computed_tokens() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    req = _decoding(sched, "a", 7, max_tokens=20)
    req.spec_token_ids = [4, 5, 6]
    out = sched.schedule()
    assert req.num_computed_tokens == 11
    # one draft accepted (4), then 8 sampled in place of 5
    sched.update_from_output(out, {"a": SampledTokens([4, 8])})
    assert req.output_token_ids == [9, 4, 8]
    assert req.num_computed_tokens == 9 and req.num_tokens == 10 and req.num_inflight == 0
    assert (req.num_draft_tokens, req.num_accepted_tokens, req.num_spec_steps) == (3, 1, 1)
    # the next step is a plain decode from the last sampled token
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_decode_tokens == {}


def test_drafts_capped_by_budget_max_model_len_and_max_tokens() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    req = _decoding(sched, "a", 7, max_tokens=20)
    sched.max_num_batched_tokens = 3
    req.spec_token_ids = [4, 5, 6, 7]
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [4, 5]}  # budget 3

    sched = make_sched(block_size=4, max_model_len=10)
    req = _decoding(sched, "b", 7, max_tokens=20)  # 8 tokens; the last one fits at 9
    req.spec_token_ids = [4, 5, 6]
    assert sched.schedule().scheduled_spec_decode_tokens == {"b": [4]}

    sched = make_sched(block_size=4, max_model_len=64)
    req = _decoding(sched, "c", 7, max_tokens=3)  # 1 output; 2 to go: one draft at most
    req.spec_token_ids = [4, 5, 6]
    assert sched.schedule().scheduled_spec_decode_tokens == {"c": [4]}


def test_stop_inside_an_accepted_run_keeps_only_tokens_up_to_it() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    req = _decoding(sched, "a", 7, max_tokens=20, stop_token_ids=[5])
    req.spec_token_ids = [4, 5, 6]
    out = sched.schedule()
    got = SampledTokens([4, 5, 6, 2])
    sched.update_from_output(out, {"a": got})
    assert req.output_token_ids == [9, 4, 5] and req.is_finished
    assert got.token_ids == [4, 5]  # what the engine detokenizes and counts
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_spec_stats_count_per_position() -> None:
    sched = make_sched(block_size=4, max_model_len=64)
    sched.spec_stats.accepted_per_pos = [0, 0, 0]
    a, b = make_req("a", 5, max_tokens=30), make_req("b", 6, max_tokens=30)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), {"a": SampledTokens([9]), "b": SampledTokens([9])})
    a.spec_token_ids, b.spec_token_ids = [4, 5, 6], [7, 8]
    out = sched.schedule()
    sched.update_from_output(out, {"a": SampledTokens([4, 5, 6, 1]),
                                   "b": SampledTokens([3])})
    s = sched.spec_stats.as_dict()
    assert s["spec_decode_num_drafts"] == 2
    assert s["spec_decode_num_draft_tokens"] == 5
    assert s["spec_decode_num_accepted_tokens"] == 3
    assert s["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 1]
    assert b.num_computed_tokens == 7  # both drafts rejected: only its last token computed


def _device_sched(**kw) -> Scheduler:
    sched = make_sched(**kw)
    sched.num_spec_tokens, sched.device_drafts = 3, True
    return sched


def test_async_verify_steps_plan_ahead_with_optimistic_counts() -> None:
    """Device drafts (asynchronous speculation): step N+1 is scheduled before step N's tokens
    are known; its counters assume every draft of N accepted, and N's rejections roll them back
    when N is read back (the runner's device counters agree: krait/ops/spec_commit.py)."""
    sched = _device_sched(block_size=4, max_model_len=64)
    req = make_req("a", 7, max_tokens=20)
    sched.add_request(req)
    prefill = sched.schedule()
    assert req.num_inflight == 1
    n1 = sched.schedule()  # the prefill's token still in flight: a verify step of 1 + 3
    assert n1.num_scheduled_tokens == {"a": 4} and n1.scheduled_spec_decode_tokens == {"a": [-1] * 3}
    assert req.num_computed_tokens == 11 and req.num_inflight == 1 + 4
    sched.update_from_output(prefill, {"a": SampledTokens([9], num_drafts=3)})
    n2 = sched.schedule()  # n1 in flight: planned as if its 3 drafts were accepted
    assert n2.cached_reqs.num_computed_tokens == [11] and n2.num_scheduled_tokens == {"a": 4}
    # n1: one draft accepted, then 8; its 2 rejected positions come off the counters
    sched.update_from_output(n1, {"a": SampledTokens([4, 8], num_drafts=0)})
    assert req.output_token_ids == [9, 4, 8]
    assert req.num_computed_tokens == 15 - 2 and req.num_inflight == 4
    sched.update_from_output(n2, {"a": SampledTokens([5], num_drafts=0)})
    assert req.num_computed_tokens == 10 and req.num_inflight == 0 and req.num_tokens == 11
    # the drafter found nothing the last time: a plain decode step, no filler drafts verified
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_decode_tokens == {}


def test_async_drafts_capped_by_the_tokens_in_flight() -> None:
    """max_tokens counts the in-flight verify's tokens at their most: no draft past it, and a
    request that the in-flight tokens may end is not scheduled again until they are known."""
    sched = _device_sched(block_size=4, max_model_len=64)
    req = make_req("a", 7, max_tokens=6)
    sched.add_request(req)
    prefill = sched.schedule()
    n1 = sched.schedule()
    assert n1.scheduled_spec_decode_tokens == {"a": [-1] * 3}  # 1 + 1..4 <= 6 outputs
    sched.update_from_output(prefill, {"a": SampledTokens([9], num_drafts=3)})
    n2 = sched.schedule()  # 5 outputs at most so far: one more, no drafts
    assert n2.num_scheduled_tokens == {"a": 1} and n2.scheduled_spec_decode_tokens == {}
    assert sched.schedule().num_scheduled_tokens == {}  # n1 and n2 may already end it

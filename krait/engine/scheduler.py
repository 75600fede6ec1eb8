"""Token-budget scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step, running requests go first (decodes and unfinished prefill chunks, oldest first), then
waiting requests in arrival order while budget, `max_num_seqs`, blocks and state slots allow. A
request's step is `num_scheduled_tokens` tokens from `num_computed_tokens`: a prefill chunk or one
decode token alike. When blocks run out, the newest running request is preempted: its blocks and
slots are freed and it waits at the head of the queue to be recomputed.

`num_computed_tokens` advances when a step is scheduled, and a step that reaches the end of a
request's tokens counts one token in flight (`num_inflight`) until its value arrives through
`update_from_output`. With async scheduling the engine schedules step N+1 before step N's tokens
are read back, so a decode row of N+1 takes its input token from the device; a request whose
in-flight tokens will end it by length is not scheduled again, and one that turns out to have
stopped (EOS, a stop token or string) has its extra step's result dropped. An asynchronous
verify step (speculation with device drafts) counts 1 + its drafts in flight and advances
`num_computed_tokens` by all of them; the rejected positions come off when it is read back.

Structured requests (a grammar constrains their tokens) wait in the queue, without holding up
the requests behind them, until their grammar is compiled (`Request.waiting_for_grammar`); their
matcher advances here, with each token appended, and its end finishes the request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from krait.engine.kv_cache_manager import KVCacheManager
from krait.engine.request import Request, RequestStatus
from krait.runner.spec_decode.drafter import drafts_allowed
from krait.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + output so far (resumed requests recompute their outputs)
    num_prompt_tokens: int  # tokens of token_ids that are prefill (all of them)
    params: SamplingParams
    block_ids: list[int]
    state_slots: list[int]
    num_computed_tokens: int
    num_output_tokens: int  # outputs already generated (seeded sampling offsets)
    eos_token_ids: list[int]
    restore_snapshot: int = -1  # prefix caching: the state snapshot its slot starts from


@dataclass
class CachedRequestData:
    """A running request the runner already holds."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # pipeline parallel: the ids of the step's scheduled tokens that are outputs (a suffix of
    # the step's positions), for the stages that did not sample them (None: not sent)
    new_token_ids: list[int] | None = None


class CachedColumns:
    """The cached requests of a step as columns, as the scheduler emits them (and as they cross
    the executor's ring: building a CachedRequestData per row cost more than the rest of a
    worker's control path). Iterating yields CachedRequestData, for code that wants rows."""

    __slots__ = ("req_ids", "new_block_ids", "num_computed_tokens", "new_token_ids")

    def __init__(self, req_ids: list[str], new_block_ids: list[list[int]],
                 num_computed_tokens: list[int], new_token_ids: list | None = None) -> None:
        self.req_ids = req_ids
        self.new_block_ids = new_block_ids
        self.num_computed_tokens = num_computed_tokens
        self.new_token_ids = new_token_ids

    @classmethod
    def of(cls, cached, with_tokens: bool = True) -> CachedColumns:
        """`cached` (a list of CachedRequestData, or columns already) as columns; the token
        column only with `with_tokens` (and None where no row has tokens)."""
        if isinstance(cached, cls):
            return cached
        tokens = [c.new_token_ids for c in cached] if with_tokens else None
        if tokens is not None and all(t is None for t in tokens):
            tokens = None
        return cls([c.req_id for c in cached], [c.new_block_ids for c in cached],
                   [c.num_computed_tokens for c in cached], tokens)

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self):
        tokens = self.new_token_ids or [None] * len(self.req_ids)
        return map(CachedRequestData, self.req_ids, self.new_block_ids,
                   self.num_computed_tokens, tokens)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData] | CachedColumns
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # structured outputs: the requests whose token this step samples under a grammar, and their
    # masks (int32 [len(structured_req_ids), words], CPU; filled by the engine after scheduling);
    # a request verifying n drafts comes 1 + n times, a mask for each position.
    # None in a step without structured rows: the runner then does no mask work at all.
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # async scheduling with structured rows: the runner queues the forward and returns a
    # DeferredSample; the engine fills the masks once the step before is read back
    grammar_deferred: bool = False
    # prefix caching with recurrent layers: (request state slot, snapshot slot) pairs whose
    # state the runner copies after the step's forward
    snapshot_saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SampledTokens:
    """What the runner sampled for one request in a step (empty for a mid-prefill chunk)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per token: id -> logprob
    ranks: list[int] | None = None
    # prompt logprobs computed in this chunk: (prompt position, [(id, logprob): the prompt's own
    # token, then the top-k in order], rank of the own token)
    prompt_logprobs: list[tuple[int, list[tuple[int, float]], int]] | None = None
    # asynchronous speculation: drafts the device's drafter found for the request's next step
    # (0: no match, its filler drafts are not worth verifying); None: not reported
    num_drafts: int | None = None


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_spec_tokens: int = 0,
        device_drafts: bool = False,
        num_microbatches: int = 1,
        send_token_ids: bool = False,
    ) -> None:
        """`device_drafts`: asynchronous speculative steps — the runner writes each request's
        drafts on the device, and every decode step of a request that may draft verifies as
        many of them as room allows (without it, a request verifies the drafts in its
        `spec_token_ids`, proposed on the host after the step before was read back).
        `num_microbatches` > 1 (pipeline parallel, vLLM's batch queue): that many batches
        may be in flight, each of requests in no other one and of at most a 1/P share of the
        sequences; `send_token_ids`: cached rows carry their output tokens (pipeline stages
        that do not sample learn them so)."""
        self.kv = kv
        self.num_microbatches = num_microbatches
        self.send_token_ids = send_token_ids
        self.num_spec_tokens = num_spec_tokens
        self.device_drafts = device_drafts and num_spec_tokens > 0
        self.spec_stats = SpecDecodeStats(num_spec_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the runner in the next step
        self._preempted_ids: set[str] = set()
        self._seen_by_runner: set[str] = set()

    # -- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Ends a request (abort, or a stop found by the detokenizer) and frees its cache."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(req)
        if request_id in self._seen_by_runner:
            self._finished_ids.add(request_id)
            self._seen_by_runner.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- scheduling -----------------------------------------------------------------------
    # (these run for every request every step: they read the token lists' lengths directly
    # instead of through Request's properties)
    def _num_new_tokens(self, req: Request, budget: int) -> int:
        inflight = req.num_inflight
        if inflight and self._length_reached(req, inflight):
            return 0  # its in-flight token ends it
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        return min(num_tokens + inflight - req.num_computed_tokens, budget)

    def _length_reached(self, req: Request, extra: int = 0) -> bool:
        """max_tokens or max_model_len reached, counting `extra` tokens not appended yet."""
        n_out = len(req.output_token_ids) + extra
        max_tokens = req.params.max_tokens
        if max_tokens is not None and n_out >= max_tokens:
            return True
        return len(req.prompt_token_ids) + n_out >= self.max_model_len

    @staticmethod
    def _advance(req: Request, n: int, num_drafts: int = 0) -> None:
        """The step just scheduled computes n tokens; one reaching the end samples a token (a
        verify step of n = 1 + num_drafts up to n tokens)."""
        req.num_computed_tokens += n
        if req.num_computed_tokens >= (
            len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_inflight
        ):
            req.num_inflight += 1 + num_drafts

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts a decode step of `req` verifies: as many of its proposed ones as the
        token budget, max_model_len and max_tokens leave room for (each accepted draft and the
        token after it must fit; none past the last token max_tokens allows)."""
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if n != 1 or req.num_inflight or req.num_computed_tokens != num_tokens - 1:
            return []  # not a plain decode step
        return req.spec_token_ids[: self._draft_room(req, budget)]

    def _draft_room(self, req: Request, budget: int) -> int:
        """The most drafts a decode step of `req` may verify: each accepted draft and the token
        after it must fit the token budget, max_model_len and max_tokens, counting the tokens
        in flight at their most."""
        extra = req.num_inflight
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids) + extra
        room = min(budget - 1, self.max_model_len - num_tokens - 1)
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - len(req.output_token_ids) - extra - 1)
        return max(room, 0)

    def _num_device_drafts(self, req: Request, n: int, budget: int) -> int:
        """Asynchronous speculation: how many of the drafts the device wrote after `req`'s
        tokens its next step verifies. Its counts include the tokens in flight at their most
        (every draft accepted), so the room left for drafts is never overestimated; the
        drafts are placeholders (-1) here: their values live on the device."""
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_inflight
        if (n != 1 or req.num_computed_tokens != num_tokens - 1
                or req.num_computed_tokens < req.num_prefill_tokens):
            return 0  # not a decode step
        if not drafts_allowed(req.params, len(req.output_token_ids)) or not req.num_found_drafts:
            return 0  # (or the drafter found nothing the last time the host heard)
        return min(self.num_spec_tokens, self._draft_room(req, budget))

    def _reserve_snapshot(self, req: Request, n: int, saves: list[tuple[int, int]]) -> None:
        """A step of `n` tokens ending on a state boundary leaves a snapshot there."""
        save = self.kv.reserve_snapshot(req, req.num_computed_tokens + n)
        if save is not None:
            saves.append(save)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        if req.request_id in self._seen_by_runner:
            self._preempted_ids.add(req.request_id)
            self._seen_by_runner.discard(req.request_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        # the cached rows as columns (CachedColumns): no object a row
        c_ids: list[str] = []
        c_blocks: list[list[int]] = []
        c_computed: list[int] = []
        c_tokens: list[list[int] | None] | None = [] if self.send_token_ids else None
        new: list[NewRequestData] = []
        preempted_now = False

        spec: dict[str, list[int]] = {}
        saves: list[tuple[int, int]] = []
        snapshots = self.kv.snapshots is not None
        exclusive = self.num_microbatches > 1
        cap = self._batch_cap() if exclusive else self.max_num_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < cap:
            req = self.running[i]
            if req.in_batch:  # in flight in another micro-batch
                i += 1
                continue
            n = self._num_new_tokens(req, budget)
            if n <= 0:
                i += 1
                continue
            if snapshots:
                n = self.kv.prefill_cut(req, req.num_computed_tokens, n)
            if self.device_drafts:
                drafts = [-1] * self._num_device_drafts(req, n, budget)
            else:
                drafts = self._drafts_to_verify(req, n, budget) if req.spec_token_ids else []
            req.spec_token_ids = []
            n += len(drafts)
            while True:
                new_blocks = self.kv.allocate(req, n)
                if new_blocks is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            if new_blocks is None:
                break  # req itself was preempted; everything after it is gone too
            num_scheduled[req.request_id] = n
            if drafts:
                spec[req.request_id] = drafts
            elif snapshots:
                self._reserve_snapshot(req, n, saves)
            budget -= n
            c_ids.append(req.request_id)
            c_blocks.append(new_blocks)
            c_computed.append(req.num_computed_tokens)
            if c_tokens is not None:
                c_tokens.append(self._output_ids(req, n))
            req.in_batch = exclusive
            self._advance(req, n, len(drafts))
            i += 1

        skipped: list[Request] = []  # waiting for their grammar: they keep their place
        while self.waiting and budget > 0 and not preempted_now:
            if len(self.running) >= self.max_num_seqs or len(num_scheduled) >= cap:
                break
            req = self.waiting[0]
            if req.waiting_for_grammar:
                skipped.append(self.waiting.popleft())
                continue
            if req.num_inflight or req.in_batch:
                break  # preempted while in flight: it resumes once that step's result is in
            if req.params.prompt_logprobs is None:  # cached tokens would have no logprobs
                req.num_computed_tokens = self.kv.match_prefix(req)  # 0 without prefix caching
            n = self._num_new_tokens(req, budget)
            if snapshots:
                n = self.kv.prefill_cut(req, req.num_computed_tokens, n)
            if not self.kv.allocate_slots(req) or self.kv.allocate(req, n) is None:
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            if snapshots:
                self._reserve_snapshot(req, n, saves)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            req.in_batch = exclusive
            self._seen_by_runner.add(req.request_id)
            req.num_prefill_tokens = req.num_tokens
            new.append(
                NewRequestData(
                    req_id=req.request_id,
                    token_ids=req.all_token_ids,
                    num_prompt_tokens=req.num_tokens,
                    params=req.params,
                    block_ids=list(req.block_ids),
                    state_slots=list(req.state_slots),
                    num_computed_tokens=req.num_computed_tokens,
                    num_output_tokens=req.num_output_tokens,
                    eos_token_ids=req.eos_token_ids,
                    restore_snapshot=req.snapshot_slot,
                )
            )
            self._advance(req, n)
        self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(
            new_reqs=new,
            cached_reqs=CachedColumns(c_ids, c_blocks, c_computed, c_tokens),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
            scheduled_spec_decode_tokens=spec,
            snapshot_saves=saves,
        )
        self._finished_ids = set()
        self._preempted_ids = set()
        return out

    def _batch_cap(self) -> int:
        """Rows of one micro-batch: a 1/P share of the requests there are (so that P batches
        fill the pipeline's stages)."""
        n = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-n // self.num_microbatches))

    @staticmethod
    def _output_ids(req: Request, n: int) -> list[int] | None:
        """The output tokens among the n positions scheduled from num_computed_tokens (a suffix
        of them; None when there are none)."""
        lp = len(req.prompt_token_ids)
        end = req.num_computed_tokens + n - lp
        if end <= 0:
            return None
        return req.output_token_ids[max(req.num_computed_tokens - lp, 0):end]

    # -- after the model step -------------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, sampled: dict[str, SampledTokens]
    ) -> list[Request]:
        """Appends the step's sampled tokens and applies token-level stops (the counters moved
        when the step was scheduled). A request preempted since the step was scheduled still
        takes its token. Returns the requests that made progress (got a token or finished)."""
        progressed: list[Request] = []
        requests = self.requests
        prefix_caching = self.kv.prefix_caching
        if sched.snapshot_saves:
            self.kv.publish_snapshots(sched.snapshot_saves)
        for req_id in sched.num_scheduled_tokens:
            req = requests.get(req_id)
            if req is None or req.status.finished:
                continue  # finished (or aborted) while this step ran: its result is dropped
            req.in_batch = False
            running = req.status is RequestStatus.RUNNING
            if running and prefix_caching:
                self.kv.cache_full_blocks(req)
            got = sampled.get(req_id)
            if got is None:
                continue
            if got.prompt_logprobs and running:
                _store_prompt_logprobs(req, got.prompt_logprobs)
            if not got.token_ids:
                continue
            if got.num_drafts is not None:
                req.num_found_drafts = got.num_drafts
            drafts = sched.scheduled_spec_decode_tokens.get(req_id)
            req.num_inflight = max(req.num_inflight - 1 - len(drafts or ()), 0)
            if drafts is not None:
                # the step computed 1 + len(drafts) positions; those after the last accepted
                # draft are recomputed from the token sampled in their place
                accepted = len(got.token_ids) - 1
                if running:
                    req.num_computed_tokens -= len(drafts) - accepted
                self.spec_stats.record(req, len(drafts), accepted)
            for j, tok in enumerate(got.token_ids):
                req.output_token_ids.append(tok)
                if got.logprobs is not None and req.logprobs is not None:
                    self._append_logprobs(req, got, j, tok)
                if self._check_stop(req, tok):
                    if j + 1 < len(got.token_ids):  # a stop inside an accepted run
                        got.token_ids = got.token_ids[: j + 1]
                    break
            progressed.append(req)
            if req.status.finished:
                if running:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self.requests.pop(req_id, None)
                self.kv.free(req)
                self._finished_ids.add(req_id)
                self._seen_by_runner.discard(req_id)
        return progressed

    @staticmethod
    def _append_logprobs(req: Request, got: SampledTokens, j: int, tok: int) -> None:
        from krait.outputs import Logprob

        # `entry` holds the sampled token and the batch's top-K (K >= k). When the sampled token
        # is among the top-K it appears once only, so ranks come from the values, not positions:
        # a top token's rank counts the top tokens before it, plus the sampled token if it is
        # strictly better (the runner ranks the sampled token after its ties).
        entry = got.logprobs[j]
        k = req.params.logprobs or 0
        sampled_lp = entry[tok]
        d = {tok: Logprob(sampled_lp, rank=got.ranks[j] if got.ranks else None)}
        others = sorted(
            ((tid, lp) for tid, lp in entry.items() if tid != tok), key=lambda x: -x[1]
        )
        for i, (tid, lp) in enumerate(others):
            rank = i + 1 + (1 if sampled_lp > lp else 0)
            if rank > k:
                break
            d[tid] = Logprob(lp, rank=rank)
        req.logprobs.append(d)
        req.cumulative_logprob += sampled_lp

    def _check_stop(self, req: Request, tok: int) -> bool:
        p = req.params
        grammar = req.grammar
        if grammar is not None:  # the matcher advances with each accepted token
            if not grammar.accept(tok):
                req.status = RequestStatus.FINISHED_ERROR
                req.stop_reason = f"structured_outputs: the grammar rejected token {tok}"
                return True
            if grammar.is_terminated():  # it accepted a stop token: the output is complete
                req.status = RequestStatus.FINISHED_STOPPED
                return True
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
                return True
        if self._length_reached(req):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


class SpecDecodeStats:
    """Running totals of speculative decoding (vLLM's spec_decode metrics)."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_drafts = 0  # verify steps that carried at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_spec_tokens  # drafts accepted at each position

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if num_drafts > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        req.num_spec_steps += 1
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }


def _store_prompt_logprobs(req: Request, entries) -> None:
    from krait.outputs import Logprob

    for pos, pairs, rank in entries:
        tok, own = pairs[0]
        d = {tok: Logprob(own, rank=rank)}
        for r, (tid, lp) in enumerate(pairs[1:], start=1):
            d.setdefault(tid, Logprob(lp, rank=r))
        req.prompt_logprobs[pos] = d  # a recomputed chunk (after preemption) overwrites

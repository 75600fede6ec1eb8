"""LLMEngine: add_request / step / abort_request, with vLLM's names."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from krait.config import EngineConfig
from krait.distributed.executor import create_executor
from krait.distributed.worker import RankProfile
from krait.engine.detokenizer import IncrementalDetokenizer
from krait.engine.kv_cache_manager import KVCacheManager, cdiv
from krait.engine.request import Request, RequestStatus
from krait.engine.scheduler import Scheduler
from krait.outputs import CompletionOutput, RequestOutput
from krait.sampling_params import SamplingParams
from krait.tokenizer_utils import eos_token_ids, get_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Parent:
    """A user request; with n > 1 it fans out into n child requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[str]
    final_only: bool = False
    reqs: dict[str, Request] = field(default_factory=dict)  # child id -> Request


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.tokenizer = get_tokenizer(mc.tokenizer or mc.model)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc.hf_config, model_dir=mc.model)
        # the model runner(s): in this process (one rank), or one worker process a rank
        self.executor = create_executor(config)
        self.runner = self.executor.runner  # the in-process ModelRunner; None with workers
        self.num_spec_tokens = self.executor.num_spec_tokens
        self._has_drafter = self.executor.has_drafter
        slots_per_request = self.executor.slots_per_request
        try:
            self.state_block_size = self._state_block_size()
            num_blocks, num_slots, num_snapshots = self._size_cache()
            # conv-only slots (ids past the full and snapshot slots): speculative decoding's
            # per-position conv windows when the recurrent state is committed once a step
            num_conv = config.scheduler.max_num_seqs * self._conv_only_columns()
            self.executor.initialize(num_blocks, num_slots + num_snapshots, num_conv)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, num_slots, slots_per_request,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            state_block_size=self.state_block_size,
            snapshot_slots=list(range(num_slots, num_slots + num_snapshots)),
            conv_slots=list(range(num_slots + num_snapshots, num_slots + num_snapshots + num_conv)),
        )
        # pipeline parallel: a queue of micro-batches, P in flight with async scheduling
        pp = config.parallel.pipeline_parallel_size
        self._batch_queue: deque | None = deque() if pp > 1 else None
        self._queue_size = pp if config.scheduler.async_scheduling else 1
        self.scheduler = Scheduler(
            self.kv,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            mc.max_model_len,
            num_spec_tokens=self.num_spec_tokens,
            device_drafts=self.executor.async_spec,
            num_microbatches=self._queue_size if pp > 1 else 1,
            send_token_ids=pp > 1,
        )
        # speculative steps are asynchronous where the runner drafts on the device; elsewhere
        # (host drafters, several ranks, CPU) each step is read back before the next is planned
        self.async_scheduling = config.scheduler.async_scheduling and (
            not self.num_spec_tokens or self.executor.async_spec)
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._text: dict[str, str] = {}  # text released so far per child (never shrinks)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._inflight = None  # (SchedulerOutput, PendingSample) launched, not yet read back
        self._structured = None  # StructuredOutputManager, built by the first structured request
        self._structured_ids: set[str] = set()  # live structured requests (children)
        # seconds the host spent blocked on the device reading sampled tokens back: a step whose
        # wait is ~0 is host-bound (the benchmarks report it per decode step)
        self.device_wait_s = 0.0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def shutdown(self) -> None:
        """Stops the worker processes (with several ranks; nothing to do with one)."""
        self.executor.shutdown()

    # -- cache sizing -----------------------------------------------------------------
    def _state_block_size(self) -> int:
        """Tokens between recurrent-state snapshots when prefix caching is on for a model with
        recurrent layers (0 otherwise): the Mamba chunk size rounded up to a multiple of the
        attention block, unless `mamba_block_size` says otherwise. A chunk-aligned boundary
        keeps a resumed prefill's SSD chunks whole, and snapshots stay few: one is taken only
        where a prefill chunk ends on a boundary (see KVCacheManager)."""
        cc = self.config.cache
        if not (cc.enable_prefix_caching and self.executor.slots_per_request):
            return 0
        chunk = self.executor.chunk_size or 256  # Gated DeltaNet alone has no SSD chunk
        size = cc.mamba_block_size or cdiv(chunk, cc.block_size) * cc.block_size
        logger.info("prefix caching with recurrent state: a snapshot can start a request every "
                    "%d tokens (the hybrid cache block; attention blocks are %d tokens)",
                    size, cc.block_size)
        return size

    def _size_cache(self) -> tuple[int, int, int]:
        """(attention blocks incl. the null block, request state slots, snapshot slots): what
        every rank holds (each rank sizes by its own bytes and memory; the least wins; a rank
        without attention or recurrent layers, a pipeline stage, does not limit them)."""
        sizes = [self._size_rank_cache(p) for p in self.executor.profiles]
        with_blocks = [b for b, _, _, per_block in sizes if per_block]
        blocks = min(with_blocks) if with_blocks else 0
        snapshots = min(s for _, _, s, _ in sizes)
        slots_only = sizes[0][1]
        if with_blocks:
            cc = self.config.cache
            logger.info(
                "KV cache: %d blocks of %d tokens (%d tokens); %d state slots",
                blocks - 1, cc.block_size, (blocks - 1) * cc.block_size, slots_only,
            )
        if self.state_block_size:
            logger.info("prefix caching: %d recurrent state snapshots", snapshots)
        return blocks, slots_only, snapshots

    def _conv_only_columns(self) -> int:
        """Slots a request takes from the conv-only pool (the same on every rank with
        recurrent layers; 0 without speculation or with layers that keep full states)."""
        return min((p.conv_only_columns for p in self.executor.profiles
                    if p.state_bytes_per_slot), default=0)

    def _size_rank_cache(self, prof: RankProfile) -> tuple[int, int, int, int]:
        """One rank's (blocks, full state slots, snapshots, its bytes per block)."""
        cc, sc = self.config.cache, self.config.scheduler
        per_block = prof.kv_bytes_per_block
        per_slot = prof.state_bytes_per_slot
        conv_only = self._conv_only_columns()
        slots = sc.max_num_seqs * (self.executor.slots_per_request - conv_only)
        conv_bytes = sc.max_num_seqs * conv_only * prof.conv_bytes_per_slot
        if slots and slots * per_slot + conv_bytes > prof.budget:
            raise ValueError(
                f"max_num_seqs={sc.max_num_seqs}: the recurrent state of that many requests needs "
                f"{(slots * per_slot + conv_bytes) / 2**30:.2f} GiB but only "
                f"{prof.budget / 2**30:.2f} GiB is free for "
                "the cache; lower max_num_seqs or give the cache more memory "
                "(gpu_memory_utilization, or cpu_kv_cache_gib on CPU)"
            )
        budget = prof.budget - conv_bytes  # what the full slots, snapshots and blocks share
        snapshots = self._num_snapshots(budget - slots * per_slot, per_slot)
        slots_only = slots
        slots += snapshots
        if per_block == 0:
            return 0, slots_only, snapshots, 0
        max_useful = sc.max_num_seqs * cdiv(self.config.model.max_model_len, cc.block_size) + 1
        if cc.num_kv_blocks is not None:
            blocks = cc.num_kv_blocks + 1  # + the null block
        else:
            blocks = min(int((budget - slots * per_slot) // per_block), max_useful)
        if blocks < 2:
            raise ValueError(
                "not enough memory for even one KV cache block; raise gpu_memory_utilization "
                "(or cpu_kv_cache_gib), or lower max_num_seqs"
            )
        if (blocks - 1) * cc.block_size < self.config.model.max_model_len:
            raise ValueError(
                f"the KV cache holds {(blocks - 1) * cc.block_size} tokens ({blocks - 1} blocks of "
                f"{cc.block_size}), less than one request of max_model_len="
                f"{self.config.model.max_model_len}; raise num_kv_blocks (or "
                "gpu_memory_utilization / cpu_kv_cache_gib), or lower max_model_len"
            )
        return blocks, slots_only, snapshots, per_block

    def _num_snapshots(self, free: int, per_slot: int) -> int:
        """State snapshots for prefix caching (0 without it or without recurrent layers)."""
        if not self.state_block_size:
            return 0
        cc, sc = self.config.cache, self.config.scheduler
        n = cc.num_state_snapshots
        if not per_slot:  # a pipeline stage without recurrent layers: no limit of its own
            return n if n is not None else 4 * sc.max_num_seqs
        if n is None:
            n = min(int(free * 0.1) // per_slot, 4 * sc.max_num_seqs)
        if n < 1 or n * per_slot > free:
            raise ValueError(
                f"prefix caching needs room for recurrent state snapshots of "
                f"{per_slot / 2**20:.1f} MiB each, and {max(free, 0) / 2**30:.2f} GiB is left after "
                "the requests' state slots; give the cache more memory or lower max_num_seqs "
                "(or set num_state_snapshots)")
        logger.debug("prefix caching: %d recurrent state snapshots (%.2f GiB) on a rank", n,
                     n * per_slot / 2**30)
        return n

    # -- requests ---------------------------------------------------------------------
    def _tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError("prompt must be a string or a dict with 'prompt_token_ids'")

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request. Raises ValueError naming the field for bad input."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        mc = self.config.model
        params.validate(mc.vocab_size)
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {mc.vocab_size})"
            )
        if len(ids) >= mc.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; max_model_len is {mc.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        if params.structured_outputs is not None:
            from krait.structured.grammar import validate_structured  # noqa: PLC0415

            validate_structured(params.structured_outputs)  # bad schemas fail here, at once
            self.structured_manager().check_ready()  # xgrammar and a tokenizer are there
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        parent = _Parent(request_id, text, ids, children, params.output_kind == "final_only")
        self._parents[request_id] = parent
        for i, cid in enumerate(children):
            cp = params
            if params.n > 1:
                cp = _child_params(params, i)
            req = Request(
                request_id=cid,
                prompt_token_ids=list(ids),
                params=cp,
                eos_token_ids=self.eos_token_ids,
                prompt=text,
                arrival_time=arrival,
            )
            self._child_parent[cid] = request_id
            parent.reqs[cid] = req
            self._detok[cid] = IncrementalDetokenizer(self.tokenizer, ids, cp)
            if cp.structured_outputs is not None:
                self._structured.submit(req)  # compiles off the loop; the request waits
                self._structured_ids.add(cid)
            self.scheduler.add_request(req)
        self.num_prompt_tokens_total += len(ids) * len(children)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for cid in parent.children:
                if self._structured is not None:
                    self._structured.discard(cid)
                    self._structured_ids.discard(cid)
                self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
                self._child_parent.pop(cid, None)
                self._detok.pop(cid, None)
                self._text.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)  # a step in flight only matters for requests still here

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def get_stats(self) -> dict:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage(),
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
            **(self.scheduler.spec_stats.as_dict() if self.num_spec_tokens else {}),
        }

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + model step; an output for each request that made progress.

        With async scheduling the step launched here is read back by the next call: the host
        schedules and prepares step N+1 while the device still runs step N, and returns step
        N's outputs."""
        failed = self._poll_grammars() if self._structured is not None else []
        if self._batch_queue is not None:
            return failed + self._step_batch_queue()
        sched = self.scheduler.schedule()
        if (self._structured_ids and self.runner is not None and self.async_scheduling
                and not self.num_spec_tokens and self._structured_rows(sched)):
            return failed + self._step_deferred(sched)
        if self._structured_ids:
            self._fill_grammar_bitmask(sched)
        pending = self.executor.execute_model(sched)
        if not self.async_scheduling:
            outputs = self._process(sched, self._read_back(pending))
            if self._has_drafter:
                self._propose_drafts()
            return failed + outputs
        if sched.grammar_bitmask is not None:
            # a structured row's next mask needs this step's token on the host: read the step
            # back now (and the one before it first), so no structured row is ever in flight
            previous, self._inflight = self._inflight, None
            outputs = [] if previous is None else self._process(
                previous[0], self._read_back(previous[1]))
            return failed + outputs + self._process(sched, self._read_back(pending))
        previous, self._inflight = self._inflight, (sched, pending)
        if previous is None:
            return failed
        return failed + self._process(previous[0], self._read_back(previous[1]))

    def _step_batch_queue(self) -> list[RequestOutput]:
        """Pipeline parallel (vLLM v1's batch queue): while fewer than P micro-batches are in
        flight, schedule one (of requests in no other) and launch it; read the oldest back when
        the queue is full or nothing more could be scheduled. A stage runs micro-batch i + 1
        while the next stage runs i; a request's tokens reach the stages that did not sample
        them with its next step (the scheduler sends them)."""
        queue = self._batch_queue
        if len(queue) < self._queue_size:
            sched = self.scheduler.schedule()
            if self._structured_ids:
                self._fill_grammar_bitmask(sched)  # its rows' last tokens are known
            if (sched.total_num_scheduled_tokens or sched.finished_req_ids
                    or sched.preempted_req_ids):
                pending = self.executor.execute_model(sched)
                if sched.total_num_scheduled_tokens:
                    queue.append((sched, pending))
                    if len(queue) < self._queue_size:
                        return []
        if not queue:
            return []
        sched, pending = queue.popleft()
        return self._process(sched, self._read_back(pending))

    # -- structured outputs -----------------------------------------------------------
    def structured_manager(self):
        """The engine's StructuredOutputManager (krait/structured), built on first use."""
        if self._structured is None:
            from krait.structured.manager import StructuredOutputManager  # noqa: PLC0415

            self._structured = StructuredOutputManager(
                self.tokenizer, self.config.model.vocab_size, self.eos_token_ids)
        return self._structured

    def _poll_grammars(self) -> list[RequestOutput]:
        """Attaches compiled grammars to their waiting requests; a request whose grammar failed
        finishes with finish_reason "error" (stop_reason: why). With nothing else to run, waits
        briefly for a compile instead of spinning."""
        mgr = self._structured
        failed = mgr.poll()
        if (not failed and mgr.has_pending() and not self.scheduler.running
                and all(r.waiting_for_grammar for r in self.scheduler.waiting)):
            mgr.wait(0.01)
            failed = mgr.poll()
        touched: dict[str, None] = {}
        for req, why in failed:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, why
            pid = self._child_parent.get(req.request_id)
            if pid is not None:
                touched[pid] = None
        return self._outputs(touched) if touched else []

    def _step_deferred(self, sched) -> list[RequestOutput]:
        """An async step with structured rows (one runner in this process): the step's forward
        is queued first; while the device runs it, the step before is read back, which
        advances the matchers, and then the masks are filled and the sampling queued. So the
        GPU computes the forward while the host waits and fills (before, the host filled the
        masks and prepared the step with the GPU idle)."""
        sched.grammar_deferred = True
        deferred = self.executor.execute_model(sched)
        previous, self._inflight = self._inflight, None
        outputs = [] if previous is None else self._process(
            previous[0], self._read_back(previous[1]))
        self._fill_grammar_bitmask(sched)
        if hasattr(deferred, "finish"):  # a DeferredSample (the runner queued the forward only)
            deferred = deferred.finish(sched.structured_req_ids, sched.grammar_bitmask)
        self._inflight = (sched, deferred)
        return outputs

    def _structured_rows(self, sched) -> list[Request]:
        """The structured requests that sample in the step just scheduled."""
        reqs, scheduled = self.scheduler.requests, sched.num_scheduled_tokens
        rows = (reqs.get(rid) for rid in self._structured_ids if rid in scheduled)
        # (one that finished while the step before was processed is gone: its row's token is
        # dropped, it needs no mask)
        return [r for r in rows if r is not None and r.grammar is not None and r.num_inflight]

    def _fill_grammar_bitmask(self, sched) -> None:
        """The masks of the structured rows that sample in the step just scheduled: one per
        sampled position, so a row verifying n drafts has 1 + n, its id repeated as often."""
        rows = self._structured_rows(sched)
        if rows:
            spec = sched.scheduled_spec_decode_tokens
            drafts = [spec.get(r.request_id, []) for r in rows]
            on_device = [i for i, d in enumerate(drafts) if d and d[0] < 0]  # placeholders
            if on_device:  # (rows new to the runner this step have none)
                got = self.runner.device_drafts(
                    [rows[i].request_id for i in on_device],
                    [len(rows[i].prompt_token_ids) + len(rows[i].output_token_ids)
                     for i in on_device],
                    [len(drafts[i]) for i in on_device])
                for i, d in zip(on_device, got):
                    drafts[i] = d
            sched.structured_req_ids = [r.request_id for r, d in zip(rows, drafts)
                                        for _ in range(1 + len(d))]
            sched.grammar_bitmask = self._structured.fill_bitmask(rows, drafts)

    def _propose_drafts(self) -> None:
        """Drafts for the next step of every running request (speculative decoding); a
        structured request's are cut to what its grammar allows."""
        running = self.scheduler.running
        drafts = self.executor.propose_drafts([r.request_id for r in running])
        for req in running:
            d = drafts.get(req.request_id, [])
            if d and req.grammar is not None:
                if d[0] >= 0:
                    d = d[: req.grammar.valid_drafts(d)]
                elif self.runner is None:
                    d = []  # left on workers' devices: their masks could not be filled
            req.spec_token_ids = d

    def _read_back(self, pending):
        sampled = pending.result()
        self.device_wait_s += pending.waited_s
        return sampled

    def _process(self, sched, sampled) -> list[RequestOutput]:
        progressed = self.scheduler.update_from_output(sched, sampled)
        touched: dict[str, None] = {}
        for req in progressed:
            new_ids = sampled[req.request_id].token_ids
            self.num_generation_tokens_total += len(new_ids)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            detok = self._detok.get(req.request_id)
            if detok is not None and _detokenize_at_end(req.params):
                if not req.is_finished:
                    # final_only, no stop string: nothing to report until it finishes (its
                    # parent reports once every child has)
                    continue
                new_ids = req.output_token_ids  # one decode when it finishes
            if detok is not None:
                held = 0  # the request's last outputs not in new_ids
                if _ended_on_stop_token(req) and not req.params.include_stop_str_in_output:
                    new_ids = new_ids[:-1]  # EOS / stop token ids stay out of the text
                    held = 1
                stop = _update_detokenizer(detok, req, new_ids, held)
                if stop is None and req.is_finished:
                    stop = detok.finish()
                if stop is not None and not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                    detok.finish()
                if stop is not None:
                    req.status = RequestStatus.FINISHED_STOPPED
                    req.stop_reason = stop
                self._text[req.request_id] = (
                    self._text.get(req.request_id, "") + detok.get_next_delta()
                )
            pid = self._child_parent.get(req.request_id)
            if pid is not None:
                touched[pid] = None
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, None]) -> list[RequestOutput]:
        """The RequestOutputs of the parents in `touched`; finished parents are forgotten."""
        outputs = []
        for pid in touched:
            parent = self._parents[pid]
            finished = all(r.is_finished for r in parent.reqs.values())
            if parent.final_only and not finished:
                continue
            outputs.append(
                RequestOutput(
                    request_id=pid,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=[
                        self._completion(r, i)
                        for i, r in enumerate(parent.reqs.values())
                        if r.num_output_tokens or r.is_finished
                    ],
                    finished=finished,
                    prompt_logprobs=next(iter(parent.reqs.values())).prompt_logprobs,
                    num_cached_tokens=max(
                        max(r.num_cached_tokens for r in parent.reqs.values()), 0),
                    metrics=_spec_metrics(parent.reqs.values()) if self.num_spec_tokens
                    else {},
                )
            )
            if finished:
                del self._parents[pid]
                for c in parent.children:
                    self._structured_ids.discard(c)
                    self._child_parent.pop(c, None)
                    self._detok.pop(c, None)
                    self._text.pop(c, None)
        return outputs

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        text = self._text.get(req.request_id, "")
        token_ids = list(req.output_token_ids)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )


def _update_detokenizer(detok: IncrementalDetokenizer, req: Request, new_ids: list[int],
                        held: int = 0):
    """detok.update(new_ids); several tokens at once (a speculative step's accepted run) go one
    at a time, and the request's outputs after a stop string (new_ids' later ones and `held`
    more at the end) are taken back off, so that the output ends where one token a step would
    have ended it."""
    if len(new_ids) + held == 1 or not req.params.stop_strings:
        return detok.update(new_ids)
    for j, tok in enumerate(new_ids):
        stop = detok.update([tok])
        if stop is not None:
            extra = len(new_ids) - 1 - j + held
            if extra:
                gone = req.output_token_ids[-extra:]
                del req.output_token_ids[-extra:]
                if req.logprobs is not None:
                    for entry, t in zip(req.logprobs[-extra:], gone):
                        req.cumulative_logprob -= entry[t].logprob
                    del req.logprobs[-extra:]
            return stop
    return None


def _spec_metrics(reqs) -> dict:
    """A request's speculative-decoding tallies (over its n children)."""
    steps = sum(r.num_spec_steps for r in reqs)
    drafts = sum(r.num_draft_tokens for r in reqs)
    accepted = sum(r.num_accepted_tokens for r in reqs)
    return {
        "spec_num_steps": steps,
        "spec_num_draft_tokens": drafts,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
        # tokens a verify step produced, on average (accepted drafts + the one sampled)
        "spec_mean_accepted_length": (accepted + steps) / steps if steps else 1.0,
    }


def _detokenize_at_end(params: SamplingParams) -> bool:
    return params.output_kind == "final_only" and not params.stop_strings


def _ended_on_stop_token(req: Request) -> bool:
    """The request just stopped on EOS or one of its stop_token_ids (not a stop string)."""
    return req.status == RequestStatus.FINISHED_STOPPED and (
        req.stop_reason is None or isinstance(req.stop_reason, int)
    )


def _child_params(params: SamplingParams, i: int) -> SamplingParams:
    import copy

    cp = copy.copy(params)
    cp.n = 1
    if params.seed is not None:
        cp.seed = params.seed + i
    return cp


__all__ = ["LLMEngine"]

"""The draft-model drafter: a second, smaller (or the same) checkpoint proposes the drafts.

`speculative_config={"model": DRAFT_DIR, "num_speculative_tokens": k}` (method "draft_model"):
any krait-loadable checkpoint, dense or hybrid, whose vocabulary is the target's. The drafter
owns a second `ModelRunner` (same device, dtype, max_model_len, block size and max_num_seqs as
the target; no speculation of its own) with its own KV blocks and state slots, handed out by its
own `KVCacheManager`, and drives it only through `execute_model(SchedulerOutput)` with scheduler
outputs it builds itself.

Each `propose` call, for every row that may draft (greedy drafts, point masses for the
rejection sampler):

1. catch-up: the target's tokens the draft has not computed yet (`token_table[row,
   computed:num_tokens]`: the tokens verified since the last call, the last sampled one
   included) run as one prefill-like chunk (the draft runner's `num_prompt_tokens` is set to
   `num_tokens`, so the rows are prefill rows continuing from their state), split into steps of
   at most `max_num_batched_tokens` tokens. The argmax at the chunk's last position is draft 1.
   A dense draft's catch-up starts past the drafts the target accepted (their KV, written by
   the last call's one-token steps, holds exactly those tokens: `_keep_accepted`), so it is one
   token after a partial acceptance and two after a full one. Where the draft runner has decode
   graphs and no request is new, a catch-up of up to 1 + k tokens a row runs as one-token steps
   (a row of L tokens in the last L), which the graphs serve (`_one_token_catch_up`; a graph
   writes each row's argmax over the known token that follows, which goes back:
   `_restore_next_tokens`).
   A row with nothing to catch up (it was not scheduled since the last call) reuses the draft 1
   it got then. A row with one token to catch up (every draft rejected) is a decode row (its
   `num_prompt_tokens` stays at its computed count): a catch-up of such rows alone replays the
   draft's decode graph instead of running eagerly.
2. k - 1 one-token greedy steps (d1 in -> d2 out, ...), all rows in one batch per step, each
   row stopping at its `max_drafts` (with `keep_last_draft`, one step more: its last draft in,
   so that its KV is kept as well).

With chained graphs (a dense draft whose runner has graphs; krait/runner/chained_graphs.py),
a call in which no request is new and every row catches up one token and takes k drafts runs
1 and 2 as one replay (`_draft_chained`): the catch-up token, then the k drafts fed back on
the device, read back once. `keep_last_draft` is on with them, so the catch-up after a verify
step is always one token (the target's own after any acceptance). With device token tables
(the GPU), the chained call reads nothing back: its drafts go straight into the target's
device token table after each row's tokens (`_drafts_on_device`), `propose` returns
DEVICE_DRAFT placeholders (the scheduler needs the counts only; the target's verify step reads
the drafts from its device inputs), and the host copy is taken at the next call (`resolve`),
so a step's one wait is the verify step's.

Asynchronous target steps (`device_drafts`: a dense draft with chained graphs over device token
tables, one rank) call `draft_on_device` instead of `propose`: right after the target's commit,
with no read-back, one chain a step for every sampling row (the target's last token at its true
position, then the k drafts, written into the target's device table); the draft's counters are
the target's host ones and are corrected on the device by the target's unreported rejections,
mirrored into the draft runner's `spec_rejected` (see that method).

Hybrid drafts hold 2 state slots per request: A, the state after the last verified token, which
only catch-ups advance, and B, scratch: before step 2, A's conv and SSM state are copied into B
for every Mamba layer and the request's slot column points at B; after the last step it points
back at A, and the catch-up redoes every verified token. Attention KV written at draft positions
needs no rollback: the draft's computed count covers verified tokens only (for a dense draft
those of its drafts the target accepted too), so the next catch-up rewrites the rest before
anything reads them.

Requests that leave the target (finished or preempted) leave the draft through
`on_requests_removed`: their blocks and slots are freed at once, and the draft runner drops them
in its next step. A request the draft pool cannot hold (blocks or slots short) gets no drafts
until it fits; one already held that cannot grow is dropped (and re-admitted, recomputed, later),
so that the pool never stays stuck.

Cache sizing: the draft's pool holds max_num_seqs requests of max_model_len when that fits in
DRAFT_CACHE_FRACTION of the target's cache memory (cpu_kv_cache_gib on CPU; on the GPU the
memory free for caches under gpu_memory_utilization when the drafter is built, target and draft
weights loaded), else it takes that fraction. The drafter is built inside the target runner's
constructor, before the target's memory profiling (krait/runner/memory.py), which then counts
the draft's weights and caches as used and sizes the target's pool from what is left. On the
GPU, unless enforce_eager, the draft runner captures decode CUDA graphs (the k - 1 one-token
steps and the catch-ups' one-token steps replay them); a call that admits a new request runs its
catch-up as one eager chunk (the prompt is a prefill). The drafts of
every step are read back once, after the last step was launched, as token arrays
(`PendingSample.tokens`, `read_steps`). A graph pool's free segments are reserved
but not allocated memory, which the target's profiling does not count: the draft's decode pool
(small: max_num_seqs rows of one token) lives in the profiler's reserve; piecewise and prefill
graph pools (several times a forward's activations at max_num_batched_tokens) would not fit there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from krait.config import EngineConfig, SpeculativeConfig, _positional_limit, read_hf_config
from krait.engine.kv_cache_manager import KVCacheManager, cdiv
from krait.engine.scheduler import CachedRequestData, NewRequestData, SchedulerOutput
from krait.ops.write_tokens import write_drafts
from krait.runner.input_batch import host_to_device
from krait.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the share of the target's cache memory the draft's KV blocks and state slots may take
DRAFT_CACHE_FRACTION = 0.1
_GREEDY = SamplingParams(temperature=0.0)
# dense drafts with chained graphs over device token tables draft on the device, after the
# target's asynchronous commit (`DraftModelDrafter.draft_on_device`); False: the target's verify
# steps stay synchronous and `propose` drafts (tests of that path)
DEVICE_DRAFTS = True
# a draft the host has not seen: the drafter wrote it into the target's device token table
# (`DraftModelDrafter._drafts_on_device`); the runner's `_write_drafts` skips such rows
DEVICE_DRAFT = -2


@dataclass
class _DraftSeq:
    """One target request as the draft sees it (duck-types what KVCacheManager reads)."""

    request_id: str  # the draft runner's id
    num_computed_tokens: int = 0  # verified tokens the draft has computed
    next_token: int = -1  # the draft's argmax after them (draft 1)
    block_ids: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # [A, B] for hybrid drafts
    # the last call's one-token steps' inputs (drafts 1 .. m - 1), whose KV sits at positions
    # num_computed_tokens onwards: a dense draft keeps the run the target accepted
    drafted: list[int] = field(default_factory=list)


def draft_engine_config(spec: SpeculativeConfig, target: EngineConfig,
                        past_positional_limit: bool = False) -> EngineConfig:
    """The draft runner's configuration: the target's device, dtype, lengths, block size and
    batch limits, no speculation. ValueError (naming speculative_config.model) for a missing
    checkpoint, a vocabulary other than the target's or a positional limit below max_model_len
    (allowed with `past_positional_limit`: EAGLE heads, whose rotary positions follow the
    target's, are used past their config's max_position_embeddings; drafts stay lossless)."""
    path = spec.model
    if not path or not Path(path).is_dir():
        raise ValueError(f"speculative_config.model={path!r}: no such directory")
    tc = target
    max_len = tc.model.max_model_len
    if past_positional_limit:
        limit = _positional_limit(read_hf_config(path))
        max_len = min(max_len, limit or max_len)
    try:
        cfg = EngineConfig.from_kwargs(
            model=str(path),
            dtype=tc.model.dtype,
            device=tc.device,
            max_model_len=max_len,
            max_num_seqs=tc.scheduler.max_num_seqs,
            max_num_batched_tokens=tc.scheduler.max_num_batched_tokens,
            block_size=tc.cache.block_size,
            gpu_memory_utilization=tc.cache.gpu_memory_utilization,
            load_format=tc.model.load_format,
            seed=tc.model.seed,
            enforce_eager=tc.enforce_eager,
            speculative_config=None,
            kv_cache_dtype=tc.cache.kv_cache_dtype,
            mamba_ssm_cache_dtype=tc.cache.mamba_ssm_cache_dtype,
            cpu_kv_cache_gib=tc.cache.cpu_kv_cache_gib,
            async_scheduling=False,
        )
    except ValueError as e:
        raise ValueError(f"speculative_config.model={path!r}: {e}") from e
    if max_len != tc.model.max_model_len:
        cfg = replace(cfg, model=replace(cfg.model, max_model_len=tc.model.max_model_len))
    if cfg.model.vocab_size != tc.model.vocab_size:
        raise ValueError(
            f"speculative_config.model={path!r}: the draft's vocab_size is "
            f"{cfg.model.vocab_size}, the target's {tc.model.vocab_size}; a draft model must "
            "share the target's vocabulary")
    return cfg


def _cache_budget(config: EngineConfig) -> int:
    """Bytes the draft's caches may take: DRAFT_CACHE_FRACTION of the target's cache memory."""
    if config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        usable = total * config.cache.gpu_memory_utilization - (total - free)
    else:
        usable = config.cache.cpu_kv_cache_gib * 2**30
    return int(max(usable, 0) * DRAFT_CACHE_FRACTION)


def draft_cache_size(per_block: int, per_slot: int, slots_per_request: int, max_num_seqs: int,
                     max_model_len: int, block_size: int, budget: int) -> tuple[int, int]:
    """(num_blocks with the null block, num_state_slots) of the draft's pool: room for
    max_num_seqs requests of max_model_len when that fits in `budget` bytes, else what the
    budget holds (the state of at least one request, at most half the budget for state when
    it is short). ValueError when not even one block or one request's state fits."""
    full_blocks = max_num_seqs * cdiv(max_model_len, block_size) + 1 if per_block else 0
    full_slots = max_num_seqs * slots_per_request
    if full_blocks * per_block + full_slots * per_slot <= budget:
        return full_blocks, full_slots
    slots = full_slots
    if per_slot and full_slots * per_slot > budget // (2 if per_block else 1):
        seats = budget // (2 if per_block else 1) // (slots_per_request * per_slot)
        slots = min(max_num_seqs, seats) * slots_per_request
    blocks = 0
    if per_block:
        blocks = min((budget - slots * per_slot) // per_block, full_blocks)
    if (per_slot and slots == 0) or (per_block and blocks < 2):
        raise ValueError(
            f"speculative_config.model: the draft's cache budget ({budget / 2**20:.1f} MiB, "
            f"{DRAFT_CACHE_FRACTION:.0%} of the cache memory) holds no request; give the cache "
            "more memory (gpu_memory_utilization, or cpu_kv_cache_gib on CPU)")
    return int(blocks), int(slots)


def init_draft_pool(runner, target: EngineConfig, slots_per_request: int) -> KVCacheManager:
    """Sizes and allocates a drafter's own runner's caches (`draft_cache_size` under
    `_cache_budget(target)`) and returns the KVCacheManager that hands them out."""
    cfg = runner.config
    ms = runner.model_state
    per_block, per_slot = ms.kv_bytes_per_block(), ms.state_bytes_per_slot()
    num_blocks, num_slots = draft_cache_size(
        per_block, per_slot, slots_per_request, cfg.scheduler.max_num_seqs,
        cfg.model.max_model_len, cfg.cache.block_size, _cache_budget(target))
    runner.initialize_cache(num_blocks, num_slots)
    logger.info("draft %s: %d KV blocks of %d tokens, %d state slots (%.1f MiB)",
                cfg.model.model, max(num_blocks - 1, 0), cfg.cache.block_size, num_slots,
                (num_blocks * per_block + num_slots * per_slot) / 2**20)
    return KVCacheManager(num_blocks, cfg.cache.block_size, num_slots, slots_per_request)


def sched_output(num_scheduled: dict[str, int], new: list[NewRequestData],
                 cached: list[CachedRequestData], finished: set[str]) -> SchedulerOutput:
    """A drafter runner's step: the tokens each of its requests computes."""
    return SchedulerOutput(
        new_reqs=new, cached_reqs=cached, num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=finished, preempted_req_ids=set())


class HeldRows:
    """The rows a drafter's runner holds already and steps this call, as columns (collected a
    row, written in numpy at once by `write`): its req_state index, its computed count c, the
    count e it catches up to, the target row its tokens come from, and its draft 1 (used where
    e == c: the row was not scheduled since the last call)."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self.computed: list[int] = []
        self.end: list[int] = []
        self.target_row: list[int] = []
        self.next_token: list[int] = []

    def add(self, index: int, computed: int, end: int, target_row: int, next_token: int) -> None:
        self.index.append(index)
        self.computed.append(computed)
        self.end.append(end)
        self.target_row.append(target_row)
        self.next_token.append(next_token)

    def write(self, states, token_table: np.ndarray, shift: int, tables,
              decode_rows: bool = False) -> None:
        """Fills the drafter runner's token tables (host, and `tables` on the device): row
        position p in [c, e) takes target token p + `shift` (0: a draft model, 1: an EAGLE head,
        one position on); a row with e == c takes its draft 1 at e. Its counters: num_tokens e
        (e + 1 for a reused draft 1), num_computed_tokens c; num_prompt_tokens e, so the
        catch-up is a prefill continuation, but c where one token is caught up (or every row,
        `decode_rows`: a catch-up run as one-token steps): a decode row, which a decode graph
        serves."""
        if not self.index:
            return
        i = np.array(self.index, dtype=np.int64)
        c = np.array(self.computed, dtype=np.int64)
        e = np.array(self.end, dtype=np.int64)
        n = e - c  # tokens to catch up
        before = np.cumsum(n) - n
        pos = np.repeat(c - before, n) + np.arange(int(n.sum()), dtype=np.int64)
        rows = np.repeat(i, n)
        toks = token_table[np.repeat(np.array(self.target_row, dtype=np.int64), n), pos + shift]
        reuse = n == 0
        if reuse.any():  # draft 1 after the row's last token
            rows = np.concatenate([rows, i[reuse]])
            pos = np.concatenate([pos, e[reuse]])
            toks = np.concatenate([toks, np.array(self.next_token, dtype=toks.dtype)[reuse]])
        states.token_ids[rows, pos] = toks
        states.num_computed_tokens[i] = c
        states.num_prompt_tokens[i] = c if decode_rows else np.where(n == 1, c, e)
        states.num_tokens[i] = e + reuse
        if tables is not None and len(rows):
            tables.write_known(rows, pos, toks)


def read_steps(steps: list, where: dict[str, int], got: np.ndarray) -> None:
    """Reads a drafter's launched steps back, after all of them were launched: step (pending,
    col) sampled draft `col` of each of its sampling rows, whose draft runner id `where` maps to
    a row of `got` ([rows, k]), written there. The last step first: one wait for the device,
    the steps before it are done by then."""
    for pending, col in reversed(steps):
        tokens = pending.tokens()
        if tokens:
            got[[where[rid] for rid in pending.req_ids], col] = tokens


def check_drafts(got: np.ndarray, expected: np.ndarray, req_ids: list[str]) -> None:
    """RuntimeError unless row q of `got` holds exactly expected[q] drafts (-1 after them)."""
    have = (got >= 0).sum(axis=1)
    bad = np.flatnonzero(have != expected)
    if len(bad):
        q = int(bad[0])
        raise RuntimeError(f"draft row {req_ids[q]}: {have[q]} drafts, expected {expected[q]}")


class DraftModelDrafter:
    """Proposes greedy drafts with a draft checkpoint run by its own ModelRunner (see the
    module doc)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig) -> None:
        from krait.runner.model_runner import ModelRunner  # noqa: PLC0415 (imports this module)

        self.k = spec.num_speculative_tokens
        self.config = draft_engine_config(spec, config)
        self.runner = ModelRunner(self.config)
        self.hybrid = bool(getattr(self.runner.model_state, "mamba_layers", None))
        # hybrid drafts: slots A (verified) and B (drafting)
        self.kv = init_draft_pool(self.runner, config, 2 if self.hybrid else 0)
        # with chained graphs (dense drafts, `capture_graphs`) the draft's last draft also runs
        # as an input, so its KV is kept with the others: the catch-up after any verify step is
        # then one token, which the chain serves
        self.keep_last_draft = False
        # the target's steps may run asynchronously: `draft_on_device` (set by capture_graphs)
        self.device_drafts = False
        if not self.config.enforce_eager:
            if self.config.device.type == "cuda":
                self.capture_graphs()
            elif self.runner.tables is not None:  # the Triton interpreter on CPU (tests)
                self.capture_graphs(record=False)
        self.max_batched = self.config.scheduler.max_num_batched_tokens
        self._seqs: dict[int, _DraftSeq] = {}  # target req_state index -> its draft sequence
        self._finished: set[str] = set()  # draft ids to drop in the draft runner's next step
        self._next_id = 0
        # tallies (tests, diagnostics): catch-up steps run, and rows whose draft 1 was reused
        self.num_catch_up_steps = 0
        self.num_kept_draft_tokens = 0  # accepted drafts whose KV a dense draft kept
        self.num_reused_first_drafts = 0
        self.num_chained_calls = 0  # calls whose steps ran as one chained graph
        # the target runner's DeviceTables (it sets them): a chained call's drafts go there on
        # the device, not through the host (`_drafts_on_device`)
        self.target_tables = None
        self._unresolved = None  # (plan, ChainedSample, order, drafts, rows): see `resolve`
        self._all_found: torch.Tensor | None = None  # int32 k's (`draft_on_device`)
        self._index_key: bytes | None = None  # `draft_on_device`'s last rows and their copy
        self._index: torch.Tensor | None = None

    # -- requests leaving -----------------------------------------------------------------
    def on_requests_removed(self, rows: list[int]) -> None:
        """The target's requests at these req_state indices finished or were preempted: their
        draft blocks and slots are freed now, their draft runner rows in its next step."""
        for row in rows:
            seq = self._seqs.pop(int(row), None)
            if seq is not None:
                self._drop(seq)

    def _drop(self, seq: _DraftSeq) -> None:
        self.kv.free(seq)
        self._finished.add(seq.request_id)

    # -- drafting -------------------------------------------------------------------------
    def capture_graphs(self, record: bool = True) -> None:
        """Decode CUDA graphs for the draft runner (its one-token steps and its catch-ups, run as
        one-token steps up to 1 + k tokens a row, replay them) and, for a dense draft unless
        krait/runner/chained_graphs.ENABLED is False, chained graphs of a call's 1 + k steps
        (`_draft_chained`; `keep_last_draft` on); `record=False`: their dataflow run eagerly
        (CPU tests)."""
        from krait.distributed import parallel_state as ps  # noqa: PLC0415
        from krait.runner.chained_graphs import (  # noqa: PLC0415
            ChainedDecodeGraphs,
            chained_graphs_enabled,
        )
        from krait.runner.cuda_graphs import CudaGraphRunner  # noqa: PLC0415

        runner = self.runner
        # device drafts: a dense draft's chains over device token tables, one rank; its
        # runner's steps then correct their counters by the target's rejections (`spec_rejected`
        # mirrored per row), and the graphs' buffers keep room for them
        self.device_drafts = bool(
            DEVICE_DRAFTS and not self.hybrid and chained_graphs_enabled()
            and runner.tables is not None
            and ps.get_tp_size() == 1 and ps.get_pp_size() == 1)
        if self.device_drafts and runner.spec_rejected is None:
            n = runner.states.max_num_reqs
            runner.spec_rejected = torch.zeros(n, dtype=torch.int32, device=runner.device)
            runner.spec_known = np.zeros(n, dtype=np.int32)
        self.runner.cuda_graphs = CudaGraphRunner(self.runner, record=record)
        self.runner.cuda_graphs.capture_all()
        # one-token catch-up steps of rows with known tokens after them replay the graphs too
        # (`_restore_next_tokens` writes back what a graph wrote over them)
        self.runner.graphs_for_known_tokens = True
        self.runner.chained_graphs = None
        self.keep_last_draft = False
        if not self.hybrid and chained_graphs_enabled():
            # the catch-up token and the k drafts as inputs, one graph (`_draft_chained`)
            chained = ChainedDecodeGraphs(self.runner, 1 + self.k, record=record,
                                          pool=self.runner.cuda_graphs.pool)
            chained.capture_all()
            self.runner.chained_graphs = chained
            self.keep_last_draft = True

    @torch.inference_mode()
    def propose(self, token_table: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """token_table int32 [max_reqs, max_model_len] (the target's host token table), the rows
        (its req_state indices) to draft for, their token counts and the most drafts each may
        take -> (drafts int32 [R, k], -1 padded; counts int32 [R])."""
        self.resolve()  # the last call's device drafts: `_keep_accepted` compares with them
        num_rows = len(rows)
        drafts = np.full((num_rows, self.k), -1, dtype=np.int32)
        counts = np.zeros(num_rows, dtype=np.int32)
        caps = np.minimum(np.asarray(max_drafts, dtype=np.int64), self.k)
        st = self.runner.states
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []  # the held rows that got new blocks
        plan: list[tuple[int, _DraftSeq, int, int]] = []  # (output row, seq, tokens, drafts)
        catch_up: dict[str, int] = {}  # draft id -> tokens to catch up
        reused: list[tuple[int, int]] = []  # (plan row, its draft 1) of rows not scheduled
        held = HeldRows()
        target_of: dict[str, int] = {}  # draft id -> its target row (catch-up rows)
        for j in np.flatnonzero(caps > 0).tolist():
            row, n, m = int(rows[j]), int(num_tokens[j]), int(caps[j])
            seq = self._seqs.get(row)
            if seq is not None and seq.num_computed_tokens > n:  # cannot happen: start over
                del self._seqs[row]
                self._drop(seq)
                seq = None
            fresh = seq is None
            if fresh:
                seq = _DraftSeq(f"draft-{self._next_id}")
                self._next_id += 1
                if not self.kv.allocate_slots(seq):
                    continue  # no free state slots: no drafts until some come back
            if not fresh and not self.hybrid:
                self._keep_accepted(seq, token_table[row], n)
            c = seq.num_computed_tokens
            # KV for every position a draft step writes: up to n + m - 2 (n + m - 1 with
            # keep_last_draft; below max_model_len - 1 either way: m <= max_model_len - n - 1)
            new_blocks = self._grow(row, seq, fresh, n + m - 1 - c + self.keep_last_draft)
            if new_blocks is None:
                continue
            if fresh:
                new_reqs.append(self._admit(row, seq, token_table[row, :n].tolist()))
            else:
                # (the draft runner's computed count is `c` already: only new blocks to send)
                if new_blocks:
                    cached.append(CachedRequestData(seq.request_id, new_blocks, c))
                # the verified tokens since the last call (c < n), or its known draft 1
                held.add(st.index[seq.request_id], c, n, row, seq.next_token)
                if c == n:  # not scheduled since the last call
                    reused.append((len(plan), seq.next_token))
                    self.num_reused_first_drafts += 1
            if c < n:
                catch_up[seq.request_id] = n - c
                target_of[seq.request_id] = row
            plan.append((j, seq, n, m))
        if self._chain_serves(plan, catch_up, new_reqs):
            return self._draft_chained(plan, rows, held, cached, token_table, drafts, counts)
        one_token_steps = self._one_token_catch_up(catch_up, new_reqs)
        held.write(st, token_table, 0, self.runner.tables, decode_rows=bool(one_token_steps))
        finished, self._finished = self._finished, set()
        steps = []  # (launched step, the draft column its tokens are)
        # 1. catch-up: as one-token steps the decode graphs serve where `_one_token_catch_up`
        # takes it, else in steps of at most max_num_batched_tokens (the first one also carries
        # the new, the held and the finished requests)
        for s, sched_tokens in enumerate(one_token_steps):
            steps.append((self.runner.execute_model(sched_output(
                sched_tokens, [], cached if s == 0 else [], finished if s == 0 else set())), 0))
            if s + 1 < len(one_token_steps):
                self._restore_next_tokens(list(sched_tokens), token_table, target_of)
            self.num_catch_up_steps += 1
        first = not one_token_steps
        while first or catch_up:  # (`_one_token_catch_up` emptied catch_up if it took it)
            sched_tokens: dict[str, int] = {}
            budget = self.max_batched
            for rid in list(catch_up):
                if budget == 0:
                    break
                t = min(catch_up[rid], budget)
                sched_tokens[rid] = t
                budget -= t
                catch_up[rid] -= t
                if catch_up[rid] == 0:
                    del catch_up[rid]
            steps.append((self.runner.execute_model(sched_output(
                sched_tokens, new_reqs if first else [], cached if first else [],
                finished if first else set())), 0))
            first = False
            self.num_catch_up_steps += bool(sched_tokens)
        if not plan:
            return drafts, counts
        # 2. the one-token steps from slot B (and with keep_last_draft one more a row, its last
        # draft as input: its token is not a draft, dropped below)
        m_of = np.array([m for *_, m in plan], dtype=np.int64)
        longest = int(m_of.max())
        if longest > 1 and self.hybrid:
            self._to_scratch([seq for _, seq, _, m in plan if m > 1])
        extra = int(self.keep_last_draft)
        for s in range(1, longest + extra):
            steps.append((self.runner.execute_model(sched_output(
                {seq.request_id: 1 for _, seq, _, m in plan if m + extra > s}, [], [], set())), s))
        got = np.full((len(plan), self.k + 1), -1, dtype=np.int64)  # each plan row's drafts
        for q, tok in reused:
            got[q, 0] = tok
        read_steps(steps, {seq.request_id: q for q, (_, seq, _, _) in enumerate(plan)}, got)
        got[np.arange(self.k + 1)[None, :] >= m_of[:, None]] = -1  # the extra steps' tokens
        return self._finish(plan, got[:, : self.k], drafts, counts)

    def _grow(self, row: int, seq: _DraftSeq, fresh: bool, num_new: int) -> list[int] | None:
        """KV blocks for `num_new` tokens past the seq's computed ones (the new ones), or None
        when the pool is short: a fresh seq is freed, a held one dropped (so that the pool
        cannot stay stuck with rows that cannot grow)."""
        new_blocks = self.kv.allocate(seq, num_new)
        if new_blocks is None:
            if fresh:
                self.kv.free(seq)
            else:
                del self._seqs[row]
                self._drop(seq)
        return new_blocks

    def _admit(self, row: int, seq: _DraftSeq, tokens: list[int]) -> NewRequestData:
        """Holds a fresh seq for target row `row`: the draft runner's new request of `tokens`
        (all prompt: its first step is a prefill)."""
        self._seqs[row] = seq
        return NewRequestData(
            req_id=seq.request_id, token_ids=tokens, num_prompt_tokens=len(tokens),
            params=_GREEDY, block_ids=list(seq.block_ids), state_slots=seq.state_slots[:1],
            num_computed_tokens=0, num_output_tokens=0, eos_token_ids=[])

    def _finish(self, plan: list, got: np.ndarray, drafts: np.ndarray,
                counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Checks and records a call's drafts (`got` int64 [len(plan), k], each plan row's,
        -1 after them) into the outputs, and rolls the draft runner's counters back to the
        verified tokens."""
        js = np.array([j for j, *_ in plan], dtype=np.int64)
        self._record(plan, got)
        drafts[js] = got
        counts[js] = [m for *_, m in plan]
        self._roll_back(plan)
        return drafts, counts

    def _record(self, plan: list, got: np.ndarray) -> None:
        """Checks a call's drafts (`got` int64 [len(plan), k], -1 after each row's m) and keeps
        each row's draft 1 and its one-token steps' inputs."""
        check_drafts(got, np.array([m for *_, m in plan], dtype=np.int64),
                     [seq.request_id for _, seq, _, _ in plan])
        extra = int(self.keep_last_draft)
        for (_, seq, _, m), row_drafts in zip(plan, got.tolist()):
            seq.next_token = row_drafts[0]
            seq.drafted = row_drafts[: m - 1 + extra]  # the one-token steps' inputs

    def _roll_back(self, plan: list) -> None:
        """The draft runner's counters back to each row's n verified tokens (the drafts are
        forgotten); a hybrid draft's slot column back to A."""
        st = self.runner.states
        n_of = np.array([n for _, _, n, _ in plan], dtype=np.int32)
        ids = np.fromiter((st.index[seq.request_id] for _, seq, _, _ in plan), np.int64, len(plan))
        for _, seq, n, _ in plan:
            seq.num_computed_tokens = n
        st.num_computed_tokens[ids] = n_of
        st.num_tokens[ids] = n_of
        if self.hybrid:  # back to A
            st.state_slots[ids, 0] = [seq.state_slots[0] for _, seq, _, _ in plan]

    def _chain_serves(self, plan: list, catch_up: dict[str, int], new_reqs: list) -> bool:
        """Whether the call runs as one chained graph: the draft runner has them, no request is
        new, every row catches up exactly one token and takes all k drafts, and a captured size
        holds the rows."""
        chained = self.runner.chained_graphs
        return bool(
            chained is not None and plan and not new_reqs and len(catch_up) == len(plan)
            and all(t == 1 for t in catch_up.values())
            and all(m == self.k for *_, m in plan)
            and chained.size_for(len(plan)) is not None)

    def _draft_chained(self, plan: list, rows: np.ndarray, held: HeldRows, cached: list,
                       token_table: np.ndarray, drafts: np.ndarray,
                       counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The call as one chained graph (`ModelRunner.execute_chained`): each row's catch-up
        token, then its k drafts fed back on the device; one read-back, or none with device
        token tables (`_drafts_on_device`). The same drafts as the stepwise path
        (`tests/models/test_spec_draft_chained.py`)."""
        held.write(self.runner.states, token_table, 0, self.runner.tables, decode_rows=True)
        finished, self._finished = self._finished, set()
        sample = self.runner.execute_chained(sched_output(
            {seq.request_id: 1 for _, seq, _, _ in plan}, [], cached, finished))
        self.num_catch_up_steps += 1
        self.num_chained_calls += 1
        where = {rid: q for q, rid in enumerate(sample.req_ids)}
        order = np.fromiter((where[seq.request_id] for _, seq, _, _ in plan), np.int64, len(plan))
        if self.target_tables is not None and self.runner.tables is not None:
            return self._drafts_on_device(plan, rows, sample, order, drafts, counts)
        tokens = sample.tokens()  # int64 [rows, 1 + k]: the last is draft k's successor
        return self._finish(plan, tokens[order, : self.k], drafts, counts)

    def _drafts_on_device(self, plan: list, rows: np.ndarray, sample, order: np.ndarray,
                          drafts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chain's k drafts a row go straight into the target's device token table, after
        each row's n tokens (`target_tables`), and the call returns without waiting for them:
        `drafts` holds DEVICE_DRAFT placeholders (the scheduler needs counts only; the target's
        verify step reads the drafts from its device inputs). The host learns them in the next
        call (`resolve`, by then long copied back), when it needs them for `_keep_accepted`."""
        k, num = self.k, len(plan)
        target_rows = np.asarray(rows, dtype=np.int64)[[j for j, *_ in plan]]
        n_of = np.array([n for _, _, n, _ in plan], dtype=np.int64)
        chain = sample.device[torch.from_numpy(order).to(sample.device.device)] if (
            (order != np.arange(num)).any()) else sample.device
        self.target_tables.write_sampled(
            np.repeat(target_rows, k), (n_of[:, None] + np.arange(k)).reshape(-1),
            chain[:, :k].reshape(-1))  # int64 [num * k]
        js = np.array([j for j, *_ in plan], dtype=np.int64)
        drafts[js] = DEVICE_DRAFT
        counts[js] = k
        self._roll_back(plan)
        self._unresolved = (plan, sample, order, drafts, js)
        return drafts, counts

    @torch.inference_mode()
    def draft_on_device(self, target_table: torch.Tensor, target_rejected: torch.Tensor,
                        target_known: np.ndarray, token_table: np.ndarray, rows: np.ndarray,
                        num_tokens: np.ndarray, prefilled: np.ndarray,
                        may_draft: np.ndarray) -> torch.Tensor:
        """The drafts of an asynchronous target step (`device_drafts`), launched right after
        its commit, nothing read back: each sampling row's k drafts go into the target's device
        token table after its true last token, and int32 [S] comes back (k for a row drafted,
        else 0: what the scheduler learns one step later).

        The host does not know the rows' true token counts (the target's counters run ahead
        by the rejections the device has not reported): the draft's counters are set to the
        target's host ones (computed n - 1, n tokens) and its runner's `spec_rejected` and
        `spec_known` mirror the target's rows, so its step corrects them on the device by the
        same amount. A row's draft holds the KV of every true token but the last (its previous
        chain wrote the catch-up token and the drafts the target accepted), so each call is one
        chain (`launch_chained`): the target's last token at its true position (read from the
        target's table), then the k drafts. A row whose prompt ended in this step gets its
        draft sequence here: its first n - 1 tokens run as a prefill first (the host knows
        them). A row that may not draft (`may_draft` False: sampling parameters that rule
        drafts out, or no room for k more tokens) leaves the draft, and so does one whose
        blocks run short; it drafts no more (a row can join only when its prompt ends, the one
        step where its true count is the host's).

        target_table int32 [R, L], target_rejected int32 [R] (device), target_known int32 [R]
        (host); token_table: the target's host token table; rows [S]: the target's req_state
        indices of the step's sampling rows; num_tokens [S]: their host counts after the step;
        prefilled, may_draft bool [S]."""
        k, runner = self.k, self.runner
        found = np.zeros(len(rows), dtype=np.int32)
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        plan: list[tuple[int, _DraftSeq, int]] = []  # (target step row, seq, n)
        prompts: dict[str, int] = {}  # new draft id -> prompt tokens to run
        for j in range(len(rows)):
            row, n = int(rows[j]), int(num_tokens[j])
            seq = self._seqs.get(row)
            if seq is not None and (prefilled[j] or not may_draft[j]):
                del self._seqs[row]  # (a prompt ending: a new request on the row)
                self._drop(seq)
                seq = None
            if not may_draft[j] or (seq is None and not prefilled[j]) or n < 2:
                continue
            fresh = seq is None
            if fresh:
                seq = _DraftSeq(f"draft-{self._next_id}")
                self._next_id += 1
            new_blocks = self._grow(row, seq, fresh, n + k)  # (computed stays 0)
            if new_blocks is None:
                continue
            if fresh:
                new_reqs.append(self._admit(row, seq, token_table[row, :n].tolist()))
                prompts[seq.request_id] = n - 1
            elif new_blocks:
                cached.append(CachedRequestData(seq.request_id, new_blocks, n - 1))
            plan.append((j, seq, n))
        finished, self._finished = self._finished, set()
        while prompts:  # the new rows' prompts but their last token, max_batched a step
            sched_tokens, budget = {}, self.max_batched
            for rid in list(prompts):
                t = min(prompts[rid], budget)
                if t == 0:
                    break
                sched_tokens[rid], budget = t, budget - t
                prompts[rid] -= t
                if prompts[rid] == 0:
                    del prompts[rid]
            runner.execute_model(sched_output(sched_tokens, new_reqs, [], finished))
            new_reqs, finished = [], set()
            self.num_catch_up_steps += 1
        if not plan:
            if finished:  # the removed rows leave the draft runner
                runner.execute_model(sched_output({}, [], [], finished))
            return host_to_device(found, runner.device)
        st = runner.states
        js = np.array([j for j, _, _ in plan], dtype=np.int64)
        n_of = np.array([n for _, _, n in plan], dtype=np.int64)
        d_rows = np.fromiter((st.index[seq.request_id] for _, seq, _ in plan), np.int64,
                             len(plan))
        st.num_computed_tokens[d_rows] = n_of - 1
        st.num_prompt_tokens[d_rows] = n_of - 1  # a decode row
        st.num_tokens[d_rows] = n_of
        t_rows_np = np.asarray(rows, dtype=np.int64)[js]
        runner.spec_known[d_rows] = target_known[t_rows_np]
        # int64 [2, P]: the draft's rows and the target's, in plan order (sent again only when
        # they change: not in the steady state of a batch)
        key = d_rows.tobytes() + t_rows_np.tobytes()
        if key != self._index_key:
            self._index = host_to_device(np.stack([d_rows, t_rows_np]), runner.device)
            self._index_key = key
        d_rows_t, t_rows = self._index[0], self._index[1]
        runner.spec_rejected[d_rows_t] = target_rejected[t_rows]
        _, batch, chain = runner.launch_chained(
            sched_output({seq.request_id: 1 for _, seq, _ in plan}, [], cached, finished),
            first_tokens=(target_table, t_rows))
        num = len(plan)
        self.num_catch_up_steps += 1
        self.num_chained_calls += 1
        # row p's drafts after the target's last token, at its true position positions[p]
        write_drafts(target_table, t_rows, batch.positions, chain, k)
        if num == len(rows):  # every row drafted (the steady state): no copy
            if self._all_found is None or self._all_found.numel() < num:
                self._all_found = torch.full((max(num, st.max_num_reqs),), k, dtype=torch.int32,
                                             device=runner.device)
            return self._all_found[:num]
        found[js] = k
        return host_to_device(found, runner.device)

    def resolve(self) -> None:
        """Takes the host copy of the last call's device drafts (`_drafts_on_device`): checks
        them, records each row's draft 1 and one-token inputs, and writes them over the
        placeholders of the array that call returned. A no-op when nothing is pending."""
        if self._unresolved is None:
            return
        plan, sample, order, drafts, js = self._unresolved
        self._unresolved = None
        got = sample.tokens()[order, : self.k]  # int64 [len(plan), k]
        self._record(plan, got)
        drafts[js] = got

    def _one_token_catch_up(self, catch_up: dict[str, int],
                            new_reqs: list) -> list[dict[str, int]]:
        """The catch-up as one-token steps (a row of L tokens in the last L of them), which the
        decode graphs serve: where the draft runner has them, no request is new (a prompt is a
        prefill) and no row has more than 1 + k tokens (after a partial acceptance a dense
        draft has one, after a full one two; a hybrid one 1 + accepted). Else [] (one chunked
        catch-up, eager past one token a row)."""
        graphs = self.runner.cuda_graphs
        if (graphs is None or new_reqs or not catch_up
                or graphs.size_for(len(catch_up)) is None):
            return []
        longest = max(catch_up.values())
        if longest == 1 or longest > 1 + self.k:
            return []  # one token a row: the one step is a decode step already
        steps = [{rid: 1 for rid, n in catch_up.items() if n >= longest - s}
                 for s in range(longest)]
        catch_up.clear()
        return steps

    def _restore_next_tokens(self, req_ids: list[str], token_table: np.ndarray,
                             target_of: dict[str, int]) -> None:
        """After a one-token catch-up step of `req_ids` that sampled nothing (known tokens
        follow): a decode graph wrote each row's argmax after its position, over the known
        token the next step reads; the token goes back (device table)."""
        st, tables = self.runner.states, self.runner.tables
        if tables is None:
            return
        i = np.fromiter((st.index[r] for r in req_ids), np.int64, len(req_ids))
        pos = st.num_computed_tokens[i].astype(np.int64)  # advanced by the step: the next input
        rows = np.fromiter((target_of[r] for r in req_ids), np.int64, len(req_ids))
        toks = token_table[rows, pos]
        tables.write_known(i, pos, toks)

    def _keep_accepted(self, seq: _DraftSeq, tokens: np.ndarray, n: int) -> None:
        """A dense draft's catch-up starts past the drafts the target accepted: the KV its
        one-token steps wrote at positions c, c + 1, ... holds exactly those tokens after the
        verified ones, so the computed count moves over the run of them the target's tokens
        [c, n) repeat (at most n - c - 1: the last verified token is always caught up, it
        gives draft 1). So a row whose drafts were accepted in part catches up one token (the
        target's own), a decode row its graphs serve, and one that took every draft two. A
        hybrid draft's state after its drafts cannot be rewound: it catches up every token."""
        c = seq.num_computed_tokens
        run = min(len(seq.drafted), n - c - 1)
        if run <= 0:
            return
        same = tokens[c : c + run] == np.asarray(seq.drafted[:run])
        keep = run if same.all() else int(np.argmin(same))
        seq.num_computed_tokens = c + keep
        self.num_kept_draft_tokens += keep

    def _to_scratch(self, seqs: list[_DraftSeq]) -> None:
        """Copies slot A's conv and SSM state into slot B for every Mamba layer (one gather and
        one scatter per state tensor) and points each request's slot column at B."""
        dev = self.config.device
        a = host_to_device(np.array([s.state_slots[0] for s in seqs], dtype=np.int64), dev)
        b = host_to_device(np.array([s.state_slots[1] for s in seqs], dtype=np.int64), dev)
        for layer in self.runner.model_state.mamba_layers:
            conv = layer.conv_state.transpose(1, 2)  # the contiguous [slots, taps, dim] storage
            conv[b] = conv[a]
            layer.ssm_state[b] = layer.ssm_state[a]
        st = self.runner.states
        for s in seqs:
            st.state_slots[st.index[s.request_id], 0] = s.state_slots[1]

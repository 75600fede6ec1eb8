"""The model runner: execute_model(scheduler output) -> sampled tokens, the step pipeline."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from krait.config import EngineConfig
from krait.distributed import parallel_state as ps
from krait.engine.kv_cache_manager import cdiv
from krait.engine.scheduler import CachedColumns, SampledTokens, SchedulerOutput
from krait.models.loader import load_model
from krait.ops._dispatch import use_triton
from krait.ops.argmax import argmax
from krait.ops.ngram_propose import ngram_propose
from krait.ops.spec_commit import commit_greedy, commit_sampled
from krait.ops.token_bitmask import apply_token_bitmask
from krait.ops.write_tokens import write_tokens
from krait.runner.chained_graphs import ChainedSample
from krait.runner.device_tables import DeviceTables
from krait.runner.input_batch import (
    InputBatch,
    build_input_batch,
    device_to_host,
    host_to_device,
    to_device,
)
from krait.runner.model_states import create_model_state
from krait.runner.penalties import PenaltyState
from krait.runner.piecewise_graphs import (
    PiecewiseGraphs,
    piecewise_enabled,
    piecewise_max_tokens_knob,
)
from krait.runner.prefill_graphs import (
    PrefillGraphs,
    prefill_graph_rows_knob,
    prefill_graphs_enabled,
)
from krait.runner.request_states import RequestStates
from krait.runner.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    build_sampling_metadata,
    greedy_sampling_metadata,
)
from krait.runner.spec_decode.draft_model import DEVICE_DRAFT
from krait.runner.spec_decode.drafter import create_drafter, drafts_allowed, ever_drafts
from krait.runner.spec_decode.rejection_sampler import RejectionSampler

logger = logging.getLogger(__name__)

# asynchronous verify steps of plain greedy rows: acceptance, commit and the next ngram drafts in
# one launch (ops/spec_commit.commit_greedy); False: the rejection sampler, commit_sampled and
# ngram_propose in turn (what a test's scripted drafter replaces)
FUSED_GREEDY_COMMIT = True


class ModelRunner:
    """One worker's model, caches and persistent request tables."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        torch.manual_seed(config.model.seed)
        # pipeline parallel: only the last stage computes logits and samples; the engine sends
        # its tokens to the other stages with each request's next step (invariant 7)
        self.pp = ps.get_pp_size() > 1
        self.is_last_stage = ps.state().is_last_stage
        self.model = load_model(config.model, self.device)
        self.model_state = create_model_state(self.model, config)
        self.sampler = Sampler()
        spec = config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.drafter = create_drafter(spec, config, self.model) if spec is not None else None
        # EAGLE: the drafter takes the hidden states of every step's kept positions (`_observe`)
        self.drafter_observes = hasattr(self.drafter, "observe")
        self.rejection_sampler = RejectionSampler()
        self.states: RequestStates | None = None
        self.num_blocks = 0
        self.num_slots = 0
        self.cuda_graphs = None  # CudaGraphRunner once captured
        # decode graphs also for one-token rows that sample nothing (known tokens follow): a
        # graph writes each row's argmax after its position, so a caller setting this writes
        # those known tokens back (the draft-model drafter's one-token catch-up steps)
        self.graphs_for_known_tokens = False
        # a draft model's chained decode steps (ChainedDecodeGraphs, set by its drafter)
        self.chained_graphs = None
        # speculative decoding: graphs of verify steps, every row 1 + k tokens (drafts padded)
        self.verify_graphs = None
        self.piecewise = None  # PiecewiseGraphs for eager steps (krait/envs.py turns them off)
        self.prefill_graphs = None  # PrefillGraphs for one-prefill-row steps
        self._grammar = None  # this step's (structured req ids, bitmask), see execute_model
        self._defer_sampling = False  # this step's sampling waits for its masks (DeferredSample)
        # asynchronous speculative steps (ngram drafts on the device, see `async_spec`): the
        # device's rejected positions per request row and the host's known part of them
        self.async_spec = False
        self.spec_rejected: torch.Tensor | None = None
        self.spec_known: np.ndarray | None = None
        self._spec_ones: torch.Tensor | None = None  # int32 [R] ones: one position a row
        # the last verify step's index arrays and their device copies (`_spec_index`)
        self._spec_index_key: tuple | None = None
        self._spec_index_val: list[torch.Tensor] = []

    # -- set-up -----------------------------------------------------------------------
    def initialize_cache(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        """`num_conv_slots`: conv-only state slots past the `num_slots` full ones
        (`ModelState.conv_only_columns`)."""
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.model_state.allocate_caches(num_blocks, num_slots, num_conv_slots)
        max_blocks = cdiv(self.max_model_len, self.block_size) if num_blocks else 0
        self.states = RequestStates(
            self.config.scheduler.max_num_seqs,
            self.max_model_len,
            max_blocks,
            self.model_state.slots_per_request,
        )
        self.model_state.request_states = self.states
        self.penalties = PenaltyState(self.states.max_num_reqs, self.vocab_size, self.device)
        # inputs are prepared on the device wherever the Triton kernels run
        self.tables = None
        if use_triton(torch.empty(0, device=self.device)):
            self.tables = DeviceTables(
                self.states.max_num_reqs, self.max_model_len, max_blocks, self.device
            )
        if hasattr(self.drafter, "target_tables"):  # the draft model writes drafts there
            self.drafter.target_tables = self.tables
        spec = self.config.speculative
        # speculative steps run asynchronously where the drafts can be made on the device: the
        # ngram drafter over the device token table, one rank (the host counters run ahead and
        # are corrected one step late, krait/ops/spec_commit.py)
        # (or the draft-model drafter's chained graphs: `DraftModelDrafter.device_drafts`)
        self.async_spec = bool(
            self.num_spec_tokens and self.tables is not None
            and (spec.method == "ngram" or getattr(self.drafter, "device_drafts", False))
            and ps.get_tp_size() == 1 and not self.pp)
        if self.async_spec:
            n = self.states.max_num_reqs
            self.spec_rejected = torch.zeros(n, dtype=torch.int32, device=self.device)
            self.spec_known = np.zeros(n, dtype=np.int32)
            self._spec_ones = torch.ones(n, dtype=torch.int32, device=self.device)  # [R]

    def capture_cuda_graphs(self) -> None:
        """Decode graphs for every capture size (GPU, unless enforce_eager)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        from krait.runner.cuda_graphs import CudaGraphRunner

        self.cuda_graphs = CudaGraphRunner(self)
        self.cuda_graphs.capture_all()
        if self.num_spec_tokens:
            self.verify_graphs = CudaGraphRunner(self, tokens_per_row=1 + self.num_spec_tokens)
            self.verify_graphs.pool = self.cuda_graphs.pool
            self.verify_graphs.capture_all()
        if self.drafter_observes:
            # an EAGLE or MTP drafter reads every step's hidden states (EAGLE-3: three layers'
            # inputs): the decode and verify graphs keep theirs; prefill steps run eagerly
            logger.info("EAGLE/MTP speculative decoding: no piecewise or prefill graphs")
            return
        tokens = self.piecewise_max_tokens()
        if tokens:
            self.piecewise = PiecewiseGraphs(self.model, tokens, self.device)
            self._capture_piecewise()
            if prefill_graphs_enabled() and self.model_state.num_accepted_tokens is None:
                self.prefill_graphs = PrefillGraphs(self, self.piecewise.buckets,
                                                    pool=self.piecewise.pool,
                                                    max_rows=prefill_graph_rows_knob())
                try:
                    self.prefill_graphs.capture_all()
                except RuntimeError as e:  # a mixer that cannot be captured: piecewise serves
                    logger.warning("prefill graphs off, their capture failed: %s", e)
                    self.prefill_graphs = None

    def piecewise_max_tokens(self) -> int:
        """The largest eager step piecewise graphs serve: 0 when off (KRAIT_PIECEWISE_GRAPHS=0,
        enforce_eager, or no CUDA), else the most tokens a step can hold, up to
        PIECEWISE_MAX_TOKENS."""
        if self.device.type != "cuda" or self.config.enforce_eager or not piecewise_enabled():
            return 0
        sched = self.config.scheduler
        return min(sched.max_num_batched_tokens, piecewise_max_tokens_knob(),
                   sched.max_num_seqs * (self.max_model_len - 1))

    def _capture_piecewise(self) -> None:
        """Every token bucket's pieces, largest first (one pool): two dummy prefills of the
        bucket's size each, the first run padded eagerly, the second captured. Done at start-up,
        so no step of a request pays a capture and the pool is in place before serving."""
        pw = self.piecewise
        cuda = self.device.type == "cuda"  # else a CPU test's PiecewiseGraphs(record=False)
        start = time.perf_counter()
        if cuda:
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info()[0]
        for tokens in reversed(pw.buckets):
            if pw.bucket_for(sum(self._dummy_prefill_lens(tokens))) != tokens:
                continue  # no dummy batch of this size: the bucket captures while serving
            for _ in range(2):
                self.profile_run(tokens)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the eager runs' blocks: what stays is the graphs' pool
            pw.pool_bytes = free_before - torch.cuda.mem_get_info()[0]
        captured = [b for b in pw.buckets if pw.state[b].graphs]
        logger.info("captured piecewise graphs for %d token buckets %s (%.0f MiB, %.1f s)",
                    len(captured), captured, pw.pool_bytes / 2**20, time.perf_counter() - start)

    def dummy_decode_batch(self, n: int, tokens_per_row: int = 1) -> InputBatch:
        """n padding rows of `tokens_per_row` tokens each (CUDA-graph capture)."""
        return build_input_batch(
            self.states, [], [], self.block_size, self.device,
            num_reqs_padded=n, num_tokens_padded=n * tokens_per_row, pad_decode=True,
            full_block_table=True, tables=self.tables, pad_tokens_per_row=tokens_per_row,
            rejections=self._rejections(),  # (room in its buffers for a step's corrections)
        )

    def _dummy_prefill_lens(self, num_tokens: int) -> list[int]:
        """Prompt lengths of a dummy prefill of `num_tokens` tokens: rows of at most
        max_model_len - 1 tokens, at most max_num_seqs of them."""
        per = max(min(num_tokens, self.max_model_len - 1), 1)
        lens = [per] * (num_tokens // per) + ([num_tokens % per] if num_tokens % per else [])
        return lens[: self.config.scheduler.max_num_seqs]  # no real batch has more rows

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward pass at `num_tokens` tokens (prefill rows of at most max_model_len - 1
        tokens) over the current caches, to measure peak activation memory."""
        lens = self._dummy_prefill_lens(num_tokens)
        st = self.states
        ids = []
        for j, n in enumerate(lens):
            rid = f"__profile_{j}"
            slots = [0] if self.num_slots else []
            st.add(rid, [0] * n, n, 0, 0, None, [], slots, [])
            ids.append(rid)
        try:
            batch = build_input_batch(
                st, ids, lens, self.block_size, self.device, tables=self.tables
            )
            hidden = self.forward(batch)
            # float32: the copy the sampler makes of non-greedy rows' logits counts too
            if self.is_last_stage:
                self.model.compute_logits(hidden[batch.logits_indices]).float()
        finally:
            for rid in ids:
                st.remove(rid)

    # -- the step ---------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        st = self.states
        if hasattr(self.drafter, "on_requests_removed"):  # a drafter holding per-request state
            self.drafter.on_requests_removed([st.index[r] for r in sched.finished_req_ids
                                              | sched.preempted_req_ids if r in st.index])
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            st.remove(rid)
        added: list[tuple[int, list[int]]] = []
        restores: list[int] = []
        for new in sched.new_reqs:
            i = st.add(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.num_computed_tokens,
                new.num_output_tokens,
                new.params,
                new.block_ids,
                new.state_slots,
                new.eos_token_ids,
            )
            added.append((i, new.state_slots))
            restores.append(new.restore_snapshot)
            if self.tables is not None:
                self.tables.set_row(i, new.token_ids)
                self.tables.add_blocks(i, 0, new.block_ids)
            n_prompt = new.num_prompt_tokens - new.num_output_tokens
            self.penalties.add(i, new.params, new.token_ids[:n_prompt], new.token_ids[n_prompt:])
        if added:
            self.model_state.add_requests(added, restores)
            if self.spec_rejected is not None:  # a new request row starts with no rejections
                rows = [i for i, _ in added]
                self.spec_known[rows] = 0
                self.spec_rejected.index_fill_(
                    0, host_to_device(np.array(rows, dtype=np.int64), self.device), 0)
        if sched.scheduled_spec_decode_tokens and not self.async_spec:
            # (asynchronous steps verify the drafts the device wrote after each row's tokens)
            self._write_drafts(sched.scheduled_spec_decode_tokens)
        if not sched.cached_reqs:
            return
        # (the tokens matter to a stage before the last only)
        cached = CachedColumns.of(sched.cached_reqs, self.pp and not self.is_last_stage)
        # every running request, every step: one numpy write; blocks only where new ones came
        index = st.index
        rows = np.fromiter((index[r] for r in cached.req_ids), np.int64, len(cached))
        st.num_computed_tokens[rows] = cached.num_computed_tokens
        for i, blocks in zip(rows.tolist(), cached.new_block_ids):
            if blocks:
                if self.tables is not None:
                    self.tables.add_blocks(i, int(st.num_blocks[i]), blocks)
                st.append_blocks(i, blocks)
        if cached.new_token_ids is not None and not self.is_last_stage:
            self._write_known_tokens(sched, cached, rows)

    def _write_known_tokens(self, sched: SchedulerOutput, cached: CachedColumns,
                            rows: np.ndarray) -> None:
        """A pipeline stage before the last: the output tokens among the step's positions, which
        the last stage sampled and the engine sends with the step (invariant 7: each stage's
        tables hold a token before a step of that stage reads it)."""
        st = self.states
        scheduled = sched.num_scheduled_tokens
        at_rows, at_pos, toks = [], [], []
        for i, rid, start, ids in zip(rows.tolist(), cached.req_ids, cached.num_computed_tokens,
                                      cached.new_token_ids):
            if not ids:
                continue
            end = start + scheduled[rid]
            st.token_ids[i, end - len(ids):end] = ids
            at_rows += [i] * len(ids)
            at_pos += range(end - len(ids), end)
            toks += ids
        if self.tables is not None and toks:
            self.tables.write_known(np.array(at_rows), np.array(at_pos), np.array(toks))

    def _write_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Puts each verified request's drafts after its last known token in the token tables
        (they stay uncounted: the sampled tokens overwrite them). Rows of DEVICE_DRAFT
        placeholders are skipped: the drafter wrote them into the device table already."""
        if any(ids and ids[0] == DEVICE_DRAFT for ids in drafts.values()):
            drafts = {r: ids for r, ids in drafts.items() if ids and ids[0] != DEVICE_DRAFT}
            if not drafts:
                return
        st = self.states
        index = st.index
        lens = np.fromiter((len(ids) for ids in drafts.values()), np.int64, len(drafts))
        i = np.fromiter((index[rid] for rid in drafts), np.int64, len(drafts))
        total = int(lens.sum())
        if total == 0:
            return
        rows = np.repeat(i, lens)
        before = np.cumsum(lens) - lens
        pos = np.repeat(st.num_tokens[i].astype(np.int64) - before, lens) + np.arange(total)
        toks = np.fromiter((t for ids in drafts.values() for t in ids), np.int64, total)
        st.token_ids[rows, pos] = toks
        if self.tables is not None:
            self.tables.write_known(rows, pos, toks)

    def _ordered_rows(
        self, sched: SchedulerOutput
    ) -> tuple[list[str], list[int], np.ndarray, int]:
        """Decode rows first, then prefill rows (the hybrid ops rely on this split): their
        request ids, scheduled token counts and req_state indices, and the number of prefill
        rows."""
        st = self.states
        req_ids = list(sched.num_scheduled_tokens)
        num = list(sched.num_scheduled_tokens.values())
        idx = np.fromiter((st.index[r] for r in req_ids), np.int64, len(req_ids))
        prefill = st.num_computed_tokens[idx] < st.num_prompt_tokens[idx]
        num_prefills = int(np.count_nonzero(prefill))
        if num_prefills == 0 or num_prefills == len(req_ids):
            return req_ids, num, idx, num_prefills
        order = np.argsort(prefill, kind="stable")  # decodes first, each in order
        ids = [req_ids[j] for j in order.tolist()]
        return ids, [num[j] for j in order.tolist()], idx[order], num_prefills

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> PendingSample:
        """Launches the step: forward and sampling are queued on the device, and the host
        counters advance as if the sampled tokens were known (their values stay on the device,
        where the next step's input preparation reads them). `.result()` of the returned handle
        waits for the sampled tokens. Prefix caching's state snapshots are copied after the
        forward (the step's restores ran before it, in `_update_states`)."""
        pending = self._execute(sched)
        if sched.snapshot_saves:
            self.model_state.copy_states(sched.snapshot_saves)
        return pending

    @torch.inference_mode()
    def execute_chained(self, sched: SchedulerOutput) -> ChainedSample:
        """A step of one-token decode rows (each row's token its known one, no request new)
        run as `chained_graphs.steps` chained greedy steps (krait/runner/chained_graphs.py):
        step s > 0 takes step s - 1's argmax. Launched, not waited for. The host counters are
        not advanced: the caller (the draft-model drafter) sets them from what it keeps."""
        req_ids, _, tokens = self.launch_chained(sched)
        return ChainedSample(req_ids, tokens)

    def launch_chained(self, sched: SchedulerOutput, first_tokens=None):
        """`execute_chained`'s launch -> (row ids, the step-0 InputBatch, int64 [rows, steps]
        tokens on the device). `first_tokens` (table int32 [R, L], rows int32 [rows] on the
        device): step 0's input of row j is table[rows[j], its position] instead of the row's
        own token (the draft model's device drafts: the target's last token, at its true
        position). With rejections (`spec_rejected`) the rows' counters are corrected on the
        device first."""
        graphs = self.chained_graphs
        self._update_states(sched)
        req_ids, num_scheduled, _, num_prefills = self._ordered_rows(sched)
        size = graphs.size_for(len(req_ids)) if req_ids else None
        if num_prefills or size is None or any(n != 1 for n in num_scheduled):
            raise ValueError("execute_chained: one-token decode rows of a captured size only")
        if self.tables is not None:
            self.tables.flush()
        into = graphs.captured_batch(size) if self.tables is not None else None
        batch = build_input_batch(
            self.states, req_ids, num_scheduled, self.block_size, self.device,
            num_reqs_padded=size, num_tokens_padded=size, pad_decode=True,
            full_block_table=True, tables=self.tables, into=into, rejections=self._rejections())
        n = len(req_ids)
        if first_tokens is not None:
            table, rows = first_tokens
            batch.input_ids[:n] = table[rows.long(), batch.positions[:n]]
        tokens = graphs.run(batch)  # int64 [size, steps]
        return req_ids, batch, tokens[:n]

    def _execute(self, sched: SchedulerOutput) -> PendingSample:
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return PendingSample.empty()
        # structured rows' masks for this step (None: no structured row samples, no mask work)
        self._grammar = (None if sched.grammar_bitmask is None
                         else (sched.structured_req_ids, sched.grammar_bitmask))
        self._defer_sampling = sched.grammar_deferred and not sched.scheduled_spec_decode_tokens
        req_ids, num_scheduled, rows, num_prefills = self._ordered_rows(sched)
        if self.tables is not None:
            self.tables.flush()
        if sched.scheduled_spec_decode_tokens:
            if self.async_spec:
                return self._execute_verify_async(sched, req_ids, num_scheduled)
            return self._execute_verify(sched, req_ids, num_scheduled)
        rejections = self._rejections()
        graph_size = None
        # never replay a prefill chunk in a decode graph, even a one-token one
        if (self.cuda_graphs is not None and num_prefills == 0
                and all(n == 1 for n in num_scheduled)
                and (self.graphs_for_known_tokens or self._rows_sample(rows))):
            graph_size = self.cuda_graphs.size_for(len(req_ids))
        if graph_size is not None:
            into = self.cuda_graphs.captured_batch(graph_size) if self.tables is not None else None
            batch = build_input_batch(
                self.states, req_ids, num_scheduled, self.block_size, self.device,
                num_reqs_padded=graph_size, num_tokens_padded=graph_size, pad_decode=True,
                tables=self.tables, into=into, rejections=rejections,
            )
            logits, greedy = self.cuda_graphs.run(batch)
            n = batch.num_reqs
            if self.drafter_observes:  # one kept position a row
                self._observe(batch, self.cuda_graphs.last_hidden, np.ones(n, dtype=np.int64))
            # the graph wrote the greedy tokens into the device token table already
            return self._sample_and_update(batch, logits[:n], greedy[:n], self.tables is not None)
        # prefill rows alone: tokens and rows padded to a captured prefill graph's
        key = (self.prefill_graphs.bucket_for(num_scheduled, num_prefills)
               if self.prefill_graphs is not None else None)
        batch = build_input_batch(
            self.states, req_ids, num_scheduled, self.block_size, self.device, tables=self.tables,
            num_tokens_padded=key[0] if key else None, num_reqs_padded=key[1] if key else None,
            rejections=rejections,
        )
        hidden = self.forward(batch)
        if not self.is_last_stage:  # a pipeline stage before the last: no logits
            return self._sample_and_update(batch, None)
        if self.drafter_observes:  # every position of a prefill chunk or decode is kept
            self._observe(batch, hidden, batch.num_scheduled_tokens_np[: batch.num_reqs])
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        prompt_lps = self._prompt_logprobs(batch, hidden)  # before the tables advance
        pending = self._sample_and_update(batch, logits)
        pending.prompt_logprobs = prompt_lps
        return pending

    def _execute_verify(self, sched: SchedulerOutput, req_ids: list[str],
                        num_scheduled: list[int]) -> PendingSample:
        """A step whose decode rows verify drafts (1 + k tokens each; k may be 0): the target's
        logits at every decode position go through the rejection sampler; prefill rows in the
        same step sample as usual. Synchronous: the accepted counts are read back here, and the
        host tables advance by them."""
        st = self.states
        v = self._verify(sched, req_ids, num_scheduled, None)
        batch, hidden, rows, computed, end = v.batch, v.hidden, v.rows, v.computed, v.end
        n = batch.num_reqs
        idx = batch.idx_mapping_np[:n]
        prompt_lps = v.prompt_logprobs
        full = self._full_verify_rows(v)
        out = self._reject(v, req_ids, self._verify_draft_ids(v, full))
        self.penalties.record(idx[rows], out.output_token_ids[:, 0])  # no drafts with penalties
        # a verify graph's rows: the sampled tokens go to the device table before the wait
        on_device = full and self.tables is not None and self._write_verified(v, out)
        lps = out.logprobs
        # the step's one sync: tokens [rows, 1 + max k], counts [rows] (and the logprobs)
        host = device_to_host([out.output_token_ids, out.num_sampled] + (
            [lps.token_ids, lps.logprobs, lps.ranks] if lps is not None else []))
        tokens, num_sampled = host[0], host[1].astype(np.int32)
        lp = [t.tolist() for t in host[2:]] if lps is not None else None
        # host tables: the sampled tokens after each row's last known one
        rows_i = idx[rows]
        start = st.num_tokens[rows_i].astype(np.int64)
        pos = start[:, None] + np.arange(tokens.shape[1])  # [rows, 1 + max k]
        keep = (pos < start[:, None] + num_sampled[:, None]) & (pos < self.max_model_len)
        w_rows = np.broadcast_to(rows_i[:, None], pos.shape)[keep]
        w_pos, w_tok = pos[keep], tokens[keep]
        st.token_ids[w_rows, w_pos] = w_tok
        st.num_tokens[rows_i] = start + num_sampled
        if self.tables is not None and len(w_rows) and not on_device:
            self.tables.write_known(w_rows, w_pos, w_tok)
        sampled: dict[str, SampledTokens] = {}
        for j, (r, m, toks) in enumerate(zip(rows.tolist(), num_sampled.tolist(),
                                             tokens.tolist())):
            got = SampledTokens(toks[:m])
            if lp is not None and st.wants_logprobs[rows_i[j]]:
                got.logprobs = [dict(zip(lp[0][j][q], lp[1][j][q])) for q in range(m)]
                got.ranks = [lp[2][j][q] for q in range(m)]
            sampled[req_ids[r]] = got
        # a verify row computed its last known token and the accepted drafts
        new_computed = end.copy()
        dec = ~batch.is_prefilling[rows]
        new_computed[rows[dec]] = computed[rows[dec]] + num_sampled[dec]
        if self.drafter_observes:
            self._observe(batch, hidden, new_computed - computed)
        st.num_computed_tokens[idx] = new_computed
        if self.model_state.num_accepted_tokens is not None:
            per_row = np.zeros(n, dtype=np.int32)  # 0 for a prefill chunk that sampled nothing
            per_row[rows] = num_sampled
            per_row = host_to_device(per_row, self.device)
            self.model_state.postprocess_state(batch.idx_mapping[:n], per_row, batch.seq_lens[:n])
        for rid, entries in prompt_lps.items():
            sampled.setdefault(rid, SampledTokens([])).prompt_logprobs = entries
        return PendingSample.resolved(sampled)

    def _full_verify_rows(self, v: _VerifyStep) -> bool:
        """Whether a verify step ran its graph with every row a full verify row (1 + k tokens,
        k drafts): its input ids and positions are then [n, 1 + k] on the device."""
        return bool(v.greedy is not None and len(v.rows) == v.batch.num_reqs
                    and (v.counts == 1 + self.num_spec_tokens).all())

    def _verify_draft_ids(self, v: _VerifyStep, full: bool) -> torch.Tensor:
        """int64 [sum(counts - 1)]: the drafts a synchronous verify step verifies, in row
        order, read from its input ids on the device (the token tables hold them after each
        row's last token): a view for full verify rows, else one gather."""
        ids = v.batch.input_ids
        if full:
            n, per = len(v.rows), 1 + self.num_spec_tokens
            return ids[: n * per].view(n, per)[:, 1:].reshape(-1)
        return ids[host_to_device(_draft_positions(v), self.device)]

    def _write_verified(self, v: _VerifyStep, out) -> bool:
        """Full verify rows' sampled tokens into the device token table, on the device (no
        host arrays): output column q of row r goes after the row's input q, at
        positions[r, q] + 1, where it is a token (-1 past the row's outputs writes nothing).
        Returns True (the host then writes only its own table)."""
        n, per = len(v.rows), 1 + self.num_spec_tokens
        tokens = out.output_token_ids  # int64 [n, per]
        if tokens.shape != (n, per):
            return False
        batch = v.batch
        rows = torch.where(tokens >= 0, batch.idx_mapping[:n, None], -1)  # int32 [n, per]
        pos = batch.positions[: n * per] + 1  # int64 [n * per]
        write_tokens(self.tables.token_ids, rows.reshape(-1), pos, tokens.reshape(-1))
        return True

    def _verify(self, sched: SchedulerOutput, req_ids: list[str], num_scheduled: list[int],
                rejections) -> _VerifyStep:
        """A verify step's forward (its graph when every row is a full verify row) and the
        logits the rejection sampler takes: every position of a decode row, the last one of a
        sampling prefill row. `rejections`: asynchronous speculation's (build_input_batch)."""
        st = self.states
        spec = sched.scheduled_spec_decode_tokens
        per_row = 1 + self.num_spec_tokens
        size = None
        # every row a full verify row: k drafts (a prefill chunk of 1 + k tokens has none)
        if self.verify_graphs is not None and all(
                len(spec.get(r, ())) == self.num_spec_tokens for r in req_ids):
            size = self.verify_graphs.size_for(len(req_ids))
        if size is not None:
            into = self.verify_graphs.captured_batch(size) if self.tables is not None else None
            batch = build_input_batch(
                st, req_ids, num_scheduled, self.block_size, self.device, tables=self.tables,
                num_reqs_padded=size, num_tokens_padded=size * per_row, pad_decode=True,
                pad_tokens_per_row=per_row, into=into, rejections=rejections)
            batch.num_draft_tokens_per_req = np.full(size, self.num_spec_tokens, np.int32)
            graph_logits, graph_greedy = self.verify_graphs.run(batch)
            # the graph's output, kept for an observing drafter (EAGLE, MTP)
            hidden = self.verify_graphs.last_hidden if self.drafter_observes else None
        else:
            batch = build_input_batch(st, req_ids, num_scheduled, self.block_size, self.device,
                                      tables=self.tables, rejections=rejections)
            batch.num_draft_tokens_per_req = np.array(
                [len(spec.get(r, ())) for r in req_ids], dtype=np.int32)
            hidden = self.forward(batch)
        n = batch.num_reqs
        idx = batch.idx_mapping_np[:n]
        prompt_lps = self._prompt_logprobs(batch, hidden) if size is None else {}
        computed = batch.num_computed_tokens_np[:n]
        end = computed + batch.num_scheduled_tokens_np[:n]
        rows = np.nonzero(end >= st.num_tokens[idx])[0]  # every decode row; prefills at their end
        qsl = batch.query_start_loc_np
        first = np.where(batch.is_prefilling[rows], qsl[rows + 1] - 1, qsl[rows])
        counts = (qsl[rows + 1] - first).astype(np.int32)  # = 1 + drafts
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        greedy = None
        if size is not None:  # a verify graph: the logits of every token, rows in order
            logits = graph_logits[: n * per_row]
            greedy = graph_greedy[: n * per_row]  # (their argmax, in the graph already)
        else:
            positions = np.repeat(first - cu[:-1], counts) + np.arange(cu[-1])
            logits = self.model.compute_logits(hidden[host_to_device(positions, self.device)])
        return _VerifyStep(batch, hidden, logits, prompt_lps, computed, end, rows, first, counts,
                           cu, greedy)

    def _reject(self, v: _VerifyStep, req_ids: list[str], draft_ids: torch.Tensor):
        """The rejection sampler over a verify step's logits (structured rows masked first,
        each position by its own mask), given the drafts in row order."""
        st = self.states
        rows_i = v.batch.idx_mapping_np[v.rows]
        if self._grammar is not None:
            self._apply_grammar(v.logits, [req_ids[r] for r in v.rows], v.cu[:-1])
        if st.plain_greedy[rows_i].all():  # no per-row parameters to gather
            meta = greedy_sampling_metadata(len(v.rows), v.logits.device)
        else:
            meta = self._sampling_metadata(v.logits, rows_i, (v.batch, v.rows))
        # (cu_num_logits: not read when num_draft_tokens is given, so a host one serves)
        return self.rejection_sampler(v.logits, torch.from_numpy(v.cu), draft_ids,
                                      None, meta, num_draft_tokens=v.counts - 1,
                                      target_argmax=None if self._grammar else v.greedy)

    def _observe(self, batch: InputBatch, hidden: torch.Tensor, kept: np.ndarray) -> None:
        """Hands an observing drafter (EAGLE) the step's hidden states: `kept[r]` positions of
        row r from its first computed one (a verify row's: 1 + its accepted drafts)."""
        n = batch.num_reqs
        self.drafter.observe(batch.idx_mapping_np[:n], batch.num_computed_tokens_np[:n],
                             np.asarray(kept, dtype=np.int64), batch.query_start_loc_np[:n],
                             hidden)

    def _rejections(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """What build_input_batch corrects the rows' counters by (asynchronous speculation)."""
        return (self.spec_rejected, self.spec_known) if self.spec_rejected is not None else None

    def _commit_and_draft(self, rows: torch.Tensor, start: torch.Tensor, tokens: torch.Tensor,
                          num_sampled: torch.Tensor | None, num_positions: torch.Tensor,
                          host_rows: np.ndarray, host_len: np.ndarray,
                          prefilled: np.ndarray) -> torch.Tensor:
        """Asynchronous speculation, after sampling: the sampling rows' tokens go to their true
        positions of the device token table, their rejected positions are counted, and the
        drafts of their next step are written after them (ngram's, or the draft model's
        chained graph: `DraftModelDrafter.draft_on_device`) — on the device: `rows` int32 [S]
        (req_state_idx), `start` int [S] (the true position of each row's first sampled
        token), `num_positions` int [S] (1 + drafts). The draft model also takes the rows'
        host view: `host_rows` [S] (req_state_idx), `host_len` [S] (their token counts as the
        host counts them after this step, every draft accepted) and `prefilled` bool [S] (the
        row's prompt ended in this step). Returns int32 [S]: k where drafts were written
        (an ngram match), else 0 (the scheduler, one step later, verifies no drafts for a row
        whose drafter found nothing)."""
        n = rows.shape[0]
        out = torch.empty(2, n, dtype=torch.int32, device=self.device)  # [2, S]: next_len, found
        next_len, found = out[0], out[1]
        table = self.tables.token_ids
        commit_sampled(table, self.spec_rejected, rows, start, None, tokens, num_sampled,
                       num_positions, next_len)
        spec = self.config.speculative
        if spec.method != "ngram":
            return self._model_drafts(host_rows, host_len, prefilled)
        ngram_propose(table, rows, next_len, found, self.num_spec_tokens,
                      spec.prompt_lookup_min, spec.prompt_lookup_max)
        return found

    def _model_drafts(self, host_rows: np.ndarray, host_len: np.ndarray,
                      prefilled: np.ndarray) -> torch.Tensor:
        """The draft model's next drafts of an asynchronous step's sampling rows, launched
        after their commit (`DraftModelDrafter.draft_on_device`; arguments as
        `_commit_and_draft`'s): int32 [S], k for a row drafted, else 0."""
        st = self.states
        room = host_len + self.num_spec_tokens <= self.max_model_len
        may = np.fromiter((ever_drafts(st.params[i]) for i in host_rows.tolist()), bool,
                          len(host_rows)) & room
        return self.drafter.draft_on_device(self.tables.token_ids, self.spec_rejected,
                                            self.spec_known, st.token_ids, host_rows, host_len,
                                            prefilled, may)

    def _spec_index(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 device copies of a verify step's small index arrays, sent in one copy; the
        last step's copies are reused while the values stay the same (a verify graph's steady
        state: every row 1 + k tokens, no copy at all)."""
        key = (tuple(a.size for a in arrays), b"".join(a.astype(np.int64).tobytes()
                                                       for a in arrays))
        if key != self._spec_index_key:
            self._spec_index_val = to_device(arrays, np.int64, self.device, tag="spec")
            self._spec_index_key = key
        return self._spec_index_val

    def _execute_verify_async(self, sched: SchedulerOutput, req_ids: list[str],
                              num_scheduled: list[int]) -> PendingVerify:
        """A verify step that leaves the accepted counts on the device (invariant 7): the
        host's counters advance as if every draft were accepted, the drafts of the next step
        are made on the device right after the rejection sampler, and the host learns the
        accepted counts when it reads the step back (`PendingVerify.result`), one step late.
        The drafts verified are the ones the device wrote after each row's last token."""
        st = self.states
        v = self._verify(sched, req_ids, num_scheduled, self._rejections())
        batch, rows, first, counts, cu, end = v.batch, v.rows, v.first, v.counts, v.cu, v.end
        n = batch.num_reqs
        idx = batch.idx_mapping_np[:n]
        rows_i = idx[rows]
        start = st.num_tokens[rows_i].astype(np.int32)
        if FUSED_GREEDY_COMMIT and self._grammar is None and st.plain_greedy[rows_i].all():
            # acceptance, commit and the next ngram drafts in one launch (ops/spec_commit.py;
            # the draft model's drafts come after it)
            rows_t, first_t, lrow_t, npos_t = self._spec_index([rows, first, cu[:-1], counts])
            target = v.greedy if v.greedy is not None else argmax(v.logits)  # [cu[-1]]
            spec = self.config.speculative
            ngram = spec.method == "ngram"
            packed = commit_greedy(
                self.tables.token_ids, self.spec_rejected, batch.idx_mapping, rows_t, first_t,
                lrow_t, npos_t, batch.input_ids, batch.positions, target, int(counts.max()),
                self.num_spec_tokens if ngram else 0, spec.prompt_lookup_min,
                spec.prompt_lookup_max)
            if not ngram:
                packed[:, -1] = self._model_drafts(rows_i, start + counts,
                                                   batch.is_prefilling[rows])
            num_sampled, logprobs = packed[:, -2], None
        else:
            rows_t, first_t, draft_at_t, npos_t = self._spec_index(
                [rows, first, _draft_positions(v), counts])
            out = self._reject(v, req_ids, batch.input_ids[draft_at_t])
            self.penalties.record(rows_i, out.output_token_ids[:, 0])  # no drafts: penalties
            # a row's first sampled token goes after its first verified position (true ones)
            found = self._commit_and_draft(batch.idx_mapping[rows_t],
                                           batch.positions[first_t] + 1, out.output_token_ids,
                                           out.num_sampled, npos_t, rows_i, start + counts,
                                           batch.is_prefilling[rows])
            # int64 [S, max_n + 2]: each row's tokens, then num_sampled, found
            packed = torch.cat([out.output_token_ids, out.num_sampled[:, None], found[:, None]],
                               dim=1)
            num_sampled, logprobs = out.num_sampled, out.logprobs
        st.num_tokens[rows_i] = start + counts  # as if every draft were accepted
        st.num_computed_tokens[idx] = end
        if self.model_state.num_accepted_tokens is not None:
            per_row = torch.zeros(n, dtype=torch.int32, device=self.device)  # 0: sampled nothing
            per_row.index_copy_(0, rows_t, num_sampled.to(torch.int32))
            self.model_state.postprocess_state(batch.idx_mapping[:n], per_row, batch.seq_lens[:n])
        pending = PendingVerify(self, [req_ids[r] for r in rows], rows_i, counts, packed,
                                logprobs, st.wants_logprobs[rows_i])
        pending.prompt_logprobs = v.prompt_logprobs
        return pending

    def device_drafts(self, req_ids: list[str], starts: list[int],
                      counts: list[int]) -> list[list[int]]:
        """Asynchronous speculation: the drafts the device wrote for these requests, `counts`
        of them from each one's true token count `starts` (the host knows it: the request's
        last step was read back), in one copy; what a structured row's masks are filled
        from."""
        st = self.states
        k = max(counts)
        if k == 0:
            return [[] for _ in req_ids]
        rows = np.fromiter((st.index[r] for r in req_ids), np.int64, len(req_ids))
        pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(k)  # [R, k]
        pos = np.minimum(pos, self.tables.token_ids.shape[1] - 1)
        rows_t, pos_t = to_device([np.repeat(rows, k), pos.reshape(-1)], np.int64, self.device)
        got = self.tables.token_ids[rows_t, pos_t].view(len(req_ids), k).tolist()
        return [g[:c] for g, c in zip(got, counts)]

    def propose_drafts(self, req_ids: list[str]) -> dict[str, list[int]]:
        """Drafts for the next step of each running request that decodes next (up to k each,
        none where the sampling parameters rule speculation out or no room is left)."""
        st = self.states
        keep = [r for r in req_ids if r in st.index]
        if self.drafter is None or not keep:
            return {}
        idx = np.fromiter((st.index[r] for r in keep), np.int64, len(keep))
        computed = st.num_computed_tokens[idx]
        # the next step is a decode: its prompt is done and it holds one token to compute
        decoding = (computed + 1 == st.num_tokens[idx]) & (computed >= st.num_prompt_tokens[idx])
        room = np.minimum(self.max_model_len - st.num_tokens[idx] - 1, self.num_spec_tokens)
        ok = np.array([drafts_allowed(st.params[i], st.num_tokens[i] - st.num_prompt_tokens[i]
                                      + st.num_output_offset[i]) for i in idx], dtype=bool)
        max_drafts = np.where(decoding & ok, np.maximum(room, 0), 0).astype(np.int32)
        if not max_drafts.any() and not getattr(self.drafter, "catches_up_every_call", False):
            return {}
        drafts, counts = self.drafter.propose(st.token_ids, idx, st.num_tokens[idx], max_drafts)
        if self.verify_graphs is not None:
            if not counts.any():
                return {}  # nothing proposed: a plain decode step (its graph) costs least
            # verify graphs take rows of exactly k drafts: fill short proposals up with their
            # last token (or the row's last one). Any draft is lossless: the rejection sampler
            # accepts or replaces it.
            last = st.token_ids[idx, st.num_tokens[idx] - 1]
            for j in np.nonzero(counts < max_drafts)[0].tolist():
                fill = drafts[j, counts[j] - 1] if counts[j] else last[j]
                drafts[j, counts[j] : max_drafts[j]] = fill
            counts = np.maximum(counts, max_drafts)
        return {r: drafts[j, : counts[j]].tolist() for j, r in enumerate(keep) if counts[j]}

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor, chunk: int = 512):
        """Logprobs of each prompt token given the tokens before it, for the prefill rows whose
        request asked (prompt_logprobs=k): {req_id: [(position, [(token, lp), top-k...], rank)]}."""
        st = self.states
        rows = range(batch.num_decodes, batch.num_reqs)
        idx = batch.idx_mapping_np
        if not any(st.wants_prompt_logprobs[idx[r]] for r in rows):
            return {}
        out = {}
        for r in rows:
            i = idx[r]
            if not st.wants_prompt_logprobs[i]:
                continue
            k = st.params[i].prompt_logprobs
            prompt_len = st.num_prompt_tokens[i] - st.num_output_offset[i]
            first = int(batch.num_computed_tokens_np[r])
            # the token at position q predicts q + 1; only prompt tokens are scored
            last = min(first + int(batch.num_scheduled_tokens_np[r]), int(prompt_len) - 1)
            entries = []
            for q0 in range(first, last, chunk):
                qs = np.arange(q0, min(q0 + chunk, last))
                toks = torch.from_numpy(batch.query_start_loc_np[r] + qs - first).to(self.device)
                lp = self.model.compute_logits(hidden[toks]).float().log_softmax(dim=-1)  # [n, V]
                target = torch.from_numpy(st.token_ids[i, qs + 1].astype(np.int64)).to(self.device)
                own = lp.gather(1, target[:, None])  # [n, 1]
                ranks = (lp >= own).sum(dim=-1).tolist()
                ids, vals = target[:, None], own
                if k:
                    top_v, top_i = lp.topk(k, dim=-1)
                    ids, vals = torch.cat([ids, top_i], 1), torch.cat([vals, top_v], 1)
                for q, row_ids, row_vals, rank in zip(qs, ids.tolist(), vals.tolist(), ranks):
                    entries.append((int(q) + 1, list(zip(row_ids, row_vals)), rank))
            if entries:
                out[batch.req_ids[r]] = entries
        return out

    def _rows_sample(self, rows: np.ndarray) -> bool:
        """Every row's (req_state indices) scheduled token is its last known one, so every row
        samples the token at its sequence length (where a decode graph writes its greedy
        token)."""
        st = self.states
        return bool((st.num_computed_tokens[rows] + 1 == st.num_tokens[rows]).all())

    def forward(self, batch: InputBatch) -> torch.Tensor:
        meta = self.model_state.prepare_attn(batch, for_capture=False)
        if self.prefill_graphs is not None and self.prefill_graphs.serves(batch):
            return self.prefill_graphs.run(batch, meta)
        if self.piecewise is not None:
            hidden = self.piecewise.run(batch.input_ids, batch.positions, batch.num_tokens, meta)
            if hidden is not None:
                return hidden
        return self.model(batch.input_ids, batch.positions, meta)

    def _sample_and_update(
        self, batch: InputBatch, logits: torch.Tensor, greedy: torch.Tensor | None = None,
        greedy_written: bool = False,
    ) -> PendingSample:
        """Samples the rows that reached their last known token and advances the host counters.
        `greedy`: each row's argmax, computed already (decode graphs); `greedy_written`: and
        stored in the device token table. A step whose masks come later returns a
        DeferredSample instead: the forward is queued, this runs at its `finish`."""
        if self._defer_sampling:
            self._defer_sampling = False
            return DeferredSample(self, (batch, logits, greedy, greedy_written))
        st = self.states
        idx = batch.idx_mapping_np[: batch.num_reqs]
        end = batch.num_computed_tokens_np[: batch.num_reqs] + batch.num_scheduled_tokens_np[
            : batch.num_reqs
        ]
        samples = end >= st.num_tokens[idx]  # the chunk reaches the last known token
        rows = np.nonzero(samples)[0]
        pending = PendingSample.empty()
        if len(rows) and logits is None:
            # a pipeline stage before the last samples nothing: its rows' tokens come with the
            # engine's next step of each request (_write_known_tokens); the counters advance
            st.num_tokens[idx[rows]] += 1
        elif len(rows):
            if len(rows) < batch.num_reqs and logits is not None:
                sel = host_to_device(rows, logits.device)
                logits = logits[sel]
                greedy = greedy[sel] if greedy is not None else None
                greedy_written = False
            if self._grammar is not None:
                self._apply_grammar(logits, [batch.req_ids[r] for r in rows])
                greedy, greedy_written = None, False  # a decode graph's argmax was unmasked
            result = self._sample(logits, idx[rows], greedy, (batch, rows))
            self.penalties.record(idx[rows], result.sampled_token_ids)
            pos = st.num_tokens[idx[rows]].copy()  # where each sampled token goes
            num_drafts = None
            if self.async_spec:  # the true positions are known on the device only
                req_rows, last = batch.idx_mapping[: batch.num_reqs], batch.logits_indices
                if len(rows) < batch.num_reqs:
                    req_rows, last = req_rows[sel], last[sel]
                # each row's token goes after its last input token's (true) position
                num_drafts = self._commit_and_draft(req_rows, batch.positions[last] + 1,
                                                    result.sampled_token_ids, None,
                                                    self._spec_ones[: len(rows)], idx[rows],
                                                    pos + 1, batch.is_prefilling[rows])
            elif self.tables is not None and not (
                    greedy_written and result.sampled_token_ids is greedy):
                fits = pos < self.max_model_len
                tokens = result.sampled_token_ids
                if not fits.all():  # rows that just reached max_model_len keep no next token
                    tokens = tokens[host_to_device(np.nonzero(fits)[0], tokens.device)]
                self.tables.write_sampled(idx[rows][fits], pos[fits], tokens)
            st.num_tokens[idx[rows]] += 1  # values arrive with the pending result
            sampled_ids = (batch.req_ids if len(rows) == batch.num_reqs
                           else [batch.req_ids[r] for r in rows])
            pending = PendingSample(
                sampled_ids, idx[rows], pos, result, st, want_logprobs=st.wants_logprobs[idx[rows]],
                num_drafts=num_drafts,
            )
            if self.tables is None:  # the host gathers the next step's inputs: it needs them now
                pending.write_host_tokens()
        st.num_computed_tokens[idx] = end
        # postprocess_state only records accepted counts: skip building its input when there
        # are none to record
        if self.model_state.num_accepted_tokens is not None:
            num_sampled = host_to_device(samples.astype(np.int32), self.device)
            self.model_state.postprocess_state(
                batch.idx_mapping[: batch.num_reqs], num_sampled, batch.seq_lens[: batch.num_reqs]
            )
        return pending

    def _apply_grammar(self, logits: torch.Tensor, row_req_ids: list[str],
                       logits_rows: np.ndarray | None = None) -> None:
        """Masks the structured rows' logits in place (one launch): `row_req_ids[j]` is the
        request of sampling row j, whose logits are row `logits_rows[j]` (default j); a verify
        row's id comes 1 + n times in the step's ids, its masks for logits rows
        logits_rows[j] .. + n. The sampler then sees the masked logits, so greedy, sampling,
        penalties and logprobs all follow the grammar; the logprobs are those of the masked
        distribution (as vLLM v1's: its bitmask is applied before the sampler too)."""
        req_ids, bitmask = self._grammar
        where = {rid: j for j, rid in enumerate(row_req_ids)}
        rows = [where.get(rid, -1) for rid in req_ids]
        if logits_rows is not None:
            # a verify row's id repeats once a position: its masks go to its logits in order
            seen: dict[str, int] = {}
            for m, (rid, j) in enumerate(zip(req_ids, rows)):
                if j >= 0:
                    rows[m] = int(logits_rows[j]) + seen.get(rid, 0)
                    seen[rid] = seen.get(rid, 0) + 1
        dev = logits.device
        apply_token_bitmask(logits, bitmask.to(dev, non_blocking=True),
                            host_to_device(np.array(rows, dtype=np.int32), dev))

    def _sample(
        self, logits: torch.Tensor, idx: np.ndarray, greedy: torch.Tensor | None = None,
        delta: tuple[InputBatch, np.ndarray] | None = None,
    ) -> SamplerOutput:
        st = self.states
        if st.plain_greedy[idx].all():
            tokens = greedy if greedy is not None else argmax(logits)
            return SamplerOutput(sampled_token_ids=tokens, logprobs=None)
        return self.sampler(logits, self._sampling_metadata(logits, idx, delta))

    def _sampling_metadata(self, logits: torch.Tensor, idx: np.ndarray,
                           delta: tuple[InputBatch, np.ndarray] | None = None
                           ) -> SamplingMetadata:
        """The sampling parameters of the rows at req_state indices `idx`. `delta`: (the
        step's batch, the rows' batch rows): seeded rows then draw at their true output index,
        the host's count less the rejections it has not learned (`batch.spec_delta`,
        asynchronous speculation)."""
        st = self.states
        params = [st.params[i] for i in idx]
        num_out = st.num_tokens[idx] - (st.num_prompt_tokens[idx] - st.num_output_offset[idx])
        rows = [
            SamplingRow(
                params=p,
                prompt_token_ids=[],
                output_token_ids=[],
                eos_token_ids=st.eos_token_ids[i],
                num_output_tokens=int(n),
            )
            for p, i, n in zip(params, idx, num_out)
        ]
        counts, mask = self.penalties.gather(idx)
        meta = build_sampling_metadata(rows, logits.shape[-1], logits.device, counts, mask)
        if (delta is not None and delta[0].spec_delta is not None
                and any(p.seed is not None for p in params)):
            batch, batch_rows = delta
            meta.seed_offset_delta = batch.spec_delta[host_to_device(
                np.asarray(batch_rows, dtype=np.int64), batch.spec_delta.device)]
        return meta


@dataclass
class _VerifyStep:
    """What a verify step's forward leaves for its sampling (ModelRunner._verify)."""

    batch: InputBatch
    hidden: torch.Tensor | None  # a verify graph's: only with an observing drafter, else None
    logits: torch.Tensor  # [cu[-1], V]: the positions the rejection sampler takes
    prompt_logprobs: dict
    computed: np.ndarray  # [num_reqs] the rows' computed counts before the step
    end: np.ndarray  # [num_reqs] and after it, every scheduled token computed
    rows: np.ndarray  # batch rows that sample (every decode row; prefill rows at their end)
    first: np.ndarray  # [len(rows)] each sampling row's first logits position in the batch
    counts: np.ndarray  # int32 [len(rows)] positions a row verifies: 1 + its drafts
    cu: np.ndarray  # int64 [len(rows) + 1] cumulative counts
    greedy: torch.Tensor | None = None  # int64 [cu[-1]]: the logits' argmax (verify graphs)


def _draft_positions(v: _VerifyStep) -> np.ndarray:
    """int64 [sum(counts - 1)]: where a verify step's drafts sit in its batch, in row order
    (each sampling row's input tokens after its first)."""
    nd = v.counts - 1
    drafts_before = v.cu[:-1] - np.arange(len(v.rows))  # drafts of the rows before each row
    return (np.repeat(v.first + 1 - drafts_before, nd) + np.arange(int(nd.sum()))).astype(
        np.int64)


class DeferredSample:
    """A step whose forward is queued and whose sampling waits for its structured rows' masks:
    under async scheduling the masks need the previous step's tokens on the host, which the
    engine reads back while the device runs this step's forward. `finish` queues the masking
    and sampling and returns the step's PendingSample."""

    def __init__(self, runner: ModelRunner, args: tuple) -> None:
        self.runner = runner
        self.args = args  # _sample_and_update's (batch, logits, greedy, greedy_written)
        self.prompt_logprobs: dict = {}

    @torch.inference_mode()
    def finish(self, req_ids: list[str], bitmask) -> PendingSample:
        runner = self.runner
        runner._grammar = None if bitmask is None else (req_ids, bitmask)
        pending = runner._sample_and_update(*self.args)
        pending.prompt_logprobs = self.prompt_logprobs
        self.args = None
        return pending


class PendingSample:
    """The sampled tokens of a launched step, copied to the host without blocking it."""

    def __init__(self, req_ids, rows, positions, result: SamplerOutput | None, states,
                 want_logprobs=None, num_drafts: torch.Tensor | None = None) -> None:
        self.req_ids: list[str] = req_ids
        self.rows = rows  # req_state_idx of each sampling row
        self.positions = positions  # the token position each row samples
        self.states = states
        self.want_logprobs = want_logprobs if want_logprobs is not None else []
        self.prompt_logprobs: dict = {}
        self._host = None
        self._event = None
        self._tokens: list[int] | None = None
        self._written = False  # token values already in the host table
        self.waited_s = 0.0  # how long reading the tokens back blocked the host
        self._resolved: dict[str, SampledTokens] | None = None
        # asynchronous speculation: whether each row's drafter found a match (see
        # ModelRunner._commit_and_draft); the last entry of the host tensors
        self._has_drafts = num_drafts is not None
        if result is None:
            return
        lp = result.logprobs
        tensors = [result.sampled_token_ids]
        if lp is not None:
            tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        if num_drafts is not None:
            tensors.append(num_drafts)
        if tensors[0].is_cuda:
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    @classmethod
    def empty(cls) -> PendingSample:
        return cls([], np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), None, None)

    @classmethod
    def resolved(cls, sampled: dict[str, SampledTokens]) -> PendingSample:
        """A step whose results the host holds already (speculative verify steps)."""
        p = cls.empty()
        p._resolved = sampled
        return p

    def ready(self) -> bool:
        """Whether `result()` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def _token_list(self) -> list[int]:
        if self._tokens is None:
            if self._event is not None:
                t0 = time.perf_counter()
                self._event.synchronize()
                self.waited_s = time.perf_counter() - t0
            self._tokens = self._host[0].tolist() if self._host is not None else []
        return self._tokens

    def tokens(self) -> list[int]:
        """Waits for the step's sampled tokens: one a sampling row, in `req_ids` order (what a
        drafter reads of its own runner's steps: no SampledTokens built a row)."""
        tokens = self._token_list()
        if tokens:
            self.write_host_tokens()
        return tokens

    def write_host_tokens(self) -> None:
        """Stores the sampled values in the host token table, for rows still held by the same
        request (a row may have been handed to another request since the launch)."""
        if self._written:
            return
        self._written = True
        st = self.states
        width = st.token_ids.shape[1]
        for rid, i, pos, tok in zip(self.req_ids, self.rows, self.positions, self._token_list()):
            if st.req_ids[i] == rid and pos < width:
                st.token_ids[i, pos] = tok

    def wire(self) -> tuple[list[str], list[list[int]]] | None:
        """The step's tokens as (req ids, [token ids]) without building a SampledTokens a row
        (the worker's reply, `wire.decode_sampled`), or None when it carries logprobs."""
        if self._resolved is not None or self.prompt_logprobs or (
                self._host is not None and len(self._host) > 1):
            return None
        tokens = self._token_list()
        if tokens:
            self.write_host_tokens()
        return list(self.req_ids), [[t] for t in tokens]

    def result(self) -> dict[str, SampledTokens]:
        """Waits for the step's sampled tokens: {req_id: SampledTokens}."""
        if self._resolved is not None:
            return self._resolved
        tokens = self._token_list()
        out: dict[str, SampledTokens] = {}
        if tokens:
            self.write_host_tokens()
            host = self._host[:-1] if self._has_drafts else self._host
            drafts = self._host[-1].tolist() if self._has_drafts else None
            lp = [t.tolist() for t in host[1:]] if len(host) > 1 else None
            for j, rid in enumerate(self.req_ids):
                sampled = SampledTokens([tokens[j]],
                                        num_drafts=drafts[j] if drafts is not None else None)
                if lp is not None and self.want_logprobs[j]:
                    sampled.logprobs = [dict(zip(lp[0][j], lp[1][j]))]
                    sampled.ranks = [lp[2][j]]
                out[rid] = sampled
        for rid, entries in self.prompt_logprobs.items():
            out.setdefault(rid, SampledTokens([])).prompt_logprobs = entries
        return out


class PendingVerify:
    """An asynchronous verify step's tokens, copied to the host without blocking it. Its
    `result()` also corrects the runner's host counters by the rejected drafts (the device
    corrected its own when the step ran)."""

    def __init__(self, runner: ModelRunner, req_ids: list[str], rows: np.ndarray,
                 counts: np.ndarray, packed: torch.Tensor, lp: LogprobsTensors | None,
                 want_logprobs: np.ndarray) -> None:
        """packed int64 [S, max_n + 2]: each row's tokens (-1 past its outputs), then its
        num_sampled and its drafter's found count; `lp`: the step's logprobs, or None."""
        self.runner = runner
        self.req_ids = req_ids
        self.rows = rows  # req_state_idx of each sampling row
        self.counts = counts  # positions each row could accept: 1 + its drafts
        self.want_logprobs = want_logprobs
        self.prompt_logprobs: dict = {}
        self.waited_s = 0.0
        self._value: dict[str, SampledTokens] | None = None
        tensors = [packed]  # (one copy back without logprobs)
        if lp is not None:
            tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        self._event = None
        if tensors[0].is_cuda:
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = tensors

    def result(self) -> dict[str, SampledTokens]:
        if self._value is not None:
            return self._value
        if self._event is not None:
            t0 = time.perf_counter()
            self._event.synchronize()
            self.waited_s = time.perf_counter() - t0
        packed = self._host[0].numpy()  # [S, max_n + 2]
        lp = [t.tolist() for t in self._host[1:]] if len(self._host) > 1 else None
        runner = self.runner
        st = runner.states
        # the rows' rejected drafts off the host counters, for rows still held by the same
        # request (a row may have a new request by now); rows are distinct
        rejected = self.counts - packed[:, -2]  # [S]
        held = np.fromiter((st.req_ids[i] == rid for i, rid in zip(self.rows.tolist(),
                                                                   self.req_ids)),
                           bool, len(self.req_ids))
        fix = held & (rejected > 0)
        if fix.any():
            st.num_tokens[self.rows[fix]] -= rejected[fix]
            runner.spec_known[self.rows[fix]] += rejected[fix]
        tokens = packed[:, :-2].tolist()
        num_sampled = packed[:, -2].tolist()
        num_drafts = packed[:, -1].tolist()
        out: dict[str, SampledTokens] = {}
        for j, rid in enumerate(self.req_ids):
            m = num_sampled[j]
            got = SampledTokens(tokens[j][:m], num_drafts=num_drafts[j])
            if lp is not None and self.want_logprobs[j]:
                got.logprobs = [dict(zip(lp[0][j][q], lp[1][j][q])) for q in range(m)]
                got.ranks = [lp[2][j][q] for q in range(m)]
            out[rid] = got
        for rid, entries in self.prompt_logprobs.items():
            out.setdefault(rid, SampledTokens([])).prompt_logprobs = entries
        self._value = out
        self._host = None
        return out

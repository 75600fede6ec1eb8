"""The EAGLE drafters: a small head over the target's own hidden states proposes the drafts.

`speculative_config={"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens":
k}` with a Llama-family target (Llama, Mistral, Qwen2, Qwen3) and a head in the public layout
(krait/models/eagle.py). Like the draft-model drafter, the head runs in a second `ModelRunner`
(the target's device, dtype, lengths, block size and batch limits) with its own KV blocks (one
attention layer) handed out by its own `KVCacheManager`, driven through SchedulerOutputs built
here; the head reads its side input (`input_hidden`) from this drafter before each forward.

Head position p takes the token at target position p + 1 and the target's hidden state at p, so
a request's head sequence is its target sequence shifted by one: after the target computed
positions 0..n-2 (its n-th token sampled, not computed yet), the head computes 0..n-2 and its
argmax at n-2 is draft 1.

Hidden states. After every target step (prefill chunks, decodes and verify steps, on the
synchronous path) the target runner calls `observe` with its hidden states at the positions it
computed and kept: all of a prefill chunk's or a decode's, the 1 + accepted positions of a
verify row. EAGLE-1 takes the target model's output (after its final norm); EAGLE-3 the inputs
of three target layers (`aux_layer_ids`), which the target model keeps in `aux_hidden` only
when this drafter asked for them (`aux_hidden_layers`). They wait in `_pending` per request
(as segments of the tensor each step kept: no tensor op a row) until the next `propose`, which
gathers each catch-up step's side input from them in one index.

Each `propose` call, for every running request it is given:

1. catch-up: the head positions whose target hidden states are pending run as one prefill-like
   chunk (split into steps of at most max_num_batched_tokens tokens), also for requests that
   may not draft now (still in prefill, penalties, ...): the head must have every position's KV
   when they do. Where that reaches the target's last computed position, the argmax there is
   draft 1, and the head's output there is the hidden state of step 2 (kept by target row in
   `_last_hidden`, one scatter a step). A request with nothing pending (not scheduled since
   the last call) reuses the draft 1 and hidden it got then. A row with one position to catch
   up (every draft rejected) is a decode row of the head runner (those come first in the
   step, the order of its batch).
2. k - 1 one-token greedy steps, each taking the token and the head's own output hidden state
   of the step before (EAGLE-3: its pre-norm output, without fc), all rows in one batch a step.

Graphs: on the GPU, unless enforce_eager, the head runner captures decode CUDA graphs, the side
input in a buffer of each graph (krait/runner/cuda_graphs.py; EAGLE-3's fc is applied to the
target's [T, 3H] hidden states before, `project_hidden`, so the side input is [T, H] in every
step). The one-token steps replay them, and so does a catch-up whose rows all have one position
(every draft rejected); longer catch-ups run eagerly. A head whose capture fails runs eagerly.
As with the draft model's decode graphs, their pool (max_num_seqs rows of one token) lives in
the target's memory profiling reserve.
Every step's tokens are read back once, after the last step was launched.

KV the head wrote at draft positions needs no rollback: its computed count covers verified
positions only, and the next catch-up rewrites them before anything reads them. A request the
head's pool cannot hold waits (its hidden states stay pending) until blocks come back. A head
sequence that lost positions (which cannot happen through the runner) never drafts again for
that request; the target is unaffected. Requests leaving the target leave the head through
`on_requests_removed`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from krait.config import EngineConfig, SpeculativeConfig
from krait.engine.scheduler import CachedRequestData, NewRequestData
from krait.runner.input_batch import host_to_device
from krait.runner.spec_decode.draft_model import (
    HeldRows,
    check_drafts,
    draft_engine_config,
    init_draft_pool,
    read_steps,
    sched_output,
)
from krait.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)
MTP_METHODS = ("mtp", "qwen3_next_mtp")  # Qwen3-Next's own head (krait/models/qwen3_next_mtp.py)


@dataclass
class _HeadSeq:
    """One target request as the head sees it (duck-types what KVCacheManager reads)."""

    request_id: str  # the head runner's id
    num_computed_tokens: int = 0  # head positions computed: 0..c-1
    next_token: int = -1  # the argmax at position c - 1 (a draft 1 when c = n - 1)
    has_hidden: bool = False  # the head's output there is in EagleDrafter._last_hidden
    block_ids: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    """Target hidden states a request's head has not consumed: positions start, start + 1, ...,
    as segments (tensor an observed step kept, first row in it, rows): no tensor op a row."""

    start: int
    segs: list[tuple[torch.Tensor, int, int]]
    length: int


def _flat_index(pendings: list[_Pending]) -> tuple[torch.Tensor, np.ndarray]:
    """(source, index): the rows of `source` (the observed tensors the segments lie in, one of
    them or their concatenation) holding every pending position, the pendings' in order."""
    bases: dict[int, int] = {}
    srcs: list[torch.Tensor] = []
    starts: list[int] = []
    lens: list[int] = []
    total = 0
    for pend in pendings:
        for t, off, cnt in pend.segs:
            base = bases.get(id(t))
            if base is None:
                base = bases[id(t)] = total
                srcs.append(t)
                total += t.shape[0]
            starts.append(base + off)
            lens.append(cnt)
    start, length = np.array(starts, dtype=np.int64), np.array(lens, dtype=np.int64)
    before = np.cumsum(length) - length
    index = np.repeat(start - before, length) + np.arange(int(length.sum()), dtype=np.int64)
    return (srcs[0] if len(srcs) == 1 else torch.cat(srcs)), index


def _refuse(spec: SpeculativeConfig, why: str) -> ValueError:
    return ValueError(f"speculative_config.model={spec.model!r} (method {spec.method!r}): {why}")


class EagleDrafter:
    """Greedy drafts from an EAGLE-1 or EAGLE-3 head, or from Qwen3-Next's MTP head (method
    "mtp": the target's own checkpoint, read as EAGLE-1 is: the target's final hidden states,
    the head's output fed back; see the module doc)."""

    catches_up_every_call = True  # the runner calls propose even when no row may draft

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig,
                 target: torch.nn.Module) -> None:
        from krait.models.eagle import (  # noqa: PLC0415
            Eagle3LlamaForCausalLM,
            EagleLlamaForCausalLM,
            aux_layer_ids,
        )
        from krait.models.llama import LlamaForCausalLM  # noqa: PLC0415
        from krait.models.qwen3_next import Qwen3NextForCausalLM  # noqa: PLC0415
        from krait.models.qwen3_next_mtp import Qwen3NextMTP, mtp_layer_count  # noqa: PLC0415
        from krait.models.registry import get_model_class  # noqa: PLC0415
        from krait.runner.model_runner import ModelRunner  # noqa: PLC0415 (imports this module)

        method = spec.method
        mtp = method in MTP_METHODS
        if mtp:
            if not isinstance(target, Qwen3NextForCausalLM):
                raise ValueError(
                    f"speculative_config.method={method!r}: multi-token-prediction heads run on "
                    f"Qwen3-Next targets (their checkpoint's mtp.* tensors); the target is "
                    f"{type(target).__name__}")
            spec = replace(spec, model=spec.model or config.model.model)
        elif not isinstance(target, LlamaForCausalLM):
            raise ValueError(
                f"speculative_config.method={method!r}: EAGLE heads run on Llama-family targets "
                f"(Llama, Mistral, Qwen2, Qwen3); the target is {type(target).__name__}")
        self.k = spec.num_speculative_tokens
        self.eagle3 = method == "eagle3"
        self.config = draft_engine_config(spec, config, past_positional_limit=True)
        hc, tc = self.config.model.hf_config, config.model.hf_config
        if mtp:
            if mtp_layer_count(hc) != 1:
                raise _refuse(spec, f"the config declares {mtp_layer_count(hc)} MTP layers "
                                    "(mtp_num_hidden_layers); a head of one is supported")
            hc.architectures = ["Qwen3NextMTP"]  # the head, not the target (a config of its own)
        elif not self.eagle3 and list(getattr(hc, "architectures", None) or []) == [
                "LlamaForCausalLM"]:
            hc.architectures = ["EagleLlamaForCausalLM"]  # EAGLE-1 releases name their base's
        want = (Qwen3NextMTP if mtp else Eagle3LlamaForCausalLM if self.eagle3
                else EagleLlamaForCausalLM)
        if get_model_class(hc) is not want:
            raise _refuse(spec, f"architecture {hc.architectures[0]!r} is not an {method!r} head "
                                "(EagleLlamaForCausalLM / LlamaForCausalLMEagle for eagle, "
                                "Eagle3LlamaForCausalLM / LlamaForCausalLMEagle3 for eagle3)")
        target_hidden = getattr(hc, "target_hidden_size", None) or hc.hidden_size
        for name, v in (("hidden_size", hc.hidden_size), ("target_hidden_size", target_hidden)):
            if v != tc.hidden_size:
                raise _refuse(spec, f"the head's {name} is {v}, the target's hidden_size "
                                    f"{tc.hidden_size}; they must be equal")
        if self.eagle3:
            layers = aux_layer_ids(hc, tc.num_hidden_layers)
            if len(layers) != 3 or not all(0 <= i < tc.num_hidden_layers for i in layers):
                raise _refuse(spec, f"auxiliary hidden-state layers {list(layers)} are not three"
                                    f" layers in 0..{tc.num_hidden_layers - 1} of the target")
            target.aux_hidden_layers = layers
        self.target = target
        self.runner = ModelRunner(self.config)
        self.head = self.runner.model
        self.head.share_target(target)
        self.kv = init_draft_pool(self.runner, config, 0)
        self.max_batched = self.config.scheduler.max_num_batched_tokens
        self._seqs: dict[int, _HeadSeq] = {}  # target req_state index -> its head sequence
        self._pending: dict[int, _Pending] = {}  # target req_state index -> hidden states
        self._lost: set[int] = set()  # rows whose head sequence lost positions: no drafts
        self._finished: set[str] = set()  # head ids to drop in the head runner's next step
        self._next_id = 0
        self.num_catch_up_steps = 0  # tallies (tests, diagnostics)
        self.num_reused_first_drafts = 0
        self.num_lost = 0  # head sequences that lost positions (never, through the runner)
        # [max_num_seqs, H], by target row: the head's output at each sequence's last computed
        # position (the hidden state of its next step; allocated on first use)
        self._last_hidden: torch.Tensor | None = None
        if self.config.device.type == "cuda" and not self.config.enforce_eager:
            self.capture_graphs()

    def capture_graphs(self, record: bool = True) -> None:
        """Decode CUDA graphs for the head's runner, its side input in a buffer of each graph
        (krait/runner/cuda_graphs.py): the one-token steps and the catch-ups of one position a
        row replay them. `record=False`: their dataflow run eagerly (CPU tests). A head whose
        capture fails runs eagerly (logged)."""
        from krait.runner.cuda_graphs import CudaGraphRunner  # noqa: PLC0415

        graphs = CudaGraphRunner(self.runner, record=record)
        try:
            graphs.capture_all()
        except RuntimeError as e:
            logger.warning("EAGLE head: decode graphs off, their capture failed: %s", e)
            return
        self.runner.cuda_graphs = graphs

    # -- the target's hidden states -------------------------------------------------------
    def observe(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                first: np.ndarray, hidden: torch.Tensor) -> None:
        """After a target step: row j (req_state index rows[j]) computed and kept `counts[j]`
        positions from `starts[j]`, its first at token `first[j]` of the step; `hidden` is the
        target model's output for the step ([T, H]; EAGLE-3 reads the model's `aux_hidden`)."""
        keep = np.flatnonzero(counts > 0)
        if not len(keep):
            return
        rows, starts, counts, first = rows[keep], starts[keep], counts[keep], first[keep]
        src = self.target.aux_hidden if self.eagle3 else hidden
        before = np.cumsum(counts) - counts
        at = np.repeat(first - before, counts) + np.arange(int(counts.sum()))
        kept = src[host_to_device(at.astype(np.int64), src.device)]
        for row, s, off, cnt in zip(rows.tolist(), starts.tolist(), before.tolist(),
                                    counts.tolist()):
            pend = self._pending.get(row)
            if pend is None:
                seq = self._seqs.get(row)
                if s != (seq.num_computed_tokens if seq is not None else 0):
                    self._lose(row)
                    continue
                self._pending[row] = _Pending(s, [(kept, off, cnt)], cnt)
            elif s == pend.start + pend.length:
                pend.segs.append((kept, off, cnt))
                pend.length += cnt
            else:
                self._lose(row)

    def _lose(self, row: int) -> None:
        logger.warning("EAGLE head: request row %d lost hidden states; it drafts no more", row)
        self.num_lost += 1
        self._lost.add(row)
        self._pending.pop(row, None)
        seq = self._seqs.pop(row, None)
        if seq is not None:
            self._drop(seq)

    # -- requests leaving -----------------------------------------------------------------
    def on_requests_removed(self, rows: list[int]) -> None:
        for row in rows:
            row = int(row)
            self._pending.pop(row, None)
            self._lost.discard(row)
            seq = self._seqs.pop(row, None)
            if seq is not None:
                self._drop(seq)

    def _drop(self, seq: _HeadSeq) -> None:
        self.kv.free(seq)
        self._finished.add(seq.request_id)

    # -- drafting -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, token_table: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """token_table int32 [max_reqs, max_model_len] (the target's host token table), the rows
        (its req_state indices) to catch up and draft for, their token counts and the most
        drafts each may take -> (drafts int32 [R, k], -1 padded; counts int32 [R])."""
        drafts = np.full((len(rows), self.k), -1, dtype=np.int32)
        counts = np.zeros(len(rows), dtype=np.int32)
        caps = np.minimum(np.asarray(max_drafts, dtype=np.int64), self.k)
        st = self.runner.states
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []  # the held rows that got new blocks
        plan: list[tuple[int, _HeadSeq, int, int, bool]] = []  # (row j, seq, end, drafts, ran)
        plan_rows: list[int] = []  # each plan row's target row
        # head id -> the hidden states it consumes now: rows of one position (decode rows)
        # first, then the others (prefill rows), as the head runner orders a step's rows
        catch_up: dict[str, _Pending] = {}
        catch_up_prefill: dict[str, _Pending] = {}
        reused: list[tuple[int, int]] = []  # (plan row, its draft 1) of rows not scheduled
        held = HeldRows()
        for j in range(len(rows)):
            row, n, m = int(rows[j]), int(num_tokens[j]), int(caps[j])
            if row in self._lost:
                continue
            seq = self._seqs.get(row)
            c = seq.num_computed_tokens if seq is not None else 0
            pend = self._pending.get(row)
            e = c + (pend.length if pend is not None else 0)  # head positions known after it
            if e > n - 1:  # cannot happen: more hidden states than computed positions
                self._lose(row)
                continue
            m = m if e == n - 1 else 0  # drafts only from the last verified position
            if pend is None and (m == 0 or seq is None or not seq.has_hidden):
                continue  # nothing to catch up, nothing to draft
            fresh = seq is None
            if fresh:
                seq = _HeadSeq(f"head-{self._next_id}")
                self._next_id += 1
            # KV for every position a head step writes: up to e + m - 2
            new_blocks = self.kv.allocate(seq, max(e, e + m - 1) - c)
            if new_blocks is None:  # the pool is short: wait, the hidden states stay pending
                if fresh:
                    self.kv.free(seq)
                continue
            rid = seq.request_id
            if fresh:
                self._seqs[row] = seq
                new_reqs.append(NewRequestData(
                    req_id=rid, token_ids=token_table[row, 1 : e + 1].tolist(),
                    num_prompt_tokens=e, params=_GREEDY, block_ids=list(seq.block_ids),
                    state_slots=[], num_computed_tokens=0, num_output_tokens=0,
                    eos_token_ids=[]))
            else:
                # (the head runner's computed count is `c` already: only new blocks to send)
                if new_blocks:
                    cached.append(CachedRequestData(rid, new_blocks, c))
                # the head's tokens: the target's, one position on (e > c), or its known draft 1
                held.add(st.index[rid], c, e, row, seq.next_token)
                if e == c:  # not scheduled since the last call
                    reused.append((len(plan), seq.next_token))
                    self.num_reused_first_drafts += 1
            if pend is not None:
                del self._pending[row]
                (catch_up if not fresh and e - c == 1 else catch_up_prefill)[rid] = pend
            plan.append((j, seq, e, m, pend is not None))
            plan_rows.append(row)
        held.write(st, token_table, 1, self.runner.tables)
        finished, self._finished = self._finished, set()
        catch_up |= catch_up_prefill
        where = {seq.request_id: q for q, (_, seq, *_) in enumerate(plan)}
        steps = self._catch_up(catch_up, where, plan_rows, new_reqs, cached, finished)
        if not plan:
            return drafts, counts
        m_of = np.array([m for *_, m, _ in plan], dtype=np.int64)
        steps += self._one_token_steps(plan, plan_rows, m_of)
        got = np.full((len(plan), self.k), -1, dtype=np.int64)  # each plan row's tokens
        for q, tok in reused:
            got[q, 0] = tok
        read_steps(steps, where, got)
        check_drafts(got, np.maximum(m_of, 1), [seq.request_id for _, seq, *_ in plan])
        js = np.array([j for j, *_ in plan], dtype=np.int64)
        # (a row that only caught up sampled a token too: the argmax it keeps, not a draft)
        drafts[js] = np.where(np.arange(self.k) < m_of[:, None], got, -1)
        counts[js] = m_of
        for (_, seq, e, _, ran), tok in zip(plan, got[:, 0].tolist()):
            if ran:  # the argmax and output at the last caught-up position
                seq.next_token = tok
                seq.has_hidden = True
            seq.num_computed_tokens = e
        ids = np.fromiter((st.index[seq.request_id] for _, seq, *_ in plan), np.int64, len(plan))
        e_of = np.array([e for _, _, e, _, _ in plan], dtype=np.int32)
        st.num_computed_tokens[ids] = e_of  # verified positions only: the drafts are forgotten
        st.num_tokens[ids] = e_of
        return drafts, counts

    def _catch_up(self, catch_up: dict[str, _Pending], where: dict[str, int],
                  plan_rows: list[int], new_reqs: list, cached: list, finished: set) -> list:
        """Launches the catch-up: the pending hidden states (one gather from the observed
        tensors a step), in the order of `catch_up` (its decode rows first: the order of the
        head runner's batch, which the side input follows token by token), in steps of at most
        max_num_batched_tokens tokens, the first also
        carrying the new, the held and the finished requests. The head's output at each row's
        last position goes to `_last_hidden`. Returns [(launched step, 0)]: draft column 0."""
        order = list(catch_up)
        lens = [catch_up[rid].length for rid in order]
        offs = np.cumsum(lens) - lens if lens else []
        src, flat = _flat_index(list(catch_up.values())) if order else (None, None)
        steps = []
        r = done = 0  # the next row to schedule, and its positions scheduled already
        first = True
        while first or r < len(order):
            sched: dict[str, int] = {}
            pieces = []
            ends_q, ends_at = [], []  # rows that end in this step: plan row, token in the step
            budget = self.max_batched
            taken = 0
            while r < len(order) and budget > 0:
                rid = order[r]
                t = min(lens[r] - done, budget)
                sched[rid] = t
                pieces.append(flat[offs[r] + done : offs[r] + done + t])
                budget -= t
                taken += t
                done += t
                if done == lens[r]:
                    ends_q.append(where[rid])
                    ends_at.append(taken - 1)
                    r, done = r + 1, 0
            if pieces:
                index = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
                self.head.input_hidden = self.head.project_hidden(
                    src[host_to_device(index, src.device)])
            steps.append((self.runner.execute_model(sched_output(
                sched, new_reqs if first else [], cached if first else [],
                finished if first else set())), 0))
            if ends_q:
                self._keep_hidden([plan_rows[q] for q in ends_q], ends_at)
            first = False
            self.num_catch_up_steps += bool(sched)
        return steps

    def _keep_hidden(self, target_rows: list[int], at: list[int]) -> None:
        """`_last_hidden[target_rows[j]]` = the head's output of the last step at token at[j]
        (one gather and one scatter)."""
        out = self.head.output_hidden
        if self._last_hidden is None:
            self._last_hidden = out.new_zeros((self.config.scheduler.max_num_seqs,
                                               out.shape[-1]))
        rows_at = host_to_device(np.array([target_rows, at], dtype=np.int64), out.device)
        self._last_hidden[rows_at[0]] = out[rows_at[1]]

    def _one_token_steps(self, plan: list, plan_rows: list[int], m_of: np.ndarray) -> list:
        """Launches steps 2..k: each row's own last output (step 2: `_last_hidden`) and its
        last draft in, all rows that draft that far in one batch a step. Returns [(launched
        step, its draft column)]."""
        steps = []
        q = np.flatnonzero(m_of > 1)  # plan rows of step 2, in plan order
        if not len(q):
            return steps
        h = self._last_hidden[host_to_device(np.array(plan_rows, dtype=np.int64)[q],
                                             self._last_hidden.device)]
        ids = [plan[p][1].request_id for p in q.tolist()]
        for s in range(1, int(m_of.max())):
            keep = m_of[q] > s
            if not keep.all():  # rows that stop here: the others' hidden states, in order
                h = h[host_to_device(np.flatnonzero(keep), h.device)]
                q = q[keep]
                ids = [rid for rid, k in zip(ids, keep.tolist()) if k]
            self.head.input_hidden = h
            steps.append((self.runner.execute_model(sched_output(
                dict.fromkeys(ids, 1), [], [], set())), s))
            h = self.head.output_hidden[: len(ids)]  # the step's rows are its batch's, in order
        return steps

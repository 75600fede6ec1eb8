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
until the next `propose`.

Each `propose` call, for every running request it is given:

1. catch-up: the head positions whose target hidden states are pending run as one prefill-like
   chunk (split into steps of at most max_num_batched_tokens tokens), also for requests that
   may not draft now (still in prefill, penalties, ...): the head must have every position's KV
   when they do. Where that reaches the target's last computed position, the argmax there is
   draft 1, and the head's output there is the hidden state of step 2. A request with nothing
   pending (not scheduled since the last call) reuses the draft 1 and hidden it got then.
2. k - 1 one-token greedy steps, each taking the token and the head's own output hidden state
   of the step before (EAGLE-3: its pre-norm output, without fc), all rows in one batch a step.

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
    draft_engine_config,
    init_draft_pool,
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
    next_hidden: torch.Tensor | None = None  # the head's output there [H]
    block_ids: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    """Target hidden states a request's head has not consumed: positions start, start + 1, ..."""

    start: int
    chunks: list[torch.Tensor]
    length: int


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
        before = np.concatenate([[0], np.cumsum(counts)[:-1]])
        at = np.repeat(first - before, counts) + np.arange(int(counts.sum()))
        kept = src[host_to_device(at.astype(np.int64), src.device)]
        for row, s, chunk in zip(rows.tolist(), starts.tolist(),
                                 kept.split(counts.tolist())):
            pend = self._pending.get(row)
            if pend is None:
                seq = self._seqs.get(row)
                if s != (seq.num_computed_tokens if seq is not None else 0):
                    self._lose(row)
                    continue
                self._pending[row] = _Pending(s, [chunk], len(chunk))
            elif s == pend.start + pend.length:
                pend.chunks.append(chunk)
                pend.length += len(chunk)
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
        cached: list[CachedRequestData] = []
        plan: list[tuple[int, _HeadSeq, int, int, bool]] = []  # (row j, seq, end, drafts, ran)
        catch_up: dict[str, list] = {}  # head id -> [hidden states to consume, consumed]
        got: dict[str, list[int]] = {}  # head id -> its sampled tokens
        hid: dict[str, torch.Tensor] = {}  # head id -> its latest output hidden state
        w_rows: list[int] = []  # writes into the head's device token table
        w_pos: list[int] = []
        w_tok: list[int] = []
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
            if pend is None and (m == 0 or seq is None or seq.next_hidden is None):
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
                cached.append(CachedRequestData(rid, new_blocks, c))
                i = st.index[rid]
                if e > c:  # the head's tokens: the target's, one position on
                    toks = token_table[row, c + 1 : e + 1]
                    st.token_ids[i, c:e] = toks
                else:  # not scheduled since the last call: its draft 1 is known
                    toks = np.array([seq.next_token])
                    st.token_ids[i, e] = seq.next_token
                    got[rid] = [seq.next_token]
                    hid[rid] = seq.next_hidden
                    self.num_reused_first_drafts += 1
                w_rows += [i] * len(toks)
                w_pos += range(c, c + len(toks))
                w_tok += toks.tolist()
                st.num_prompt_tokens[i] = e
                st.num_tokens[i] = e + (e == c)
            if pend is not None:
                del self._pending[row]
                catch_up[rid] = [torch.cat(pend.chunks) if len(pend.chunks) > 1
                                 else pend.chunks[0], 0]
            plan.append((j, seq, e, m, pend is not None))
        tables = self.runner.tables
        if tables is not None and w_rows:
            tables.write_sampled(np.array(w_rows), np.array(w_pos),
                                 host_to_device(np.array(w_tok, dtype=np.int64), tables.device))
        finished, self._finished = self._finished, set()
        pending = []
        # 1. catch-up, in steps of at most max_num_batched_tokens (the first one also carries the
        # new, the held and the finished requests)
        first = True
        while first or catch_up:
            sched: dict[str, int] = {}
            inputs = []
            ends = []  # (head id, its last token's index in the step) for rows that end here
            budget = self.max_batched
            for rid in list(catch_up):
                if budget == 0:
                    break
                h, done = catch_up[rid]
                t = min(len(h) - done, budget)
                sched[rid] = t
                inputs.append(h[done : done + t])
                budget -= t
                catch_up[rid][1] += t
                if done + t == len(h):
                    del catch_up[rid]
                    ends.append((rid, self.max_batched - budget - 1))
            if inputs:
                self.head.input_hidden = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
            pending.append(self.runner.execute_model(sched_output(
                sched, new_reqs if first else [], cached if first else [],
                finished if first else set())))
            for rid, at in ends:
                hid[rid] = self.head.output_hidden[at]
            first = False
            self.num_catch_up_steps += bool(sched)
        if not plan:
            return drafts, counts
        ended = dict(hid)  # each row's hidden state at its last verified position
        # 2. the one-token steps, each from the head's own last output
        longest = max(m for *_, m, _ in plan)
        for s in range(1, longest):
            step = [seq.request_id for _, seq, _, m, _ in plan if m > s]
            self.head.input_hidden = torch.stack([hid[rid] for rid in step])
            pending.append(self.runner.execute_model(sched_output(
                dict.fromkeys(step, 1), [], [], set())))
            out = self.head.output_hidden
            for q, rid in enumerate(step):
                hid[rid] = out[q]
        for p in pending:  # read back once, after every step was launched
            for rid, sampled in p.result().items():
                got.setdefault(rid, []).extend(sampled.token_ids)
        for j, seq, e, m, ran in plan:
            toks = got[seq.request_id]
            if len(toks) != max(m, 1):
                raise RuntimeError(f"head row {seq.request_id}: {len(toks)} tokens, expected "
                                   f"{max(m, 1)}")
            if m:
                drafts[j, :m] = toks
                counts[j] = m
            if ran:  # the argmax and output at the last caught-up position
                seq.next_token = toks[0]
                seq.next_hidden = ended[seq.request_id]
            seq.num_computed_tokens = e
            i = st.index[seq.request_id]
            st.num_computed_tokens[i] = e  # verified positions only: the drafts are forgotten
            st.num_tokens[i] = e
        return drafts, counts

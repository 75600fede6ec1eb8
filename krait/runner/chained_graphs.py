"""Chained decode graphs: S greedy one-token steps of a draft model as one CUDA graph a batch
size.

Step 0 takes each row's known token (the drafter's one-token catch-up), step s > 0 takes the
argmax of step s - 1 at the next position: positions, sequence lengths and KV slots advance on
the device (the slot of position p is block_table[row, p // block_size] * block_size +
p % block_size), so one replay replaces S steps with host work between them. The greedy tokens
of every step come back as one int64 [N, S] tensor. Dense models only (the metadata of a
recurrent-state model would have to advance its state slots too).

Only the drafter uses these (krait/runner/spec_decode/draft_model.py, `_draft_chained`);
`ENABLED = False` below turns them off, and the drafter then steps its decode graphs one by one
(the fallback, should a chained graph fail on some GPU: krait/envs.py admits no switch for a
performance choice). `record=False` runs the captured body eagerly at each replay (the CPU tests' path), over
the real batch's attention bound: min(max_seq_len + S - 1, max_model_len).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from krait.ops.argmax import argmax
from krait.runner.cuda_graphs import capture_each, capture_sizes, copy_tensors, record_graph
from krait.runner.input_batch import InputBatch

logger = logging.getLogger(__name__)


# the switch: False = the draft-model drafter never captures or replays chained graphs
ENABLED = True


def chained_graphs_enabled() -> bool:
    """Whether drafters capture chained graphs (`ENABLED`, read at capture)."""
    return ENABLED


def next_slots(block_table: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """int64 [N] KV slots of `positions` (int64 [N]) through block_table (int32 [N, W]); -1 where
    `live` (bool [N]) is False (padding rows write no KV)."""
    blk = block_table.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long()
    return torch.where(live, blk * block_size + positions % block_size, -1)


@dataclasses.dataclass
class _Chain:
    graph: object | None  # torch.cuda.CUDAGraph, or None (record=False)
    batch: InputBatch  # step 0's captured inputs
    meta: object  # StepMetadata of step 0 (captured buffers)
    tokens: torch.Tensor | None  # int64 [N, S]: each step's greedy tokens


class ChainedDecodeGraphs:
    """`steps` chained greedy decode steps for one (dense) ModelRunner, per capture size."""

    def __init__(self, runner, steps: int, record: bool = True, pool=None) -> None:
        self.runner = runner
        self.steps = steps
        self.record = record
        self.sizes = capture_sizes(runner.config.scheduler.max_num_seqs)
        self.chains: dict[int, _Chain] = {}
        self.pool = pool

    def size_for(self, num_reqs: int) -> int | None:
        fitting = [s for s in self.sizes if s >= num_reqs]
        return min(fitting) if fitting else None

    def captured_batch(self, size: int) -> InputBatch:
        """Step 0's input buffers of the chain of `size` rows (`build_input_batch(into=...)`)."""
        return self.chains[size].batch

    @torch.inference_mode()
    def capture_all(self) -> None:
        cost = capture_each(self.sizes, self._capture, self.record)
        if cost is not None:
            logger.info("captured %d chained %d-step draft CUDA graphs (%.0f MiB, %.1f s)",
                        len(self.sizes), self.steps, cost.bytes / 2**20, cost.seconds)

    def _capture(self, n: int) -> None:
        r = self.runner
        batch = r.dummy_decode_batch(n)  # full-width block table: positions advance
        meta = r.model_state.prepare_attn(batch, for_capture=True)
        if not self.record:
            self.chains[n] = _Chain(None, batch, meta, None)
            return
        graph, tokens = record_graph(lambda: self._body(batch, meta), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.chains[n] = _Chain(graph, batch, meta, tokens)

    def _body(self, batch: InputBatch, meta) -> torch.Tensor:
        """The S steps over step 0's buffers -> int64 [N, S] greedy tokens."""
        r = self.runner
        attn = meta.attn
        ids, pos = batch.input_ids, batch.positions  # int64 [N]
        seq, slots = attn.seq_lens, attn.slot_mapping  # int32 [N], int64 [N]
        live = batch.idx_mapping >= 0  # bool [N]
        step_len = live.to(seq.dtype)
        out = []
        for s in range(self.steps):
            step = dataclasses.replace(meta, attn=dataclasses.replace(
                attn, seq_lens=seq, slot_mapping=slots))
            greedy = argmax(r.model.compute_logits(r.model(ids, pos, step)))  # int64 [N]
            out.append(greedy)
            if s + 1 < self.steps:
                ids, pos, seq = greedy, pos + 1, seq + step_len
                slots = next_slots(attn.block_table, pos, live, r.block_size)
        return torch.stack(out, dim=1)

    def run(self, batch: InputBatch) -> torch.Tensor:
        """batch: step 0, a decode batch padded to a captured size with a full-width block table
        (built into its buffers, or not) -> int64 [N, S] (the chain's buffer: valid until the
        next run)."""
        c = self.chains[batch.num_reqs_padded]
        meta = self.runner.model_state.prepare_attn(batch, for_capture=False, into=c.meta)
        for dst, src in ((c.batch.input_ids, batch.input_ids),
                         (c.batch.positions, batch.positions),
                         (c.batch.idx_mapping, batch.idx_mapping)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        copy_tensors(c.meta, meta)
        if c.graph is None:  # record=False: the body over the real batch's attention bound
            bound = int(np.max(batch.seq_lens_cpu_upper_bound[: batch.num_reqs], initial=0))
            bound = min(bound + self.steps - 1, self.runner.max_model_len)
            step0 = dataclasses.replace(c.meta, attn=dataclasses.replace(
                c.meta.attn, max_seq_len=bound))
            c.tokens = self._body(c.batch, step0)
        else:
            c.graph.replay()
        return c.tokens


class ChainedSample:
    """A launched chain's greedy tokens, copied to the host without blocking it: `tokens()`
    waits once and returns int64 [num_reqs, S], rows in `req_ids` order."""

    def __init__(self, req_ids: list[str], tokens: torch.Tensor) -> None:
        self.req_ids = req_ids
        # int64 [num_reqs, S] on the device: the chain's buffer, valid until its next run
        self.device = tokens
        self._event = None
        if tokens.is_cuda:
            self._host = tokens.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens.clone()  # (record=False: the chain's buffer is rebound next run)

    def tokens(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.numpy()

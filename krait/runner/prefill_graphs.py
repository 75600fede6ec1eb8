"""Whole-forward CUDA graphs for steps of one prefill row (on by default on the GPU with the
piecewise graphs; `KRAIT_PREFILL_GRAPHS=0` turns them off).

A step whose only row is a prefill (a lone request's prompt, or a chunk of it) is an idle
server's time to first token. Piecewise graphs (krait/runner/piecewise_graphs.py) take its
projections, norms and MLPs, but leave the sequence mixers eager: on the H200 a Mamba mixer is
seven Triton launches and an attention mixer two, and their host time (~150-300 us a layer) is
most of a short prompt's prefill (mamba2-1.3b 18 ms for 128 tokens, docs/benchmarks.md).

Such a step has one metadata layout per token bucket: one row whose tokens are padded to the
bucket, the padded tokens outside every row (slot -1, past the row's query end, in no Mamba
chunk), every length and offset in device tensors. So the whole forward, mixers included, is
captured once per bucket from a dummy one-row prefill of the bucket's size (at start-up, after
the piecewise graphs, in their memory pool), and a step replays it after copying its inputs and
metadata into the captured tensors. The capture's host values (the maximum query length = the
bucket) only size launch grids, and those grids cover any row of at most the bucket's tokens;
the kernels skip the rest from the device metadata.

`record=False` runs the same padded forward eagerly at each step over the captured tensors
(how CPU tests check the padding and the copies; a debugging aid on the GPU).
"""

from __future__ import annotations

import gc
import logging

import torch

from krait.ops._dispatch import env
from krait.runner.cuda_graphs import copy_tensors
from krait.runner.input_batch import InputBatch, build_input_batch

logger = logging.getLogger(__name__)


def prefill_graphs_enabled() -> bool:
    """On unless KRAIT_PREFILL_GRAPHS=0 (the default since session 11: on the H200 a
    one-request prefill of 128 / 512 tokens went 4.7 -> 2.3 / 4.8 -> 3.0 ms for qwen3-0.6b and
    16.9 -> 6.1 / 17.9 -> 7.8 ms for mamba2-1.3b against the piecewise graphs alone;
    docs/benchmarks.md)."""
    return env("KRAIT_PREFILL_GRAPHS", "1") != "0"


class _Graph:
    def __init__(self, graph, batch: InputBatch, meta, hidden: torch.Tensor) -> None:
        self.graph = graph  # None with record=False
        self.batch = batch  # the capture's inputs: input_ids, positions [Tb]
        self.meta = meta  # the capture's StepMetadata (its tensors are the graph's inputs)
        self.hidden = hidden  # [Tb, hidden]


class PrefillGraphs:
    """Captures and replays one-prefill-row graphs for one ModelRunner, per token bucket of
    `buckets` (those a one-row prompt can fill: at most max_model_len - 1 tokens)."""

    def __init__(self, runner, buckets: list[int], pool=None, record: bool = True) -> None:
        self.runner = runner
        self.buckets = [b for b in buckets if b <= runner.max_model_len - 1]
        self.record = record
        self.pool = pool
        self.graphs: dict[int, _Graph] = {}
        self.pool_bytes = 0

    def bucket_for(self, num_scheduled: list[int], num_prefills: int) -> int | None:
        """The captured bucket that serves a step of these rows (ordered decode rows first),
        or None: one prefill row and no other."""
        if len(num_scheduled) != 1 or num_prefills != 1:
            return None
        return next((b for b in self.buckets if b >= num_scheduled[0] and b in self.graphs),
                    None)

    def serves(self, batch: InputBatch) -> bool:
        """The batch was built for a captured bucket (`bucket_for`)."""
        return (batch.num_reqs == 1 and batch.num_decodes == 0
                and batch.num_tokens_padded in self.graphs
                and batch.num_tokens_padded > 0)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first. The GC is paused during the captures (a collection
        inside one could free an older graph's memory: a cudaFree that breaks it)."""
        cuda = self.runner.device.type == "cuda" and self.record
        if cuda:
            gc.collect()
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for tokens in reversed(self.buckets):
                self._capture(tokens)
        finally:
            if was_enabled:
                gc.enable()
        if cuda:
            torch.cuda.synchronize()
            self.pool_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured prefill graphs for %d token buckets %s (%.0f MiB)",
                    len(self.graphs), sorted(self.graphs), self.pool_bytes / 2**20)

    def _capture(self, tokens: int) -> None:
        r = self.runner
        st = r.states
        rid = "__prefill_graph"
        st.add(rid, [0] * tokens, tokens, 0, 0, None, [], [0] if r.num_slots else [], [])
        try:
            # the widest block table: a replay copies narrower ones into its leading columns
            batch = build_input_batch(st, [rid], [tokens], r.block_size, r.device,
                                      full_block_table=True, tables=r.tables)
            meta = r.model_state.prepare_attn(batch)
            if not self.record:
                self.graphs[tokens] = _Graph(None, batch, meta, None)
                return
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # Triton compiles and tunes outside the graph
                r.model(batch.input_ids, batch.positions, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = r.model(batch.input_ids, batch.positions, meta)
            self.graphs[tokens] = _Graph(graph, batch, meta, hidden)
        finally:
            st.remove(rid)

    def run(self, batch: InputBatch, meta) -> torch.Tensor:
        """The step's hidden states [num_tokens, hidden]: its inputs and metadata copied into
        the bucket's captured tensors, then the graph replayed."""
        g = self.graphs[batch.num_tokens_padded]
        g.batch.input_ids.copy_(batch.input_ids)
        g.batch.positions.copy_(batch.positions)
        copy_tensors(g.meta, meta)
        if g.graph is None:  # record=False
            g.hidden = self.runner.model(g.batch.input_ids, g.batch.positions, g.meta)
        else:
            g.graph.replay()
        return g.hidden[: batch.num_tokens]

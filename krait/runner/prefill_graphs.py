"""Whole-forward CUDA graphs for steps of one prefill row (on the GPU with the piecewise graphs).

A step whose only row is a prefill (a lone request's prompt, or a chunk of it) is an idle
server's time to first token. Piecewise graphs (krait/runner/piecewise_graphs.py) take its
projections, norms and MLPs, but leave the sequence mixers eager: on the H200 a Mamba mixer is
seven Triton launches and an attention mixer two, and their host time (~150-300 us a layer) is
most of a short prompt's prefill (mamba2-1.3b 18 ms for 128 tokens, docs/benchmarks.md).

Such a step has one metadata layout per token bucket: its tokens padded to the bucket, the
padded tokens outside the row (slot -1, past the row's query end, in no Mamba chunk), every
length and offset in device tensors. So the whole forward, mixers included, is captured once
per bucket from a dummy prefill of that shape (at start-up, after the piecewise graphs, in their
memory pool), and a step replays it after copying its inputs and metadata into the captured
tensors. docs/cuda_graphs.md has the rules every graph kind keeps. The capture's host values (the maximum query length = the
bucket) only size launch grids, and those grids cover any row of at most the bucket's tokens;
the kernels skip the rest from the device metadata.

`record=False` runs the same padded forward eagerly at each step over the captured tensors
(how CPU tests check the padding and the copies; a debugging aid on the GPU).
"""

from __future__ import annotations

import logging

import torch

from krait.runner.cuda_graphs import capture_window, copy_tensors, warmup_stream
from krait.runner.input_batch import InputBatch, build_input_batch

logger = logging.getLogger(__name__)


def prefill_graphs_enabled() -> bool:
    """Prefill graphs come with the piecewise graphs (the runner captures them after those):
    always, where those are on."""
    return True


def prefill_graph_rows_knob() -> int:
    """The most prefill rows a step may have to take a prefill graph: one."""
    return 1


class _Graph:
    def __init__(self, graph, batch: InputBatch, meta, hidden: torch.Tensor) -> None:
        self.graph = graph  # None with record=False
        self.batch = batch  # the capture's inputs: input_ids, positions [Tb]
        self.meta = meta  # the capture's StepMetadata (its tensors are the graph's inputs)
        self.hidden = hidden  # [Tb, hidden]


class PrefillGraphs:
    """Captures and replays prefill-only graphs for one ModelRunner: one per token bucket of
    `buckets` (those a one-row prompt can fill: at most max_model_len - 1 tokens), each for a
    step of one prefill row. (Graphs of 2-4 rows for requests arriving together measured no
    faster and grew the pool: docs/benchmarks.md.)"""

    def __init__(self, runner, buckets: list[int], pool=None, record: bool = True,
                 max_rows: int = 1) -> None:
        if max_rows != 1:  # the runner's argument: the graphs take one row
            raise ValueError(f"prefill graphs take one row, not {max_rows}")
        self.runner = runner
        self.buckets = [b for b in buckets if b <= runner.max_model_len - 1]
        self.record = record
        self.pool = pool
        self.graphs: dict[int, _Graph] = {}  # padded tokens -> graph
        self.pool_bytes = 0

    def bucket_for(self, num_scheduled: list[int], num_prefills: int
                   ) -> tuple[int, int] | None:
        """(padded tokens, padded rows: 1) of the captured graph that serves a step of these
        rows, or None: a step of one prefill row only."""
        if len(num_scheduled) != 1 or num_prefills != 1:
            return None
        return next(((b, 1) for b in self.buckets if b >= num_scheduled[0] and b in self.graphs),
                    None)

    def serves(self, batch: InputBatch) -> bool:
        """The batch was built for a captured graph (`bucket_for`)."""
        return (batch.num_decodes == 0 and batch.num_reqs > 0 and batch.num_reqs_padded == 1
                and batch.num_tokens_padded in self.graphs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first, inside one `capture_window`."""
        with capture_window(self.runner.device.type == "cuda" and self.record) as cost:
            for tokens in reversed(self.buckets):
                self._capture(tokens)
        self.pool_bytes = cost.bytes
        logger.info("captured prefill graphs for token buckets %s (%.0f MiB, %.1f s)",
                    sorted(self.graphs), cost.bytes / 2**20, cost.seconds)

    def _capture(self, tokens: int) -> None:
        r = self.runner
        st = r.states
        ids, lens = ["__prefill_graph_0"], [tokens]
        st.add(ids[0], [0] * tokens, tokens, 0, 0, None, [], [0] if r.num_slots else [], [])
        try:
            # the widest block table: a replay copies narrower ones into its leading columns
            batch = build_input_batch(st, ids, lens, r.block_size, r.device,
                                      full_block_table=True, tables=r.tables)
            meta = r.model_state.prepare_attn(batch)
            if meta.attn is not None:  # query tiles for any row of up to `tokens` tokens
                meta.attn.max_query_len = tokens
            if not self.record:
                self.graphs[tokens] = _Graph(None, batch, meta, None)
                return
            stream = warmup_stream(torch.cuda.current_device())
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
            for rid in ids:
                st.remove(rid)

    def run(self, batch: InputBatch, meta) -> torch.Tensor:
        """The step's hidden states [num_tokens, hidden]: its inputs and metadata copied into
        the captured tensors of its bucket's graph, then the graph replayed."""
        g = self.graphs[batch.num_tokens_padded]
        g.batch.input_ids.copy_(batch.input_ids)
        g.batch.positions.copy_(batch.positions)
        copy_tensors(g.meta, meta)
        if g.graph is None:  # record=False
            g.hidden = self.runner.model(g.batch.input_ids, g.batch.positions, g.meta)
        else:
            g.graph.replay()
        return g.hidden[: batch.num_tokens]

"""Whole-forward CUDA graphs for steps of prefill rows only: one row by default, 2-4 rows with
`KRAIT_PREFILL_GRAPH_ROWS` (on by default on the GPU with the piecewise graphs;
`KRAIT_PREFILL_GRAPHS=0` turns them off).

A step whose only row is a prefill (a lone request's prompt, or a chunk of it) is an idle
server's time to first token. Piecewise graphs (krait/runner/piecewise_graphs.py) take its
projections, norms and MLPs, but leave the sequence mixers eager: on the H200 a Mamba mixer is
seven Triton launches and an attention mixer two, and their host time (~150-300 us a layer) is
most of a short prompt's prefill (mamba2-1.3b 18 ms for 128 tokens, docs/benchmarks.md).

Such a step has one metadata layout per token bucket and row count: its tokens padded to the
bucket, the padded tokens outside every row (slot -1, past the last row's query end, in no
Mamba chunk), its rows padded with empty ones (slot -1, no tokens), every length and offset in
device tensors. So the whole forward, mixers included, is captured once per bucket and row
count from a dummy prefill of that shape (at start-up, after the piecewise graphs, in their
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

from krait.ops._dispatch import env
from krait.runner.cuda_graphs import capture_window, copy_tensors, warmup_stream
from krait.runner.input_batch import InputBatch, build_input_batch

logger = logging.getLogger(__name__)


def prefill_graphs_enabled() -> bool:
    """On unless KRAIT_PREFILL_GRAPHS=0 (the default since session 11: on the H200 a
    one-request prefill of 128 / 512 tokens went 4.7 -> 2.3 / 4.8 -> 3.0 ms for qwen3-0.6b and
    16.9 -> 6.1 / 17.9 -> 7.8 ms for mamba2-1.3b against the piecewise graphs alone;
    docs/benchmarks.md)."""
    return env("KRAIT_PREFILL_GRAPHS", "1") != "0"


def prefill_graph_rows_knob() -> int:
    """KRAIT_PREFILL_GRAPH_ROWS: the most prefill rows a step may have to take a prefill graph
    (1, 2 or 4; 1 unless set). Steps of 2-4 rows (requests arriving together) get graphs of
    2 or 4 rows, their spare rows empty: not yet measured on the GPU, so off by default."""
    value = env("KRAIT_PREFILL_GRAPH_ROWS", "1")
    if value not in ("1", "2", "4"):
        raise ValueError(f"KRAIT_PREFILL_GRAPH_ROWS must be 1, 2 or 4, got {value!r}")
    return int(value)


class _Graph:
    def __init__(self, graph, batch: InputBatch, meta, hidden: torch.Tensor) -> None:
        self.graph = graph  # None with record=False
        self.batch = batch  # the capture's inputs: input_ids, positions [Tb]
        self.meta = meta  # the capture's StepMetadata (its tensors are the graph's inputs)
        self.hidden = hidden  # [Tb, hidden]


class PrefillGraphs:
    """Captures and replays prefill-only graphs for one ModelRunner, one per token bucket of
    `buckets` (those a one-row prompt can fill: at most max_model_len - 1 tokens) and row count
    (1 up to `max_rows`, powers of two; spare rows are empty padding rows)."""

    def __init__(self, runner, buckets: list[int], pool=None, record: bool = True,
                 max_rows: int = 1) -> None:
        self.runner = runner
        self.buckets = [b for b in buckets if b <= runner.max_model_len - 1]
        max_rows = min(max_rows, runner.config.scheduler.max_num_seqs)
        self.rows = [r for r in (1, 2, 4) if r <= max_rows]
        self.record = record
        self.pool = pool
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (tokens, rows) -> graph
        self.pool_bytes = 0

    def bucket_for(self, num_scheduled: list[int], num_prefills: int
                   ) -> tuple[int, int] | None:
        """(padded tokens, padded rows) of the captured graph that serves a step of these rows
        (ordered decode rows first), or None: prefill rows only, at most max_rows of them."""
        n = len(num_scheduled)
        if n == 0 or num_prefills != n:
            return None
        rows = next((r for r in self.rows if r >= n), None)
        if rows is None:
            return None
        total = sum(num_scheduled)
        return next(((b, rows) for b in self.buckets if b >= total and (b, rows) in self.graphs),
                    None)

    def serves(self, batch: InputBatch) -> bool:
        """The batch was built for a captured graph (`bucket_for`)."""
        return (batch.num_decodes == 0 and batch.num_reqs > 0
                and (batch.num_tokens_padded, batch.num_reqs_padded) in self.graphs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket and row count, largest first, inside one `capture_window`."""
        with capture_window(self.runner.device.type == "cuda" and self.record) as cost:
            for tokens in reversed(self.buckets):
                for rows in reversed(self.rows):
                    if rows <= tokens:
                        self._capture(tokens, rows)
        self.pool_bytes = cost.bytes
        logger.info("captured prefill graphs for %d token buckets x rows %s (%.0f MiB, %.1f s)",
                    len(self.graphs), sorted(self.graphs), cost.bytes / 2**20, cost.seconds)

    def _capture(self, tokens: int, rows: int) -> None:
        r = self.runner
        st = r.states
        # one long row and rows - 1 of one token each; own slots (rows <= max_num_seqs)
        lens = [tokens - rows + 1] + [1] * (rows - 1)
        ids = [f"__prefill_graph_{i}" for i in range(rows)]
        for i, (rid, n) in enumerate(zip(ids, lens)):
            st.add(rid, [0] * n, n, 0, 0, None, [], [i] if r.num_slots else [], [])
        try:
            # the widest block table: a replay copies narrower ones into its leading columns
            batch = build_input_batch(st, ids, lens, r.block_size, r.device,
                                      full_block_table=True, tables=r.tables)
            meta = r.model_state.prepare_attn(batch)
            if meta.attn is not None:  # query tiles for any row of up to `tokens` tokens
                meta.attn.max_query_len = tokens
            if not self.record:
                self.graphs[(tokens, rows)] = _Graph(None, batch, meta, None)
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
            self.graphs[(tokens, rows)] = _Graph(graph, batch, meta, hidden)
        finally:
            for rid in ids:
                st.remove(rid)

    def run(self, batch: InputBatch, meta) -> torch.Tensor:
        """The step's hidden states [num_tokens, hidden]: its inputs and metadata copied into
        the captured tensors of its (tokens, rows) graph, then the graph replayed."""
        g = self.graphs[(batch.num_tokens_padded, batch.num_reqs_padded)]
        g.batch.input_ids.copy_(batch.input_ids)
        g.batch.positions.copy_(batch.positions)
        copy_tensors(g.meta, meta)
        if g.graph is None:  # record=False
            g.hidden = self.runner.model(g.batch.input_ids, g.batch.positions, g.meta)
        else:
            g.graph.replay()
        return g.hidden[: batch.num_tokens]

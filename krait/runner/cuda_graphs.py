"""CUDA graphs for decode batches (every row one token).

Each capture size N records embedding -> logits -> greedy tokens for N rows over static
buffers; with device-side input preparation the greedy tokens are also written into the device
token table (a batch that samples otherwise overwrites them after the replay). Capture builds the
metadata with `for_capture=True` (max_seq_len = max_model_len); a replay builds the real batch's
inputs and metadata, padded to N rows (idx_mapping -1, the null block, slot -1), directly in the
captured buffers (`build_input_batch(into=...)`, `prepare_attn(into=...)`: one host-to-device
copy and one input-preparation launch), and copies only what was built elsewhere. Batches with
any prefill row, or with a row whose token is not its last known one, never come here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time

import torch

from krait.ops.argmax import argmax
from krait.ops.write_tokens import write_tokens
from krait.runner.input_batch import InputBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (and max_num_seqs itself), largest first."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes), reverse=True)


@functools.cache
def warmup_stream(device_index: int) -> torch.cuda.Stream:
    """The one side stream every graph's eager warm-up runs on, per device. cuBLAS keeps a
    workspace (32 MiB on Hopper) per stream it ever ran on until the process ends: a fresh
    stream per capture size took up to 32 of torch's pooled streams, ~1 GiB that stayed
    allocated after the engine was deleted (H200, docs/benchmarks.md)."""
    return torch.cuda.Stream(device=device_index)


def copy_tensors(dst, src) -> None:
    """Copies every tensor reachable through dataclass fields (and tuples of tensors in them)
    of src into dst's, except those already built in dst's memory. A block table narrower than
    the captured one fills its leading columns: the kernels read no column past a row's
    length. Private fields (a step's memos, built inside the graph) are not inputs."""
    for f in dataclasses.fields(dst):
        if f.name.startswith("_"):
            continue
        _copy_value(getattr(dst, f.name), getattr(src, f.name))


def _copy_value(d, s) -> None:
    if isinstance(d, torch.Tensor):
        if s.data_ptr() == d.data_ptr():
            return
        if d.shape != s.shape and d.dim() == 2 and s.shape[0] == d.shape[0]:
            d = d[:, : s.shape[1]]
        d.copy_(s)
    elif isinstance(d, tuple):
        for a, b in zip(d, s, strict=True):
            _copy_value(a, b)
    elif dataclasses.is_dataclass(d):
        copy_tensors(d, s)


@dataclasses.dataclass
class CaptureCost:
    """What a `capture_window` took: device bytes (0 without CUDA) and seconds."""

    bytes: int = 0
    seconds: float = 0.0


def capture_each(sizes: list[int], capture, record: bool) -> CaptureCost | None:
    """capture(n) for every size (largest first: later graphs reuse the first's pool); when
    recording, all inside one `capture_window`, whose cost is returned (else None)."""
    if not record:
        for n in sizes:
            capture(n)
        return None
    with capture_window(cuda=True) as cost:
        for n in sizes:
            capture(n)
    return cost


def record_graph(body, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """`body()` warmed up twice on a side stream (Triton compiles and autotunes outside the
    graph), then recorded into a new graph of memory pool `pool` (None: its own) -> (graph,
    what the recorded body returned)."""
    stream = warmup_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


@contextlib.contextmanager
def capture_window(cuda: bool):
    """Around a series of graph captures: Python's cyclic GC collects first and is paused
    inside (collecting an earlier engine's graphs there frees their memory pool, a cudaFree
    that invalidates the capture: seen once as a GPU parity run whose later models all
    failed); yields a CaptureCost filled in at the end (device memory taken, with `cuda`)."""
    cost = CaptureCost()
    start = time.perf_counter()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield cost
    finally:
        if was_enabled:
            gc.enable()
    if cuda:
        torch.cuda.synchronize()
        cost.bytes = free_before - torch.cuda.mem_get_info()[0]
    cost.seconds = time.perf_counter() - start


class _Graph:
    def __init__(self, graph, batch: InputBatch, meta, hidden_in: torch.Tensor | None,
                 logits: torch.Tensor, greedy: torch.Tensor, hidden: torch.Tensor,
                 aux: torch.Tensor | None) -> None:
        self.graph = graph
        self.batch = batch
        self.meta = meta
        self.hidden_in = hidden_in  # [N, W] a drafter head's side input (`input_hidden`), or None
        self.logits = logits  # [N, V]
        self.greedy = greedy  # int64 [N]: argmax of each row's logits
        self.hidden = hidden  # [N, H]: the model's output (an EAGLE or MTP drafter reads it)
        self.aux = aux  # [N, 3H] or None: the EAGLE-3 layers' inputs the target keeps
        self.served = False  # run() has replayed it on a real batch (not only the capture's)


class CudaGraphRunner:
    """Captures and replays decode graphs for one ModelRunner.

    `record=False` keeps every buffer and step of the graph path but runs the captured body
    eagerly at each replay instead of recording a graph: how CPU tests (no CUDA) exercise the
    decode-graph dataflow, and a debugging aid on the GPU."""

    def __init__(self, runner, record: bool = True, tokens_per_row: int = 1) -> None:
        self.runner = runner
        self.record = record
        # 1: decode graphs; 1 + k: speculative verify graphs (every row its last token and k
        # drafts, the logits of every token; the host writes the accepted tokens after them)
        self.tokens_per_row = tokens_per_row
        self.sizes = capture_sizes(runner.config.scheduler.max_num_seqs)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        # the model's output of the last `run` (its graph's buffer: valid until the next run)
        self.last_hidden: torch.Tensor | None = None

    def size_for(self, num_reqs: int) -> int | None:
        fitting = [s for s in self.sizes if s >= num_reqs]
        return min(fitting) if fitting else None

    @torch.inference_mode()
    def replay_ms(self, num_reqs: int, repeats: int = 50) -> float | None:
        """Device ms of one replay of the graph that serves `num_reqs` rows, replayed back to
        back with its last inputs: the step's GPU time with no host in the way (benchmarks
        only: each replay repeats that step's writes to the KV cache, the state slots and the
        token table, so the rows it served must be dropped after). None without recorded
        graphs, or when that graph never served a real batch (its inputs would still be the
        capture's dummy rows, which a MoE routes unlike real ones)."""
        size = self.size_for(num_reqs)
        if (size is None or not self.record or size not in self.graphs
                or not self.graphs[size].served):
            return None
        graph = self.graphs[size].graph
        torch.cuda.synchronize()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    @torch.inference_mode()
    def capture_all(self) -> None:
        cost = capture_each(self.sizes, self._capture, self.record)
        if cost is not None:
            kind = ("decode" if self.tokens_per_row == 1
                    else f"{self.tokens_per_row}-token verify")
            logger.info("captured %d %s CUDA graphs (%.0f MiB, %.1f s)", len(self.sizes), kind,
                        cost.bytes / 2**20, cost.seconds)

    def _capture(self, n: int) -> None:
        r = self.runner
        batch = r.dummy_decode_batch(n, self.tokens_per_row)
        meta = r.model_state.prepare_attn(batch, for_capture=True)
        # a drafter head (krait/models/eagle.py) reads a side input its drafter sets before
        # each forward: the graph reads it from a buffer of its own, which `run` fills
        width = getattr(r.model, "input_hidden_width", 0)
        hidden_in = (torch.zeros(n * self.tokens_per_row, width, dtype=r.config.model.dtype,
                                 device=r.device) if width else None)
        if not self.record:
            self.graphs[n] = _Graph(None, batch, meta, hidden_in,
                                    *self._body(batch, meta, hidden_in))
            return
        graph, body = record_graph(lambda: self._body(batch, meta, hidden_in), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[n] = _Graph(graph, batch, meta, hidden_in, *body)

    def _body(self, batch: InputBatch, meta, hidden_in: torch.Tensor | None = None) -> tuple:
        """(logits, greedy, hidden, aux): see `_Graph`."""
        r = self.runner
        if hidden_in is not None:
            r.model.input_hidden = hidden_in
        hidden = r.model(batch.input_ids, batch.positions, meta)
        logits = r.model.compute_logits(hidden)
        greedy = argmax(logits)
        if r.tables is not None and self.tokens_per_row == 1:
            # each row's token goes at its sequence length
            write_tokens(r.tables.token_ids, batch.idx_mapping, batch.seq_lens, greedy)
        aux = r.model.aux_hidden if getattr(r.model, "aux_hidden_layers", ()) else None
        return logits, greedy, hidden, aux

    def captured_batch(self, size: int) -> InputBatch:
        """The input buffers of the graph of `size` rows (`build_input_batch(into=...)`)."""
        return self.graphs[size].batch

    def run(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: a decode batch padded to a captured size (built into its buffers, or not).
        Returns (logits [N * tokens_per_row, V], greedy tokens int64 [N * tokens_per_row])."""
        g = self.graphs[batch.num_reqs_padded]
        meta = self.runner.model_state.prepare_attn(batch, for_capture=False, into=g.meta)
        if batch.input_ids.data_ptr() != g.batch.input_ids.data_ptr():
            g.batch.input_ids.copy_(batch.input_ids)
            g.batch.positions.copy_(batch.positions)
        copy_tensors(g.meta, meta)
        model = self.runner.model
        if g.hidden_in is not None:  # the side input the drafter set for this step's tokens
            h, model.input_hidden = model.input_hidden, None
            if h is None or h.shape[0] != batch.num_tokens:
                raise RuntimeError(f"{type(model).__name__}: the drafter must set input_hidden "
                                   f"for the step's {batch.num_tokens} tokens")
            g.hidden_in[: batch.num_tokens].copy_(h)
        if g.graph is None:  # record=False
            g.logits, g.greedy, g.hidden, g.aux = self._body(g.batch, g.meta, g.hidden_in)
        else:
            g.graph.replay()
        g.served = True
        self.last_hidden = g.hidden
        if g.hidden_in is not None:  # the head's output, as after an eager forward
            model.output_hidden = g.hidden
        if g.aux is not None:  # the model's attribute named an eager step's tensor since
            self.runner.model.aux_hidden = g.aux
        return g.logits, g.greedy

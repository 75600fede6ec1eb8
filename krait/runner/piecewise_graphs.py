"""Piecewise CUDA graphs for eager steps (prefills, mixed batches; on the GPU unless
enforce_eager, or the diagnostic `KRAIT_PIECEWISE_GRAPHS=0`, turns them off).

An eager step is bound by the host below a few thousand tokens (~50 us of Python, dispatch and
launcher per op: qwen3's 512-token prefill spent several times its kernels' time on the host,
docs/benchmarks.md). Everything of a forward except the sequence mixers — embedding, norms, projections,
MLP / MoE — has shapes fixed by the token count alone, so it can be captured per token bucket;
the mixers (rotary + KV write + paged attention; conv + SSM scan with the state slots) need the
step's own metadata and run eagerly between the pieces, as in vLLM.

The models mark each mixer call with `mixer_call(fn, activations, meta, kind, *extra)`. Without
a recorder active it is a plain call. Under `PiecewiseGraphs`:
- tokens are padded to a bucket of Tb rows (static `input_ids` / `positions`); the piece before
  a mixer copies its activations into static buffers (so the piece's own memory can be reused
  by the next piece), the mixer sees them cut to the step's T real rows with the step's
  metadata, and its result lands in rows [:T] of a static [Tb, ...] buffer. The buffers are
  one per argument position, feature shape and dtype, shared by every mixer and bucket: a
  mixer's inputs and output are consumed right away. Rows past T carry garbage through the
  row-local pieces and are never read;
- a bucket's first step runs that padded forward eagerly (Triton compiles and tunes outside
  any capture); its second captures (both at start-up, through dummy prefills:
  `ModelRunner._capture_piecewise`; the memory profile keeps room for the pool): each piece
  is recorded, then replayed at once to feed the mixer that follows, so the capturing step's
  results are real; later steps replay piece 0, mixer 0, piece 1, ... with the step's
  metadata (`StepMetadata.<kind>`), the recorded activations (fixed addresses in the graphs'
  pool) and the recorded extra arguments.
`record=False` keeps the pieces eager at every step (how CPU tests exercise the padding, the
cut to T rows and the buffers); a bucket's later steps then serve each mixer through the
`_Mixer` recorded at its first step, as a replay does (the step's metadata looked up by kind,
the recorded extra arguments and buffers). With `poison=True` the padded rows of every mixer
output are NaN, so a padded row that leaked into a real one would show.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from krait.envs import get
from krait.runner.cuda_graphs import warmup_stream

logger = logging.getLogger(__name__)

_recorder: _Recorder | None = None  # the forward being padded, captured or replayed
# the largest bucket: past a few thousand tokens an eager step is bound by the device anyway,
# and larger buckets grow the pool for no gain
PIECEWISE_MAX_TOKENS = 2048


def piecewise_enabled() -> bool:
    """On unless `KRAIT_PIECEWISE_GRAPHS=0` (a diagnostic: krait/envs.py): on the H200 they cut
    a one-request prefill several times over (docs/benchmarks.md)."""
    return get("KRAIT_PIECEWISE_GRAPHS") != "0"


def piecewise_max_tokens_knob() -> int:
    """The most tokens an eager step may have to take the piecewise graphs:
    PIECEWISE_MAX_TOKENS."""
    return PIECEWISE_MAX_TOKENS


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to the first one >= max_tokens."""
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


def mixer_call(fn: Callable[..., torch.Tensor], activations: tuple[torch.Tensor, ...], meta,
               kind: str, *extra) -> torch.Tensor:
    """fn(*activations, meta, *extra): a sequence mixer, whose work depends on the step's
    metadata (`meta` is `StepMetadata.<kind>`). Activations are [T, ...] tensors of the step's
    token rows; fn returns [T, ...]."""
    if _recorder is None:
        return fn(*activations, meta, *extra)
    return _recorder.mixer(fn, activations, meta, kind, extra)


def piecewise_forward() -> bool:
    """Is a forward being padded, captured or replayed in pieces? Its mixers' inputs and
    outputs are then fixed at the bucket's first step, so a model takes no path that only
    some steps' metadata allows (a decode-only fusion) while one is."""
    return _recorder is not None


class _Mixer:
    """A recorded mixer call: its static inputs, the metadata it takes, where its output goes."""

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...], kind: str, extra,
                 out: torch.Tensor) -> None:
        self.fn, self.inputs, self.kind, self.extra, self.out = fn, inputs, kind, extra, out

    def run(self, n: int, step_meta) -> None:
        result = self.fn(*(a[:n] for a in self.inputs), getattr(step_meta, self.kind), *self.extra)
        self.out[:n].copy_(result)


class _Recorder:
    """One padded forward of `num_padded` rows for a step of `num_real` real ones."""

    def __init__(self, owner: PiecewiseGraphs, num_real: int, num_padded: int,
                 capture: bool, step_meta=None, replay: list[_Mixer] | None = None) -> None:
        self.owner, self.n, self.padded, self.capture = owner, num_real, num_padded, capture
        self.step_meta, self.replay = step_meta, replay  # eager pieces, recorded mixers
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.mixers: list[_Mixer] = []
        self.calls = 0

    def begin_piece(self) -> None:
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            # every piece and bucket: one pool. A bucket start-up could not capture captures
            # while serving: only this thread's CUDA calls are checked (a server thread's own
            # work must not fail them)
            graph.capture_begin(pool=self.owner.pool, capture_error_mode="thread_local")
            self.graphs.append(graph)

    def end_piece(self) -> None:
        if self.capture:
            self.graphs[-1].capture_end()
            self.graphs[-1].replay()  # this step's values, for the mixer that follows

    def mixer(self, fn, activations, meta, kind: str, extra) -> torch.Tensor:
        for a in activations:
            if a.shape[0] != self.padded:
                raise ValueError(f"mixer activations must have {self.padded} rows, got {a.shape}")
        inputs = tuple(self.owner.buffer(("in", i), a, self.padded) for i, a in enumerate(activations))
        for buf, a in zip(inputs, activations):
            buf.copy_(a)  # part of the piece: its own memory is free for the next one
        self.end_piece()
        if self.replay is not None:
            recorded = self.replay[self.calls]
            if any(a.data_ptr() != b.data_ptr() for a, b in zip(inputs, recorded.inputs)):
                raise RuntimeError("piecewise replay: a mixer's inputs moved since its recording")
            recorded.run(self.n, self.step_meta)
            out = recorded.out
        else:
            result = fn(*(a[: self.n] for a in inputs), meta, *extra)
            out = self.owner.buffer(("out",), result, self.padded)
            out[: self.n].copy_(result)
            self.mixers.append(_Mixer(fn, inputs, kind, extra, out))
        self.calls += 1
        if self.owner.poison and self.padded > self.n:
            out[self.n :] = float("nan")
        self.begin_piece()
        return out


class _Bucket:
    def __init__(self) -> None:
        self.steps = 0
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.mixers: list[_Mixer] = []
        self.hidden: torch.Tensor | None = None  # [Tb, hidden], the last piece's output


class PiecewiseGraphs:
    """Eager steps of at most `max_tokens` tokens through per-bucket piecewise graphs (see the
    module docstring). `run` returns hidden states [T, hidden], or None for a step it does not
    serve (more tokens than the largest bucket)."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, device: torch.device,
                 record: bool = True, poison: bool = False) -> None:
        self.model = model
        self.buckets = token_buckets(max_tokens)
        self.record, self.poison = record, poison
        self.input_ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.state = {b: _Bucket() for b in self.buckets}
        self.pool = None  # graph memory pool token, and the capture stream, at the first capture
        self.pool_bytes = 0  # device memory the start-up captures took
        self.stream: torch.cuda.Stream | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}

    def buffer(self, role: tuple, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The static [rows, ...] buffer of a mixer input (role ("in", position)) or output
        (("out",)) with `like`'s feature shape and dtype."""
        key = (*role, tuple(like.shape[1:]), like.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty((self.buckets[-1], *like.shape[1:]), dtype=like.dtype,
                              device=like.device)  # [max bucket, ...]
            self._buffers[key] = buf
        return buf[:rows]

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, num_tokens: int,
            meta) -> torch.Tensor | None:
        tb = self.bucket_for(num_tokens)
        if tb is None or num_tokens == 0:
            return None
        self.input_ids[:num_tokens].copy_(input_ids[:num_tokens])
        self.positions[:num_tokens].copy_(positions[:num_tokens])
        bucket = self.state[tb]
        if bucket.graphs:
            for i, graph in enumerate(bucket.graphs):
                graph.replay()
                if i < len(bucket.mixers):
                    bucket.mixers[i].run(num_tokens, meta)
            return bucket.hidden[:num_tokens]
        capture = self.record and bucket.steps >= 1
        bucket.steps += 1
        hidden = self._forward(tb, num_tokens, meta, capture, bucket)
        return hidden[:num_tokens]

    def _forward(self, tb: int, n: int, meta, capture: bool, bucket: _Bucket) -> torch.Tensor:
        global _recorder
        replay = bucket.mixers if not self.record and bucket.mixers else None
        rec = _Recorder(self, n, tb, capture, meta, replay)
        if capture:
            gc.collect()  # no collection (a free of older graphs' memory) inside a capture
            was_enabled = gc.isenabled()
            gc.disable()
            if self.pool is None:  # one side stream and one memory pool for every capture
                self.pool = torch.cuda.graph_pool_handle()
                self.stream = warmup_stream(torch.cuda.current_device())
            stream = self.stream
            stream.wait_stream(torch.cuda.current_stream())
        _recorder = rec
        try:
            if capture:
                with torch.cuda.stream(stream):
                    rec.begin_piece()
                    hidden = self.model(self.input_ids[:tb], self.positions[:tb], meta)
                    rec.end_piece()
                torch.cuda.current_stream().wait_stream(stream)
            else:
                hidden = self.model(self.input_ids[:tb], self.positions[:tb], meta)
        finally:
            _recorder = None
            if capture and was_enabled:
                gc.enable()
        if capture:
            bucket.graphs, bucket.mixers, bucket.hidden = rec.graphs, rec.mixers, hidden
            logger.info("piecewise graphs: %d tokens, %d pieces", tb, len(rec.graphs))
        elif not self.record and replay is None:
            bucket.mixers = rec.mixers  # what the bucket's later steps replay
        return hidden

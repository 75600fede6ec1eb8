"""Pipeline stages: which layers a stage holds, and the hidden + residual hand-over between
stages inside the model's layer loop (`run_layers` asks `current()`; with one stage it is None
and the loop is the single-process one).

A stage receives its micro-batch's input (blocking: it needs it) and sends its output without
waiting for the next stage to take it, so it can start the next micro-batch while the next
stage still runs this one: NCCL's send only queues on the GPU; gloo's blocks until received,
so on gloo one thread of the stage's own sends, in order. Every stage runs the micro-batches in
the engine's order and the messages between two ranks match in that order, so no send waits on
a receive that comes after it (no deadlock). (An isend on gloo made each hand-over take up to
hundreds of milliseconds on the dev box: its progress waited for a later wait().)"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from krait import envs
from krait.distributed import parallel_state as ps


def stage_layer_ranges(num_layers: int, pp_size: int, partition: list[int] | None = None
                       ) -> list[tuple[int, int]]:
    """[start, end) of every stage: even, the remainder to the first stages, unless `partition`
    (layers a stage: `layer_partition()`, from KRAIT_PP_LAYER_PARTITION) says otherwise."""
    if partition is not None:
        sizes = list(partition)
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"layer partition {sizes} (KRAIT_PP_LAYER_PARTITION) must give "
                             f"{pp_size} stages of at least one layer each, {num_layers} layers "
                             "in all")
    else:
        if pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp_size} is more than the model's "
                             f"{num_layers} layers")
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if s < extra else 0) for s in range(pp_size)]
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def layer_partition() -> list[int] | None:
    """KRAIT_PP_LAYER_PARTITION as layers per stage (None when unset)."""
    text = envs.get("KRAIT_PP_LAYER_PARTITION").strip()
    if not text:
        return None
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"KRAIT_PP_LAYER_PARTITION={text!r} must be comma-separated layer "
                         "counts, one a stage (e.g. 8,8,16)") from None


def make_layers(num_layers: int, build: Callable[[int], torch.nn.Module]) -> torch.nn.ModuleList:
    """The model's layer list: every layer with one stage; under PP the other stages' layers are
    MissingModule placeholders (built on the meta device first, only to learn whether they hold
    recurrent state, so that every stage sizes request state slots alike)."""
    from krait.layers.embedding import MissingModule

    if ps.get_pp_size() == 1:
        return torch.nn.ModuleList(build(i) for i in range(num_layers))
    start, end = stage_layer_ranges(num_layers, ps.get_pp_size(),
                                    layer_partition())[ps.get_pp_rank()]
    layers = []
    for i in range(num_layers):
        if start <= i < end:
            layers.append(build(i))
            continue
        with torch.device("meta"):
            ghost = build(i)
        recurrent = any(getattr(m, "has_recurrent_state", False) for m in ghost.modules())
        layers.append(MissingModule(recurrent))
    return torch.nn.ModuleList(layers)


@dataclass
class StageContext:
    """This process's stage: its layer range and the hand-over buffers' shape."""

    start: int
    end: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    _sender: _Sender | None = field(default=None, repr=False)

    def run(self, layers, final_norm, x, positions, meta, x_scale: float, pre_norm):
        """The stage's part of the layer loop: receive (x, residual) from the previous stage
        (all but the first), run the stage's layers, send them on (all but the last: returns x,
        which the runner does not use), or apply the final norm (the last)."""
        st = ps.state()
        residual = None
        if not st.is_first_stage:
            buf = torch.empty(2, positions.shape[0], self.hidden_size, dtype=self.dtype,
                              device=self.device)
            ps.pp_recv(buf, st.pp_rank - 1)
            x, residual = buf[0], buf[1]
        for i in range(self.start, self.end):
            x, residual = layers[i](positions, x, residual, meta)
        if not st.is_last_stage:
            out = torch.stack([x, residual])
            if ps.host_blocking_sends():
                if self._sender is None:
                    self._sender = _Sender()
                self._sender.send(out, st.pp_rank + 1)
            else:
                ps.pp_send(out, st.pp_rank + 1)
            return x
        return pre_norm(final_norm, x, residual, x_scale)[0]


class _Sender:
    """A thread that makes a stage's sends, in order, so that the stage does not wait for the
    next one to receive; a failed send is raised by the next `send`."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name="krait-pp-send", daemon=True).start()

    def send(self, x: torch.Tensor, to_stage: int) -> None:
        if self._error is not None:
            raise RuntimeError("a pipeline send failed") from self._error
        self._queue.put((x, to_stage))

    def _loop(self) -> None:
        while True:
            x, to_stage = self._queue.get()
            try:
                ps.pp_send(x, to_stage)
            except BaseException as e:  # noqa: BLE001 (reported to the stage's thread)
                self._error = e
                return


_STAGE: StageContext | None = None


def current() -> StageContext | None:
    return _STAGE


def set_stage(ctx: StageContext | None) -> None:
    global _STAGE
    _STAGE = ctx

"""One rank's worker: a ModelRunner inside its process group, and the loop a worker process
runs around it (the multiprocess executor's side of its rings and pipe)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import pickle
import select
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from krait import envs
from krait.config import EngineConfig
from krait.distributed import parallel_state as ps
from krait.distributed import pipeline
from krait.distributed.shm_ring import PIPE, RingHandle, ShmRing, wait_until
from krait.distributed.wire import decode_sched, encode_sampled

logger = logging.getLogger(__name__)


@dataclass
class RankProfile:
    """What the engine needs from a rank to size the shared cache: its bytes per KV block and
    per state slot, the bytes it has for the cache, and the model state's request layout."""

    kv_bytes_per_block: int
    state_bytes_per_slot: int
    budget: int
    slots_per_request: int
    chunk_size: int | None
    num_spec_tokens: int
    has_drafter: bool
    # speculative decoding's conv-only slots (`ModelState.conv_only_columns`) and their bytes
    conv_only_columns: int = 0
    conv_bytes_per_slot: int = 0


def rank_profile(runner, config: EngineConfig) -> RankProfile:
    ms = runner.model_state
    if config.device.type == "cuda":
        from krait.runner.memory import profile_free_memory

        budget = profile_free_memory(runner, config)
    else:
        budget = int(config.cache.cpu_kv_cache_gib * 2**30)
    return RankProfile(ms.kv_bytes_per_block(), ms.state_bytes_per_slot(), budget,
                       ms.slots_per_request, getattr(ms, "chunk_size", None),
                       runner.num_spec_tokens, runner.drafter is not None,
                       ms.conv_only_columns, ms.conv_bytes_per_slot())


class Worker:
    """One rank: joins the process group, builds its shard of the model (its TP slices of its
    PP stage's layers) in a ModelRunner, and runs the engine's steps on it."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str,
                 timeout_s: float = 600.0) -> None:
        par = config.parallel
        tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
        cuda = config.device.type == "cuda"
        if cuda:
            local = rank % max(torch.cuda.device_count(), 1)
            torch.cuda.set_device(local)
            device = torch.device(f"cuda:{local}")
        else:
            device = torch.device("cpu")
            # the host's cores shared among the ranks: more intra-op threads than cores spin
            # against each other once stages compute at the same time (pipelined micro-batches
            # took 200-300 ms a step instead of 4 on the 2-core dev box)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp * pp)))
        self.rank = rank
        st = ps.init_distributed(rank, tp, pp, init_method, "nccl" if cuda else "gloo",
                                 timeout_s)
        # CUDA graphs are not captured across ranks yet: every rank runs eagerly
        self.config = dataclasses.replace(config, device=device, enforce_eager=True)
        if pp > 1:
            from krait.distributed.layout import num_layers

            hf = config.model.hf_config
            start, end = pipeline.stage_layer_ranges(num_layers(hf), pp,
                                                     pipeline.layer_partition())[st.pp_rank]
            pipeline.set_stage(pipeline.StageContext(start, end, hf.hidden_size,
                                                     config.model.dtype, device))
        from krait.runner.model_runner import ModelRunner

        self.runner = ModelRunner(self.config)
        self.is_output_rank = st.is_output_rank
        self._fault: int | None = None  # a step that raises (`inject_fault`, tests)
        self._steps = 0

    def profile(self) -> RankProfile:
        return rank_profile(self.runner, self.config)

    def initialize(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        self.runner.initialize_cache(num_blocks, num_slots, num_conv_slots)
        self.runner.capture_cuda_graphs()

    def execute_model(self, sched):
        self._steps += 1
        if self._fault is not None and self._steps == self._fault:
            raise RuntimeError(f"injected fault in worker {self.rank} at step {self._steps}")
        return self.runner.execute_model(sched)

    def propose_drafts(self, req_ids: list[str]) -> dict[str, list[int]]:
        return self.runner.propose_drafts(req_ids)

    def inject_fault(self, steps_from_now: int) -> None:
        """Tests: the worker raises in its step `steps_from_now` steps on."""
        self._fault = self._steps + steps_from_now


def _watch_parent(parent_pid: int) -> None:
    """Exits this process when its parent is gone (the parent died without stopping it)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _ready(pending) -> bool:
    """Whether a step's result can be read without waiting for the device."""
    ready = getattr(pending, "ready", None)
    return ready is None or ready()


class _Outbox:
    """The output rank's launched steps, sent to the engine's result ring in order as soon as
    their tokens are on the host (a result too large for a slot goes on the pipe)."""

    def __init__(self, ring: ShmRing, conn) -> None:
        self.ring = ring
        self.conn = conn
        self.pending: collections.deque = collections.deque()

    def flush(self) -> None:
        q = self.pending
        while q and _ready(q[0][1]):
            step, p = q[0]
            wire = p.wire() if hasattr(p, "wire") else None
            if wire is None:
                wire = encode_sampled(p.result())
            data = pickle.dumps(("result", step, wire), protocol=5)
            if not self.ring.try_write(data):
                return  # the engine has not read the ring for a while: later
            q.popleft()
            if self.ring.sleepers():
                self.conn.send_bytes(b"")  # the engine blocks on the pipes: wake it
            if len(data) > self.ring.handle.slot_bytes:
                self.conn.send_bytes(data)


def _recv_payload(conn) -> bytes:
    """The next message on the pipe that is not a wake-up."""
    while True:
        data = conn.recv_bytes()
        if data:
            return data


def worker_main(config: EngineConfig, rank: int, init_method: str, conn, parent_pid: int,
                timeout_s: float, worker_cls: type | None, requests: RingHandle,
                results: RingHandle) -> None:
    """A worker process. Messages from the executor come on the `requests` ring (or, too large
    for a slot, on `conn`), pickled tuples, in order: ("execute", SchedulerOutput, step),
    ("call", method, args) (replies ("reply", value) on `conn`), ("shutdown",). The output rank
    writes ("result", step, {req_id: SampledTokens}) for every step to the `results` ring.
    `worker_cls` replaces Worker (scripts/mp_overhead.py's stub). Any exception is sent back on
    `conn` as ("error", rank, traceback) and ends the process; so does the parent's death."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    logging.basicConfig(level=envs.get("KRAIT_LOG_LEVEL"))
    try:
        worker = (worker_cls or Worker)(config, rank, init_method, timeout_s)
        inbox = ShmRing.attach(requests, reader=rank)
        outbox = _Outbox(ShmRing.attach(results), conn) if worker.is_output_rank else None
        conn.send(("ready", worker.profile()))
        loads = pickle.loads
        piped: collections.deque[bytes] = collections.deque()  # payloads too large for a slot

        def poll():
            if outbox is not None and outbox.pending:
                outbox.flush()
            return inbox.try_read()

        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)

        def block(timeout: float) -> None:  # until the pipe has something (or `timeout`)
            inbox.set_sleeping(True)
            try:
                if not poller.poll(0 if inbox.try_peek() else math.ceil(timeout * 1000)):
                    return
                while poller.poll(0):
                    data = conn.recv_bytes()
                    if data:
                        piped.append(data)
            finally:
                inbox.set_sleeping(False)

        while True:
            data = wait_until(poll, None, None if outbox is not None and outbox.pending
                              else block)
            if data is PIPE:
                data = piped.popleft() if piped else _recv_payload(conn)
            msg = loads(data)
            kind = msg[0]
            if kind == "execute":
                p = worker.execute_model(decode_sched(msg[1]))
                if outbox is not None:
                    outbox.pending.append((msg[2], p))
                    outbox.flush()
            elif kind == "call":
                conn.send(("reply", getattr(worker, msg[1])(*msg[2])))
            elif kind == "shutdown":
                inbox.close()
                if outbox is not None:
                    outbox.ring.close()
                break
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(1)  # the parent is gone
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    ps.destroy_distributed()

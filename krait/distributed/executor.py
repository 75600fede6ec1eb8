"""Executors: how the engine runs its model runner(s).

- `UniExecutor`: the ModelRunner in the engine's process (one rank). Its `execute_model` is
  the runner's own bound method, so the single-process step is the code path it always was.
- `MultiprocExecutor`: one worker process a rank (spawned; gloo on CPU, NCCL on GPU). Each step
  the SchedulerOutput is pickled once and written to a shared-memory broadcast ring that every
  worker reads (`shm_ring.py`; a payload larger than a slot goes on the pipes); rank 0 of the
  last stage writes each step's sampled tokens to a second ring as soon as they are on the
  host, where the engine reads them back. A worker's exception comes back as its traceback on
  its pipe and is raised here; a worker that dies is noticed through its process sentinel
  (both watched while the engine waits on a ring); workers exit when the parent pid goes. The
  rings are unlinked at shutdown (and by multiprocessing's resource tracker if the engine
  process itself dies).
- `RayExecutor` (krait/distributed/ray_executor.py): the same workers as Ray actors.

Every executor offers: `profiles` (one RankProfile a rank), `initialize(num_blocks,
num_slots, num_conv_slots=0)`, `execute_model(sched) -> pending` (`.result()` -> {req_id: SampledTokens},
`.waited_s`), `propose_drafts(req_ids)`, `shutdown()`."""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import socket
import time
import weakref

from krait.config import EngineConfig
from krait.distributed.shm_ring import ALL, PIPE, ShmRing
from krait.distributed.wire import decode_sampled, encode_sched
from krait.distributed.worker import RankProfile, rank_profile, worker_main

logger = logging.getLogger(__name__)

# how long ranks wait for each other in a collective before giving up
COLLECTIVE_TIMEOUT_S = 600.0


class Executor:
    """The interface (see the module docstring)."""

    profiles: list[RankProfile]
    runner = None  # the in-process ModelRunner (UniExecutor only)

    def initialize(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        raise NotImplementedError

    def execute_model(self, sched):
        raise NotImplementedError

    def propose_drafts(self, req_ids: list[str]) -> dict[str, list[int]]:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    # what the engine reads, the same on every rank (or the widest)
    @property
    def slots_per_request(self) -> int:
        return max(p.slots_per_request for p in self.profiles)

    @property
    def chunk_size(self) -> int | None:
        return next((p.chunk_size for p in self.profiles if p.chunk_size), None)

    @property
    def num_spec_tokens(self) -> int:
        return self.profiles[0].num_spec_tokens

    @property
    def has_drafter(self) -> bool:
        return self.profiles[0].has_drafter

    @property
    def async_spec(self) -> bool:
        """Speculative steps run asynchronously (drafts made on the device; one rank only)."""
        return self.runner is not None and self.runner.async_spec


class UniExecutor(Executor):
    """The runner in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from krait.runner.model_runner import ModelRunner

        self.config = config
        self.runner = ModelRunner(config)
        self.profiles = [rank_profile(self.runner, config)]
        # the runner's own methods: no wrapper frame on the step's path
        self.execute_model = self.runner.execute_model
        self.propose_drafts = self.runner.propose_drafts

    def initialize(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        self.runner.initialize_cache(num_blocks, num_slots, num_conv_slots)
        self.runner.capture_cuda_graphs()


class WorkerError(RuntimeError):
    """A worker process raised or died; the message holds its traceback or exit code."""


class _RemotePending:
    """A launched step of the workers; `.result()` asks the output rank for its tokens."""

    __slots__ = ("executor", "step", "waited_s", "_value")

    def __init__(self, executor: MultiprocExecutor, step: int) -> None:
        self.executor = executor
        self.step = step
        self.waited_s = 0.0
        self._value = None

    def result(self):
        if self._value is None:
            t0 = time.perf_counter()
            self._value = self.executor._result(self.step)
            self.waited_s = time.perf_counter() - t0
        return self._value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs, conns, rings, timeout: float = 5.0) -> None:
    """Asks every worker to stop, terminates (and kills) the ones still alive, and unlinks the
    rings."""
    if rings:
        try:
            rings[0].try_write(pickle.dumps(("shutdown",)))  # a full ring: a worker is stuck
        except Exception:
            pass
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        try:
            c.close()
        except Exception:
            pass
    for ring in rings:
        ring.close()
    rings.clear()


class MultiprocExecutor(Executor):
    """One spawned worker process a rank (rank = pp_rank * tp_size + tp_rank)."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0,
                 worker_cls: type | None = None) -> None:
        """`worker_cls`: a stand-in for Worker (a stubbed model: scripts/mp_overhead.py)."""
        self.config = config
        world = config.parallel.world_size
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs, self.conns = [], []
        self._dead: WorkerError | None = None
        self._inbox = [collections.deque() for _ in range(world)]
        self._step = 0
        self._poller = None
        # engine -> every worker; the output rank -> the engine (reader 0)
        self._requests = ShmRing.create(world)
        self._results = ShmRing.create(1)
        self._results.reader = 0
        rings = [self._requests, self._results]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, rings)
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"krait-worker-{rank}", daemon=True,
                            args=(config, rank, init_method, child, os.getpid(),
                                  COLLECTIVE_TIMEOUT_S, worker_cls, self._requests.handle,
                                  self._results.handle))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        par = config.parallel
        # rank 0 of the last stage returns the sampled tokens
        self.output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        try:
            self.profiles = [self._wait(r, "ready", start_timeout_s)[1] for r in range(world)]
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d worker processes (tp=%d, pp=%d)", world,
                    par.tensor_parallel_size, par.pipeline_parallel_size)

    # -- messages --------------------------------------------------------------------
    def _fail(self, err: WorkerError) -> WorkerError:
        self._dead = err
        self.shutdown()
        return err

    def _wait(self, rank: int, kind: str, timeout: float | None = None):
        """The next message from `rank` (which must be of `kind`), watching every worker: a
        worker's error or death raises WorkerError (and stops them all). Other ranks'
        messages read meanwhile wait in their inbox."""
        inbox = self._inbox[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not inbox:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._fail(WorkerError(f"worker {rank} did not answer in {timeout:.0f} s"))
            self._pump(left)
        msg = inbox.popleft()
        if msg[0] != kind:
            raise self._fail(WorkerError(f"worker {rank} sent {msg[0]!r}, expected {kind!r}"))
        return msg

    def _pump(self, timeout: float | None) -> None:
        """Reads whatever the workers sent (waiting up to `timeout`); raises on an error
        message or a dead worker."""
        if self._poller is None:  # built once: a selector a call costs tens of microseconds
            self._poller = select.poll()
            for fd in [c.fileno() for c in self.conns] + [p.sentinel for p in self.procs]:
                self._poller.register(fd, select.POLLIN)
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        ready = {fd for fd, _ in self._poller.poll(ms)}
        for r, c in enumerate(self.conns):
            if c.fileno() not in ready:
                continue
            try:
                data = c.recv_bytes()
            except (EOFError, OSError):
                continue  # its sentinel reports the death
            if not data:
                continue  # a wake-up (the result ring has something)
            msg = pickle.loads(data)
            if msg[0] == "error":
                dead = self._dead_worker(exclude=msg[1])
                if dead is not None:  # the error is the other rank's death seen in a collective
                    raise self._fail(WorkerError(
                        f"{dead}; worker {msg[1]} then failed: {msg[2].strip().splitlines()[-1]}"))
                raise self._fail(WorkerError(f"worker {msg[1]} failed:\n{msg[2]}"))
            self._inbox[r].append(msg)
        for r, p in enumerate(self.procs):
            if p.sentinel in ready and not self.conns[r].poll():
                p.join(1.0)
                raise self._fail(WorkerError(
                    f"worker {r} (pid {p.pid}) died with exit code {p.exitcode}"))

    def _dead_worker(self, exclude: int, wait_s: float = 0.5) -> str | None:
        """'worker N (pid P) died with exit code C' for a worker (not `exclude`) that is gone
        or goes within `wait_s` without having reported an error of its own."""
        others = [(r, p) for r, p in enumerate(self.procs) if r != exclude]
        multiprocessing.connection.wait([p.sentinel for _, p in others], wait_s)
        for r, p in others:
            if p.exitcode is None:
                continue
            try:  # its own error, if it sent one before going
                while self.conns[r].poll():
                    data = self.conns[r].recv_bytes()
                    msg = pickle.loads(data) if data else ("wake",)
                    if msg[0] == "error":
                        return f"worker {msg[1]} failed:\n{msg[2]}"
            except (EOFError, OSError):
                pass
            return f"worker {r} (pid {p.pid}) died with exit code {p.exitcode}"
        return None

    def _check(self) -> None:
        """Raises WorkerError if a worker reported an error or died (called while waiting)."""
        self._pump(0)

    def _broadcast(self, msg: tuple, ranks=None) -> None:
        """Writes msg to the ring for `ranks` (default all); too large for a slot, it goes on
        their pipes."""
        if self._dead is not None:
            raise WorkerError(f"the workers are stopped: {self._dead}")
        data = pickle.dumps(msg, protocol=5)
        targets = ALL if ranks is None else sum(1 << r for r in ranks)
        ring = self._requests
        piped = ring.write(data, targets, self._check)
        try:
            for r in ring.sleepers(targets):  # blocked on their pipe: wake them
                self.conns[r].send_bytes(b"")
            if piped:
                for r in range(len(self.conns)) if ranks is None else ranks:
                    self.conns[r].send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError):
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:  # raises the worker's error or death
                self._pump(0.5)
            raise

    def _call(self, method: str, *args, ranks=None):
        """Runs Worker.method(*args) on `ranks` (default all) and returns their replies."""
        ranks = list(range(len(self.conns)) if ranks is None else ranks)
        self._broadcast(("call", method, args), ranks)
        return [self._wait(r, "reply")[1] for r in ranks]

    # -- the interface ------------------------------------------------------------------
    def initialize(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        self._call("initialize", num_blocks, num_slots, num_conv_slots)

    def execute_model(self, sched) -> _RemotePending:
        self._step += 1
        self._broadcast(("execute", encode_sched(sched), self._step))
        return _RemotePending(self, self._step)

    def _result(self, step: int):
        """Step `step`'s sampled tokens. The output rank sends every step's, in order; those
        of steps nobody reads back (an empty step) are passed over."""
        while True:
            if self._dead is not None:
                raise WorkerError(f"the workers are stopped: {self._dead}")
            data = self._results.read(self._check, self._pump)
            msg = (self._wait(self.output_rank, "result") if data is PIPE
                   else pickle.loads(data))
            if msg[1] == step:
                return decode_sampled(msg[2])
            if msg[1] > step:
                raise self._fail(WorkerError(f"step {msg[1]}'s result came for step {step}"))

    def propose_drafts(self, req_ids: list[str]) -> dict[str, list[int]]:
        """The output rank's drafts; a model drafter runs sharded like the target, so then every
        rank runs it (the same drafts: their collectives agree)."""
        if not drafts_on_every_rank(self.config):
            return self._call("propose_drafts", req_ids, ranks=[self.output_rank])[0]
        return self._call("propose_drafts", req_ids)[self.output_rank]

    def shutdown(self) -> None:
        self._finalizer()


def drafts_on_every_rank(config: EngineConfig) -> bool:
    """Whether every rank runs the drafter: a model drafter (draft model, EAGLE, MTP) under
    tensor parallelism (its layers sharded like the target's, its steps collective); ngram
    drafts on the output rank alone."""
    spec = config.speculative
    return spec is not None and spec.method != "ngram" and \
        config.parallel.tensor_parallel_size > 1


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniExecutor(config)
    if backend == "mp":
        return MultiprocExecutor(config)
    if backend == "ray":
        from krait.distributed.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"distributed_executor_backend {backend!r} is unknown")

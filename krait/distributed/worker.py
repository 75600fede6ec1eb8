"""One rank's worker: a ModelRunner inside its process group, and the loop a worker process
runs around it (the multiprocess executor's side of the pipe)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from krait import envs
from krait.config import EngineConfig
from krait.distributed import parallel_state as ps
from krait.distributed import pipeline
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


def rank_profile(runner, config: EngineConfig) -> RankProfile:
    ms = runner.model_state
    if config.device.type == "cuda":
        from krait.runner.memory import profile_free_memory

        budget = profile_free_memory(runner, config)
    else:
        budget = int(config.cache.cpu_kv_cache_gib * 2**30)
    return RankProfile(ms.kv_bytes_per_block(), ms.state_bytes_per_slot(), budget,
                       ms.slots_per_request, getattr(ms, "chunk_size", None),
                       runner.num_spec_tokens, runner.drafter is not None)


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
        self.rank = rank
        st = ps.init_distributed(rank, tp, pp, init_method, "nccl" if cuda else "gloo",
                                 timeout_s)
        # CUDA graphs are not captured across ranks yet: every rank runs eagerly
        self.config = dataclasses.replace(config, device=device, enforce_eager=True)
        if pp > 1:
            from krait.distributed.layout import num_layers

            hf = config.model.hf_config
            start, end = pipeline.stage_layer_ranges(num_layers(hf), pp)[st.pp_rank]
            pipeline.set_stage(pipeline.StageContext(start, end, hf.hidden_size,
                                                     config.model.dtype, device))
        from krait.runner.model_runner import ModelRunner

        self.runner = ModelRunner(self.config)
        self.is_output_rank = st.is_output_rank
        self._fault: int | None = None  # a step that raises (`inject_fault`, tests)
        self._steps = 0

    def profile(self) -> RankProfile:
        return rank_profile(self.runner, self.config)

    def initialize(self, num_blocks: int, num_slots: int) -> None:
        self.runner.initialize_cache(num_blocks, num_slots)
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


def worker_main(config: EngineConfig, rank: int, init_method: str, conn, parent_pid: int,
                timeout_s: float, worker_cls: type | None = None) -> None:
    """A worker process: messages from the executor over `conn` (pickled tuples), in order:
    ("execute", SchedulerOutput, step), ("result", step) (output rank only: replies ("result",
    step, {req_id: SampledTokens})), ("call", method, args) (replies ("reply", value)),
    ("shutdown",). `worker_cls` replaces Worker (scripts/mp_overhead.py's stub). Any exception is sent back as ("error", rank, traceback) and ends the
    process; a closed pipe (the parent died) ends it too."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    logging.basicConfig(level=envs.get("KRAIT_LOG_LEVEL"))
    try:
        worker = (worker_cls or Worker)(config, rank, init_method, timeout_s)
        conn.send(("ready", worker.profile()))
        pending: dict[int, object] = {}
        loads = pickle.loads
        while True:
            msg = loads(conn.recv_bytes())
            kind = msg[0]
            if kind == "execute":
                p = worker.execute_model(decode_sched(msg[1]))
                if worker.is_output_rank:
                    pending[msg[2]] = p
            elif kind == "result":
                p = pending.pop(msg[1])
                conn.send_bytes(pickle.dumps(("result", msg[1], encode_sampled(p.result())),
                                             protocol=5))
            elif kind == "call":
                conn.send(("reply", getattr(worker, msg[1])(*msg[2])))
            elif kind == "shutdown":
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

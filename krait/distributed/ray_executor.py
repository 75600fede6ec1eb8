"""The Ray executor: the same Worker a rank, as Ray actors in one placement group (a bundle a
rank: one GPU each on CUDA, one CPU on CPU). It joins the cluster at RAY_ADDRESS when that is
set, else starts a local Ray. Ray is imported only here, only when this backend is chosen
(`pip install krait[ray]`); the multiprocess backend never needs it."""

from __future__ import annotations

import logging
import os
import socket
import time

from krait.config import EngineConfig
from krait.distributed.executor import (
    COLLECTIVE_TIMEOUT_S,
    Executor,
    WorkerError,
    drafts_on_every_rank,
)

logger = logging.getLogger(__name__)


class _RayWorker:
    """The actor around a Worker (its methods are what the executor calls remotely)."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str, timeout_s: float):
        from krait.distributed.worker import Worker

        self.worker = Worker(config, rank, init_method, timeout_s)

    def node_ip(self) -> str:
        return socket.gethostbyname(socket.gethostname())

    def profile(self):
        return self.worker.profile()

    def initialize(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        self.worker.initialize(num_blocks, num_slots, num_conv_slots)

    def execute(self, sched):
        """The step; the output rank returns its tokens, the others None."""
        pending = self.worker.execute_model(sched)
        return pending.result() if self.worker.is_output_rank else None

    def propose_drafts(self, req_ids):
        return self.worker.propose_drafts(req_ids)


class _RayPending:
    __slots__ = ("refs", "out", "waited_s", "_value")

    def __init__(self, refs, out: int) -> None:
        self.refs, self.out, self.waited_s, self._value = refs, out, 0.0, None

    def result(self):
        if self._value is None:
            import ray

            t0 = time.perf_counter()
            try:
                values = ray.get(self.refs)  # every rank's, so that any failure surfaces
            except Exception as e:
                raise WorkerError(f"a Ray worker failed: {e}") from e
            self._value = values[self.out]
            self.waited_s = time.perf_counter() - t0
        return self._value


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray "
                             "(pip install 'krait[ray]')") from None
        self.config = config
        par = config.parallel
        world = par.world_size
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address or None, include_dashboard=False,
                     log_to_driver=True, ignore_reinit_error=True,
                     **({} if address else {"num_cpus": max(world, os.cpu_count() or 1)}))
        gpu = config.device.type == "cuda"
        bundles = [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
        self.pg = placement_group(bundles, strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        host = "127.0.0.1" if not os.environ.get("RAY_ADDRESS") else _driver_ip()
        init_method = f"tcp://{host}:{_free_port()}"
        actor = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RayWorker)
        self.actors = [
            actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}},
            ).remote(config, r, init_method, COLLECTIVE_TIMEOUT_S)
            for r in range(world)
        ]
        self.output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        try:
            self.profiles = ray.get([a.profile.remote() for a in self.actors])
        except Exception as e:
            self.shutdown()
            raise WorkerError(f"a Ray worker failed to start: {e}") from e
        logger.info("started %d Ray workers (tp=%d, pp=%d)", world, par.tensor_parallel_size,
                    par.pipeline_parallel_size)

    def initialize(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        import ray

        ray.get([a.initialize.remote(num_blocks, num_slots, num_conv_slots) for a in self.actors])

    def execute_model(self, sched) -> _RayPending:
        return _RayPending([a.execute.remote(sched) for a in self.actors], self.output_rank)

    def propose_drafts(self, req_ids: list[str]) -> dict[str, list[int]]:
        import ray

        if not drafts_on_every_rank(self.config):
            return ray.get(self.actors[self.output_rank].propose_drafts.remote(req_ids))
        return ray.get([a.propose_drafts.remote(req_ids) for a in self.actors])[self.output_rank]

    def shutdown(self) -> None:
        import ray

        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _driver_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _pythonpath() -> str:
    """The krait the driver runs (a source checkout too), first on the workers' path."""
    import krait

    root = os.path.dirname(os.path.dirname(os.path.abspath(krait.__file__)))
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")

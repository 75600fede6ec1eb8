"""The multiprocess executor's control path per step, the model stubbed: each step's
SchedulerOutput (a decode batch of --batch rows) pickled and written to every worker, and the
output rank's sampled tokens read back, over the real MultiprocExecutor and worker loop.

    PYTHONPATH=. python scripts/mp_overhead.py --batch 64 --ranks 2 --steps 2000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from krait.distributed.worker import RankProfile


class _Pending:
    """PendingSample's interface: `wire()` is what the worker sends, `result()` the objects."""

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids

    def wire(self):
        return list(self.req_ids), [[7] for _ in self.req_ids]

    def result(self):
        from krait.engine.scheduler import SampledTokens

        return {r: SampledTokens([7]) for r in self.req_ids}


class StubWorker:
    """Worker's interface without a model: every scheduled row samples token 7."""

    def __init__(self, config, rank, init_method, timeout_s) -> None:
        self.is_output_rank = rank == 0

    def profile(self) -> RankProfile:
        return RankProfile(1024, 0, 1 << 30, 0, None, 0, False)

    def initialize(self, num_blocks: int, num_slots: int) -> None:
        pass

    def execute_model(self, sched):
        return _Pending(list(sched.num_scheduled_tokens))


def decode_step(batch: int, step: int):
    """A decode step's SchedulerOutput as the scheduler emits it (cached rows as columns)."""
    from krait.engine.scheduler import CachedColumns, SchedulerOutput

    ids = [f"req-{i}" for i in range(batch)]
    cached = CachedColumns(ids, [[1000 + step] if (step + i) % 16 == 0 else []
                                 for i in range(batch)], [100 + step] * batch)
    return SchedulerOutput([], cached, {r: 1 for r in ids}, batch, set(), set())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    from krait.config import EngineConfig
    from krait.distributed.executor import MultiprocExecutor
    from tests.utils import make_tiny_llama

    model = make_tiny_llama(tempfile.mkdtemp() + "/m")
    config = EngineConfig.from_kwargs(model, device="cpu", tensor_parallel_size=args.ranks)
    ex = MultiprocExecutor(config, worker_cls=StubWorker)
    try:
        steps = [decode_step(args.batch, s) for s in range(args.steps)]
        for s in steps[:100]:  # warm-up
            ex.execute_model(s).result()
        t0 = time.perf_counter()
        prev = None
        for s in steps:  # async scheduling's pattern: launch N + 1, then read N back
            p = ex.execute_model(s)
            if prev is not None:
                prev.result()
            prev = p
        prev.result()
        per_step = (time.perf_counter() - t0) / len(steps)
    finally:
        ex.shutdown()
    print(json.dumps({"batch": args.batch, "ranks": args.ranks, "steps": args.steps,
                      "control_path_ms_per_step": round(per_step * 1e3, 4)}))


if __name__ == "__main__":
    main()

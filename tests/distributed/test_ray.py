"""The Ray backend on CPU: a local Ray, TP=2 in a placement group, equals the single-process
engine (skipped where Ray is not installed)."""

from __future__ import annotations

import pytest

from tests.distributed.common import assert_same, models, run  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def test_ray_tp2_matches_single_process(models, monkeypatch) -> None:  # noqa: F811
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = models("granitemoehybrid")
    ref = run(model)
    try:
        got = run(model, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert_same(ref, got)

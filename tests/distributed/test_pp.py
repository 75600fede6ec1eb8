"""Pipeline parallelism (gloo): PP=2 (2 processes) and TP=2 x PP=2 (4 processes) equal the
single-process engine token for token, with chunked prefill and preemption. NemotronH's
4 layers "M*-E" split into a stage with attention and Mamba and one with neither (its cache
sizing must not limit the others)."""

from __future__ import annotations

import pytest

from tests.distributed.common import assert_same, models, run  # noqa: F401

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", ["llama", "nemotronh"])
def test_pp2_matches_single_process(models, name: str) -> None:  # noqa: F811
    model = models(name)
    ref_pre: list = []
    ref = run(model, ref_pre)
    assert ref_pre, "the workload must preempt"
    assert_same(ref, run(model, [], pipeline_parallel_size=2))


@pytest.mark.parametrize("name", ["granitemoehybrid"])
def test_tp2_pp2_matches_single_process(models, name: str) -> None:  # noqa: F811
    model = models(name)
    ref = run(model)
    assert_same(ref, run(model, tensor_parallel_size=2, pipeline_parallel_size=2))


def test_stage_layer_ranges() -> None:
    """Even stages, the remainder to the first; an explicit partition is checked."""
    from krait.distributed.pipeline import stage_layer_ranges

    assert stage_layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_layer_ranges(4, 2, [3, 1]) == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match="layer partition"):
        stage_layer_ranges(2, 2, [1, 2])
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        stage_layer_ranges(2, 3)

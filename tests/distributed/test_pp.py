"""Pipeline parallelism (gloo): PP=2 (2 processes) and TP=2 x PP=2 (4 processes) equal the
single-process engine token for token, with chunked prefill and preemption, two micro-batches
in flight (async scheduling's batch queue). NemotronH's 4 layers "M*-E" split into a stage with
attention and Mamba and one with neither (its cache sizing must not limit the others)."""

from __future__ import annotations

import pytest

from krait import SamplingParams
from tests.distributed.common import PROMPTS, assert_same, models, run  # noqa: F401

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", ["llama", "nemotronh", "qwen3next"])
def test_pp2_matches_single_process(models, name: str) -> None:  # noqa: F811
    model = models(name)
    ref_pre: list = []
    ref = run(model, ref_pre)
    assert ref_pre, "the workload must preempt"
    assert_same(ref, run(model, [], pipeline_parallel_size=2))


def test_pp2_micro_batches_match_single_process(models) -> None:  # noqa: F811
    """Twice the requests one micro-batch takes (max_num_seqs 4: micro-batches of 2), chunked
    prefill and preemption: two micro-batches are in flight at once, no request is in both,
    and the tokens equal the single-process engine's; and the same without async scheduling
    (one batch at a time)."""
    model = models("llama")
    prompts = PROMPTS + [{"prompt_token_ids": [5 + (11 * j + k) % 400 for j in range(n)]}
                         for k, n in ((4, 7), (5, 15), (6, 3), (7, 11))]
    ref_pre: list = []
    ref = run(model, ref_pre, prompts)
    assert ref_pre, "the workload must preempt"
    depths: list[int] = []

    def probe(engine) -> None:
        launch = engine.executor.execute_model

        def launched(sched):
            others = {r for s, _ in engine._batch_queue for r in s.num_scheduled_tokens}
            assert not others & set(sched.num_scheduled_tokens), "a request in two batches"
            depths.append(len(engine._batch_queue) + 1)
            return launch(sched)

        engine.executor.execute_model = launched

    pre: list = []
    assert_same(ref, run(model, pre, prompts, probe, pipeline_parallel_size=2))
    assert pre and max(depths) == 2
    depths.clear()
    # (no logprobs: the output rank sends its tokens as plain lists, PendingSample.wire)
    got = run(model, None, prompts, probe, SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True),
              pipeline_parallel_size=2, async_scheduling=False)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert max(depths) == 1


@pytest.mark.parametrize("name", ["granitemoehybrid", "qwen3next"])
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


def test_layer_partition_from_the_environment(monkeypatch) -> None:
    """KRAIT_PP_LAYER_PARTITION: layers per stage, checked at start-up."""
    from types import SimpleNamespace

    import torch

    from krait.distributed.layout import validate_layout
    from krait.distributed.pipeline import layer_partition, stage_layer_ranges

    assert layer_partition() is None
    monkeypatch.setenv("KRAIT_PP_LAYER_PARTITION", "8,8,16")
    assert stage_layer_ranges(32, 3, layer_partition()) == [(0, 8), (8, 16), (16, 32)]
    cfg = SimpleNamespace(architectures=["X"], num_hidden_layers=30)
    with pytest.raises(ValueError, match=r"\[8, 8, 16\] \(KRAIT_PP_LAYER_PARTITION\) must "
                       "give 3 stages of at least one layer each, 30 layers in all"):
        validate_layout(cfg, 1, 3, None, torch.device("cpu"))
    monkeypatch.setenv("KRAIT_PP_LAYER_PARTITION", "8;8")
    with pytest.raises(ValueError, match="must be comma-separated layer counts"):
        layer_partition()

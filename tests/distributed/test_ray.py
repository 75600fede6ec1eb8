"""The Ray backend on CPU: a local Ray, TP=2 in a placement group, equals the single-process
engine (skipped where Ray is not installed), with a draft model too. The workload is small: Ray's start-up and its
per-step calls are what this checks (chunked prefill and preemption across ranks are the mp
tests' part, tests/distributed/test_tp.py)."""

from __future__ import annotations

import pytest

from krait import LLM, SamplingParams
from tests.distributed.common import ENGINE, PROMPTS, assert_same, models  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def _run(model_dir: str, **kw):
    llm = LLM(model_dir, **{**ENGINE, "max_num_batched_tokens": 64, "num_kv_blocks": 40, **kw})
    try:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4,
                                                        ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [(o.outputs[0].token_ids,
             [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_ray_tp2_matches_single_process(models, monkeypatch) -> None:  # noqa: F811
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = models("granitemoehybrid")
    ref = _run(model)
    try:
        got = _run(model, tensor_parallel_size=2, distributed_executor_backend="ray")
        # a draft model (the target itself) drafts on both actors, sharded like the target
        drafted = _run(model, tensor_parallel_size=2, distributed_executor_backend="ray",
                       speculative_config={"model": model, "num_speculative_tokens": 2})
    finally:
        ray.shutdown()
    assert_same(ref, got)
    assert_same(ref, drafted)

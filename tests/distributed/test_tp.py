"""Tensor parallelism over the multiprocess executor (gloo, 2 worker processes): output equals
the single-process engine's token for token (logprobs within 1e-4: the reductions reorder),
with chunked prefill and preemption; ngram speculation and prefix caching compose."""

from __future__ import annotations

import pytest

from tests.distributed.common import assert_same, models, run  # noqa: F401

pytestmark = pytest.mark.timeout(300)

# (model, extra engine options for both runs)
CASES = {
    "qwen3-ngram": ("qwen3", {"speculative_config": {"method": "ngram",
                                                     "num_speculative_tokens": 2}}),
    "granitemoehybrid-prefix": ("granitemoehybrid", {"enable_prefix_caching": True}),
    "nemotronh": ("nemotronh", {}),
    "falconh1": ("falconh1", {}),
    "qwen3next": ("qwen3next", {}),
    "qwen3next-prefix-ngram": ("qwen3next", {"enable_prefix_caching": True, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 2}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_single_process(models, case: str) -> None:  # noqa: F811
    name, extra = CASES[case]
    model = models(name)
    ref_pre: list = []
    ref = run(model, ref_pre, **extra)
    assert ref_pre, "the workload must preempt"
    got = run(model, [], tensor_parallel_size=2, **extra)
    assert_same(ref, got)

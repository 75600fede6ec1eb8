"""Speculative decoding with model drafters under tensor parallelism (mp executor, gloo, 2
ranks): the drafter runs on every rank, its layers sharded like the target's, and proposes
exactly the single-process drafts; output equals the single-process engine's token for token,
with chunked prefill and preemption. Cases: hybrid draft models for a hybrid target (the draft's
own state slots; drafts all rejected, and all accepted), an EAGLE-3 head (its draft vocabulary
map read from the sharded checkpoint) and Qwen3-Next's MTP head."""

from __future__ import annotations

import pytest

from tests.distributed.common import assert_same, run
from tests.models.test_spec_eagle import TARGET_LAYERS, make_head
from tests.models.test_spec_mtp import add_mtp_head
from tests.utils import make_tiny_hybrid, make_tiny_llama, make_tiny_qwen3_next

pytestmark = pytest.mark.timeout(400)


def _build(case: str, root) -> tuple[str, dict]:
    """(target checkpoint, speculative_config) of a case."""
    if case.startswith("granitemoehybrid"):
        target = make_tiny_hybrid(root / "target", "granitemoehybrid")
        if case.endswith("self-draft"):  # its own draft: every draft accepted
            return target, {"model": target}
        # its first two layers under another seed: every draft rejected
        draft = make_tiny_hybrid(root / "draft", "granitemoehybrid", seed=1,
                                 num_hidden_layers=2, layer_types=["mamba", "attention"])
        return target, {"model": draft}
    if case == "eagle3":
        return make_tiny_llama(root / "target", num_hidden_layers=TARGET_LAYERS), {
            "method": "eagle3", "model": make_head(root / "head", "eagle3")}
    target = make_tiny_qwen3_next(root / "target", num_attention_heads=4)
    add_mtp_head(target)
    return target, {"method": "mtp"}


def _recording(log: list):
    """An on_engine probe: every proposal the executor returns, in order."""
    def probe(engine) -> None:
        propose = engine.executor.propose_drafts
        engine.executor.propose_drafts = lambda ids: log.append(d := propose(ids)) or d
    return probe


@pytest.mark.parametrize("case", ["granitemoehybrid-draft", "granitemoehybrid-self-draft",
                                  "eagle3", "qwen3next-mtp"])
def test_tp2_model_drafters_match_single_process(tmp_path, case: str) -> None:
    target, spec = _build(case, tmp_path)
    spec = {**spec, "num_speculative_tokens": 2}
    ref_log: list = []
    got_log: list = []
    ref_pre: list = []
    ref = run(target, ref_pre, on_engine=_recording(ref_log), speculative_config=spec)
    # (every draft accepted, the workload ends in fewer steps, before the pool runs short)
    assert ref_pre or case.endswith("self-draft"), "the workload must preempt"
    got = run(target, [], on_engine=_recording(got_log), tensor_parallel_size=2,
              speculative_config=spec)
    assert_same(ref, got)
    assert got_log == ref_log and sum(len(d) for d in ref_log) > 0

"""Invariant 7's data contract on a pipeline stage that is not the last (the case that shipped
broken in vLLM): the stage samples nothing itself, takes the last stage's tokens (the engine
sends them with the request's next step), and its state updates scatter through an int32
`idx_mapping` whose -1 rows are skipped; a chunked-prefill step that sampled nothing records
the neutral accepted count 1.

The stage runs in this process: stage 0 of 2 of a GraniteMoeHybrid (Mamba + attention + MoE)
under an engine configured for PP=2 (its batch queue, one micro-batch at a time), its send
replaced by a recorder and the output rank's result by LAST_STAGE_TOKEN, under ngram
speculation so that the accepted counts exist."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from krait import SamplingParams
from krait.config import EngineConfig
from krait.distributed import parallel_state as ps
from krait.distributed import pipeline
from krait.engine.engine import LLMEngine
from krait.engine.scheduler import SampledTokens
from krait.runner.model_runner import PendingSample
from tests.distributed.common import models  # noqa: F401

SENTINEL = 9
LAST_STAGE_TOKEN = 7  # what the (replaced) last stage samples


@pytest.fixture
def stage0_engine(models, monkeypatch):  # noqa: F811
    model = models("granitemoehybrid")
    config = EngineConfig.from_kwargs(
        model, device="cpu", dtype="float32", max_num_batched_tokens=4, block_size=4,
        num_kv_blocks=16, max_model_len=32, max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    # the engine of a PP=2 deployment (synchronous: one micro-batch in flight), its one rank
    # in this process (the "uni" executor the options chose)
    config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, pipeline_parallel_size=2),
        scheduler=dataclasses.replace(config.scheduler, async_scheduling=False))
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(ps, "pp_send", lambda x, to: sent.append(x.clone()))
    old = ps.set_state(ps.ParallelState(pp_size=2, pp_rank=0, pp_ranks=(0, 1)))
    pipeline.set_stage(pipeline.StageContext(0, 2, 64, torch.float32, torch.device("cpu")))
    try:
        engine = LLMEngine(config)
        launch = engine.executor.execute_model

        def with_output_rank(sched):  # the last stage samples LAST_STAGE_TOKEN
            launch(sched)
            reqs = engine.scheduler.requests
            return PendingSample.resolved({
                rid: SampledTokens([LAST_STAGE_TOKEN]) for rid in sched.num_scheduled_tokens
                if rid in reqs and reqs[rid].num_inflight})

        engine.executor.execute_model = with_output_rank
        yield engine, sent
    finally:
        pipeline.set_stage(None)
        ps.set_state(old)


def test_invariant_7_non_last_stage_chunk_without_sampling(stage0_engine) -> None:
    engine, sent = stage0_engine
    runner = engine.runner
    assert runner.pp and not runner.is_last_stage
    assert len(runner.model_state.mamba_layers) == 1  # layer 0 only; layer 2 is stage 1's
    ms = runner.model_state
    calls = []
    orig = ms.postprocess_state

    def recorded(idx_mapping, num_sampled, seq_lens=None):
        calls.append((idx_mapping.clone(), num_sampled if isinstance(num_sampled, int)
                      else num_sampled.clone()))
        return orig(idx_mapping, num_sampled, seq_lens)

    ms.postprocess_state = recorded
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 13))}, params)  # 10 tokens
    engine.step()  # chunk 1 of 3 (4 tokens): nothing sampled
    row = runner.states.index["a"]
    ms.num_accepted_tokens.fill_(SENTINEL)
    engine.step()  # chunk 2 of 3: nothing sampled
    idx, num = calls[-1]
    assert idx.dtype == torch.int32 and idx.tolist() == [row]
    assert num.tolist() == [0]  # the chunk sampled nothing ...
    expect = [SENTINEL] * ms.num_accepted_tokens.shape[0]
    expect[row] = 1  # ... and records the neutral count
    assert ms.num_accepted_tokens.tolist() == expect
    # the stage sent hidden + residual of its 4 tokens each chunk, and sampled nothing itself
    assert [tuple(t.shape) for t in sent] == [(2, 4, 64), (2, 4, 64)]
    outs = engine.step()  # chunk 3 (2 tokens) reaches the prompt's end: the last stage samples
    assert [o.outputs[0].token_ids for o in outs] == [[LAST_STAGE_TOKEN]]
    assert runner.states.num_tokens[row] == 11  # the stage counted the token it did not see
    engine.step()  # the decode step reads the token: the engine sent it with the step
    assert runner.states.token_ids[row, 10] == LAST_STAGE_TOKEN  # the tables stay in step
    assert tuple(sent[-1].shape) == (2, 1, 64)


def test_invariant_7_idx_mapping_minus_one_rows_skipped(stage0_engine) -> None:
    """-1 rows (padding, rows another stage dropped) never write: with a wrapping index the
    last row would take their value."""
    engine, _ = stage0_engine
    ms = engine.runner.model_state
    n = ms.num_accepted_tokens.shape[0]
    ms.num_accepted_tokens.fill_(SENTINEL)
    idx = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
    ms.postprocess_state(idx, torch.tensor([0, 3, 2, 0], dtype=torch.int32))
    assert ms.num_accepted_tokens.tolist() == [2, 1] + [SENTINEL] * (n - 2)
    ms.postprocess_state(idx, 0)  # an int: every real row 1
    assert ms.num_accepted_tokens.tolist() == [1, 1] + [SENTINEL] * (n - 2)

"""A deleted engine gives its GPU memory back (GPU only).

cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it ever ran on, until the process
ends; graph warm-ups on a fresh stream per capture size left up to ~1 GiB allocated after the
engine was gone (docs/benchmarks.md). Every capture now warms up on one stream
(`krait.runner.cuda_graphs.warmup_stream`)."""

from __future__ import annotations

import gc

import pytest
import torch

from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.runner.cuda_graphs import warmup_stream
from krait.sampling_params import SamplingParams
from tests.utils import make_tiny_hybrid

pytestmark = pytest.mark.gpu


def test_a_deleted_engine_leaves_at_most_a_few_workspaces(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = make_tiny_hybrid(tmp_path / "granitemoehybrid", "granitemoehybrid")
    eng = LLMEngine(EngineConfig.from_kwargs(model=model, device="cuda", max_model_len=256,
                                             max_num_seqs=32, gpu_memory_utilization=0.3))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": list(range(5, 40))}, greedy)
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - before
    # the default stream's, the warm-up stream's and the capture stream's workspaces at most
    assert left <= 3 * 32 * 2**20 + 4 * 2**20, f"{left / 2**20:.1f} MiB still allocated"
    dev = torch.cuda.current_device()
    assert warmup_stream(dev) is warmup_stream(dev)

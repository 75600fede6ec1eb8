"""A step never synchronizes the host with the GPU (GPU only).

Async scheduling overlaps the host's work on step N+1 with the device's work on step N; one
blocking copy or `.item()` inside a step serializes the two again (seen on the H200: a blocking
index copy in `write_sampled` and a scalar `__setitem__` in the slot reset kept decode steps
host-bound). The read-back of sampled tokens waits on an event, which sync debug mode does not
flag. Runs under `make` only with KRAIT_TEST_GPU=1 (`scripts/gpu_check.sh kernels`)."""

from __future__ import annotations

import warnings

import pytest
import torch

from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.sampling_params import SamplingParams
from tests.utils import make_tiny_model

pytestmark = pytest.mark.gpu


def _syncs_during(fn) -> list[str]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("arch", ["llama", "granitemoehybrid", "qwen3next"])
def test_steps_do_not_synchronize(arch: str, tmp_path) -> None:
    # qwen3next: the Gated DeltaNet decode (conv update, delta-rule update with its gates) and
    # prefill (prep + sequential pass, token_to_seq on the device) as well
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = make_tiny_model(tmp_path / arch, arch)
    eng = LLMEngine(EngineConfig.from_kwargs(model=model, device="cuda", max_model_len=256,
                                             max_num_seqs=8, gpu_memory_utilization=0.3))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"a{i}", {"prompt_token_ids": list(range(5 + i, 40 + 3 * i))}, greedy)
    for _ in range(4):  # warm-up: compilation, first allocations
        eng.step()

    def decode_and_mixed_steps() -> None:
        for _ in range(3):
            eng.step()  # decode graphs
        eng.add_request("late", {"prompt_token_ids": list(range(3, 60))}, greedy)
        for _ in range(3):
            eng.step()  # a mixed prefill + decode step, then decode

    assert _syncs_during(decode_and_mixed_steps) == []

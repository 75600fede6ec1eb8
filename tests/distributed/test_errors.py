"""Layouts refused at start-up, and failures of the workers: a worker's exception reaches the
engine as a WorkerError with its traceback, a killed worker is reported, and no worker outlives
the engine or its parent process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from krait import LLM, SamplingParams
from krait.config import EngineConfig
from krait.distributed import executor as executor_mod
from krait.distributed.executor import WorkerError
from krait.distributed.layout import validate_layout
from tests.distributed.common import ENGINE, PROMPTS, models  # noqa: F401

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")


def _cfg(**kw):
    base = dict(architectures=["X"], num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("cfg, tp, pp, match", [
    (_cfg(), 3, 1, r"does not divide the model's attention heads \(num_attention_heads\) \(8\)"),
    (_cfg(num_attention_heads=12, num_key_value_heads=4), 3, 1,
     r"does not divide the model's key/value heads \(num_key_value_heads\) \(4\)"),
    (_cfg(num_attention_heads=12, num_key_value_heads=4), 6, 1,
     r"neither a divisor nor a multiple of the model's key/value heads \(4\)"),
    (_cfg(num_attention_heads=16, num_key_value_heads=16, mamba_n_heads=12), 8, 1,
     r"Mamba heads \(12\)"),
    (_cfg(num_attention_heads=4, num_key_value_heads=4, mamba_n_heads=8, mamba_n_groups=3), 2,
     1, r"Mamba groups \(n_groups\) \(3\)|multiple of the model's Mamba groups"),
    (_cfg(intermediate_size=96, moe_intermediate_size=30), 4, 1, r"moe_intermediate_size"),
    (_cfg(), 1, 5, r"pipeline_parallel_size=5 is more than the model's 4 layers"),
    (_cfg(architectures=["Qwen3NextForCausalLM"], linear_num_key_heads=2,
          linear_num_value_heads=6), 4, 1,
     r"does not divide the model's Gated DeltaNet key heads \(linear_num_key_heads\) \(2\)"),
    (_cfg(architectures=["Qwen3NextForCausalLM"], linear_num_key_heads=4,
          linear_num_value_heads=6), 4, 1,
     r"Gated DeltaNet value heads \(linear_num_value_heads\) \(6\)"),
    (_cfg(architectures=["Qwen3NextForCausalLM"], linear_num_key_heads=4,
          linear_num_value_heads=8, moe_intermediate_size=32,
          shared_expert_intermediate_size=18), 4, 1, r"shared_expert_intermediate_size \(18\)"),
])
def test_impossible_layouts_are_refused(cfg, tp, pp, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_layout(cfg, tp, pp, None, CPU)


def test_layout_refusals_through_the_engine_options(models) -> None:  # noqa: F811
    m = models("qwen3")
    with pytest.raises(ValueError, match="attention heads"):
        EngineConfig.from_kwargs(m, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        EngineConfig.from_kwargs(m, device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineConfig.from_kwargs(m, device="cpu", tensor_parallel_size=2,
                                 distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni' runs one process"):
        EngineConfig.from_kwargs(m, device="cpu", tensor_parallel_size=2,
                                 distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="speculative decoding with pipeline_parallel_size"):
        EngineConfig.from_kwargs(m, device="cpu", pipeline_parallel_size=2, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2})
    draft = {"model": m, "num_speculative_tokens": 2}  # drafters run sharded like the target
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=1: .* target's 2"):
        EngineConfig.from_kwargs(m, device="cpu", tensor_parallel_size=2, speculative_config={
            **draft, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        EngineConfig.from_kwargs(m, device="cpu", speculative_config={
            **draft, "draft_tensor_parallel_size": 2})
    assert EngineConfig.from_kwargs(m, device="cpu", tensor_parallel_size=2, speculative_config={
        **draft, "draft_tensor_parallel_size": 2}).speculative.draft_tensor_parallel_size == 2
    assert EngineConfig.from_kwargs(m, device="cpu").parallel.distributed_executor_backend == "uni"
    assert EngineConfig.from_kwargs(
        m, device="cpu", tensor_parallel_size=2).parallel.distributed_executor_backend == "mp"


def test_qwen3_next_indivisible_tp_is_refused(models) -> None:  # noqa: F811
    """The tiny Qwen3-Next (4 query heads, 1 KV head, 2 GDN key heads over 6 value heads): tp=4
    splits the attention but not the Gated DeltaNet key heads; tp=2 is accepted."""
    m = models("qwen3next")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's "
                       r"Gated DeltaNet key heads \(linear_num_key_heads\) \(2\)"):
        EngineConfig.from_kwargs(m, device="cpu", tensor_parallel_size=4)
    assert EngineConfig.from_kwargs(
        m, device="cpu", tensor_parallel_size=2).parallel.distributed_executor_backend == "mp"


def test_more_ranks_than_gpus_is_refused() -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"needs {n + 2} GPUs; {n} are visible"):
        validate_layout(_cfg(num_hidden_layers=64), n + 2, 1, None, torch.device("cuda"))


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_worker_exception_is_raised_by_the_engine(models) -> None:  # noqa: F811
    """Worker 1 raises in its 3rd step: generate raises WorkerError with that worker's
    traceback, both workers are stopped, and later steps fail at once."""
    executor_mod.COLLECTIVE_TIMEOUT_S = 60.0
    llm = LLM(models("llama"), **ENGINE, tensor_parallel_size=2)
    ex = llm.llm_engine.executor
    pids = [p.pid for p in ex.procs]
    rings = _ring_files(ex)
    assert all(os.path.exists(f) for f in rings)
    ex._call("inject_fault", 3, ranks=[1])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # the fault, or (a race) worker 0's collective failing on its peer's exit first
    with pytest.raises(WorkerError, match=r"(?s)worker 1 failed:.*injected fault|worker 0 "
                       r"failed:.*(Connection reset|Connection closed|Read error)"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(_gone(pid) for pid in pids)
    assert not any(os.path.exists(f) for f in rings)  # the shared memory is unlinked
    with pytest.raises(WorkerError, match="the workers are stopped"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)


def test_killed_worker_is_reported(models) -> None:  # noqa: F811
    executor_mod.COLLECTIVE_TIMEOUT_S = 60.0
    llm = LLM(models("llama"), **ENGINE, tensor_parallel_size=2)
    ex = llm.llm_engine.executor
    pids = [p.pid for p in ex.procs]
    rings = _ring_files(ex)
    os.kill(pids[1], signal.SIGKILL)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with pytest.raises(WorkerError, match=r"(?s)worker 1 \(pid \d+\) died with exit code -9|"
                       r"worker 0 failed:.*(Connection reset|Connection closed|Read error)"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(_gone(pid) for pid in pids)
    assert not any(os.path.exists(f) for f in rings)


def _ring_files(ex) -> list[str]:
    """The executor's shared-memory rings' files."""
    return [f"/dev/shm/{r.handle.name}" for r in (ex._requests, ex._results)]


_PARENT = """
import os, sys
from krait import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2,
              num_kv_blocks=16, max_model_len=32)
    ex = llm.llm_engine.executor
    print(" ".join(str(p.pid) for p in ex.procs), flush=True)
    print(" ".join(r.handle.name for r in (ex._requests, ex._results)), flush=True)
    os.kill(os.getpid(), 9)
"""


def test_workers_exit_when_the_parent_dies(models, tmp_path) -> None:  # noqa: F811
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, str(script), models("llama")], capture_output=True,
                         text=True, env=env, timeout=180)
    assert out.returncode == -9, out.stderr[-2000:]
    pid_line, ring_line = out.stdout.splitlines()[:2]
    pids = [int(p) for p in pid_line.split()]
    assert len(pids) == 2
    assert all(_gone(pid) for pid in pids)
    # multiprocessing's resource tracker unlinks the rings of an engine that died
    deadline = time.monotonic() + 10.0
    rings = [f"/dev/shm/{name}" for name in ring_line.split()]
    while any(os.path.exists(f) for f in rings) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f) for f in rings)

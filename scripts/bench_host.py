"""The engine's own host time per decode step (scheduler, runner bookkeeping, sampling, output
processing) with the model forward stubbed out: what async scheduling has to hide behind the
device step at large batches. CPU, a tiny random model; prints JSON.

PYTHONPATH=. python3 scripts/bench_host.py [--batch-sizes 1,64,256] [--steps 200] [--profile]"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.sampling_params import SamplingParams
from tests.utils import make_tiny_llama


def host_ms_per_step(model_dir: str, batch: int, steps: int, profile: bool) -> float:
    eng = LLMEngine(EngineConfig.from_kwargs(
        model=model_dir, device="cpu", dtype="float32", max_num_seqs=batch,
        max_model_len=steps + 64, max_num_batched_tokens=max(2048, 32 * batch)))
    hidden = eng.config.model.hf_config.hidden_size
    # the forward is stubbed: zeros [tokens, hidden] (the lm_head and sampling still run)
    eng.runner.forward = lambda b: torch.zeros(b.num_tokens_padded, hidden)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True,
                            output_kind="final_only")
    for i in range(batch):
        eng.add_request(str(i), {"prompt_token_ids": [3 + (i + j) % 97 for j in range(32)]}, params)
    for _ in range(5):
        eng.step()
    if profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
    chunks = []  # the fastest of five chunks: this measures the code, not the machine's noise
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(steps // 5):
            eng.step()
        chunks.append((time.perf_counter() - t) / (steps // 5) * 1e3)
    ms = min(chunks)
    if profile:
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return ms


def main() -> None:
    torch.set_num_threads(1)  # the host path is single-threaded Python: keep torch's pool out
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_llama(tmp, num_hidden_layers=1, max_position_embeddings=1 << 16)
        rows = [{"batch": b, "host_ms_per_step": host_ms_per_step(model_dir, b, args.steps,
                                                                   args.profile)}
                for b in map(int, args.batch_sizes.split(","))]
    print(json.dumps({"kind": "host", "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Profiles decode steps of a named config: where the step time goes (CPU vs GPU kernels).

PYTHONPATH=. python3 scripts/profile_decode.py qwen3-0.6b 1 1024"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from krait.bench.offline import CONFIG_DIR, _prompts
from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.sampling_params import SamplingParams


def main() -> None:
    name, batch, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    eng = LLMEngine(EngineConfig.from_kwargs(model=str(CONFIG_DIR / name), load_format="dummy",
                                             max_model_len=ctx + 128, max_num_seqs=max(batch, 8)))
    vocab = eng.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, ctx, vocab, 0)):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    print(f"{name} batch {batch} ctx {ctx}: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms/step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for rid in list(eng._parents):
        eng.abort_request(rid)
    # one prefill of `ctx` tokens, profiled after a warm-up of the same length
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = _prompts(1, ctx, vocab, 1)[0]
    for rep in range(3):
        eng.add_request(f"p{rep}", {"prompt_token_ids": prompt}, one)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while eng.has_unfinished_requests():
                eng.step()
            torch.cuda.synchronize()
        print(f"prefill {ctx}: {(time.perf_counter() - t) * 1e3:.2f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()

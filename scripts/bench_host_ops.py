"""Host time of an eager step's op wrappers: a prefill through the model on the CPU with every
Triton launch a no-op, so what is timed is krait's Python and the torch work around each launch
(the JIT launcher itself, ~16 us a launch on the GPU machine, is not in it). Per layer, for the
dense and hybrid tiny models; `--profile` lists the functions by own time.

PYTHONPATH=. python3 scripts/bench_host_ops.py [--tokens 512] [--profile]"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels become interpretable
os.environ["KRAIT_TRITON_CPU"] = "1"  # ... and krait's ops take their Triton path on CPU tensors
os.environ["KRAIT_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # tiny configs have short position limits

import triton.runtime.interpreter as interpreter  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402

import krait.ops.argmax as argmax_op  # noqa: E402
from krait import LLM, SamplingParams  # noqa: E402
from tests.utils import make_tiny_hybrid, make_tiny_llama  # noqa: E402


def _no_launch(self, grid):
    return lambda *args, **kwargs: None


interpreter.InterpretedFunction.__getitem__ = _no_launch
jit.KernelInterface.__getitem__ = _no_launch
# the sampled token must be a real one: the argmax's Triton path is the only launch that runs
argmax_op.argmax_triton = lambda x, block=4096: x.argmax(dim=-1).clamp(0, x.shape[-1] - 1)

LAYERS = 8


def host_ms_per_layer(arch: str, tokens: int, profile: bool) -> float:
    with tempfile.TemporaryDirectory() as d:
        if arch == "qwen3":
            path = make_tiny_llama(d, arch="qwen3", num_hidden_layers=LAYERS)
        else:
            path = make_tiny_hybrid(d, arch)  # its own layer pattern
        llm = LLM(path, device="cpu", dtype="float32", enforce_eager=True,
                  max_num_batched_tokens=max(2048, tokens), max_model_len=tokens + 16)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = {"prompt_token_ids": [3 + i % 50 for i in range(tokens)]}
    for _ in range(3):
        llm.generate([prompt], params, use_tqdm=False)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    if profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            llm.generate([prompt], params, use_tqdm=False)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumulative").print_stats("krait", 40)
    return best * 1e3 / llm.llm_engine.config.model.hf_config.num_hidden_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--archs", default="qwen3,mamba2,granitemoehybrid")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for arch in args.archs.split(","):
        ms = host_ms_per_layer(arch, args.tokens, args.profile)
        print(f"{arch:18s} {ms * 1e3:8.1f} us a layer (a {args.tokens}-token prefill request, "
              "launches stubbed)")


if __name__ == "__main__":
    main()

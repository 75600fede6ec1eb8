"""`krait bench prefix`: prefix caching on a shared-prefix workload (JSON on stdout).

N requests share a `--prefix-len`-token prefix and add `--suffix-len` distinct tokens each,
`--output-len` tokens out. One engine with prefix caching measures the time to first token of a
cold request (nothing cached) and of warm ones (each alone, the prefix cached), then the whole
workload's throughput; an engine without caching runs the same workload, and both run distinct
prompts of the same lengths (caching's cost when nothing is shared).
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np
import torch

from krait.bench.cli_args import add_prefix_args as add_cli_args  # noqa: F401
from krait.bench.offline import _device_name, _engine, _model_dir, _sync
from krait.engine.engine import LLMEngine
from krait.sampling_params import SamplingParams


def _workload(n: int, prefix: int, suffix: int, vocab: int, seed: int, shared: bool
              ) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    hi = max(vocab - 10, 11)
    if not shared:
        return rng.integers(10, hi, size=(n, prefix + suffix)).tolist()
    head = rng.integers(10, hi, size=prefix).tolist()
    return [head + tail for tail in rng.integers(10, hi, size=(n, suffix)).tolist()]


def _ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds from adding a request, alone in the engine, to its first token; its prompt
    tokens found cached); the request is run to its end."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    first, cached = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - t
                cached = o.num_cached_tokens
    return first, cached


def _run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str
         ) -> tuple[float, int]:
    """(seconds, prompt tokens found cached) of the prompts run together."""
    dev = engine.config.device
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind="final_only")
    hits = engine.kv.prefix_hits
    _sync(dev)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()
    _sync(dev)
    return time.perf_counter() - t, engine.kv.prefix_hits - hits


def bench_prefix(args) -> tuple[dict, list[str]]:
    model = _model_dir(args)
    n, pre, suf, out_len = args.num_prompts, args.prefix_len, args.suffix_len, args.output_len
    max_len = args.max_model_len or pre + suf + out_len + 16
    result: dict = {"kind": "prefix", "model": args.config or args.model,
                    "num_prompts": n, "prefix_len": pre, "suffix_len": suf,
                    "output_len": out_len}
    rows = []
    for caching in (True, False):
        engine = _engine(args, model, max_model_len=max_len, enable_prefix_caching=caching)
        vocab = engine.config.model.vocab_size
        result["device"] = _device_name(engine.config.device)
        # warm-up: both workloads whole on other tokens. Triton specialises kernels on the
        # chunk layouts a workload produces (caching's cut chunks are others than plain ones):
        # a warm-up of a few prompts left compilations inside the timed runs, and whichever
        # engine ran first paid them (30% of a run on the H200)
        _run(engine, _workload(n, pre, suf, vocab, seed=98, shared=False), out_len, "warm-d")
        _run(engine, _workload(n, pre, suf, vocab, seed=99, shared=True), out_len, "warm-s")
        t_shared, hits = _run(engine, _workload(n, pre, suf, vocab, 1, True), out_len, "shared")
        t_distinct, _ = _run(engine, _workload(n, pre, suf, vocab, 2, False), out_len, "distinct")
        key = "cache_on" if caching else "cache_off"
        result[key] = {"shared_output_tok_per_s": n * out_len / t_shared,
                       "shared_cached_tokens": hits,
                       "distinct_output_tok_per_s": n * out_len / t_distinct}
        if caching:
            fresh = _workload(1 + args.num_warm, pre, suf, vocab, seed=3, shared=True)
            cold, _ = _ttft(engine, "cold", fresh[0])
            warm = [_ttft(engine, f"warm{i}", p) for i, p in enumerate(fresh[1:])]
            result[key].update(ttft_cold_s=cold,
                               ttft_warm_s=statistics.median(w for w, _ in warm),
                               ttft_warm_all_s=[w for w, _ in warm],
                               cached_tokens_per_warm=[c for _, c in warm])
            result["state_block_size"] = engine.state_block_size
            snaps = engine.kv.snapshots
            result["num_state_snapshots"] = snaps.num_slots if snaps is not None else 0
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    on, off = result["cache_on"], result["cache_off"]
    result["ttft_warm_over_cold"] = on["ttft_warm_s"] / on["ttft_cold_s"]
    result["shared_speedup"] = on["shared_output_tok_per_s"] / off["shared_output_tok_per_s"]
    result["distinct_cost"] = 1 - on["distinct_output_tok_per_s"] / off["distinct_output_tok_per_s"]
    rows.append(f"TTFT cold {on['ttft_cold_s'] * 1e3:.1f} ms, warm {on['ttft_warm_s'] * 1e3:.1f} "
                f"ms ({result['ttft_warm_over_cold']:.1%} of cold)")
    rows.append(f"shared-prefix throughput: {on['shared_output_tok_per_s']:.0f} vs "
                f"{off['shared_output_tok_per_s']:.0f} output tok/s without caching "
                f"({result['shared_speedup']:.2f}x)")
    rows.append(f"distinct prompts: {on['distinct_output_tok_per_s']:.0f} vs "
                f"{off['distinct_output_tok_per_s']:.0f} output tok/s "
                f"(caching costs {result['distinct_cost']:.1%})")
    return result, rows

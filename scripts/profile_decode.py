"""Where a decode step and one prefill spend their time: wall time vs GPU kernel time, top kernels.

PYTHONPATH=. python3 scripts/profile_decode.py qwen3-0.6b:1:1024 mamba2-1.3b:64:1024 [--prefill 2048]
    [--mamba-ssm-cache-dtype bfloat16] [--speculative-config '{"num_speculative_tokens":3}']

With a speculative config the prompts are the repetitive workload (ngram drafts accepted), so the
profiled steps are verify steps.

Prints a compact table per spec (NAME:BATCH:CONTEXT); full profiler tables go to $OUT/prof_*.txt."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from krait.bench.offline import CONFIG_DIR, _prompts
from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kernel_rows(prof, per: int) -> tuple[float, list[tuple[str, float, float]]]:
    """(GPU µs per step, [(kernel, calls per step, µs per step)]) from a profile of `per` steps."""
    rows = []
    total = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", 0.0) or 0.0
        if t <= 0 or ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total += t
        rows.append((ev.key[:70], ev.count / per, t / per))
    rows.sort(key=lambda r: -r[2])
    return total / per, rows


def _report(tag: str, wall_ms: float, prof, per: int, out_dir: str) -> None:
    gpu_us, rows = _kernel_rows(prof, per)
    print(f"== {tag}: wall {wall_ms:.3f} ms, GPU kernels {gpu_us / 1e3:.3f} ms "
          f"({sum(r[1] for r in rows):.0f} launches)")
    for name, calls, us in rows[:24]:
        print(f"   {us:9.1f} us {calls:6.1f}x  {name}")
    with open(os.path.join(out_dir, f"prof_{tag.replace(' ', '_').replace(':', '_')}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40,
                                          max_name_column_width=70))
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40,
                                          max_name_column_width=70))


def profile_spec(spec: str, prefill: int, out_dir: str, ssm_dtype: str = "float32",
                 speculative: dict | None = None) -> None:
    name, batch, ctx = spec.split(":")
    batch, ctx = int(batch), int(ctx)
    os.environ.setdefault("KRAIT_ALLOW_LONG_MAX_MODEL_LEN", "1")  # random weights
    eng = LLMEngine(EngineConfig.from_kwargs(
        model=str(CONFIG_DIR / name), load_format="dummy", max_model_len=max(ctx, prefill) + 256,
        max_num_seqs=max(batch, 8), max_num_batched_tokens=max(2048, prefill),
        mamba_ssm_cache_dtype=ssm_dtype, speculative_config=speculative))
    vocab = eng.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, output_kind="final_only")
    workload = "repetitive" if speculative else "random"
    for i, p in enumerate(_prompts(batch, ctx, vocab, 0, workload)):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    _sync()
    t = time.perf_counter()
    for _ in range(20):
        eng.step()
    _sync()
    wall = (time.perf_counter() - t) / 20 * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        _sync()
    _report(f"{name} {'verify' if speculative else 'decode'} b{batch} ctx{ctx}", wall, prof, 10,
            out_dir)
    _host_decode(eng)
    _find_syncs(eng, None, "three decode steps")
    for rid in list(eng._parents):
        eng.abort_request(rid)
    if not prefill:
        return
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = _prompts(1, prefill, vocab, 1)[0]
    for rep in range(3):  # not under the profiler, but after one in this process (its CUDA
        # activity tracing may stay attached and slow launches: `krait bench` times host-bound
        # steps cleanly)
        eng.add_request(f"u{rep}", {"prompt_token_ids": prompt}, one)
        _sync()
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        _sync()
        print(f"   prefill {prefill} unprofiled: {(time.perf_counter() - t) * 1e3:.2f} ms")
    for rep in range(3):
        eng.add_request(f"p{rep}", {"prompt_token_ids": prompt}, one)
        _sync()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while eng.has_unfinished_requests():
                eng.step()
            _sync()
        wall = (time.perf_counter() - t) * 1e3
    _report(f"{name} prefill {prefill}", wall, prof, 1, out_dir)
    _host_functions(eng, prompt)
    _find_syncs(eng, prompt)
    top_cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    print("   host (self CPU ms, calls): " + ", ".join(
        f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.1f}/{e.count}" for e in top_cpu))


def _print_stats(pr, title: str, sort: str, n: int, per: int = 1) -> None:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(n)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    print(f"   {title} (cProfile, by {sort}; times over {per} steps):")
    for ln in lines[3 : n + 5]:
        print("     " + ln[:160])


def _host_decode(eng: LLMEngine, steps: int = 50) -> None:
    """The host's own time per decode step (wall minus the time blocked on the device) and the
    Python functions it goes to: what bounds a step once the device work is shorter."""
    import cProfile

    _sync()
    t, w = time.perf_counter(), eng.device_wait_s
    for _ in range(steps):
        eng.step()
    _sync()
    wall = (time.perf_counter() - t) / steps * 1e3
    wait = (eng.device_wait_s - w) / steps * 1e3
    print(f"   host per decode step: wall {wall:.3f} ms, blocked on the device {wait:.3f} ms, "
          f"host's own {wall - wait:.3f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    _sync()
    pr.disable()
    _print_stats(pr, "host functions of decode steps", "tottime", 30, steps)
    _print_stats(pr, "host functions of decode steps", "cumulative", 45, steps)


def _host_functions(eng: LLMEngine, prompt: list[int]) -> None:
    """Python functions by own time during one prefill request (cProfile): where the host time
    of an eager step goes (krait's wrappers, Triton's launcher, torch dispatch)."""
    import cProfile

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    eng.add_request("host", {"prompt_token_ids": prompt}, one)
    pr = cProfile.Profile()
    pr.enable()
    while eng.has_unfinished_requests():
        eng.step()
    _sync()
    pr.disable()
    _print_stats(pr, "host functions of one prefill request", "tottime", 25)
    _print_stats(pr, "host functions of one prefill request", "cumulative", 60)


def _find_syncs(eng: LLMEngine, prompt: list[int] | None, what: str = "one prefill request") -> None:
    """Source lines that synchronize the host with the GPU: during one prefill request, or
    (prompt None) during three steps of what is running."""
    if not torch.cuda.is_available():
        return
    import warnings

    if prompt is not None:
        one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        eng.add_request("sync", {"prompt_token_ids": prompt}, one)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if prompt is None:
            for _ in range(3):
                eng.step()
        while prompt is not None and eng.has_unfinished_requests():
            eng.step()
    torch.cuda.set_sync_debug_mode(0)
    seen: dict[tuple[str, int], int] = {}
    for w in caught:
        key = (w.filename, w.lineno)
        seen[key] = seen.get(key, 0) + 1
    print(f"   host-device syncs in {what}: {sum(seen.values())} (the read-back of sampled "
          "tokens is an event wait, not listed)")
    for (f, line), n in sorted(seen.items(), key=lambda kv: -kv[1])[:12]:
        print(f"     {n:4d}x {f}:{line}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--mamba-ssm-cache-dtype", default="float32")
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    for spec in args.specs:
        profile_spec(spec, args.prefill, out_dir, args.mamba_ssm_cache_dtype,
                     args.speculative_config)


if __name__ == "__main__":
    main()

"""krait's Gated DeltaNet prefill (`gated_delta_chunk_triton`) beside flash-linear-attention's
`chunk_gated_delta_rule` on the same inputs: Qwen3-Next-80B's GDN shapes (16 key heads, 32 value
heads, K = V = 128), bf16 q/k/v/beta, float32 g (log-decay) and state, q/k l2-normed in the
kernels, varlen (cu_seqlens) with one sequence of --tokens (8192) from a random initial state.
Warm-up, then CUDA-event timing of each call over --reps reps (median). JSON on stdout:
{"krait_ms", "fla_ms", "ratio" (krait / fla), the outputs' and final states' relative
difference}; fla_ms null (and "fla": the reason) when `fla` is not importable. --breakdown adds
"krait_kernels_ms": the median of CUDA events around each of krait's launches (diag_inv, prep,
state, out; the events themselves cost a little). --config overrides entries of
`gated_delta_chunk.chunk_config` (e.g. BV=32,STATE_STAGES=2,OUT_WARPS=8,WU_LOWP=True; None for an
option left to Triton); --sweep times more such configs in the same call (krait alone; each row's
outputs and states against the main row's krait: rel_diff_*_main).

Usage (device machine, repo root): python3 scripts/bench_gdn_prefill.py [--tokens 8192]
[--breakdown] [--config KEY=VALUE,...] [--sweep 'K=V,...;K=V,...']
fla-core on a machine without an index: pip install --no-deps --no-index wheels/*.whl
(fla-core and einops; `scripts/gpu_check.sh gdn` does it when wheels/ exists)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from krait.bench.roofline import median_time  # noqa: E402

HK, HV, K, V = 16, 32, 128, 128


def inputs(lens: list[int], seed: int = 0) -> dict:
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=gen)
    a = torch.randn(T, HV, **kw)
    A_log = torch.rand(HV, **kw) * 3 - 4  # slow decays (-0.01 to -0.2 a token): long memory
    return dict(
        q=torch.randn(T, HK, K, **kw).bfloat16(), k=torch.randn(T, HK, K, **kw).bfloat16(),
        v=torch.randn(T, HV, V, **kw).bfloat16(),
        g=-torch.exp(A_log) * torch.nn.functional.softplus(a),  # [T, Hv] float32, <= 0
        beta=torch.rand(T, HV, **kw).bfloat16(),
        h0=torch.randn(len(lens), HV, K, V, **kw) * 0.1,  # float32 [N, Hv, K, V]
        qsl=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                         device="cuda"),
    )


def time_ms(fn, warmup: int, reps: int) -> float:
    torch.cuda.synchronize()
    return median_time(fn, reps=reps, warmup=warmup) * 1e3


def krait_call(x: dict, config: dict | None = None):
    from krait.ops.gated_delta_chunk import gated_delta_chunk_triton

    n = x["h0"].shape[0]
    states = x["h0"].clone()  # slots 0..n-1, each starting from its initial state
    slots = torch.arange(n, dtype=torch.int32, device="cuda")
    init = torch.ones(n, dtype=torch.int32, device="cuda")

    def run():
        states.copy_(x["h0"])
        return gated_delta_chunk_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], states,
                                        x["qsl"], slots, init, config=config), states

    return run


def fla_call(x: dict):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu = x["qsl"].long()
    args = [t[None] for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])]  # [1, T, ...]

    def run():
        o, ht = chunk_gated_delta_rule(*args, scale=K ** -0.5, initial_state=x["h0"],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=cu)
        return o[0], ht

    return run


def parse_config(text: str | None) -> dict:
    """'BV=32,PRECISION=tf32,WU_LOWP=True' -> {'BV': 32, 'PRECISION': 'tf32', 'WU_LOWP': True}
    (ints where they parse; None, True, False)."""
    out = {}
    words = {"None": None, "True": True, "False": False}
    for item in filter(None, (text or "").split(",")):
        key, value = item.split("=", 1)
        value = value.strip()
        out[key.strip()] = (int(value) if value.lstrip("-").isdigit()
                            else words[value] if value in words else value)
    return out


def kernel_breakdown(run, reps: int) -> dict:
    """Median ms of each krait launch over `reps` calls, from CUDA events around them."""
    from krait.ops import gated_delta_chunk as gdc

    gdc.KERNEL_EVENTS = []
    try:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for name, start, end in gdc.KERNEL_EVENTS:
            times.setdefault(name, []).append(start.elapsed_time(end))
    finally:
        gdc.KERNEL_EVENTS = None
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--lens", default=None, help="comma-separated sequence lengths (varlen)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--breakdown", action="store_true",
                   help="also time each krait launch (CUDA events around them)")
    p.add_argument("--config", default=None,
                   help="KEY=VALUE,... overriding gated_delta_chunk.chunk_config entries")
    p.add_argument("--sweep", default=None,
                   help="configs separated by ';' (each KEY=VALUE,...) timed after the main "
                        "row, krait alone, with the per-kernel breakdown: 'sweep' in the JSON")
    args = p.parse_args()
    lens = [int(n) for n in args.lens.split(",")] if args.lens else [args.tokens]
    x = inputs(lens)
    config = parse_config(args.config)
    krait = krait_call(x, config or None)
    out = {"kind": "gdn_prefill", "device": torch.cuda.get_device_name(), "lens": lens,
           "heads": [HK, HV], "head_dims": [K, V], "dtype": "bfloat16", "config": config,
           "krait_ms": time_ms(krait, args.warmup, args.reps)}
    if args.breakdown:
        out["krait_kernels_ms"] = kernel_breakdown(krait, args.reps)
    o_k, s_k = krait()
    o_k, s_k = o_k.clone(), s_k.clone()
    if args.sweep:
        out["sweep"] = []
        for text in args.sweep.split(";"):
            cfg = {**config, **parse_config(text)}
            row = {"config": cfg}
            try:
                run = krait_call(x, cfg)
                row["krait_ms"] = time_ms(run, args.warmup, args.reps)
                row["krait_kernels_ms"] = kernel_breakdown(run, args.reps)
                o_c, s_c = run()  # against the main row's krait (numerics of the options)
                row["rel_diff_out_main"], row["rel_diff_state_main"] = rel(o_c, o_k), rel(s_c, s_k)
            except Exception as e:  # noqa: BLE001 (a config that does not compile: its row says so)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["sweep"].append(row)
    out.update(fla_ms=None, ratio=None)
    try:
        fla = fla_call(x)
    except ImportError as e:
        out["fla"] = f"not importable: {e}"
    else:
        try:  # krait's row is kept whatever fla does on this machine
            out["fla_ms"] = time_ms(fla, args.warmup, args.reps)
            out["ratio"] = out["krait_ms"] / out["fla_ms"]
            o_f, s_f = fla()
            out["rel_diff_out"] = rel(o_k, o_f)  # krait against fla
            out["rel_diff_state"] = rel(s_k, s_f)
            import fla as fla_mod

            out["fla_version"] = getattr(fla_mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out["fla"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

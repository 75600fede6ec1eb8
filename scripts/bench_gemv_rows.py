"""The multi-row GEMV (krait/ops/gemv_rows.py) against cuBLAS on the benchmarked models'
projections: for each shape (bf16 weights [N, K]; gate_ups [2I, K] also with silu-and-mul in
the epilogue) and M in 1, 2, 4, 8 rows it times F.linear (cuBLAS; for a gate_up also F.linear
then silu_and_mul, what a multi-row MLP paid before), `krait.layers.linear`'s dispatch
(`linear`; for a gate_up the one-row epilogue path at M = 1, the multi-row one above), gemv_rows
with its default config (`rows_config`) and a sweep of configs around it.

Each timing is a CUDA graph of CALLS calls replayed REPLAYS times (the median replay over
CALLS): launch overhead excluded, as in a decode graph; the weight rotates through enough
copies to exceed 256 MB, so every call streams it from HBM, not L2. One JSON object a line:
{"shape", "n", "k", "silu", "m", "impl", "config", "us", "gbps" (weight bytes / time), "err"
(relative error against float32 F.linear)}; a config that fails to compile or run prints its
"error" and the sweep goes on; "wrong": true where err > 1e-2. Last, one "best" line per
(shape, M): the fastest gemv_rows config beside cuBLAS and the default.

Usage (device machine, repo root): python3 scripts/bench_gemv_rows.py [--shapes
qwen3.qkv,granite.down,...] [--rows 1,2,4,8] [--quick] [--jobs 8] (--quick: the default config,
cuBLAS and the dispatch only). The sweep's kernels are compiled first in --jobs processes (Triton's on-disk cache then
serves the timing process, and the next run)."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from krait.layers import linear as layer  # noqa: E402
from krait.ops._dispatch import cdiv  # noqa: E402
from krait.ops.activation import silu_and_mul  # noqa: E402
from krait.ops.gemv import gemv_triton  # noqa: E402
from krait.ops.gemv_rows import gemv_rows, rows_config, split_k  # noqa: E402
from krait.ops.gemv_tma import gemv_tma  # noqa: E402

# name -> (N, K, silu_mul_out): qwen3-0.6b, mamba2-1.3b, granite-4.0-h-micro (hidden 2048;
# mamba in_proj 2 * 4096 + 2 * 128 + 64 = 8512 rows as mamba2's, out_proj 2048 x 4096 as
# mamba2's; attention 32 heads, 8 kv heads of 64; shared MLP 8192)
SHAPES = {
    "qwen3.qkv": (4096, 1024, False),
    "qwen3.o": (1024, 2048, False),
    "qwen3.gate_up": (6144, 1024, True),
    "qwen3.down": (1024, 3072, False),
    "mamba2.in_proj+granite.in_proj": (8512, 2048, False),
    "mamba2.out_proj+granite.out_proj": (2048, 4096, False),
    "granite.qkv": (3072, 2048, False),
    "granite.o": (2048, 2048, False),
    "granite.gate_up": (16384, 2048, True),
    "granite.down": (2048, 8192, False),
}
CALLS, REPLAYS, WARMUP = 50, 7, 2
L2_FLUSH_BYTES = 256 << 20
# the sweep's tiles (BLOCK_N, BLOCK_K, STAGES, num_warps), each with SPLIT_K for about 1.5
# and 3 waves over the SMs
TILES = [(64, 64, 4, 4), (64, 128, 3, 4), (64, 128, 4, 4), (64, 128, 5, 4), (64, 256, 3, 4),
         (64, 128, 4, 8), (128, 128, 4, 8), (128, 64, 4, 8)]
WAVES = (1.5, 3.0)


def sweep(n: int, k: int, silu: bool, sms: int) -> list[dict]:
    """The default config, it with EARLY_BOX, and TILES at WAVES (deduplicated, within the
    shared memory of a block)."""
    cols = n // 2 if silu else n
    default = rows_config(4, n, k, silu, sms)
    out = [default, dict(default, EARLY_BOX=True)]
    boxes = 2 if silu else 1
    for bn, bk, st, nw in TILES:
        if (st + 1) * boxes * bn * bk * 2 > 220 << 10:  # the ring (+ x) past 227 KiB
            continue
        for waves in WAVES:
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=nw,
                       SPLIT_K=split_k(cdiv(cols, bn), k, bk, sms, waves))
            if cfg not in out:
                out.append(cfg)
    return out


def graph_us(make_call, copies: int) -> float:
    """Microseconds a call: CALLS calls (call i on weight copy i % copies) captured in one CUDA
    graph, the median of REPLAYS replays after WARMUP."""
    calls = [make_call(i % copies) for i in range(CALLS)]
    for c in calls[:copies]:  # compiles, descriptors, workspaces: outside the capture
        c()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
    torch.cuda.synchronize()
    for _ in range(WARMUP):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    del graph
    return sorted(times)[len(times) // 2]


def layer_gate_up(x, w):
    """A gated MLP's first half as `krait.layers.linear.silu_mlp` routes it (replayed here: the
    layer has no entry for it alone): one row, the one-row gate_up GEMV (TMA or not) with
    silu-and-mul in its epilogue; 2-8 rows, the multi-row GEMV with it where the plan takes
    them; else cuBLAS then silu_and_mul."""
    if layer._one_row(x) and layer.plan.gate_up_epilogue(1, *w.shape):
        cfg = layer._tma(x, w, None, silu_mul_out=True)
        if cfg is not None:
            return gemv_tma(x, w, cfg, silu_mul_out=True)
        return gemv_triton(x, w, silu_mul_out=True)
    if (layer._few_rows(x) and layer.plan.multi_row_gate_up(x.shape[0], *w.shape)
            and layer._rows_take(x, w, None)):
        return gemv_rows(x, w, silu_mul_out=True)
    return silu_and_mul(F.linear(x, w))


def impls(silu: bool, configs: list[dict]):
    """(impl, config, fn(x, w), checked against the reference) to time."""
    out = [("cublas", None, F.linear, not silu)]  # a gate_up's bare GEMM: [M, 2I], unchecked
    if silu:
        out.append(("cublas+silu_and_mul", None, lambda x, w: silu_and_mul(F.linear(x, w)),
                    True))
    out.append(("krait_layer", None, layer_gate_up if silu else layer.linear, True))
    for i, cfg in enumerate(configs):
        name = "gemv_rows.default" if i == 0 else "gemv_rows"
        out.append((name, cfg, lambda x, w, cfg=cfg: gemv_rows(x, w, cfg, silu_mul_out=silu),
                    True))
    return out


def _precompile(job: tuple) -> int:
    """One worker of --jobs: runs each (N, K, silu, config) once on a tiny x, so that Triton's
    on-disk cache holds the kernel when the timing process asks for it; failures are left to
    that process to report. Returns how many ran."""
    done = 0
    for n, k, silu, cfg in job:
        try:
            w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
            gemv_rows(torch.zeros(4, k, device="cuda", dtype=torch.bfloat16), w, cfg,
                      silu_mul_out=silu)
            torch.cuda.synchronize()
            done += 1
        except Exception:  # noqa: BLE001 (reported by the timing run)
            pass
    return done


def precompile(names: list[str], sms: int, quick: bool, jobs: int) -> None:
    """Compiles the sweep's kernels in `jobs` processes (spawned, each its own CUDA context)
    before the timing starts: ~50 kernels at a second or two each would take most of the
    time budget one by one."""
    if jobs <= 1:
        return
    work, seen = [], set()
    for name in names:
        n, k, silu = SHAPES[name]
        for cfg in sweep(n, k, silu, sms)[:1 if quick else None]:
            key = (silu, tuple(sorted(cfg.items())))
            if key not in seen:  # N and K are not constexprs: one compile a config
                seen.add(key)
                work.append((n, k, silu, cfg))
    chunks = [work[i::jobs] for i in range(jobs)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs) as pool:
        done = sum(pool.map(_precompile, [c for c in chunks if c]))
    print(json.dumps(dict(precompiled=done, kernels=len(work))), flush=True)


def reference(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    y = F.linear(x.float(), w.float())
    if silu:
        half = y.shape[1] // 2
        y = F.silu(y[:, :half].bfloat16().float()) * y[:, half:].bfloat16().float()
    return y


def measure(rec: dict, fn, xs: torch.Tensor, weights: list[torch.Tensor],
            want: torch.Tensor | None, nbytes: int) -> dict:
    """Fills rec with fn's error against `want` (None: unchecked), its time a call and the
    weight's effective bandwidth; or with the error it raised."""
    try:
        got = fn(xs, weights[0])
        torch.cuda.synchronize()
        if want is not None:
            rec["err"] = float((got.float() - want).norm() / want.norm())
            rec["wrong"] = rec["err"] > 1e-2
        us = graph_us(lambda i: (lambda: fn(xs, weights[i])), len(weights))
        rec.update(us=round(us, 3), gbps=round(nbytes / us / 1e3, 1))
    except Exception as e:  # a config that does not compile or run: say so, go on
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rec["traceback"] = traceback.format_exc(limit=3)[-600:]
        torch.cuda.synchronize()
    return rec


def summary(name: str, m: int, silu: bool, recs: list[dict]) -> dict | None:
    """The fastest correct gemv_rows config of one (shape, M) beside cuBLAS (with the
    activation for a gate_up), the default config and the layer's dispatch."""
    timed = {r["impl"]: r["us"] for r in recs if "us" in r}
    ok = [r for r in recs if "us" in r and r["impl"].startswith("gemv_rows")
          and not r.get("wrong")]
    if not ok:
        return None
    top = min(ok, key=lambda r: r["us"])
    cublas = timed.get("cublas+silu_and_mul" if silu else "cublas")
    return dict(best=True, shape=name, m=m, config=top["config"], us=top["us"],
                gbps=top["gbps"], default_us=timed.get("gemv_rows.default"),
                cublas_us=cublas, layer_us=timed.get("krait_layer"),
                speedup_vs_cublas=round(cublas / top["us"], 2) if cublas else None,
                failed=sum("error" in r or bool(r.get("wrong")) for r in recs))


def print_best(best: list[dict], t0: float) -> None:
    """The sweep's closing lines: each "best" record, then the seconds since t0."""
    for b in best:
        print(json.dumps(b), flush=True)
    print(json.dumps(dict(done=True, seconds=round(time.time() - t0, 1))), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the sweep first")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.time()
    precompile(args.shapes.split(","), sms, args.quick, args.jobs)
    gen = torch.Generator(device=dev).manual_seed(0)
    best: list[dict] = []
    for name in args.shapes.split(","):
        n, k, silu = SHAPES[name]
        nbytes = n * k * 2
        copies = min(CALLS, max(2, math.ceil(L2_FLUSH_BYTES / nbytes) + 1))
        weights = [torch.randn(n, k, device=dev, generator=gen).mul_(k ** -0.5).bfloat16()
                   for _ in range(copies)]
        configs = sweep(n, k, silu, sms)[:1 if args.quick else None]
        for m in (int(r) for r in args.rows.split(",")):
            xs = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            want = reference(xs, weights[0], silu)
            recs = []
            for impl, cfg, fn, check in impls(silu, configs):
                rec = dict(shape=name, n=n, k=k, silu=silu, m=m, impl=impl, config=cfg)
                recs.append(measure(rec, fn, xs, weights, want if check else None, nbytes))
                print(json.dumps(rec), flush=True)
            if (top := summary(name, m, silu, recs)) is not None:
                best.append(top)
        del weights
        torch.cuda.empty_cache()
    print_best(best, t0)


if __name__ == "__main__":
    main()

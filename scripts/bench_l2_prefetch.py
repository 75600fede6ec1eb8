"""What an L2 prefetch (krait/ops/l2_prefetch.py) buys a one-row projection: krait's GEMV and
cuBLAS (F.linear) timed cold (L2 flushed by zeroing a 256 MB buffer), and after the weight was
prefetched and a spin (torch.cuda._sleep) gave the prefetch time to land. CUDA events bracket
the projection alone; a spin also precedes the cold runs, so "after spin" vs "after prefetch"
isolates the prefetch. Also: the spin's own time and the prefetch kernel's (it only issues the
requests: fire-and-forget, so its time is not the transfer's).

PYTHONPATH=. python3 scripts/bench_l2_prefetch.py [--reps 50] [--sleep-cycles 20000]   (GPU)"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

# (N, K) bf16 weights: qwen3-0.6b, mamba2-1.3b, granite-4.0-h-micro's gate_up (67 MB)
SHAPES = {
    "qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048), "qwen3 gate_up": (6144, 1024),
    "qwen3 down": (1024, 3072), "mamba2 in_proj": (8512, 2048), "mamba2 out_proj": (2048, 4096),
    "granite gate_up": (16384, 2048),
}


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def timed(prologue, body, flush: torch.Tensor, reps: int) -> float:
    """Median µs of `body` alone over `reps` runs, each after an L2 flush and `prologue`."""
    times = []
    for _ in range(reps + 2):  # the first two warm up
        flush.zero_()
        prologue()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        body()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50, help="timed runs per measurement")
    p.add_argument("--sleep-cycles", type=int, default=20000,
                   help="spin after the prefetch, in clock cycles (20000: ~10 us at 2 GHz)")
    p.add_argument("--max-mb", type=float, default=None,
                   help="prefetch at most this many MB of each weight (default: all of it)")
    p.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    args = p.parse_args()

    from krait.ops.gemv import gemv_triton
    from krait.ops.l2_prefetch import l2_cache_bytes, l2_prefetch

    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    cap = None if args.max_mb is None else int(args.max_mb * (1 << 20))
    spin = lambda: torch.cuda._sleep(args.sleep_cycles)
    nothing = lambda: None
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    print(f"{torch.cuda.get_device_name(dev)}, L2 {l2_cache_bytes(dev) / 2**20:.0f} MB, "
          f"{args.reps} reps, spin {args.sleep_cycles} cycles")
    rows = []
    for name in names:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        err = float((gemv_triton(x, w).float() - ref).norm() / ref.norm())
        gemv = lambda w=w, x=x: gemv_triton(x, w)
        cublas = lambda w=w, x=x: F.linear(x, w)

        def prefetched(bulk: bool = False, evict_last: bool = False, w=w):
            def go():
                l2_prefetch(w, cap, evict_last=evict_last, bulk=bulk)
                spin()
            return go

        r = dict(shape=name, n=n, k=k, mb=w.nbytes / 1e6, rel_err=err)
        r["gemv_cold"] = timed(nothing, gemv, flush, args.reps)
        r["gemv_spin"] = timed(spin, gemv, flush, args.reps)
        r["gemv_pf"] = timed(prefetched(), gemv, flush, args.reps)
        r["gemv_pf_last"] = timed(prefetched(evict_last=True), gemv, flush, args.reps)
        r["gemv_pf_bulk"] = timed(prefetched(bulk=True), gemv, flush, args.reps)
        r["cublas_cold"] = timed(nothing, cublas, flush, args.reps)
        r["cublas_spin"] = timed(spin, cublas, flush, args.reps)
        r["cublas_pf"] = timed(prefetched(), cublas, flush, args.reps)
        r["spin"] = timed(nothing, spin, flush, args.reps)
        r["pf_issue"] = timed(nothing, lambda w=w: l2_prefetch(w, cap), flush, args.reps)
        r["pf_bulk_issue"] = timed(nothing, lambda w=w: l2_prefetch(w, cap, bulk=True), flush,
                                   args.reps)
        for key in ("gemv_spin", "gemv_pf", "gemv_pf_bulk"):
            r[f"{key}_gbs"] = w.nbytes / r[key] / 1e3
        rows.append(r)
        del w

    head = (f"{'shape':16} {'MB':>5} | {'GEMV us: cold':>13} {'spin':>6} {'pf':>6} "
            f"{'pf last':>7} {'pf bulk':>7} | {'cuBLAS: cold':>12} {'spin':>6} {'pf':>6} | "
            f"{'spin us':>7} {'issue':>6} {'bulk':>6} | {'GB/s: spin':>10} {'pf':>6} {'bulk':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['shape']:16} {r['mb']:5.1f} | {r['gemv_cold']:13.2f} {r['gemv_spin']:6.2f} "
              f"{r['gemv_pf']:6.2f} {r['gemv_pf_last']:7.2f} {r['gemv_pf_bulk']:7.2f} | "
              f"{r['cublas_cold']:12.2f} {r['cublas_spin']:6.2f} {r['cublas_pf']:6.2f} | "
              f"{r['spin']:7.2f} {r['pf_issue']:6.2f} {r['pf_bulk_issue']:6.2f} | "
              f"{r['gemv_spin_gbs']:10.0f} "
              f"{r['gemv_pf_gbs']:6.0f} {r['gemv_pf_bulk_gbs']:6.0f}"
              + (f"  (GEMV rel err {r['rel_err']:.2g}!)" if r["rel_err"] > 1e-2 else ""))
    print(json.dumps(dict(bench="l2_prefetch", device=torch.cuda.get_device_name(dev),
                          l2_bytes=l2_cache_bytes(dev), reps=args.reps,
                          sleep_cycles=args.sleep_cycles, max_bytes=cap, rows=rows)))


if __name__ == "__main__":
    main()

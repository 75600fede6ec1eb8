"""The MoE's few-route path (krait/ops/moe_routes.py) at real expert shapes: its default tiles
against a sweep of the up launch's tiles (down at its default) and of the down launch's
(split by route or not; up at its default).

Each timing is a CUDA graph of CALLS calls, each routing the token(s) to other random experts
(so the experts stream from HBM, not L2), replayed REPLAYS times (`bench_gemv_rows.graph_us`).
One JSON object a line: {"shape", "T", "part" ("default" | "up" | "down"), "config", "us",
"gbps" (distinct expert bytes a call / time)}; last, one "best" line per (shape, T).

Isolated calls can rank configs differently from the model's decode graph, where the launches
wait on the router and the top-k under PDL (route_up's one loop: slower here, 44 us a step
faster in Qwen3-Next-8l's batch-1 graph; docs/benchmarks.md, session 27): confirm a change with
`krait bench latency` on the model.

Usage (device machine, repo root): python3 scripts/bench_moe_routes.py [--shapes qwen3next,granite_tiny]
    [--tokens 1,2,4] [--quick]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv_rows import graph_us, print_best  # noqa: E402

from krait.ops.moe_routes import moe_routes_triton, routes_config  # noqa: E402

# name -> (hidden, intermediate, experts, top-k): Qwen3-Next-80B-A3B, granite-4.0-h-tiny
SHAPES = {"qwen3next": (2048, 512, 512, 10), "granite_tiny": (1536, 512, 64, 6)}
CALLS = 50
UP = [(bn, bk, nw) for bn, bk, nw in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048),
                                                       (4, 8))]
DOWN = [(bn, bk, nw, s) for bn, bk, nw, s in
        itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (False, True))]


def calls(x, w13, w2, tw, ids, add, cfg):
    """make_call(i) for graph_us: call i routes to the experts of ids[i]."""
    return lambda i: (lambda: moe_routes_triton(x, w13, w2, tw, ids[i], 1, add, config=cfg))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--quick", action="store_true", help="the default config only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    best = []
    for name in args.shapes.split(","):
        H, inter, E, k = SHAPES[name]
        w13 = (torch.randn(E, 2 * inter, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        w2 = (torch.randn(E, H, inter, device=dev, generator=gen) * inter ** -0.5).bfloat16()
        for T in (int(t) for t in args.tokens.split(",")):
            if 2 * T * k > E:
                continue  # not a few-route batch: fused_moe's grouped GEMM serves it
            x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
            add = torch.randn(T, H, device=dev, generator=gen).bfloat16()
            tw = torch.rand(T, k, device=dev, generator=gen)
            ids = [torch.stack([torch.randperm(E, device=dev, generator=gen)[:k]
                                for _ in range(T)]).to(torch.int32) for _ in range(CALLS)]
            nbytes = sum(len(set(i.flatten().tolist())) for i in ids) / CALLS * 3 * inter * H * 2
            base = routes_config(T, k, H, inter, sms)
            variants = [("default", base)]
            if not args.quick:
                variants += [("up", dict(base, up=u)) for u in UP if u != base["up"]]
                variants += [("down", dict(base, down=d)) for d in DOWN if d != base["down"]]
            recs = []
            for part, cfg in variants:
                rec = dict(shape=name, T=T, part=part, config=cfg)
                try:
                    us = graph_us(calls(x, w13, w2, tw, ids, add, cfg), CALLS)
                    rec.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1))
                except Exception as e:  # noqa: BLE001 (a config that fails: say so, go on)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    torch.cuda.synchronize()
                recs.append(rec)
                print(json.dumps(rec), flush=True)
            timed = [r for r in recs if "us" in r]
            top_up = min((r for r in timed if r["part"] in ("up", "default")), key=lambda r: r["us"])
            top_dn = min((r for r in timed if r["part"] in ("down", "default")), key=lambda r: r["us"])
            best.append(dict(best=True, shape=name, T=T, default_us=recs[0].get("us"),
                             up=top_up["config"]["up"], up_us=top_up["us"],
                             down=top_dn["config"]["down"], down_us=top_dn["us"]))
        del w13, w2
        torch.cuda.empty_cache()
    print_best(best, t0)


if __name__ == "__main__":
    main()

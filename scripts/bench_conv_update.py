"""The Mamba decode conv update alone, by program shape (KRAIT_CONV_UPDATE=block_d:rows:warps):
µs a call and the bytes' rate at granite-4.0-h-micro's conv (4352 channels, width 4, channel-last
bf16 state) for batch 64 and 256, one call per layer over `--layers` layers' own states (past
the L2). Writes the fastest shape at the largest batch to `--best` (a knob value).

PYTHONPATH=. python3 scripts/bench_conv_update.py [--best FILE]"""

from __future__ import annotations

import argparse
import os

import torch

from krait.ops.causal_conv1d import causal_conv1d_update_triton
from scripts.bench_ssu import _time_us

DIM, WIDTH = 64 * 64 + 2 * 128, 4


def bench_batch(batch: int, layers: int) -> tuple[float, str]:
    """Prints a row per shape; returns the fastest (µs, knob)."""
    dev, bf16 = "cuda", torch.bfloat16
    states = [torch.randn(batch + 1, WIDTH - 1, DIM, device=dev, dtype=bf16).transpose(1, 2)
              for _ in range(layers)]  # [slots, dim, taps] views of channel-last storage
    x = torch.randn(batch, DIM, device=dev, dtype=bf16)
    w = torch.randn(DIM, WIDTH, device=dev, dtype=bf16)
    b = torch.randn(DIM, device=dev, dtype=bf16)
    slots = torch.randperm(batch, device=dev).to(torch.int32)
    moved = batch * DIM * 2 * (2 * (WIDTH - 1) + 2)  # state read + written, x, out

    def run() -> None:
        for s in states:
            causal_conv1d_update_triton(x, s, w, b, slots)

    best = (float("inf"), "")
    for knob in [""] + [f"{d}:{r}:{wp}" for d in (256, 512, 1024) for r in (1, 2, 4)
                        for wp in (4, 8)]:
        os.environ["KRAIT_CONV_UPDATE"] = knob
        try:
            us = _time_us(run) / layers
        finally:
            del os.environ["KRAIT_CONV_UPDATE"]
        print(f"{batch:5d} {knob or 'default':>10s} {us:8.2f} {moved / us / 1e6:6.2f}", flush=True)
        best = min(best, (us, knob))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--best", default=None)
    args = ap.parse_args()
    print(f"{'batch':>5s} {'shape':>10s} {'us':>8s} {'TB/s':>6s}")
    best = (0.0, "")
    for batch in (int(b) for b in args.batches.split(",")):
        best = bench_batch(batch, args.layers)
    print(f"fastest at the largest batch: {best[1] or 'default'} ({best[0]:.2f} us)")
    if args.best:
        with open(args.best, "w") as f:
            f.write(best[1])


if __name__ == "__main__":
    main()

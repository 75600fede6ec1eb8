"""The Mamba decode state update alone, by program shape: µs a call (and the state bytes' rate)
for each BLOCK_P (state rows a program) x warps, at the decode shapes the targets run: batch 1
and 64 with a float32 state (mamba2-1.3b / granite-4.0-h-micro: 64 heads x 64 x 128) and the
throughput workload's batch 256 with a bf16 state. Each timing is a CUDA graph of one call per
layer over `--layers` layers' own state pools, past the L2 as in a decode step
(`bench_gemv.time_us`).

PYTHONPATH=. python3 scripts/bench_ssu.py"""

from __future__ import annotations

import argparse

import torch

import krait.ops.selective_state_update as ssu_mod
from scripts.bench_gemv import time_us  # median µs a call over a graph cycling the states

HEADS, P, N = 64, 64, 128


def bench_case(batch: int, dtype: torch.dtype, layers: int) -> None:
    """Every program shape at one batch and state dtype: a row each, then the default's."""
    dev = "cuda"
    states = [torch.randn(batch + 1, HEADS, P, N, device=dev).to(dtype) for _ in range(layers)]
    x = torch.randn(batch, HEADS, P, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(batch, HEADS, device=dev, dtype=torch.bfloat16)
    A = -torch.rand(HEADS, device=dev)
    B = torch.randn(batch, 1, N, device=dev, dtype=torch.bfloat16)
    C = torch.randn(batch, 1, N, device=dev, dtype=torch.bfloat16)
    D = torch.randn(HEADS, device=dev)
    dt_bias = torch.randn(HEADS, device=dev)
    slots = torch.arange(batch, device=dev, dtype=torch.int32)
    moved = 2 * batch * HEADS * P * N * states[0].element_size()  # bytes a call

    def run(state: torch.Tensor) -> None:
        ssu_mod.selective_state_update_triton(state, x, dt, A, B, C, D, dt_bias, slots)

    real_block_p, real_warps = ssu_mod._block_p, ssu_mod.ssu_warps
    name = str(dtype).removeprefix("torch.")
    for block_p in (8, 16, 32, 64):
        for warps in (2, 4, 8):
            ssu_mod._block_p = lambda *a, bp=block_p: bp
            ssu_mod.ssu_warps = lambda *a, w=warps: w
            try:
                us = time_us(run, states)
            finally:
                ssu_mod._block_p, ssu_mod.ssu_warps = real_block_p, real_warps
            rate = moved / (us * 1e-6) / 1e12
            print(f"{batch:5d} {name:>8s} {block_p:7d} {warps:5d} {us:8.2f} {rate:6.2f}", flush=True)
    us = time_us(run, states)
    print(f"{batch:5d} {name:>8s} default {'':5s} {us:8.2f} {moved / (us * 1e-6) / 1e12:6.2f}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1:float32,64:float32,256:bfloat16")
    ap.add_argument("--layers", type=int, default=36)
    args = ap.parse_args()
    print(f"{'batch':>5s} {'state':>8s} {'BLOCK_P':>7s} {'warps':>5s} {'us':>8s} {'TB/s':>6s}")
    for case in args.cases.split(","):
        batch, dtype = case.split(":")
        # batch 1's states are small: enough layers that they do not stay in the L2
        bench_case(int(batch), getattr(torch, dtype), args.layers if int(batch) > 1 else
                   max(args.layers, 48))


if __name__ == "__main__":
    main()

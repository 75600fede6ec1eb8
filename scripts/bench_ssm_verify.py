"""Times Mamba2's verify-step kernels at mamba2-1.3b's sizes (64 heads x 64 x 128, one group,
fp32 state), one JSON line a measurement, microseconds a call (a CUDA graph of calls cycling
over LAYERS state tensors, as the model's layers do):

- `selective_state_verify` (its deferred commit: every row replays k + 1 kept tokens, then runs
  its own 1 + k) on the launcher's tile, in its two forms (UNROLL or not), the looped one under
  register caps, the unrolled one on smaller tiles too;
- the decode step's `selective_state_update`, for scale;
- `causal_conv1d_verify` over channels a program;
- the gated RMSNorm of the verify rows (1 + k rows a request, one 4096-wide group) over warps
  (0: the launcher's choice).

Usage (GPU): PYTHONPATH=. python3 scripts/bench_ssm_verify.py [--batches 1,64]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv_rows import graph_us as _graph_us  # noqa: E402

from krait.ops.causal_conv1d_verify import causal_conv1d_verify_triton  # noqa: E402
from krait.ops.gated_rms_norm import gated_rms_norm_triton  # noqa: E402
from krait.ops.selective_state_update import selective_state_update_triton  # noqa: E402
from krait.ops.selective_state_verify import selective_state_verify_triton  # noqa: E402

H, P, N, G = 64, 64, 128, 1
LAYERS = 48  # state tensors: as many as the model's layers, so a graph's calls miss L2


def graph_us(calls: list) -> float:
    """Microseconds a call, the calls cycled through one CUDA graph (bench_gemv_rows')."""
    return _graph_us(lambda i: calls[i], len(calls))


def inputs(batch: int, k: int, dev):
    t = batch * (1 + k)
    g = torch.Generator(device=dev).manual_seed(0)
    xbc = torch.randn(t, H * P + 2 * G * N, device=dev, generator=g).bfloat16()
    x = xbc[:, : H * P].view(t, H, P)
    B = xbc[:, H * P : H * P + G * N].view(t, G, N)
    C = xbc[:, H * P + G * N :].view(t, G, N)
    dt = (torch.randn(t, H, device=dev, generator=g) * 0.5 - 1).bfloat16()
    A = -torch.rand(H, device=dev, generator=g).exp()
    D = torch.randn(H, device=dev, generator=g)
    dt_bias = torch.rand(H, device=dev, generator=g) - 0.5
    qsl = torch.arange(0, t + 1, 1 + k, device=dev, dtype=torch.int32)
    return x, dt, A, B, C, D, dt_bias, qsl


def bench_batch(batch: int, k: int, dev) -> None:
    """Prints the JSON lines of one batch size."""
    x, dt, A, B, C, D, dt_bias, qsl = inputs(batch, k, dev)
    cols = 1 + k
    idx = torch.arange(batch, device=dev, dtype=torch.int32)
    states = [torch.randn(batch, H, P, N, device=dev) * 0.1 for _ in range(LAYERS)]
    rec = {"batch": batch, "k": k, "state_GB_per_layer": batch * H * P * N * 4 / 1e9}
    # the decode step: one token a row, a slot a row
    slots = torch.arange(batch, device=dev, dtype=torch.int32)
    decode = [partial(selective_state_update_triton, s, x[::cols], dt[::cols], A, B[::cols],
                      C[::cols], D, dt_bias, slots) for s in states]
    print(json.dumps({**rec, "kernel": "decode_update", "us": graph_us(decode)}), flush=True)
    # every request replays k + 1 kept tokens (all accepted: the most work), then its own
    kept = [(torch.zeros(2, batch, cols, H, P, device=dev, dtype=torch.bfloat16),
             torch.zeros(2, batch, cols, H, device=dev, dtype=torch.bfloat16),
             torch.zeros(2, batch, cols, G, N, device=dev, dtype=torch.bfloat16),
             torch.full((batch,), cols, device=dev, dtype=torch.int32)) for _ in range(LAYERS)]
    # verify_tile's tile; the kernel's two forms (UNROLL or not), the looped one under register
    # caps (0: LOOP_MAXNREG, 255: none); then the unrolled form on smaller tiles (block_p x
    # warps; 0: the launcher's), which batch 1's few programs may want
    runs = [(False, 0, 0, 0), (False, 72, 0, 0), (False, 255, 0, 0), (True, 0, 0, 0)]
    runs += [(True, 0, bp, w) for bp, w in ((4, 4), (4, 8), (8, 4))]
    for unroll, cap, bp, w in runs:
        calls = [partial(selective_state_verify_triton, s, x, dt, A, B, C, D, dt_bias, qsl,
                         slots[:, None], idx, r, unroll=unroll, maxnreg=cap or None,
                         block_p=bp or None, num_warps=w or None)
                 for s, r in zip(states, kept)]
        print(json.dumps({**rec, "kernel": "verify", "unroll": unroll, "maxnreg": cap,
                          "block_p": bp, "warps": w, "us": graph_us(calls)}), flush=True)
    # the verify conv over the rows' xBC (channel-last bf16 state as the engine keeps it, one
    # slot column a token) over channels a program (0: the launcher's)
    dim = H * P + 2 * G * N
    xbc = torch.randn(batch * cols, dim, device=dev).bfloat16()  # [T, conv_dim]
    conv_w = torch.randn(dim, 4, device=dev).bfloat16()  # [conv_dim, width]
    conv_states = [torch.randn(batch * cols, 3, dim, device=dev).bfloat16().transpose(1, 2)
                   for _ in range(LAYERS)]
    conv_slots = torch.arange(batch * cols, device=dev, dtype=torch.int32).view(batch, cols)
    accepted = torch.full((batch,), cols, device=dev, dtype=torch.int32)
    for bd in (0, 32, 64, 256):
        calls = [partial(causal_conv1d_verify_triton, xbc, cs, conv_w, None, qsl, conv_slots,
                         accepted, idx, "silu", block_d=bd or None) for cs in conv_states]
        print(json.dumps({**rec, "kernel": "conv_verify", "block_d": bd,
                          "us": graph_us(calls)}), flush=True)
    # the gated norm of the verify rows
    y = torch.randn(batch * cols, H * P, device=dev).bfloat16()
    z = torch.randn(batch * cols, H * P, device=dev).bfloat16()
    weight = torch.randn(H * P, device=dev).bfloat16()
    for w in (0, 4, 8, 16, 32):
        calls = [partial(gated_rms_norm_triton, y, z, weight, 1e-5, H * P, num_warps=w or None)]
        print(json.dumps({**rec, "kernel": "gated_norm", "warps": w,
                          "us": graph_us(calls)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    for batch in [int(b) for b in args.batches.split(",")]:
        bench_batch(batch, args.k, torch.device("cuda"))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

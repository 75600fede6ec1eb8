"""The decode-batch GEMM (krait/ops/decode_gemm.py, autotuned) against cuBLAS (F.linear) at the
shipped configs' projection shapes and decode batch sizes: µs a call with L2 flushed (as inside a
decode step, where the weights are not cached), TFLOP/s and weight TB/s, the tuned tile.

PYTHONPATH=. python3 scripts/bench_decode_gemm.py [--rows 16,64,128,256]"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from krait.ops.decode_gemm import _decode_gemm_tuned, decode_gemm_triton

SHAPES = [  # (name, N, K)
    ("granite/mamba2 in_proj", 8512, 2048), ("granite/mamba2 out_proj", 2048, 4096),
    ("granite gate_up", 16384, 2048), ("granite down", 2048, 8192), ("granite qkv", 3072, 2048),
    ("qwen3 qkv", 4096, 1024), ("qwen3 gate_up", 6144, 1024), ("qwen3 down", 1024, 3072),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,128,256")
    rows = [int(r) for r in ap.parse_args().rows.split(",")]
    print(f"{'shape':26s} {'M':>4s} {'cuBLAS us':>10s} {'krait us':>9s} {'ratio':>6s} "
          f"{'TFLOP/s':>8s} {'TB/s':>6s}  tile")
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            decode_gemm_triton(x, w)  # tunes this shape's bucket
            t_cublas = triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w))
            t_krait = triton.testing.do_bench(lambda x=x, w=w: decode_gemm_triton(x, w))
            best = _decode_gemm_tuned.best_config
            tile = f"{best.kwargs['BLOCK_M']}x{best.kwargs['BLOCK_N']}x{best.kwargs['BLOCK_K']}" \
                   f"/w{best.num_warps}s{best.num_stages}"
            flops = 2 * m * n * k / (t_krait * 1e-3) / 1e12
            tbs = n * k * 2 / (t_krait * 1e-3) / 1e12
            print(f"{name:26s} {m:4d} {t_cublas * 1e3:10.2f} {t_krait * 1e3:9.2f} "
                  f"{t_krait / t_cublas:6.2f} {flops:8.0f} {tbs:6.2f}  {tile}", flush=True)


if __name__ == "__main__":
    main()

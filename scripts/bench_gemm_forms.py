"""cuBLAS formulations of a decode batch's projection y = x @ W^T (x [M, K], W [N, K]) at the
shipped configs' shapes, µs a call with L2 flushed (as inside a decode step): F.linear (what
krait calls), the transposed product (W @ x^T)^T made contiguous, and F.linear under cuBLASLt.
Session 9's profile found cuBLAS's tiles for granite's in_proj at batch 256 on ~68 CTAs of 132
SMs (~1 ms of a 9.7 ms step over all projections): this measures what another formulation buys
before any kernel is written.

PYTHONPATH=. python3 scripts/bench_gemm_forms.py [--rows 64,128,256]"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from scripts.bench_gemv import SHAPES  # (N, K) of the decode projections


def _us(fn) -> float:
    return triton.testing.do_bench(fn) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256")
    rows = [int(r) for r in ap.parse_args().rows.split(",")]
    print(f"{'shape':26s} {'M':>4s} {'F.linear':>9s} {'(Wx^T)^T':>9s} {'cuBLASLt':>9s}  us")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            plain = _us(lambda x=x, w=w: F.linear(x, w))
            swapped = _us(lambda x=x, w=w: torch.mm(w, x.t()).t().contiguous())
            torch.testing.assert_close(torch.mm(w, x.t()).t(), F.linear(x, w), atol=2e-2, rtol=2e-2)
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                lt = _us(lambda x=x, w=w: F.linear(x, w))
            finally:
                torch.backends.cuda.preferred_blas_library(before)
            print(f"{name:26s} {m:4d} {plain:9.2f} {swapped:9.2f} {lt:9.2f}", flush=True)


if __name__ == "__main__":
    main()

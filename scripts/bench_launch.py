"""Host cost of one launch on this machine: a Triton kernel through its JIT launcher, the same
compiled kernel called directly, and a few torch ops (µs of host time each, the GPU left to run
behind). An eager step (a prefill) pays these once per op.

PYTHONPATH=. python3 scripts/bench_launch.py"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from krait.ops.pdl import pdl_args
from krait.ops.rms_norm import _rms_norm_kernel, rms_norm


def _per_call(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev = torch.device("cuda")
    x = torch.randn(16, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    big = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    xs = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    args = (x, x, w, out, out, 2048, 1e-6, 1.0, 2048, 2048, 2048, 2048)
    consts = dict(HAS_RESIDUAL=False, SCALE_X=False, BLOCK_D=2048, **pdl_args(False))
    pdl_consts = dict(HAS_RESIDUAL=False, SCALE_X=False, BLOCK_D=2048, **pdl_args(True))
    compiled = _rms_norm_kernel[(16,)](*args, **consts)  # the JIT returns the compiled kernel
    direct = compiled[(16, 1, 1)]
    const_vals = tuple(consts[k] for k in ("HAS_RESIDUAL", "SCALE_X", "BLOCK_D", "PDL"))

    rows = [
        ("krait rms_norm (its wrapper, then the JIT launcher)", lambda: rms_norm(x, w, 1e-6)),
        ("the kernel through its JIT launcher, no PDL", lambda: _rms_norm_kernel[(16,)](*args, **consts)),
        ("the kernel through its JIT launcher, PDL", lambda: _rms_norm_kernel[(16,)](*args, **pdl_consts)),
        ("the compiled kernel called directly, no PDL", lambda: direct(*args, *const_vals)),
        ("torch.empty", lambda: torch.empty(16, 2048, device=dev, dtype=torch.bfloat16)),
        ("torch add", lambda: x + x),
        ("F.linear M=2048 (cuBLAS)", lambda: F.linear(xs, big)),
        ("F.linear M=16 (cuBLAS)", lambda: F.linear(x, big)),
        ("torch topk", lambda: torch.topk(x.float(), 4, dim=-1)),
    ]
    for name, fn in rows:
        print(f"{_per_call(fn):8.2f} us  {name}")


if __name__ == "__main__":
    main()

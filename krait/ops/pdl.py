"""Programmatic dependent launch (PDL) for the small kernels of a decode step (on sm_90 and
newer).

At batch 1 a decode step is ~300 kernels of a few microseconds each, and each pays a launch and
ramp-up that the previous kernel's tail does not hide (docs/benchmarks.md: qwen3-0.6b projections
of 4-8 MB take 5-6 us for 1-2 us of data). With PDL the next kernel may start while this one
finishes: a kernel launched with `launch_pdl=True` calls `pdl_trigger()` (its dependents may be
scheduled once every program of it has called it or exited) and `pdl_wait()` before it touches
any memory that earlier kernels of the stream write or read; only constant inputs (weights) may
be loaded before the wait, which is where a GEMV gains most: its first weight tile is in flight
while the previous kernel drains. `pdl_wait()` returns once every earlier kernel has finished and
its writes are visible, so the stream's order is kept and the caching allocator stays safe.

Kernels take `PDL: tl.constexpr`; launchers pass `**pdl_args(use_pdl(tensor))`. Off on the CPU
(the interpreter has no grid-dependency instructions) and before sm_90. On the H200 batch-1
decode steps are markedly shorter with it (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    try:
        from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without the intrinsics: PDL stays off (use_pdl checks it)
        gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Lets the next kernel of the stream launch (a no-op unless PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Waits until the earlier kernels of the stream are done (a no-op unless PDL)."""
    if PDL:
        gdc_wait()


def use_pdl(t: Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL: CUDA tensors on a Hopper-or-newer GPU
    (the grid-dependency instructions need sm_90)."""
    if not t.is_cuda or gdc_wait is None:
        return False
    return _supports_pdl(t.device.index if t.device.index is not None else -1)


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    index = torch.cuda.current_device() if device_index < 0 else device_index
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(on: bool) -> dict:
    """Launch keywords: the kernel's PDL flag, and Triton's `launch_pdl` only when on (a launch
    without PDL passes nothing new to Triton)."""
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}

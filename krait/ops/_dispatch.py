"""What every op's launcher shares: the backend choice (Triton kernels on CUDA, torch references
elsewhere) and launch arithmetic — each at a fraction of a microsecond, since an eager step (a
prefill) calls them for every op of every layer on the host's critical path."""

import functools

import torch
from torch import Tensor

from krait.envs import environ_get, get


def interpreting() -> bool:
    """Triton runs kernels through its interpreter (`TRITON_INTERPRET=1`, the CPU tests)."""
    return environ_get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code (Triton's is a constexpr function: ~2 us a call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 for host code (Triton's is a constexpr function: ~2.3 us a call)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def use_triton(t: Tensor) -> bool:
    """True when `t` lives on a CUDA device and `KRAIT_TORCH_OPS` is unset (or "" / "0").

    Setting `KRAIT_TORCH_OPS=1` forces the torch references everywhere (debugging, A/B checks);
    `KRAIT_TRITON_CPU=1` with `TRITON_INTERPRET=1` runs the Triton kernels on CPU tensors, so a
    whole model can be checked through its kernels without a GPU (slow: tests at tiny sizes).
    """
    if get("KRAIT_TORCH_OPS") not in ("", "0"):
        return False
    if t.is_cuda:
        return True
    return get("KRAIT_TRITON_CPU") == "1" and interpreting()


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """The device's SM count (4 off CUDA: the interpreter's small grids), looked up once."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4

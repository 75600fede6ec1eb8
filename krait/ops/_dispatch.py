"""Backend choice shared by every op: Triton kernels on CUDA, torch references elsewhere."""

import os

from torch import Tensor


def use_triton(t: Tensor) -> bool:
    """True when `t` lives on a CUDA device and `KRAIT_TORCH_OPS` is unset (or "" / "0").

    Setting `KRAIT_TORCH_OPS=1` forces the torch references everywhere (debugging, A/B checks);
    `KRAIT_TRITON_CPU=1` with `TRITON_INTERPRET=1` runs the Triton kernels on CPU tensors, so a
    whole model can be checked through its kernels without a GPU (slow: tests at tiny sizes).
    """
    if os.environ.get("KRAIT_TORCH_OPS", "") not in ("", "0"):
        return False
    if t.is_cuda:
        return True
    return os.environ.get("KRAIT_TRITON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"

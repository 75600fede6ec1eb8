"""Backend choice shared by every op: Triton kernels on CUDA, torch references elsewhere."""

import os

from torch import Tensor


def use_triton(t: Tensor) -> bool:
    """True when `t` lives on a CUDA device and `KRAIT_TORCH_OPS` is unset (or "" / "0").

    Setting `KRAIT_TORCH_OPS=1` forces the torch references everywhere (debugging, A/B checks).
    """
    return t.is_cuda and os.environ.get("KRAIT_TORCH_OPS", "") in ("", "0")

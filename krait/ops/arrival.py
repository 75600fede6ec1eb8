"""Arrival counters for one-launch reductions across programs (the GEMV's split-K, the fused
Mamba decode's group norm, the argmax): each program adds one to its key's counter after writing
its partial result, the program that sees the last count combines the partials in a fixed order
and writes the counter back to zero, so the buffer is all zeros between launches (graph-safe, no
memset). Each op keeps its own buffer per device."""

from __future__ import annotations

import torch
from torch import Tensor


def arrival_counters(pool: dict[torch.device, Tensor], device: torch.device, n: int) -> Tensor:
    """At least n zeroed int32 counters on `device`, allocated once and grown when needed."""
    c = pool.get(device)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        pool[device] = c
    return c

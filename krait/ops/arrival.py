"""Arrival counters for one-launch reductions across programs (the GEMV's split-K, the fused
Mamba decode's group norm, the Gated DeltaNet decode's head norm, the MoE's split down
projection, the argmax): each program adds one to its key's counter after writing its partial
result, the program that sees the last count combines the partials in a fixed order and writes
the counter back to zero, so the buffer is all zeros between launches (graph-safe, no memset).
Each op keeps its own buffer per device."""

from __future__ import annotations

import torch
from torch import Tensor

from krait.ops._dispatch import cdiv

# counters a pool outgrew: CUDA graphs captured before the growth still address them, so they
# are kept (never freed, never handed to another tensor by the caching allocator)
_RETIRED: list[Tensor] = []


def arrival_counters(pool: dict[torch.device, Tensor], device: torch.device, n: int) -> Tensor:
    """At least n zeroed int32 counters on `device`, allocated once and grown when needed (an
    eager step past the captured batch sizes); the outgrown buffer stays allocated for the
    graphs that captured it."""
    c = pool.get(device)
    if c is None or c.numel() < n:
        if c is not None:
            _RETIRED.append(c)
        c = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        pool[device] = c
    return c


def split_k_scratch(pool: dict[torch.device, Tensor], split: int, shape: tuple[int, ...],
                    tiles: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(partials float32 [split, *shape], arrival counters for `tiles` column tiles) of a
    split-K launch on `like`'s device; with split 1 the kernel reads neither, and both are
    `like`."""
    if split == 1:
        return like, like
    part = torch.empty(split, *shape, dtype=torch.float32, device=like.device)  # [S, *shape]
    return part, arrival_counters(pool, like.device, tiles)


def slice_width(k: int, split: int, block_k: int) -> int:
    """Columns of K each of a split-K launch's `split` slices streams: whole `block_k` tiles."""
    return cdiv(cdiv(k, split), block_k) * block_k

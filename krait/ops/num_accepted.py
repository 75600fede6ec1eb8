"""Records each request's accepted-position count after a step (speculative decoding).

`num_accepted[idx_mapping[b]] = max(num_sampled[b], 1)` for every batch row b whose
idx_mapping is not -1. A row that sampled nothing (a prefill chunk, a non-last pipeline stage)
gets 1, the neutral count: the next step starts from the slot of the first position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, use_triton


@triton.jit
def _fill_num_accepted_kernel(
    num_accepted_ptr, idx_mapping_ptr, num_sampled_ptr, n_rows, const_sampled,
    HAS_TENSOR: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_rows
    idx = tl.load(idx_mapping_ptr + offs, mask=in_range, other=-1)
    if HAS_TENSOR:
        n = tl.load(num_sampled_ptr + offs, mask=in_range, other=1)
    else:
        n = tl.zeros([BLOCK], dtype=tl.int32) + const_sampled
    n = tl.maximum(n, 1)
    keep = in_range & (idx >= 0)
    tl.store(num_accepted_ptr + idx, n.to(tl.int32), mask=keep)


def fill_num_accepted_triton(
    num_accepted: Tensor, idx_mapping: Tensor, num_sampled: Tensor | int
) -> None:
    n_rows = idx_mapping.shape[0]
    if n_rows == 0:
        return
    has_tensor = isinstance(num_sampled, Tensor)
    block = 128
    grid = (cdiv(n_rows, block),)
    _fill_num_accepted_kernel[grid](
        num_accepted,
        idx_mapping,
        num_sampled if has_tensor else idx_mapping,
        n_rows,
        0 if has_tensor else int(num_sampled),
        HAS_TENSOR=has_tensor,
        BLOCK=block,
    )


def fill_num_accepted_ref(
    num_accepted: Tensor, idx_mapping: Tensor, num_sampled: Tensor | int
) -> None:
    if idx_mapping.shape[0] == 0:
        return
    keep = idx_mapping >= 0
    if isinstance(num_sampled, Tensor):
        n = num_sampled.to(torch.int32).clamp(min=1)[keep]
    else:
        n = torch.full((int(keep.sum()),), max(int(num_sampled), 1), dtype=torch.int32,
                       device=num_accepted.device)
    num_accepted[idx_mapping[keep].long()] = n


def fill_num_accepted(num_accepted: Tensor, idx_mapping: Tensor, num_sampled: Tensor | int) -> None:
    """num_accepted int32 [max_reqs] (in place); idx_mapping int32 [B] (-1 skipped);
    num_sampled int32 [B] or an int for every row."""
    if use_triton(num_accepted):
        fill_num_accepted_triton(num_accepted, idx_mapping, num_sampled)
    else:
        fill_num_accepted_ref(num_accepted, idx_mapping, num_sampled)

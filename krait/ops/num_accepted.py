"""Records each request's accepted-position count after a step (speculative decoding).

`num_accepted[idx_mapping[b]] = max(num_sampled[b], 1)` for every batch row b whose
idx_mapping is not -1. A row that sampled nothing (a prefill chunk, a non-last pipeline stage)
gets 1, the neutral count: the next step starts from the slot of the first position.

`fill_replay_ctl` writes the Mamba2 state update's control words for its deferred commit
(krait/ops/selective_state_verify.py): a row with drafts keeps its accepted count and flips its
parity; any other row (a prefill chunk, a decode row without drafts) keeps nothing.
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


@triton.jit
def _fill_replay_ctl_kernel(ctl_ptr, idx_mapping_ptr, num_sampled_ptr, drafts_ptr, n_rows,
                            BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_rows
    idx = tl.load(idx_mapping_ptr + offs, mask=in_range, other=-1)
    keep = in_range & (idx >= 0)
    n = tl.maximum(tl.load(num_sampled_ptr + offs, mask=in_range, other=1), 1)
    drafts = tl.load(drafts_ptr + offs, mask=in_range, other=0)
    old = tl.load(ctl_ptr + idx, mask=keep, other=0)
    flipped = 1 - (old >> 16)
    word = tl.where(drafts > 0, n | (flipped << 16), 0)
    tl.store(ctl_ptr + idx, word.to(tl.int32), mask=keep)


def fill_replay_ctl_ref(ctl: Tensor, idx_mapping: Tensor, num_sampled: Tensor,
                        draft_counts: Tensor) -> None:
    draft_counts = draft_counts[: idx_mapping.shape[0]]
    keep = idx_mapping >= 0
    if not bool(keep.any()):
        return
    idx = idx_mapping[keep].long()
    n = num_sampled[keep].to(torch.int32).clamp(min=1)
    flipped = 1 - (ctl[idx] >> 16)
    ctl[idx] = torch.where(draft_counts[keep] > 0, n | (flipped << 16), 0).to(torch.int32)


def fill_replay_ctl_triton(ctl: Tensor, idx_mapping: Tensor, num_sampled: Tensor,
                           draft_counts: Tensor) -> None:
    n_rows = idx_mapping.shape[0]
    if n_rows == 0:
        return
    block = 128
    _fill_replay_ctl_kernel[(cdiv(n_rows, block),)](
        ctl, idx_mapping, num_sampled, draft_counts[:n_rows], n_rows, BLOCK=block)


def fill_replay_ctl(ctl: Tensor, idx_mapping: Tensor, num_sampled: Tensor,
                    draft_counts: Tensor) -> None:
    """ctl int32 [max_reqs] (in place): for each batch row b with idx_mapping[b] >= 0,
    `max(num_sampled[b], 1) | (1 - parity) << 16` where draft_counts[b] > 0 (a verify row
    with drafts: its accepted tokens wait in the replay buffers it wrote at 1 - parity), else 0.
    idx_mapping, num_sampled int32 [B]; draft_counts int32 [>= B]."""
    fn = fill_replay_ctl_triton if use_triton(ctl) else fill_replay_ctl_ref
    fn(ctl, idx_mapping, num_sampled, draft_counts)

"""Greedy sampling's argmax over the vocabulary: the first index of each row's maximum, as
`torch.argmax`.

torch reduces a row in one thread block: at batch 1 a 150k-entry row took 23 us on the H200
(docs/benchmarks.md, granite b=1 profile), on the critical path after every decode graph. Here
program (r, c) reduces the c-th BLOCK of row r, and the last program of a row to finish (the
arrival-counter pattern of gemv.py: counters reset by that program, one launch) picks the best
block, the lowest on ties, so the first maximal index wins as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton
from krait.ops.arrival import arrival_counters

_COUNTERS: dict[torch.device, Tensor] = {}  # per-row arrival counters, back to zero after a launch


@triton.jit
def _argmax_kernel(
    x_ptr, out_ptr, val_ptr, idx_ptr, count_ptr, vocab, stride_row,
    NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)  # NaN (a padded graph row's garbage) ranks last
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * NUM_BLOCKS + blk, best)
    tl.store(idx_ptr + row * NUM_BLOCKS + blk, blk * BLOCK + at)
    arrived = tl.atomic_add(count_ptr + row, 1)  # acq_rel: orders the stores above
    if arrived == NUM_BLOCKS - 1:
        b = tl.arange(0, BLOCK_B)
        vals = tl.load(val_ptr + row * NUM_BLOCKS + b, mask=b < NUM_BLOCKS, other=float("-inf"),
                       cache_modifier=".cg")
        _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * NUM_BLOCKS + first, cache_modifier=".cg"))
        tl.atomic_xchg(count_ptr + row, 0)


def argmax_triton(x: Tensor, block: int = 4096) -> Tensor:
    """Triton launcher of `argmax`."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)  # [R]
    if rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(block, next_pow2(vocab))
    num_blocks = cdiv(vocab, block)
    vals = torch.empty(rows, num_blocks, dtype=torch.float32, device=x.device)  # [R, blocks]
    idx = torch.empty(rows, num_blocks, dtype=torch.int64, device=x.device)  # [R, blocks]
    _argmax_kernel[(rows, num_blocks)](
        x, out, vals, idx, arrival_counters(_COUNTERS, x.device, rows), vocab, x.stride(0),
        NUM_BLOCKS=num_blocks, BLOCK=block, BLOCK_B=next_pow2(num_blocks),
    )
    return out


def argmax(x: Tensor) -> Tensor:
    """x [R, V] -> int64 [R]: the first index of each row's maximum (the Triton kernel ranks
    NaN below everything; no row of a real request holds NaN)."""
    return argmax_triton(x) if use_triton(x) else x.argmax(dim=-1)

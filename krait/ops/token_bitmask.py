"""Grammar masks on the logits: the tokens a row's grammar forbids become -inf, in place.

A mask is xgrammar's packed layout: int32 words, bit `t % 32` of word `t // 32` set when token
`t` is allowed. `rows[s]` names the logits row that bitmask row `s` applies to (-1: skipped, as
every consumer of `idx_mapping` skips padding), so one launch serves the batch's structured rows
and leaves the others untouched. Columns past the mask's `32 * words` bits (logits wider than
the tokenizer's vocabulary) are forbidden.

Shapes: logits [B, V] (any float dtype), bitmask [S, W] int32, rows [S] int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, use_triton


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, vocab, num_words, stride_logits, stride_mask,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(rows_ptr + s)
    if row < 0:
        return
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    words = cols // 32
    word = tl.load(bitmask_ptr + s.to(tl.int64) * stride_mask + words,
                   mask=(cols < vocab) & (words < num_words), other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row.to(tl.int64) * stride_logits + cols,
             tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=(cols < vocab) & ~allowed)


def apply_token_bitmask_triton(logits: Tensor, bitmask: Tensor, rows: Tensor,
                               block: int = 1024) -> Tensor:
    """Triton launcher of `apply_token_bitmask` (one launch for every masked row)."""
    num_masks = bitmask.shape[0]
    if num_masks == 0:
        return logits
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1, "rows must be contiguous"
    vocab = logits.shape[1]
    _apply_bitmask_kernel[(num_masks, cdiv(vocab, block))](
        logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0),
        BLOCK=block,
    )
    return logits


def apply_token_bitmask_reference(logits: Tensor, bitmask: Tensor, rows: Tensor) -> Tensor:
    """Torch reference of `apply_token_bitmask`."""
    keep = rows >= 0
    if not bool(keep.any()):
        return logits
    vocab = logits.shape[1]
    masks, targets = bitmask[keep], rows[keep].long()
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (masks.unsqueeze(-1) >> shifts) & 1  # [S, W, 32]
    allowed = bits.reshape(masks.shape[0], -1).bool()  # [S, 32 W]
    if allowed.shape[1] < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool,
                          device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    sel = logits[targets]
    logits[targets] = sel.masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> Tensor:
    """Sets logits[rows[s], t] = -inf wherever bitmask row s forbids token t; in place,
    returns `logits`."""
    if use_triton(logits):
        return apply_token_bitmask_triton(logits, bitmask, rows)
    return apply_token_bitmask_reference(logits, bitmask, rows)

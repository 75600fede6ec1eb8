"""Sampled tokens into the device token table (the runner's persistent per-request table that
input preparation reads the next step's tokens from):

  token_table[rows[b], positions[b]] = tokens[b]   for rows[b] >= 0 and positions[b] < L

A row whose request just reached max_model_len (position L) keeps no next token; padding rows
(-1) write nothing. One launch, no host arrays: a decode CUDA graph runs it on its own
idx_mapping and seq_lens, right after the greedy argmax.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton


@triton.jit
def _write_tokens_kernel(table_ptr, rows_ptr, pos_ptr, tok_ptr, n, width, stride_row,
                         BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = b < n
    r = tl.load(rows_ptr + b, mask=m, other=-1)
    p = tl.load(pos_ptr + b, mask=m, other=0)
    tok = tl.load(tok_ptr + b, mask=m, other=0)
    ok = m & (r >= 0) & (p < width)
    tl.store(table_ptr + tl.maximum(r, 0).to(tl.int64) * stride_row + p, tok.to(tl.int32),
             mask=ok)


def write_tokens_triton(table: Tensor, rows: Tensor, positions: Tensor, tokens: Tensor) -> None:
    """Triton launcher of `write_tokens`."""
    n = rows.shape[0]
    if n == 0:
        return
    block = min(next_pow2(n), 1024)
    _write_tokens_kernel[(cdiv(n, block),)](
        table, rows, positions, tokens, n, table.shape[1], table.stride(0), BLOCK=block,
    )


def write_tokens_ref(table: Tensor, rows: Tensor, positions: Tensor, tokens: Tensor) -> None:
    """Torch reference of `write_tokens`."""
    r, p = rows.long(), positions.long()
    ok = (r >= 0) & (p < table.shape[1])
    table[r[ok], p[ok]] = tokens[: len(rows)][ok].to(table.dtype)


def write_tokens(table: Tensor, rows: Tensor, positions: Tensor, tokens: Tensor) -> None:
    """table int32 [R, L]; rows int32 [B] (-1 = padding); positions int32/int64 [B]; tokens
    int32/int64 [>= B]: writes each live row's token at its position, in place."""
    if use_triton(table):
        write_tokens_triton(table, rows, positions, tokens)
    else:
        write_tokens_ref(table, rows, positions, tokens)

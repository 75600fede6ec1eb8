"""Sampled tokens into the device token table (the runner's persistent per-request table that
input preparation reads the next step's tokens from):

  token_table[rows[b], positions[b]] = tokens[b]   for rows[b] >= 0 and positions[b] < L

A row whose request just reached max_model_len (position L) keeps no next token; padding rows
(-1) write nothing. One launch, no host arrays: a decode CUDA graph runs it on its own
idx_mapping and seq_lens, right after the greedy argmax.

`write_drafts`: a draft model's k drafts a row after the row's last token, in one launch:

  token_table[rows[p], last[p] + 1 + q] = drafts[p, q]   for q < k, rows[p] >= 0, position < L
"""

from __future__ import annotations

import torch
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


@triton.jit
def _write_drafts_kernel(table_ptr, rows_ptr, last_ptr, drafts_ptr, k, width, stride_row,
                         stride_d, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    r = tl.load(rows_ptr + p)
    start = tl.load(last_ptr + p) + 1
    q = tl.arange(0, BLOCK_K)
    tok = tl.load(drafts_ptr + p * stride_d + q, mask=q < k, other=0)
    ok = (q < k) & (r >= 0) & (start + q < width)
    tl.store(table_ptr + tl.maximum(r, 0).to(tl.int64) * stride_row + start + q,
             tok.to(tl.int32), mask=ok)


def write_drafts_ref(table: Tensor, rows: Tensor, last: Tensor, drafts: Tensor, k: int) -> None:
    """Torch reference of `write_drafts`."""
    n = rows.shape[0]
    pos = last[:n].long()[:, None] + 1 + torch.arange(k, device=table.device)  # [P, k]
    r = rows.long()[:, None].expand(n, k)
    ok = (r >= 0) & (pos < table.shape[1])
    table[r[ok], pos[ok]] = drafts[:n, :k][ok].to(table.dtype)


def write_drafts(table: Tensor, rows: Tensor, last: Tensor, drafts: Tensor, k: int) -> None:
    """table int32 [R, L]; rows int32/int64 [P] (-1 = padding); last int [>= P] (each row's
    last token's position); drafts int [>= P, >= k] (row-contiguous): writes row p's k drafts
    after its last token, in place."""
    n = rows.shape[0]
    if n == 0 or k == 0:
        return
    if use_triton(table):
        _write_drafts_kernel[(n,)](table, rows, last, drafts, k, table.shape[1], table.stride(0),
                                   drafts.stride(0), BLOCK_K=next_pow2(k))
    else:
        write_drafts_ref(table, rows, last, drafts, k)

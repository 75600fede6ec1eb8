"""Asynchronous speculative steps: the device keeps each request's rejected positions, so the
host can plan the next step before it knows how many drafts were accepted.

The host's counters of a request (its token and computed counts) run ahead: a verify step of
1 + d positions advances them by 1 + d, as if every draft were accepted. On the device,
`rejected[i]` sums, over all of request row i's steps, the positions that turned out not to be
accepted; the host keeps `known[i]`, the part of that sum it has read back and subtracted from
its counters. The true counters are the host's minus (rejected - known).

`apply_rejections`: the step's per-row inputs (computed counts, sequence lengths; host values)
corrected in place on the device; `delta[b]` keeps each row's correction.

  d = rejected[idx[b]] - known[b]  (0 for idx[b] == -1);  computed[b] -= d;  seq_lens[b] -= d

`commit_sampled`: after sampling, each sampling row s (request row rows[s]) writes its tokens at
their true positions and records its rejections:

  p = start[s] - delta[s];  table[rows[s], p + q] = tokens[s, q]  for q < num_sampled[s], p + q < L
  (delta None: start is the true position already, p = start[s])
  rejected[rows[s]] += num_positions[s] - num_sampled[s];  next_len[s] = p + num_sampled[s]

(`start`: the host's position of the first sampled token; `num_positions`: the tokens the row
might have produced, 1 + its drafts; `next_len`: the row's true token count after the step.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton


@triton.jit
def _apply_rejections_kernel(idx_ptr, known_ptr, rejected_ptr, computed_ptr, seq_lens_ptr,
                             delta_ptr, n, BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = b < n
    i = tl.load(idx_ptr + b, mask=m, other=-1)
    live = m & (i >= 0)
    d = tl.load(rejected_ptr + tl.maximum(i, 0), mask=live, other=0) - tl.load(
        known_ptr + b, mask=live, other=0)
    d = tl.where(live, d, 0)
    tl.store(computed_ptr + b, tl.load(computed_ptr + b, mask=m, other=0) - d, mask=m)
    tl.store(seq_lens_ptr + b, tl.load(seq_lens_ptr + b, mask=m, other=0) - d, mask=m)
    tl.store(delta_ptr + b, d, mask=m)


def apply_rejections_triton(idx: Tensor, known: Tensor, rejected: Tensor, computed: Tensor,
                            seq_lens: Tensor, delta: Tensor) -> None:
    n = idx.shape[0]
    if n == 0:
        return
    block = min(next_pow2(n), 1024)
    _apply_rejections_kernel[(cdiv(n, block),)](idx, known, rejected, computed, seq_lens, delta,
                                                n, BLOCK=block)


def apply_rejections_ref(idx: Tensor, known: Tensor, rejected: Tensor, computed: Tensor,
                         seq_lens: Tensor, delta: Tensor) -> None:
    live = idx >= 0
    d = torch.where(live, rejected[idx.long().clamp(min=0)] - known, 0).to(torch.int32)
    computed -= d
    seq_lens -= d
    delta.copy_(d)


def apply_rejections(idx: Tensor, known: Tensor, rejected: Tensor, computed: Tensor,
                     seq_lens: Tensor, delta: Tensor) -> None:
    """idx int32 [B] (-1 = padding), known int32 [B], rejected int32 [R]; computed, seq_lens
    int32 [B] corrected in place; delta int32 [B] out (see the module docstring)."""
    if use_triton(idx):
        apply_rejections_triton(idx, known, rejected, computed, seq_lens, delta)
    else:
        apply_rejections_ref(idx, known, rejected, computed, seq_lens, delta)


@triton.jit
def _commit_sampled_kernel(table_ptr, rejected_ptr, rows_ptr, start_ptr, delta_ptr, tok_ptr,
                           nsamp_ptr, npos_ptr, next_ptr, width, stride_row, stride_tok,
                           HAS_NSAMP: tl.constexpr, HAS_DELTA: tl.constexpr,
                           BLOCK: tl.constexpr):
    s = tl.program_id(0)
    i = tl.load(rows_ptr + s)
    p = tl.load(start_ptr + s)
    if HAS_DELTA:
        p -= tl.load(delta_ptr + s)
    if HAS_NSAMP:
        m = tl.load(nsamp_ptr + s)
    else:
        m = 1
    q = tl.arange(0, BLOCK)
    tok = tl.load(tok_ptr + s * stride_tok + q, mask=q < m, other=0)
    ok = (q < m) & (p + q < width) & (i >= 0)
    tl.store(table_ptr + tl.maximum(i, 0).to(tl.int64) * stride_row + p + q, tok.to(tl.int32),
             mask=ok)
    if i >= 0:
        r = tl.load(rejected_ptr + i)
        tl.store(rejected_ptr + i, r + tl.load(npos_ptr + s) - m)
    tl.store(next_ptr + s, p + m)


def commit_sampled_triton(table: Tensor, rejected: Tensor, rows: Tensor, start: Tensor,
                          delta: Tensor | None, tokens: Tensor, num_sampled: Tensor | None,
                          num_positions: Tensor, next_len: Tensor) -> None:
    n = rows.shape[0]
    if n == 0:
        return
    tokens = tokens.reshape(n, -1)
    _commit_sampled_kernel[(n,)](
        table, rejected, rows, start, delta if delta is not None else start, tokens,
        num_sampled if num_sampled is not None else rows, num_positions, next_len,
        table.shape[1], table.stride(0), tokens.stride(0),
        HAS_NSAMP=num_sampled is not None, HAS_DELTA=delta is not None, BLOCK=next_pow2(max(tokens.shape[1], 1)),
    )


def commit_sampled_ref(table: Tensor, rejected: Tensor, rows: Tensor, start: Tensor,
                       delta: Tensor | None, tokens: Tensor, num_sampled: Tensor | None,
                       num_positions: Tensor, next_len: Tensor) -> None:
    n = rows.shape[0]
    if n == 0:
        return
    tokens = tokens.reshape(n, -1)
    m = (num_sampled if num_sampled is not None
         else torch.ones(n, dtype=torch.int32, device=rows.device)).long()
    p = (start if delta is None else start - delta).long()
    q = torch.arange(tokens.shape[1], device=rows.device)
    pos = p[:, None] + q  # [n, N]
    r = rows.long()
    ok = (q < m[:, None]) & (pos < table.shape[1]) & (r[:, None] >= 0)
    rr = r[:, None].expand_as(pos)
    table[rr[ok], pos[ok]] = tokens[ok].to(table.dtype)
    live = r >= 0
    rejected.index_add_(0, r[live], (num_positions.long() - m)[live].to(rejected.dtype))
    next_len.copy_((p + m).to(next_len.dtype))


def commit_sampled(table: Tensor, rejected: Tensor, rows: Tensor, start: Tensor,
                   delta: Tensor | None, tokens: Tensor, num_sampled: Tensor | None, num_positions: Tensor,
                   next_len: Tensor) -> None:
    """table int32 [R, L]; rejected int32 [R]; rows, delta int32 [S]; start, num_positions int32
    or int64 [S]; tokens int [S, N] (or [S] with num_sampled None: one token a row);
    num_sampled int32 [S]; next_len int32 [S] out. `delta` None: `start` holds the true
    positions. Rows must be distinct (see the module docstring)."""
    if use_triton(table):
        commit_sampled_triton(table, rejected, rows, start, delta, tokens, num_sampled,
                              num_positions, next_len)
    else:
        commit_sampled_ref(table, rejected, rows, start, delta, tokens, num_sampled,
                           num_positions, next_len)

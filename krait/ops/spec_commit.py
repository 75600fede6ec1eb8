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

`commit_greedy`: a verify step of plain greedy rows, after the forward, in one launch: each
sampling row's greedy acceptance (krait/ops/greedy_accept.py, its drafts read from the step's
input ids after its first verified token), its commit as above (its true start: the prepared
position of that token + 1) and its next ngram drafts (krait/ops/ngram_propose.py; none with
k = 0, found 0: the draft model drafts after it), into one int64 [S, max_n + 2] result: the
row's tokens (-1 past its outputs), num_sampled, found.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton
from krait.ops.greedy_accept import greedy_accept_ref
from krait.ops.ngram_propose import ngram_propose_ref, ngram_row


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


@triton.jit
def _commit_greedy_kernel(table_ptr, rejected_ptr, idx_ptr, brow_ptr, first_ptr, lrow_ptr,
                          npos_ptr, ids_ptr, pos_ptr, target_ptr, out_ptr, width, stride_row,
                          max_n, k, min_n, MAX_N: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, NGRAM: tl.constexpr):
    s = tl.program_id(0)
    i = tl.load(idx_ptr + tl.load(brow_ptr + s))
    first = tl.load(first_ptr + s)  # the row's first verified token in the batch
    lrow = tl.load(lrow_ptr + s)  # and its logits row
    npos = tl.load(npos_ptr + s)
    nd = npos - 1
    j = tl.arange(0, BLOCK_N)
    t = tl.load(target_ptr + lrow + j, mask=j <= nd, other=-1)
    d = tl.load(ids_ptr + first + 1 + j, mask=j < nd, other=-2)
    stop = tl.min(tl.where((j < nd) & (d == t), BLOCK_N, j), axis=0)  # accepted drafts
    m = stop + 1
    out = out_ptr + s.to(tl.int64) * (max_n + 2)
    tl.store(out + j, tl.where(j <= stop, t, -1), mask=j < max_n)
    tl.store(out + max_n, m.to(tl.int64))
    found = 0
    if i >= 0:
        base = table_ptr + i.to(tl.int64) * stride_row
        p = tl.load(pos_ptr + first) + 1
        tl.store(base + p + j, t.to(tl.int32), mask=(j < m) & (p + j < width))
        tl.store(rejected_ptr + i, tl.load(rejected_ptr + i) + npos - m)
        if NGRAM:  # (k = 0: another drafter drafts after this launch)
            tl.debug_barrier()  # the committed tokens, visible to the drafter's loads below
            found = ngram_row(base, (p + m).to(tl.int32), width, k, min_n, MAX_N, BLOCK,
                              BLOCK_K)
    tl.store(out + max_n + 1, found)  # (stored as int64)


def commit_greedy_triton(table: Tensor, rejected: Tensor, idx_mapping: Tensor, batch_rows: Tensor,
                         firsts: Tensor, logits_rows: Tensor, num_positions: Tensor,
                         input_ids: Tensor, positions: Tensor, target: Tensor, max_n: int,
                         k: int, min_n: int, max_ngram: int) -> Tensor:
    num_rows = batch_rows.shape[0]
    out = torch.empty(num_rows, max_n + 2, dtype=torch.int64, device=table.device)
    if num_rows:
        _commit_greedy_kernel[(num_rows,)](
            table, rejected, idx_mapping, batch_rows, firsts, logits_rows, num_positions,
            input_ids, positions, target, out, table.shape[1], table.stride(0), max_n, k,
            min_n, MAX_N=max_ngram, BLOCK_N=next_pow2(max_n), BLOCK=256,
            BLOCK_K=next_pow2(max(k, 1)), NGRAM=k > 0,
        )
    return out


def commit_greedy_ref(table: Tensor, rejected: Tensor, idx_mapping: Tensor, batch_rows: Tensor,
                      firsts: Tensor, logits_rows: Tensor, num_positions: Tensor,
                      input_ids: Tensor, positions: Tensor, target: Tensor, max_n: int,
                      k: int, min_n: int, max_ngram: int) -> Tensor:
    num_rows = batch_rows.shape[0]
    nd = num_positions.long() - 1
    # the drafts, packed: row s's after its first verified token
    at = firsts.long().repeat_interleave(nd) + 1 + (
        torch.arange(int(nd.sum()), device=table.device)
        - (torch.cumsum(nd, 0) - nd).repeat_interleave(nd))
    # greedy_accept reads row s's logits at firsts[s] on and its drafts at firsts[s] - s on
    lrows = logits_rows.long()
    tokens, num_sampled = greedy_accept_ref(
        target[lrows.repeat_interleave(nd + 1) + _ranks(nd + 1)], input_ids[at],
        torch.cumsum(nd + 1, 0) - (nd + 1), nd, max_n)
    rows = idx_mapping[batch_rows.long()]
    next_len = torch.empty(num_rows, dtype=torch.int32, device=table.device)
    commit_sampled_ref(table, rejected, rows, positions[firsts.long()] + 1, None, tokens,
                       num_sampled, num_positions, next_len)
    found = torch.zeros(num_rows, dtype=torch.int32, device=table.device)
    if k:
        ngram_propose_ref(table, rows, next_len, found, k, min_n, max_ngram)
    return torch.cat([tokens, num_sampled[:, None], found[:, None]], dim=1)


def _ranks(counts: Tensor) -> Tensor:
    """0 .. counts[s] - 1 for each s, packed."""
    return torch.arange(int(counts.sum()), device=counts.device) - (
        torch.cumsum(counts, 0) - counts).repeat_interleave(counts)


def commit_greedy(table: Tensor, rejected: Tensor, idx_mapping: Tensor, batch_rows: Tensor,
                  firsts: Tensor, logits_rows: Tensor, num_positions: Tensor, input_ids: Tensor,
                  positions: Tensor, target: Tensor, max_n: int, k: int, min_n: int,
                  max_ngram: int) -> Tensor:
    """Plain greedy verify rows, after the forward (see the module docstring).

    table int32 [R, L]; rejected int32 [R]; idx_mapping int32 [B]; batch_rows, firsts,
    logits_rows, num_positions int64 [S] (each sampling row's batch row, first verified token,
    its logits row, 1 + its drafts); input_ids, positions int64 [tokens] (the step's prepared
    inputs); target int64 [T] (the argmax of every logits row); max_n >= max num_positions;
    k drafts, ngram sizes min_n..max_ngram. Returns int64 [S, max_n + 2]. Rows distinct."""
    fn = commit_greedy_triton if use_triton(table) else commit_greedy_ref
    return fn(table, rejected, idx_mapping, batch_rows, firsts, logits_rows, num_positions,
              input_ids, positions, target, max_n, k, min_n, max_ngram)

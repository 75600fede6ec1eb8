"""Prompt-lookup drafts on the device, written into the token table after each row's tokens.

For request row i = rows[s] with n = num_tokens[s] tokens table[i, :n]: the candidates are the
positions e < n - 1 (a token follows them); a candidate's match length is the largest l <=
max_n with table[i, e - j] == table[i, n - 1 - j] for every j < l (e - j >= 0). Among the
candidates with l >= min_n the longest wins, then the most recent (largest e) — the host
drafter's rule (krait/runner/spec_decode/ngram.py). Its k drafts are the tokens after it,
continued periodically past the row's end: table[i, e + 1 + q % (n - e - 1)]. A row without a
match (or with fewer than min_n + 1 tokens) drafts its last token k times: any draft is
lossless, and a verify graph needs k of them. Drafts go to table[i, n + q] (those < L);
counts[s] says whether they came from a match (k) or not (0).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import next_pow2, use_triton


@triton.jit
def ngram_row(base, n, width, k, min_n, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One row's drafts (`base`: its table row, n >= 1 tokens): writes them after its tokens
    and returns k if they came from a match, else 0. Also called by spec_commit's fused
    greedy kernel, after it commits the row's tokens."""
    found = 0
    best = tl.full([BLOCK], -1, tl.int64)
    for e0 in range(0, n - 1, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        run = e < n - 1
        length = tl.zeros([BLOCK], tl.int32)
        for j in tl.static_range(MAX_N):
            last = tl.load(base + n - 1 - j, mask=n - 1 - j >= 0, other=-1)
            ok = run & (e - j >= 0)
            t = tl.load(base + e - j, mask=ok, other=-2)
            run = ok & (t == last)
            length += run.to(tl.int32)
        key = tl.where(length >= min_n, length.to(tl.int64) * (1 << 40) + e, -1)
        best = tl.maximum(best, key)
    top = tl.max(best, axis=0)
    q = tl.arange(0, BLOCK_K)
    if top >= 0:
        found = k
        start = (top % (1 << 40)).to(tl.int32) + 1
        src = start + q % (n - start)
    else:
        src = q * 0 + n - 1
    d = tl.load(base + src, mask=q < k, other=0)
    tl.store(base + n + q, d, mask=(q < k) & (n + q < width))
    return found


@triton.jit
def _ngram_propose_kernel(table_ptr, rows_ptr, ntok_ptr, counts_ptr, width, stride_row, k, min_n,
                          MAX_N: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    s = tl.program_id(0)
    i = tl.load(rows_ptr + s)
    n = tl.load(ntok_ptr + s)
    found = 0
    if i >= 0 and n >= 1:
        found = ngram_row(table_ptr + i.to(tl.int64) * stride_row, n, width, k, min_n,
                          MAX_N, BLOCK, BLOCK_K)
    tl.store(counts_ptr + s, found)


def ngram_propose_triton(table: Tensor, rows: Tensor, num_tokens: Tensor, counts: Tensor, k: int,
                         min_n: int, max_n: int) -> None:
    if rows.shape[0] == 0 or k == 0:
        counts.zero_()
        return
    _ngram_propose_kernel[(rows.shape[0],)](
        table, rows, num_tokens, counts, table.shape[1], table.stride(0), k, min_n,
        MAX_N=max_n, BLOCK=256, BLOCK_K=next_pow2(k),
    )


def ngram_propose_ref(table: Tensor, rows: Tensor, num_tokens: Tensor, counts: Tensor, k: int,
                      min_n: int, max_n: int) -> None:
    width = table.shape[1]
    counts.zero_()
    for s, (i, n) in enumerate(zip(rows.tolist(), num_tokens.tolist())):
        if i < 0 or n < 1 or k == 0:
            continue
        row = table[i, :n].tolist()
        best = None
        for e in range(n - 1):
            length = 0
            while length < max_n and e - length >= 0 and row[e - length] == row[n - 1 - length]:
                length += 1
            if length >= min_n and (best is None or length >= best[0]):
                best = (length, e)
        if best is None:
            drafts = [row[n - 1]] * k
        else:
            counts[s] = k
            start = best[1] + 1
            drafts = [row[start + q % (n - start)] for q in range(k)]
        for q, d in enumerate(drafts):
            if n + q < width:
                table[i, n + q] = d


def ngram_propose(table: Tensor, rows: Tensor, num_tokens: Tensor, counts: Tensor, k: int,
                  min_n: int, max_n: int) -> None:
    """table int32 [R, L]; rows int32 [S] (-1 = skip); num_tokens int32 [S]; counts int32 [S]
    out: writes each row's k drafts after its tokens, in place (see the module docstring)."""
    if use_triton(table):
        ngram_propose_triton(table, rows, num_tokens, counts, k, min_n, max_n)
    else:
        ngram_propose_ref(table, rows, num_tokens, counts, k, min_n, max_n)

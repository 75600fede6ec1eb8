"""Greedy verification of draft tokens in one launch (the rejection sampler's all-greedy path).

Row r scores n_r = 1 + k_r consecutive positions, its logits rows firsts[r] .. firsts[r] + k_r
(packed in row order), its drafts at draft_token_ids[firsts[r] - r ...] (packed likewise). A
draft is accepted while it equals the target's argmax at its position; the row's outputs are
the argmax at positions 0 .. a (a = its accepted drafts: accepted drafts equal the argmax there,
and position a draws the argmax), -1 after:

  a = the leading run of j < k_r with draft[j] == target[firsts[r] + j]
  tokens[r, j] = target[firsts[r] + j] for j <= a, else -1;  num_sampled[r] = a + 1

This is what `RejectionSampler.forward` computes for all-greedy rows without bans, penalties
or logprobs, in ~18 small torch ops (the reference below is that path's arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import next_pow2, use_triton


@triton.jit
def _greedy_accept_kernel(target_ptr, drafts_ptr, firsts_ptr, ndraft_ptr, tok_ptr, nsamp_ptr,
                          max_n, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    first = tl.load(firsts_ptr + r)
    k = tl.load(ndraft_ptr + r)
    j = tl.arange(0, BLOCK)
    t = tl.load(target_ptr + first + j, mask=j <= k, other=-1)
    d = tl.load(drafts_ptr + first - r + j, mask=j < k, other=-2)
    # the first position that is not an accepted draft (k when every draft is accepted)
    stop = tl.min(tl.where((j < k) & (d == t), BLOCK, j), axis=0)
    tl.store(tok_ptr + r.to(tl.int64) * max_n + j, tl.where(j <= stop, t, -1), mask=j < max_n)
    tl.store(nsamp_ptr + r, (stop + 1).to(tl.int32))


def greedy_accept_triton(target: Tensor, draft_token_ids: Tensor, firsts: Tensor,
                         num_drafts: Tensor, max_n: int) -> tuple[Tensor, Tensor]:
    num_rows = firsts.shape[0]
    tokens = torch.empty(num_rows, max_n, dtype=torch.int64, device=target.device)
    num_sampled = torch.empty(num_rows, dtype=torch.int32, device=target.device)
    if num_rows:
        _greedy_accept_kernel[(num_rows,)](target, draft_token_ids, firsts, num_drafts, tokens,
                                           num_sampled, max_n, BLOCK=next_pow2(max_n))
    return tokens, num_sampled


def greedy_accept_ref(target: Tensor, draft_token_ids: Tensor, firsts: Tensor,
                      num_drafts: Tensor, max_n: int) -> tuple[Tensor, Tensor]:
    num_rows = firsts.shape[0]
    j = torch.arange(max_n, device=target.device)  # [max_n]
    k = num_drafts.long().unsqueeze(1)  # [R, 1]
    r = torch.arange(num_rows, device=target.device).unsqueeze(1)  # [R, 1]
    at = (firsts.long().unsqueeze(1) + j).clamp_(max=max(target.shape[0] - 1, 0))  # [R, max_n]
    t = target[at] if target.numel() else torch.zeros_like(at)
    d_at = (at - r).clamp_(0, max(draft_token_ids.shape[0] - 1, 0))
    d = draft_token_ids[d_at] if draft_token_ids.numel() else torch.full_like(at, -2)
    accepted = ((d == t) & (j < k)).to(torch.int32)  # [R, max_n]
    stop = accepted.cumprod(dim=1).sum(dim=1)  # [R] the leading run
    tokens = torch.where(j <= stop.unsqueeze(1), t, -1)
    return tokens, (stop + 1).to(torch.int32)


def greedy_accept(target: Tensor, draft_token_ids: Tensor, firsts: Tensor, num_drafts: Tensor,
                  max_n: int) -> tuple[Tensor, Tensor]:
    """target int64 [T] (the argmax at every logits row); draft_token_ids int64 [sum k_r];
    firsts, num_drafts int64 [R] (each row's first logits row and k_r); max_n >= 1 + max k_r.
    Returns (tokens int64 [R, max_n], num_sampled int32 [R]) (see the module docstring)."""
    if use_triton(target):
        return greedy_accept_triton(target, draft_token_ids, firsts, num_drafts, max_n)
    return greedy_accept_ref(target, draft_token_ids, firsts, num_drafts, max_n)

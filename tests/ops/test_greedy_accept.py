"""Greedy verification in one launch (krait/ops/greedy_accept.py): the Triton kernel and the
reference against a per-row loop, and the rejection sampler's greedy path against its
general path (the same tokens and counts)."""

import numpy as np
import pytest
import torch

from krait.ops.greedy_accept import greedy_accept_ref, greedy_accept_triton


def _rows(seed: int, num_rows: int, max_k: int, vocab: int = 5):
    """Drafts that often equal the argmax (a small vocabulary), k_r in 0..max_k."""
    g = np.random.default_rng(seed)
    k = g.integers(0, max_k + 1, size=num_rows)
    firsts = np.concatenate([[0], np.cumsum(k + 1)[:-1]]).astype(np.int64)
    target = g.integers(0, vocab, size=int((k + 1).sum()))
    drafts = g.integers(0, vocab, size=int(k.sum()))
    return target, drafts, firsts, k


def _loop(target, drafts, firsts, k, max_n):
    tokens = np.full((len(k), max_n), -1, dtype=np.int64)
    num_sampled = np.zeros(len(k), dtype=np.int32)
    for r in range(len(k)):
        a = 0
        while a < k[r] and drafts[firsts[r] - r + a] == target[firsts[r] + a]:
            a += 1
        tokens[r, : a + 1] = target[firsts[r] : firsts[r] + a + 1]
        num_sampled[r] = a + 1
    return tokens, num_sampled


@pytest.mark.parametrize("impl", [greedy_accept_ref, greedy_accept_triton], ids=["ref", "triton"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_accept_takes_the_leading_run_of_argmax_drafts(impl, seed):
    target, drafts, firsts, k = _rows(seed, num_rows=7, max_k=4)
    max_n = int(k.max()) + 1 + seed % 2  # (a wider output than needed is padded with -1)
    tokens, num_sampled = impl(torch.from_numpy(target), torch.from_numpy(drafts),
                               torch.from_numpy(firsts), torch.from_numpy(k), max_n)
    want_tokens, want_n = _loop(target, drafts, firsts, k, max_n)
    assert tokens.dtype == torch.int64 and num_sampled.dtype == torch.int32
    assert tokens.tolist() == want_tokens.tolist()
    assert num_sampled.tolist() == want_n.tolist()


def test_rejection_sampler_greedy_path_equals_its_general_path():
    """The one-launch path (all greedy, plain, no logprobs) and `_verify`'s (taken when
    logprobs are asked for) give the same tokens and counts."""
    from krait.runner.sampler import greedy_sampling_metadata
    from krait.runner.spec_decode.rejection_sampler import RejectionSampler

    g = torch.Generator().manual_seed(0)
    k = np.array([3, 0, 2, 3])
    logits = torch.randn(int((k + 1).sum()), 6, generator=g)
    drafts = torch.randint(0, 6, (int(k.sum()),), generator=g)
    argmax = logits.argmax(dim=-1)
    drafts[:3] = argmax[:3]  # row 0 accepts all its drafts
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(k + 1)]))
    meta = greedy_sampling_metadata(len(k), logits.device)
    fast = RejectionSampler()(logits, cu, drafts, None, meta, num_draft_tokens=k)
    meta.max_num_logprobs = 0
    general = RejectionSampler()(logits, cu, drafts, None, meta, num_draft_tokens=k)
    assert fast.output_token_ids.tolist() == general.output_token_ids.tolist()
    assert fast.num_sampled.tolist() == general.num_sampled.tolist()
    assert fast.num_sampled.tolist()[0] == 4

"""The device ops of asynchronous speculative steps: rejection bookkeeping, committing sampled
tokens at their true positions, and prompt-lookup drafts on the device."""

import numpy as np
import pytest
import torch

from krait.ops.ngram_propose import ngram_propose_ref, ngram_propose_triton
from krait.ops.spec_commit import (
    apply_rejections_ref,
    apply_rejections_triton,
    commit_sampled_ref,
    commit_sampled_triton,
)
from krait.runner.spec_decode.ngram import NgramProposer

I32 = torch.int32


@pytest.mark.parametrize("impl", [apply_rejections_ref, apply_rejections_triton],
                         ids=["ref", "triton"])
def test_apply_rejections_corrects_live_rows_and_skips_padding(impl):
    rejected = torch.tensor([5, 0, 9, 2], dtype=I32)
    idx = torch.tensor([2, -1, 0, 3], dtype=I32)
    known = torch.tensor([6, 4, 5, 2], dtype=I32)  # row 1 is padding: its known is ignored
    computed = torch.tensor([10, 0, 20, 30], dtype=I32)
    seq_lens = torch.tensor([14, 1, 21, 31], dtype=I32)
    delta = torch.full((4,), -7, dtype=I32)
    impl(idx, known, rejected, computed, seq_lens, delta)
    assert delta.tolist() == [3, 0, 0, 0]
    assert computed.tolist() == [7, 0, 20, 30]
    assert seq_lens.tolist() == [11, 1, 21, 31]


@pytest.mark.parametrize("impl", [commit_sampled_ref, commit_sampled_triton], ids=["ref", "triton"])
def test_commit_sampled_writes_true_positions_and_counts_rejections(impl):
    table = torch.zeros(3, 10, dtype=I32)
    rejected = torch.tensor([1, 0, 0], dtype=I32)
    rows = torch.tensor([0, 2, 1], dtype=I32)
    start = torch.tensor([5, 8, 2], dtype=I32)  # the host's (optimistic) positions
    delta = torch.tensor([1, 0, 0], dtype=I32)  # row 0 had one rejection the host missed
    tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    num_sampled = torch.tensor([2, 4, 1], dtype=I32)
    num_positions = torch.tensor([4, 4, 1], dtype=I32)  # row 1: a prefill row's one token
    next_len = torch.zeros(3, dtype=I32)
    impl(table, rejected, rows, start, delta, tokens, num_sampled, num_positions, next_len)
    assert table[0].tolist() == [0, 0, 0, 0, 11, 12, 0, 0, 0, 0]
    assert table[2].tolist() == [0] * 8 + [21, 22]  # past max_model_len: dropped
    assert table[1].tolist() == [0, 0, 31] + [0] * 7
    assert rejected.tolist() == [1 + 2, 0, 0]
    assert next_len.tolist() == [6, 12, 3]


@pytest.mark.parametrize("impl", [commit_sampled_ref, commit_sampled_triton], ids=["ref", "triton"])
def test_commit_sampled_one_token_rows(impl):
    table = torch.zeros(2, 6, dtype=I32)
    rejected = torch.zeros(2, dtype=I32)
    rows = torch.tensor([1, 0], dtype=I32)
    next_len = torch.zeros(2, dtype=I32)
    impl(table, rejected, rows, torch.tensor([3, 0], dtype=I32), torch.tensor([1, 0], dtype=I32),
         torch.tensor([7, 8]), None, torch.ones(2, dtype=I32), next_len)
    assert table.tolist() == [[8, 0, 0, 0, 0, 0], [0, 0, 7, 0, 0, 0]]
    assert rejected.tolist() == [0, 0] and next_len.tolist() == [3, 1]


@pytest.mark.parametrize("impl", [commit_sampled_ref, commit_sampled_triton], ids=["ref", "triton"])
def test_commit_sampled_takes_true_int64_positions_without_delta(impl):
    """delta None: start holds the true positions (the runner's: the positions the device
    prepared, + 1), int64 as prepare_inputs makes them."""
    table = torch.zeros(2, 8, dtype=I32)
    rejected = torch.tensor([2, 0], dtype=I32)
    rows = torch.tensor([1, 0], dtype=I32)
    start = torch.tensor([6, 1], dtype=torch.int64)
    tokens = torch.tensor([[11, 12, 13], [21, 22, 23]])
    next_len = torch.zeros(2, dtype=I32)
    impl(table, rejected, rows, start, None, tokens, torch.tensor([3, 1], dtype=I32),
         torch.tensor([3, 3], dtype=I32), next_len)
    assert table.tolist() == [[0, 21, 0, 0, 0, 0, 0, 0], [0] * 6 + [11, 12]]
    assert rejected.tolist() == [2 + 2, 0] and next_len.tolist() == [9, 2]


def _random_rows(seed: int, num_rows: int, width: int, vocab: int):
    g = np.random.default_rng(seed)
    table = g.integers(0, vocab, size=(num_rows, width)).astype(np.int32)
    for r in range(0, num_rows, 3):  # some rows repeat a phrase, as the bench workload does
        period = int(g.integers(1, 6))
        table[r, 4:] = np.resize(table[r, :period], width - 4)
    n = g.integers(1, width - 4, size=num_rows).astype(np.int32)
    return table, n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_ngram_matches_the_host_drafter(seed):
    k, lo, hi = 3, 1, 4
    table, n = _random_rows(seed, 12, 48, vocab=4)
    host_drafts, host_counts = NgramProposer(k, lo, hi).propose(table, n, np.full(12, k))
    rows = torch.arange(12, dtype=I32)
    for impl in (ngram_propose_ref, ngram_propose_triton):
        t = torch.from_numpy(table.copy())
        counts = torch.full((12,), -1, dtype=I32)
        impl(t, rows, torch.from_numpy(n), counts, k, lo, hi)
        assert counts.tolist() == [k if c else 0 for c in host_counts.tolist()]
        for r in range(12):
            got = t[r, n[r] : n[r] + k].tolist()
            if host_counts[r]:
                assert got == host_drafts[r, :k].tolist(), (impl.__name__, r)
            else:  # no match: the last token again (the host proposes nothing)
                assert got == [int(table[r, n[r] - 1])] * k, (impl.__name__, r)
            assert t[r, : n[r]].tolist() == table[r, : n[r]].tolist()  # tokens untouched


def test_device_ngram_skips_padding_and_clips_at_the_table_end():
    t = torch.tensor([[1, 2, 1, 2, 1, 0], [5, 5, 5, 5, 5, 5]], dtype=I32)
    want = t.clone()
    want[0, 5] = 2  # "1 2 1" matched at 0..2: the next token 2; the rest is past the end
    counts = torch.full((2,), -1, dtype=I32)
    ngram_propose_triton(t, torch.tensor([0, -1], dtype=I32), torch.tensor([5, 3], dtype=I32),
                         counts, 3, 1, 3)
    assert t.tolist() == want.tolist()
    assert counts.tolist() == [3, 0]


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_write_drafts_after_each_rows_last_token(impl, monkeypatch):
    """A draft model's k drafts a row after the row's last (true) position: padding rows and
    positions past the table's end write nothing; the drafts tensor may be wider than k."""
    from krait.ops.write_tokens import write_drafts

    # "triton": the kernel through the interpreter on CPU tensors
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1" if impl == "triton" else "0")
    table = torch.zeros(3, 10, dtype=I32)
    rows = torch.tensor([2, -1, 0], dtype=I32)
    last = torch.tensor([3, 5, 7], dtype=torch.int64)
    drafts = torch.arange(1, 13, dtype=torch.int64).view(3, 4)  # [P, k + 1]
    write_drafts(table, rows, last, drafts, 3)
    assert table[2].tolist() == [0, 0, 0, 0, 1, 2, 3, 0, 0, 0]
    assert table[0].tolist() == [0] * 8 + [9, 10]  # q = 2 falls past the end
    assert table[1].tolist() == [0] * 10


@pytest.mark.parametrize("seed", range(3))
def test_commit_greedy_equals_its_ops_in_sequence(seed):
    """The fused kernel (greedy acceptance, commit at the true positions, the next ngram
    drafts) against its reference, which runs greedy_accept, commit_sampled and
    ngram_propose's references in turn: the same table, rejections and packed result. Rows:
    verify rows of 1 + k tokens (drafts right or wrong) and a prefill row's last token."""
    from krait.ops.spec_commit import commit_greedy_ref, commit_greedy_triton

    g = np.random.default_rng(seed)
    k, width = 3, 40
    table, n = _random_rows(seed, num_rows=5, width=width, vocab=6)
    # batch rows -> request rows (3: padding, here a "sampling" row too: it commits nothing)
    idx = torch.tensor([3, 0, 4, -1, 1], dtype=I32)
    counts = np.array([1 + k, 1 + k, 1, 1, 1 + k], dtype=np.int64)
    batch_rows = np.array([0, 1, 2, 3, 4])
    tokens_per_row = np.array([1 + k, 1 + k, 5, 1, 1 + k])
    qsl = np.concatenate([[0], np.cumsum(tokens_per_row)])
    firsts = np.array([qsl[0], qsl[1], qsl[3] - 1, qsl[3], qsl[4]])  # prefill row: last token
    logits_rows = np.concatenate([[0], np.cumsum(counts)[:-1]])
    positions = np.zeros(qsl[-1], dtype=np.int64)
    for b, (i, t) in enumerate(zip(idx.tolist(), tokens_per_row)):
        if i >= 0:  # the row's tokens end where its table row's do
            positions[qsl[b]: qsl[b] + t] = n[i] - t + np.arange(t)
    input_ids = torch.from_numpy(g.integers(0, 6, qsl[-1]))
    target = torch.from_numpy(g.integers(0, 6, int(counts.sum())))
    input_ids[1:1 + k] = target[:k]  # batch row 0 accepts every draft
    results = []
    for impl in (commit_greedy_ref, commit_greedy_triton):
        t = torch.from_numpy(table.copy())
        rejected = torch.tensor([0, 1, 0, 2, 0], dtype=I32)
        out = impl(t, rejected, idx, *(torch.from_numpy(a).long() for a in (
            batch_rows, firsts, logits_rows, counts)), input_ids, torch.from_numpy(positions),
            target, int(counts.max()), k, 1, 3)
        results.append((t.tolist(), rejected.tolist(), out.tolist()))
        # k = 0 (the draft model drafts after the launch): the same commit, no drafts
        t0 = torch.from_numpy(table.copy())
        rejected0 = torch.tensor([0, 1, 0, 2, 0], dtype=I32)
        out0 = impl(t0, rejected0, idx, *(torch.from_numpy(a).long() for a in (
            batch_rows, firsts, logits_rows, counts)), input_ids, torch.from_numpy(positions),
            target, int(counts.max()), 0, 1, 3)
        results.append((t0.tolist(), rejected0.tolist(), out0.tolist()))
    assert results[0] == results[2] and results[1] == results[3]
    out, out0 = results[0][2], results[1][2]
    assert results[0][1] == results[1][1]  # the rejections: the drafter's k plays no part
    assert [row[:-1] for row in out0] == [row[:-1] for row in out]
    assert all(row[-1] == 0 for row in out0)  # nothing found
    assert out[0][:k + 2] == target[: k + 1].tolist() + [k + 1]  # all accepted, then num_sampled
    assert [row[-2] for row in out][2] == 1  # the prefill row samples one token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
def test_commit_greedy_real_sizes_gpu(rows):
    """commit_greedy's kernel against its reference at a bench's sizes: 64 verify rows of
    1 + 3 tokens over a 2048-token table, half the drafts right."""
    from krait.ops.spec_commit import commit_greedy_ref, commit_greedy_triton

    k, width = 3, 2048
    table, n = _random_rows(1, num_rows=rows, width=width, vocab=151936)
    n = np.maximum(n, 8)
    per = 1 + k
    positions = (n[:, None] - 1 + np.arange(per)).reshape(-1)
    g = np.random.default_rng(2)
    target = g.integers(0, 151936, rows * per)
    input_ids = g.integers(0, 151936, rows * per)
    right = g.random(rows * per) < 0.5
    input_ids[1:][right[:-1]] = target[:-1][right[:-1]]
    dev = "cuda"
    args = [torch.arange(rows, dtype=I32, device=dev)] + [
        torch.from_numpy(a).long().to(dev) for a in (
            np.arange(rows), np.arange(rows) * per, np.arange(rows) * per,
            np.full(rows, per))] + [torch.from_numpy(a).to(dev) for a in (
                input_ids, positions, target)]
    results = []
    for impl in (commit_greedy_ref, commit_greedy_triton):
        t = torch.from_numpy(table).to(dev)
        rejected = torch.zeros(rows, dtype=I32, device=dev)
        out = impl(t, rejected, *args, per, k, 1, 3)
        results.append((t.cpu(), rejected.cpu(), out.cpu()))
    for a, b in zip(*results):
        assert torch.equal(a, b)

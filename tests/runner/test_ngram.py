"""Tests of krait.runner.spec_decode.ngram (prompt-lookup drafting)."""

from __future__ import annotations

import numpy as np
import pytest

from krait.runner.spec_decode.ngram import NgramProposer


def propose(seqs: list[list[int]], k: int, lo: int, hi: int, max_drafts=None, pad: int = 0):
    """Runs the proposer on `seqs` laid out in a wide table padded with `pad`."""
    width = max(len(s) for s in seqs) + 3
    table = np.full((len(seqs), width), pad, dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s)] = s
    lengths = np.array([len(s) for s in seqs])
    caps = np.full(len(seqs), k) if max_drafts is None else np.asarray(max_drafts)
    drafts, counts = NgramProposer(k, lo, hi).propose(table, lengths, caps)
    assert drafts.dtype == np.int32 and counts.dtype == np.int32
    assert drafts.shape == (len(seqs), k) and counts.shape == (len(seqs),)
    out = []
    for d, c in zip(drafts, counts):
        assert (d[c:] == -1).all()
        out.append(d[:c].tolist())
    return out


def reference(tokens: list[int], k: int, lo: int, hi: int, cap: int) -> list[int]:
    """The definition: the longest suffix n-gram (hi >= n >= lo) with an earlier occurrence,
    its most recent such occurrence, and the min(k, cap) tokens that followed it, continued
    periodically past the row's end."""
    cap = min(cap, k)
    if cap <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n :]
                return [follow[t % len(follow)] for t in range(cap)]
    return []


def test_repetition():
    assert propose([[1, 2, 3, 4, 1, 2, 3]], k=3, lo=1, hi=3) == [[4, 1, 2]]


def test_no_match():
    assert propose([[1, 2, 3, 4, 5]], k=3, lo=1, hi=3) == [[]]
    assert propose([[1, 2, 3, 1, 5]], k=3, lo=2, hi=3) == [[]]  # 1-grams do not count


def test_most_recent_occurrence_wins():
    # [5, 6] occurs at 0 and at 2: the one at 2 is taken; [5, 6] follows it, then again
    assert propose([[5, 6, 5, 6, 5, 6]], k=4, lo=2, hi=2) == [[5, 6, 5, 6]]
    assert propose([[1, 2, 8, 1, 2, 9, 1, 2]], k=1, lo=2, hi=2) == [[9]]


def test_match_near_the_end_continues_periodically():
    assert propose([[9, 9, 4, 1, 2, 7, 1, 2]], k=5, lo=2, hi=2) == [[7, 1, 2, 7, 1]]
    # the occurrence just before the suffix: the last token repeated
    assert propose([[3, 4, 4]], k=5, lo=1, hi=1) == [[4, 4, 4, 4, 4]]


def test_longer_ngrams_beat_more_recent_shorter_ones():
    seq = [1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3]
    assert propose([seq], k=3, lo=1, hi=3) == [[50, 9, 2]]  # the 3-gram at 0
    assert propose([seq], k=3, lo=1, hi=2) == [[60, 1, 2]]  # the 2-gram [2, 3] at 5
    assert propose([seq], k=3, lo=4, hi=5) == [[]]  # no 4-gram repeats
    assert propose([[1, 2, 3, 50, 1, 2, 3]], k=2, lo=2, hi=8) == [[50, 1]]  # the 3-gram


def test_short_rows_and_overlapping_occurrences():
    assert propose([[7]], k=3, lo=1, hi=3) == [[]]
    assert propose([[7, 7]], k=3, lo=1, hi=3) == [[7, 7, 7]]
    assert propose([[7, 7]], k=3, lo=2, hi=3) == [[]]  # a 2-gram needs an earlier copy
    assert propose([[1, 1, 1, 1]], k=3, lo=3, hi=3) == [[1, 1, 1]]  # overlaps the suffix


def test_max_drafts_caps():
    seq = [1, 2, 3, 4, 5, 1, 2]
    got = propose([seq] * 4, k=3, lo=2, hi=2, max_drafts=[0, 1, 2, 9])
    assert got == [[], [3], [3, 4], [3, 4, 5]]


def test_rows_of_different_lengths_ignore_the_padding():
    seqs = [[4, 5, 6, 4, 5], [1, 2, 1], [8, 0, 0, 8, 0], [3], [2, 2, 2, 2, 2, 2, 2, 2, 2]]
    # padding equal to some rows' last tokens: a match there would be wrong
    for pad in (0, 1, 5, -1):
        assert propose(seqs, k=3, lo=1, hi=2, pad=pad) == [
            [6, 4, 5], [2, 1, 2], [0, 8, 0], [], [2, 2, 2],
        ]


def test_zero_speculative_tokens():
    drafts, counts = NgramProposer(0, 1, 2).propose(
        np.array([[1, 1, 1]], dtype=np.int32), np.array([3]), np.array([4])
    )
    assert drafts.shape == (1, 0) and counts.tolist() == [0]


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        NgramProposer(3, 0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 1, 2).propose(np.zeros((1, 4), np.int32), np.array([5]), np.array([1]))


@pytest.mark.parametrize("vocab_range", [(2, 6), (20, 60)])  # dense and sparse candidates
@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 3), (2, 4), (3, 3), (1, 5)])
def test_matches_the_reference_on_random_rows(lo, hi, vocab_range):
    rng = np.random.default_rng(lo * 10 + hi + vocab_range[0])
    k = 4
    for _ in range(30):
        rows = int(rng.integers(1, 12))
        width = int(rng.integers(1, 80))
        vocab = int(rng.integers(*vocab_range))
        table = rng.integers(0, vocab, size=(rows, width)).astype(np.int32)
        lengths = rng.integers(0, width + 1, size=rows)
        caps = rng.integers(0, 6, size=rows)
        drafts, counts = NgramProposer(k, lo, hi).propose(table, lengths, caps)
        for r in range(rows):
            want = reference(table[r, : lengths[r]].tolist(), k, lo, hi, int(caps[r]))
            assert drafts[r, : counts[r]].tolist() == want, (table[r, : lengths[r]], caps[r])
            assert (drafts[r, counts[r] :] == -1).all()

"""Tests of krait.runner.spec_decode.rejection_sampler on CPU (and on CUDA with the gpu marker)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from krait.runner.sampler import Sampler, SamplingRow, build_sampling_metadata
from krait.runner.spec_decode import rejection_sampler as rs
from krait.runner.spec_decode.rejection_sampler import RejectionSampler
from krait.sampling_params import SamplingParams

CPU = torch.device("cpu")


def row(output: list[int] | None = None, eos=(), num_outputs: int | None = None, **kw):
    return SamplingRow(
        params=SamplingParams(**kw),
        prompt_token_ids=[0],
        output_token_ids=list(output or []),
        eos_token_ids=list(eos),
        num_output_tokens=num_outputs,
    )


def verify(
    logits: torch.Tensor,
    num_drafts: list[int],
    drafts: list[int] | torch.Tensor,
    rows: list[SamplingRow],
    draft_probs: torch.Tensor | None = None,
    pass_counts: bool = True,
):
    """RejectionSampler on packed logits; row r owns num_drafts[r] + 1 consecutive rows."""
    cu = torch.tensor([0, *np.cumsum(np.asarray(num_drafts) + 1).tolist()], dtype=torch.int32)
    meta = build_sampling_metadata(rows, logits.shape[1], logits.device)
    ids = torch.as_tensor(drafts, dtype=torch.int64).to(logits.device)
    return RejectionSampler()(
        logits, cu.to(logits.device), ids, draft_probs, meta,
        num_draft_tokens=num_drafts if pass_counts else None,
    )


def plain(logits: torch.Tensor, rows: list[SamplingRow]):
    return Sampler()(logits, build_sampling_metadata(rows, logits.shape[1], logits.device))


def peaked(best: list[int], vocab: int = 8, gap: float = 5.0, seed: int = 0) -> torch.Tensor:
    """[len(best), vocab] logits whose row i has its maximum at best[i]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(best), vocab, generator=g) * 0.5
    x[torch.arange(len(best)), torch.tensor(best)] += gap
    return x


# ---------------------------------------------------------------------------------------------
# greedy

# (argmax at each of the row's k + 1 positions, drafts, expected output)
GREEDY_ROWS = [
    ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),  # all accepted, then the bonus argmax
    ([5, 6, 7, 0], [4, 6, 7], [5]),  # the first draft rejected: the argmax replaces it
    ([1, 1, 2, 3], [1, 1, 5], [1, 1, 2]),  # the last draft rejected
    ([0, 2, 3, 6], [0, 5, 3], [0, 2]),  # a later draft that matches counts for nothing
    ([7], [], [7]),  # no drafts: a plain decode row
    ([3, 4], [3], [3, 4]),  # fewer drafts than the batch's widest row, all accepted
]


def _greedy_case(rows_spec, **kw):
    best = [t for argmaxes, _, _ in rows_spec for t in argmaxes]
    logits = peaked(best)
    drafts = [d for _, ds, _ in rows_spec for d in ds]
    num_drafts = [len(ds) for _, ds, _ in rows_spec]
    return verify(logits, num_drafts, drafts, [row(temperature=0.0, **kw) for _ in rows_spec])


def _padded(expected: list[list[int]], width: int = 4) -> list[list[int]]:
    """Outputs padded to max_n (4 for GREEDY_ROWS and every slice of it below)."""
    return [e + [-1] * (width - len(e)) for e in expected]


def test_greedy_exact_outputs_in_one_batch():
    out = _greedy_case(GREEDY_ROWS)
    expected = [e for _, _, e in GREEDY_ROWS]
    assert out.output_token_ids.dtype == torch.int64 and out.num_sampled.dtype == torch.int32
    assert out.output_token_ids.tolist() == _padded(expected)
    assert out.num_sampled.tolist() == [len(e) for e in expected]
    assert out.logprobs is None


@pytest.mark.parametrize("i", range(len(GREEDY_ROWS)))
def test_greedy_row_alone_equals_row_in_batch(i):
    out = _greedy_case([GREEDY_ROWS[i]])
    expected = GREEDY_ROWS[i][2]
    width = len(GREEDY_ROWS[i][0])
    assert out.output_token_ids.tolist() == [expected + [-1] * (width - len(expected))]


def test_greedy_fast_path_skips_the_softmax_path(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the greedy fast path must not process probabilities")

    monkeypatch.setattr(rs, "_verify", boom)
    out = _greedy_case(GREEDY_ROWS)
    assert out.output_token_ids.tolist() == _padded([e for _, _, e in GREEDY_ROWS])


def test_greedy_rows_in_the_general_path():
    """Logprobs, or a random row in the batch, leave the greedy rows' outputs as they are."""
    expected = _padded([e for _, _, e in GREEDY_ROWS])
    with_logprobs = _greedy_case(GREEDY_ROWS, logprobs=1)
    assert with_logprobs.output_token_ids.tolist() == expected
    best = [t for argmaxes, _, _ in GREEDY_ROWS for t in argmaxes] + [0, 0]
    logits = peaked(best)
    drafts = [d for _, ds, _ in GREEDY_ROWS for d in ds] + [0]
    rows = [row(temperature=0.0) for _ in GREEDY_ROWS] + [row(temperature=1.0, seed=1)]
    out = verify(logits, [len(ds) for _, ds, _ in GREEDY_ROWS] + [1], drafts, rows)
    assert out.output_token_ids[:-1].tolist() == expected


def test_greedy_counts_read_off_cu_num_logits():
    out = _greedy_case(GREEDY_ROWS)
    best = [t for argmaxes, _, _ in GREEDY_ROWS for t in argmaxes]
    again = verify(
        peaked(best), [len(ds) for _, ds, _ in GREEDY_ROWS],
        [d for _, ds, _ in GREEDY_ROWS for d in ds],
        [row(temperature=0.0) for _ in GREEDY_ROWS], pass_counts=False,
    )
    assert torch.equal(out.output_token_ids, again.output_token_ids)


def test_one_sampler_across_steps_of_different_layouts():
    """The sampler keeps the last step's index tensors: a new layout must replace them."""
    sampler = RejectionSampler()
    for spec in [GREEDY_ROWS, GREEDY_ROWS[:2], GREEDY_ROWS[:2], GREEDY_ROWS[3:], GREEDY_ROWS]:
        best = [t for argmaxes, _, _ in spec for t in argmaxes]
        num_drafts = [len(ds) for _, ds, _ in spec]
        cu = torch.tensor(np.r_[0, np.cumsum(np.asarray(num_drafts) + 1)])
        meta = build_sampling_metadata([row(temperature=0.0) for _ in spec], 8, CPU)
        drafts = torch.tensor([d for _, ds, _ in spec for d in ds], dtype=torch.int64)
        out = sampler(peaked(best), cu, drafts, None, meta, num_draft_tokens=num_drafts)
        assert out.output_token_ids.tolist() == _padded([e for _, _, e in spec])


# ---------------------------------------------------------------------------------------------
# rows without drafts are Sampler rows


def _undrafted_rows(logits: torch.Tensor) -> list[SamplingRow]:
    best = [int(i) for i in logits.float().argmax(-1)]
    return [
        row(temperature=0.0),
        row(temperature=0.8, seed=3, num_outputs=5),
        row(temperature=1.0, top_k=5, seed=4, logprobs=2),
        row(temperature=1.2, top_p=0.9, seed=5),
        row(temperature=0.7, min_p=0.1, seed=6, num_outputs=1),
        row(temperature=1.0, top_k=8, top_p=0.8, seed=7),
        row(temperature=1.0, seed=8, eos=[best[6]], min_tokens=2, output=[1]),  # EOS banned
        row(temperature=1.0, seed=9, logit_bias={3: 4.0, 11: -50.0}),
        row(temperature=1.0, seed=10, repetition_penalty=1.3, frequency_penalty=0.5,
            output=[best[8], 2, 2]),
        row(temperature=0.0, presence_penalty=1.5, output=[best[9]]),
        row(temperature=1.0, seed=11, stop_token_ids=[best[10]], min_tokens=1),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_without_drafts_match_the_sampler_exactly(dtype):
    for trial in range(4):
        g = torch.Generator().manual_seed(trial)
        logits = (torch.randn(11, 40, generator=g) * 2).to(dtype)
        rows = _undrafted_rows(logits)
        want = plain(logits, rows)
        got = verify(logits, [0] * len(rows), [], rows)
        assert got.output_token_ids.shape == (len(rows), 1)
        assert torch.equal(got.output_token_ids[:, 0], want.sampled_token_ids)
        assert got.num_sampled.tolist() == [1] * len(rows)
        assert torch.equal(got.logprobs.token_ids[:, 0], want.logprobs.token_ids)
        assert torch.equal(got.logprobs.logprobs[:, 0], want.logprobs.logprobs)
        assert torch.equal(got.logprobs.ranks[:, 0], want.logprobs.ranks)


def test_undrafted_rows_next_to_drafted_rows_match_the_sampler():
    torch.manual_seed(0)
    vocab = 40
    single = torch.randn(11, vocab) * 2
    rows = _undrafted_rows(single)
    drafted = [row(temperature=1.0, seed=50 + i) for i in range(3)] + [row(temperature=0.0)]
    num_drafts = [0] * len(rows) + [3, 1, 2, 3]
    # interleave: drafted rows first and last, the plain rows in between
    order = [11, *range(0, 6), 12, *range(6, 11), 13, 14]
    all_rows = rows + drafted
    rows_in_order = [all_rows[i] for i in order]
    counts = [num_drafts[i] for i in order]
    blocks = [single[i : i + 1] if i < 11 else torch.randn(k + 1, vocab)
              for i, k in zip(order, counts)]
    logits = torch.cat(blocks)
    drafts = torch.randint(0, vocab, (sum(counts),)).tolist()
    q = torch.rand(sum(counts), vocab).softmax(-1)
    got = verify(logits, counts, drafts, rows_in_order, draft_probs=q)
    want = plain(single, rows).sampled_token_ids
    for j, i in enumerate(order):
        if i < 11:
            assert got.num_sampled[j] == 1
            assert got.output_token_ids[j, 0] == want[i], (j, i)


def test_position_j_draws_from_seed_offset_plus_j():
    """A sure rejection at position 0 draws Sampler's token of output index `offset`; sure
    acceptances leave the bonus at position k with Sampler's token of index `offset + k`."""
    vocab, k, offset = 32, 3, 7
    torch.manual_seed(0)
    for seed in range(12):
        # the draft lies outside the top 3: p(d) = 0, rejected; the residual is p itself
        logits = torch.randn(k + 1, vocab)
        d0 = int(logits[0].argsort()[0])
        r = row(temperature=1.0, top_k=3, seed=seed, num_outputs=offset)
        out = verify(logits, [k], [d0, 0, 0], [r])
        assert out.num_sampled.item() == 1
        want = plain(logits[:1], [r]).sampled_token_ids
        assert out.output_token_ids[0, 0] == want[0]
        # drafts with p(d) = 1 exactly are always accepted
        drafts = torch.randint(0, vocab, (k,))
        sure = torch.zeros(k + 1, vocab)
        sure[torch.arange(k), drafts] = 100.0
        sure[k] = torch.randn(vocab)
        r = row(temperature=1.0, seed=seed, num_outputs=offset)
        out = verify(sure, [k], drafts, [r])
        assert out.num_sampled.item() == k + 1
        assert out.output_token_ids[0, :k].tolist() == drafts.tolist()
        bonus = row(temperature=1.0, seed=seed, num_outputs=offset + k)
        assert out.output_token_ids[0, k] == plain(sure[k:], [bonus]).sampled_token_ids[0]


# ---------------------------------------------------------------------------------------------
# seeds


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    vocab, k = 16, 3
    g = torch.Generator().manual_seed(0)
    outputs, lengths = set(), set()
    for seed in range(24):
        logits = torch.randn(k + 1, vocab, generator=g)
        q = torch.randn(k, vocab, generator=g).softmax(-1)
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        r = row(temperature=1.0, seed=seed, num_outputs=4)
        alone = verify(logits, [k], drafts, [r], draft_probs=q)
        torch.manual_seed(seed + 1000)  # a different global RNG state
        again = verify(logits, [k], drafts, [r], draft_probs=q)
        assert torch.equal(alone.output_token_ids, again.output_token_ids)
        # the same row between others: unseeded random rows, a greedy row, another seed
        other = torch.randn(10, vocab, generator=g)
        other_q = torch.randn(6, vocab, generator=g).softmax(-1)
        batch_logits = torch.cat([other[:3], logits, other[3:]])
        batch_q = torch.cat([other_q[:2], q, other_q[2:]])
        batch_drafts = torch.cat([torch.randint(0, vocab, (2,)), drafts,
                                  torch.randint(0, vocab, (4,))])
        rows = [row(temperature=0.9), r, row(temperature=0.0), row(temperature=1.0, seed=99),
                row(temperature=1.0, top_k=4)]
        mixed = verify(batch_logits, [2, k, 1, 0, 3], batch_drafts, rows, draft_probs=batch_q)
        assert mixed.num_sampled[1] == alone.num_sampled[0]
        assert torch.equal(mixed.output_token_ids[1], alone.output_token_ids[0])
        n = int(alone.num_sampled[0])
        outputs.add(tuple(alone.output_token_ids[0, :n].tolist()))
        lengths.add(n)
    assert len(outputs) > 12  # different seeds draw different tokens
    assert len(lengths) >= 3  # rejections at several positions were exercised


def test_point_mass_seeded_rows_are_reproducible():
    vocab, k = 10, 2
    g = torch.Generator().manual_seed(1)
    for seed in range(10):
        logits = torch.randn(k + 1, vocab, generator=g)
        drafts = torch.randint(0, vocab, (k,), generator=g)
        r = row(temperature=0.8, top_p=0.9, seed=seed)
        a = verify(logits, [k], drafts, [r])
        torch.manual_seed(seed)
        b = verify(torch.cat([torch.randn(2, vocab), logits]), [1, k], torch.cat(
            [torch.randint(0, vocab, (1,)), drafts]), [row(temperature=1.0), r])
        assert torch.equal(a.output_token_ids[0], b.output_token_ids[1][: k + 1])
        assert a.num_sampled[0] == b.num_sampled[1]


def test_point_mass_rows_emit_the_samplers_own_draws():
    """Point-mass drafts take the coupled test: position j's output is Sampler's draw for
    output index offset + j, whatever the drafts are; they only decide how many positions
    count. So a seeded row emits with drafts exactly what it emits without them."""
    vocab, k, offset = 12, 4, 5
    g = torch.Generator().manual_seed(3)
    stops = set()
    for seed in range(16):
        logits = torch.randn(k + 1, vocab, generator=g) * 0.7
        kw = {"temperature": 0.9, "top_p": 0.95, "seed": seed}
        draws = [int(plain(logits[j : j + 1], [row(num_outputs=offset + j, **kw)])
                     .sampled_token_ids[0]) for j in range(k + 1)]
        m = seed % (k + 1)  # drafts equal to the draws up to m, then one that is not
        drafts = draws[:k]
        if m < k:
            drafts[m] = (draws[m] + 1) % vocab
        out = verify(logits, [k], drafts, [row(num_outputs=offset, **kw)])
        n = int(out.num_sampled[0])
        assert n == m + 1
        assert out.output_token_ids[0, :n].tolist() == draws[:n]
        stops.add(n)
    assert stops == set(range(1, k + 2))


# ---------------------------------------------------------------------------------------------
# the output distribution is the target's

CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}  # p = 0.001
N = 20000
VOCAB = 6
TARGET = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.30, 0.10, 0.35, 0.15, 0.05],
        [0.22, 0.20, 0.18, 0.16, 0.14, 0.10],
        [0.10, 0.04, 0.45, 0.06, 0.05, 0.30],
    ],
    dtype=torch.float64,
)
# no ties, and no nucleus boundary within rounding of the cases' top_k / top_p
# the draft model's q_j (draft-model case) / where the n-gram drafts come from (point mass)
DRAFT = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.20, 0.25, 0.25],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        [0.30, 0.10, 0.10, 0.10, 0.10, 0.30],
    ],
    dtype=torch.float64,
)
NGRAM_SOURCE = torch.tensor(
    [
        [0.50, 0.20, 0.10, 0.10, 0.05, 0.05],
        [0.10, 0.40, 0.10, 0.30, 0.05, 0.05],
        [0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
    ],
    dtype=torch.float64,
)


def processed(probs: torch.Tensor, temperature: float, top_k: int | None,
              top_p: float | None) -> torch.Tensor:
    """The target distribution as the Sampler defines it, computed by hand for the test."""
    p = probs.log().div(temperature).softmax(-1)
    if top_k is not None:
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep.scatter_(-1, p.topk(top_k, dim=-1).indices, True)
        p = torch.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if top_p is not None:
        out = torch.zeros_like(p)
        for i in range(p.shape[0]):  # the smallest set of the best tokens with mass >= top_p
            order = p[i].argsort(descending=True)
            mass = p[i][order].cumsum(0)
            n = int((mass < top_p).sum()) + 1
            out[i, order[:n]] = p[i, order[:n]]
        p = out / out.sum(-1, keepdim=True)
    return p


def chi2_ok(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the samples pass a chi-square goodness-of-fit test against probs at p = 0.001
    (and hold no token of probability 0)."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat < CHI2_CRITICAL[int(support.sum()) - 1]


CASES = [
    # (drafter, k, temperature, top_k, top_p)
    ("draft_model", 3, 1.0, None, None),
    ("draft_model", 2, 1.0, 4, None),
    ("ngram", 2, 1.0, None, None),
    ("ngram", 3, 0.8, None, 0.8),
]


def _spec_batch(drafter: str, k: int, seed: int):
    """N identical rows: logits [N * (k + 1), V], drafts [N * k], draft probs or None."""
    g = torch.Generator().manual_seed(seed)
    source = DRAFT if drafter == "draft_model" else NGRAM_SOURCE
    drafts = torch.stack([torch.multinomial(source[j], N, replacement=True, generator=g)
                          for j in range(k)], dim=1)  # [N, k]
    logits = TARGET[: k + 1].log().float().repeat(N, 1)  # [N * (k + 1), V]
    q = None
    if drafter == "draft_model":
        q = DRAFT[:k].float().repeat(N, 1)  # [N * k, V]
    return logits, drafts, q


@pytest.mark.parametrize("drafter, k, temperature, top_k, top_p", CASES)
def test_outputs_are_distributed_as_the_target(drafter, k, temperature, top_k, top_p):
    """Output position j, among the rows that reached it (drafts 0..j-1 accepted), is
    distributed as p_j: the test's target logits do not depend on the tokens before them, and
    the drafts of position j are drawn independently of what happened before j."""
    logits, drafts, q = _spec_batch(drafter, k, seed=k)
    rows = [row(temperature=temperature, top_k=top_k or -1, top_p=top_p or 1.0)
            for _ in range(N)]
    torch.manual_seed(1234)
    out = verify(logits, [k] * N, drafts.reshape(-1), rows, draft_probs=q)
    p = processed(TARGET[: k + 1], temperature, top_k, top_p)
    ns = out.num_sampled
    assert int(ns.min()) >= 1 and int(ns.max()) == k + 1
    for j in range(k + 1):
        reached = ns > j
        assert int(reached.sum()) >= 200, f"position {j} is reached too rarely for a test"
        assert chi2_ok(out.output_token_ids[reached, j], p[j]), f"position {j}"
        assert (out.output_token_ids[~reached, j] == -1).all()
    # the first draft is accepted with probability sum_x min(p_0, q_0) (point mass: E[p_0(d)])
    source = DRAFT if drafter == "draft_model" else NGRAM_SOURCE
    if drafter == "draft_model":
        accept_rate = float(torch.minimum(p[0], source[0]).sum())
    else:
        accept_rate = float((p[0] * source[0]).sum())
    seen = float((ns > 1).double().mean())
    assert abs(seen - accept_rate) < 4.5 * (accept_rate * (1 - accept_rate) / N) ** 0.5


def _wrong_first_tokens(kind: str, drafter: str, p0: torch.Tensor, d0: torch.Tensor,
                        g: torch.Generator) -> torch.Tensor:
    """Output token 0 of deliberately broken verifiers."""
    q0 = DRAFT[0] if drafter == "draft_model" else torch.zeros(VOCAB, dtype=torch.float64)
    if kind == "always_accept":
        return d0
    u = torch.rand(d0.shape[0], generator=g, dtype=torch.float64)
    q_d = q0[d0] if drafter == "draft_model" else torch.ones_like(u)
    accept = u * q_d <= p0[d0]
    from_p = torch.multinomial(p0, d0.shape[0], replacement=True, generator=g)
    if kind == "resample_from_p":  # the rejection draws from p instead of the residual
        return torch.where(accept, d0, from_p)
    assert kind == "swapped_residual"  # redraws from max(q - p, 0) instead of max(p - q, 0)
    if drafter == "ngram":  # max(onehot(d) - p, 0) is d's alone
        return d0
    residual = (q0 - p0).clamp(min=0.0)
    redraw = torch.multinomial(residual / residual.sum(), d0.shape[0], replacement=True,
                               generator=g)
    return torch.where(accept, d0, redraw)


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
@pytest.mark.parametrize("kind", ["always_accept", "resample_from_p", "swapped_residual"])
def test_the_distribution_check_catches_wrong_verifiers(drafter, kind):
    """Negative control: the same chi-square check fails broken verifiers on the same inputs."""
    _, drafts, _ = _spec_batch(drafter, 2, seed=2)
    p0 = processed(TARGET[:1], 1.0, None, None)[0]
    g = torch.Generator().manual_seed(7)
    wrong = _wrong_first_tokens(kind, drafter, p0, drafts[:, 0], g)
    assert not chi2_ok(wrong, p0)
    # while plain sampling from p_0 passes it
    assert chi2_ok(torch.multinomial(p0, N, replacement=True, generator=g), p0)


# ---------------------------------------------------------------------------------------------
# logprobs


def test_logprobs_are_the_raw_target_log_softmax_at_each_output():
    vocab, num_lp = 30, 3
    torch.manual_seed(0)
    num_drafts = [3, 0, 2, 1]
    logits = (torch.randn(sum(num_drafts) + 4, vocab) * 3).to(torch.bfloat16)
    drafts = logits.float().argmax(-1)  # mostly accepted by the greedy rows
    cu = np.r_[0, np.cumsum(np.asarray(num_drafts) + 1)]
    packed = torch.cat([drafts[cu[r] : cu[r] + k] for r, k in enumerate(num_drafts)])
    rows = [
        row(temperature=0.0, logprobs=num_lp),
        row(temperature=0.5, top_k=4, seed=1, logprobs=1),
        row(temperature=1.5, seed=2),
        row(temperature=0.0, logprobs=0),
    ]
    out = verify(logits, num_drafts, packed, rows)
    lp = out.logprobs
    max_n = max(num_drafts) + 1
    assert lp.token_ids.shape == (4, max_n, num_lp + 1)
    assert lp.logprobs.shape == (4, max_n, num_lp + 1) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (4, max_n)
    raw = logits.float().log_softmax(-1)
    for r in range(4):
        n = int(out.num_sampled[r])
        for j in range(max_n):
            if j >= n:
                assert lp.token_ids[r, j].tolist() == [-1] * (num_lp + 1)
                assert lp.logprobs[r, j].tolist() == [0.0] * (num_lp + 1)
                assert lp.ranks[r, j] == 0
                continue
            t = int(cu[r]) + j
            tok = int(out.output_token_ids[r, j])
            assert lp.token_ids[r, j, 0] == tok
            assert lp.logprobs[r, j, 0] == raw[t, tok]
            top = raw[t].topk(num_lp)
            assert torch.equal(lp.logprobs[r, j, 1:], top.values)
            assert torch.equal(lp.token_ids[r, j, 1:], top.indices)
            assert lp.ranks[r, j] == int((raw[t] >= raw[t, tok]).sum())
    assert out.num_sampled[0] == 4  # the greedy row accepted its argmax drafts


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "kw",
    [
        dict(min_tokens=3, eos=[1]),
        dict(logit_bias={2: 1.0}),
        dict(repetition_penalty=1.2, output=[1]),
        dict(presence_penalty=0.5, output=[1]),
    ],
)
def test_drafted_rows_with_bans_bias_or_penalties_raise(kw):
    logits = torch.randn(4, 8)
    rows = [row(temperature=1.0), row(temperature=1.0, **kw)]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        verify(logits, [0, 2], [3, 4], rows)
    # without drafts the same row is fine
    verify(torch.randn(4, 8), [2, 0], [3, 4], rows)


def test_inconsistent_shapes_raise():
    logits = torch.randn(5, 8)
    rows = [row(temperature=0.0), row(temperature=0.0)]
    with pytest.raises(ValueError):
        verify(logits, [1, 1], [1, 2], rows)  # 5 logits rows for 2 + 2 positions
    with pytest.raises(ValueError):
        verify(logits, [2, 1], [1, 2], rows)  # 2 drafts for 3
    with pytest.raises(ValueError):
        verify(logits, [2, 1], [1, 2, 3], rows, draft_probs=torch.rand(3, 7))


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_on_cuda_without_host_syncs():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    vocab = 5000
    torch.manual_seed(0)
    num_drafts = [3, 0, 2, 3, 1, 0]
    total = sum(num_drafts) + len(num_drafts)
    logits = (torch.randn(total, vocab, device=dev) * 3).bfloat16()
    drafts = torch.randint(0, vocab, (sum(num_drafts),), device=dev)
    q = torch.randn(sum(num_drafts), vocab, device=dev).softmax(-1)
    cu = torch.tensor(np.r_[0, np.cumsum(np.asarray(num_drafts) + 1)], device=dev)
    greedy_rows = [row(temperature=0.0) for _ in num_drafts]
    random_rows = [row(temperature=0.9, top_p=0.9, seed=i, logprobs=2) if i % 2 else
                   row(temperature=0.0) for i in range(len(num_drafts))]
    metas = [build_sampling_metadata(r, vocab, dev) for r in (greedy_rows, random_rows)]
    sampler = RejectionSampler()

    def run():
        out = [sampler(logits, cu, drafts, probs, meta, num_draft_tokens=num_drafts)
               for meta in metas for probs in (None, q)]
        return out

    outs = run()  # warm-up (Triton compilation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [str(w.message) for w in caught if "synchroniz" in str(w.message)] == []
    # greedy on CUDA = greedy on CPU
    cpu = RejectionSampler()(logits.cpu(), cu.cpu(), drafts.cpu(), None,
                             build_sampling_metadata(greedy_rows, vocab, CPU), num_drafts)
    assert torch.equal(outs[0].output_token_ids.cpu(), cpu.output_token_ids)
    # seeded rows reproduce; undrafted seeded rows equal the Sampler's draw on CUDA
    again = run()
    for a, b in zip(outs, again):
        assert torch.equal(a.output_token_ids[1::2], b.output_token_ids[1::2])
    single = logits[cu[:-1][torch.tensor([1, 5], device=dev)]]
    want = plain(single, [random_rows[1], random_rows[5]]).sampled_token_ids
    assert torch.equal(outs[2].output_token_ids[[1, 5], 0], want)

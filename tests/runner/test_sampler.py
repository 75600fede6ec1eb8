"""Tests of krait.runner.sampler on CPU (and on CUDA with the gpu marker)."""

from __future__ import annotations

import math

import pytest
import torch

from krait.runner.sampler import (
    Sampler,
    SamplingRow,
    apply_bans_and_penalties,
    build_sampling_metadata,
    exponential_noise,
    mix_seeds,
)
from krait.sampling_params import SamplingParams

CPU = torch.device("cpu")


def row(
    output: list[int] | None = None, prompt: list[int] | None = None, eos=(), **kw
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**kw),
        prompt_token_ids=list(prompt or [0]),
        output_token_ids=list(output or []),
        eos_token_ids=list(eos),
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    meta = build_sampling_metadata(rows, logits.shape[1], logits.device)
    return Sampler()(logits, meta)


def draws(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n independent samples of one row's distribution (the row repeated n times, unseeded)."""
    torch.manual_seed(1234)
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return sample(logits, [row(**kw) for _ in range(n)]).sampled_token_ids


def test_metadata_leaves_unused_fields_none():
    meta = build_sampling_metadata([row(temperature=0.0), row(temperature=0.0)], 32, CPU)
    assert meta.all_greedy and not meta.all_random
    for name in (
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "output_counts",
        "prompt_mask",
        "max_num_logprobs",
    ):
        assert getattr(meta, name) is None, name
    assert meta.banned == []
    assert meta.temperature.tolist() == [0.0, 0.0]
    # top-k/p and min-p on greedy rows change nothing, so they stay unused too.
    meta = build_sampling_metadata([row(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1)], 32, CPU)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None


def test_metadata_fields_when_used():
    rows = [
        row(
            output=[5, 5, 7],
            prompt=[1, 2],
            temperature=0.8,
            top_k=4,
            seed=3,
            logprobs=2,
            frequency_penalty=0.5,
        ),
        row(output=[9], temperature=0.0, repetition_penalty=1.3, logprobs=5),
        row(temperature=1.0, top_p=0.9, min_p=0.05),
    ]
    meta = build_sampling_metadata(rows, 16, CPU)
    assert not meta.all_greedy and not meta.all_random
    assert meta.temperature.dtype == torch.float32
    assert meta.top_k.tolist() == [4, 16, 16]
    assert meta.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.0, 0.05])
    assert meta.seeds == [3, None, None] and meta.seed_offsets == [3, 1, 0]
    assert meta.presence_penalty is None
    assert meta.frequency_penalty.tolist() == [0.5, 0.0, 0.0]
    assert meta.repetition_penalty.tolist() == pytest.approx([1.0, 1.3, 1.0])
    assert meta.output_counts.shape == (3, 16)
    assert meta.output_counts[0, 5] == 2 and meta.output_counts[0, 7] == 1
    assert meta.output_counts[1, 9] == 1 and meta.output_counts.sum() == 4
    assert meta.prompt_mask.dtype == torch.bool and meta.prompt_mask[1, 0]
    assert meta.max_num_logprobs == 5


def test_greedy_is_argmax_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    out = sample(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    rows = [row(temperature=0.0 if i % 2 == 0 else 1.5, top_k=5) for i in range(6)]
    out = sample(logits, rows).sampled_token_ids
    assert torch.equal(out[::2], logits[::2].argmax(-1))


def test_temperature_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature, n = 0.7, 20000
    counts = torch.bincount(draws(logits, n, temperature=temperature), minlength=8).double()
    expected = (logits.double() / temperature).softmax(-1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 30.0  # 7 degrees of freedom: p < 1e-4 at 30


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9, 0.3, 1.8, -0.2, 0.0])
    got = set(draws(logits, 3000, temperature=1.0, top_k=3).tolist())
    assert got == {1, 3, 5}


PROBS = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])


@pytest.mark.parametrize("top_p, nucleus", [(0.7, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p, nucleus):
    perm = torch.tensor([3, 0, 4, 2, 1])  # shuffled so the kept ids are not a prefix
    got = set(draws(PROBS.log()[perm], 4000, top_p=top_p).tolist())
    position = perm.argsort()  # position[i]: where PROBS[i] sits in the shuffled row
    assert got == {int(position[i]) for i in nucleus}


def test_top_p_keeps_one_token_when_p_is_tiny():
    got = set(draws(PROBS.log().flip(0), 500, top_p=1e-9).tolist())  # 1 - p rounds to 1.0
    assert got == {4}


def test_top_k_and_top_p_together():
    got = set(draws(PROBS.log(), 3000, top_k=2, top_p=0.95).tolist())
    assert got == {0, 1}


@pytest.mark.parametrize("min_p, kept", [(0.2, {0, 1, 2}), (0.35, {0, 1})])
def test_min_p(min_p, kept):
    assert set(draws(PROBS.log(), 3000, min_p=min_p).tolist()) == kept


def test_seed_is_independent_of_batch_position_and_neighbours():
    vocab = 64
    target = torch.zeros(vocab)  # uniform: the token is decided by the noise alone
    torch.manual_seed(0)
    other = torch.randn(3, vocab)
    for seed in range(20):
        alone = sample(target.unsqueeze(0), [row(output=[1, 2, 3], seed=seed)])
        logits = torch.cat([other[:2], target.unsqueeze(0), other[2:]])
        rows = [
            row(temperature=0.0),
            row(output=[4], seed=seed, top_k=3, repetition_penalty=1.2),
            row(output=[1, 2, 3], seed=seed),
            row(temperature=0.5, top_p=0.5, logprobs=1),
        ]
        mixed = sample(logits, rows)
        assert mixed.sampled_token_ids[2] == alone.sampled_token_ids[0]


def test_different_offsets_give_different_draws():
    target = torch.zeros(1, 64)
    tokens = {
        sample(target, [row(output=[0] * offset, seed=11)]).sampled_token_ids.item()
        for offset in range(40)
    }
    assert len(tokens) > 20  # 40 uniform draws over 64 ids: ~28 distinct expected


def test_penalties_match_a_hand_computed_case():
    logits = torch.tensor([[1.0, -2.0, 0.4, 3.0, -1.0, 0.0]])
    r = row(
        prompt=[0, 1],
        output=[3, 3, 4],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    meta = build_sampling_metadata([r], 6, CPU)
    got = apply_bans_and_penalties(logits, meta)
    # token 0: prompt, 1.0 / 2; token 1: prompt, -2.0 * 2; token 3: 3.0 / 2 - 0.5 * 2 - 0.25;
    # token 4: -1.0 * 2 - 0.5 * 1 - 0.25; tokens 2 and 5 unseen.
    expected = torch.tensor([[0.5, -4.0, 0.4, 0.25, -2.75, 0.0]])
    torch.testing.assert_close(got, expected)
    assert logits[0, 3] == 3.0  # the input is not edited
    # Greedy decoding sees the penalised logits: token 3 no longer wins.
    r.params.temperature = 0.0
    out = sample(logits, [r]).sampled_token_ids
    assert out.item() == 0


def test_penalties_only_touch_their_own_rows():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    rows = [
        row(output=[3, 4], temperature=0.0, presence_penalty=2.0),
        row(output=[3, 4], temperature=0.0),
    ]
    got = apply_bans_and_penalties(logits, build_sampling_metadata(rows, 10, CPU))
    torch.testing.assert_close(got[1], logits[1])
    assert got[0, 3] == logits[0, 3] - 2.0


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0, 0.5]])  # EOS (2) best, stop id 3 next
    eos = [2]

    def pick(output, **kw):
        return sample(
            logits, [row(output=output, eos=eos, temperature=0.0, stop_token_ids=[3], **kw)]
        ).sampled_token_ids.item()

    assert pick([7], min_tokens=3) == 4
    assert pick([7], min_tokens=3, ignore_eos=True) == 2
    assert pick([7, 7, 7], min_tokens=3) == 2
    meta = build_sampling_metadata(
        [
            row(output=[1], eos=eos, min_tokens=2, stop_token_ids=[3]),
            row(output=[1, 1], eos=eos, min_tokens=2),
        ],
        6,
        CPU,
    )
    assert meta.banned == [(0, [2, 3])]


def test_min_tokens_ban_holds_for_random_rows():
    logits = torch.tensor([0.0, 0.0, 8.0, 0.0])
    got = set(draws(logits, 500, output=[], eos=[2], min_tokens=1).tolist())
    assert 2 not in got


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = (torch.randn(4, 30) * 3).to(torch.bfloat16)
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=1.0, repetition_penalty=1.5, output=[int(logits[1].float().argmax())]),
        row(temperature=2.0, top_k=5, logprobs=1),
        row(temperature=0.0, presence_penalty=1.0, output=[int(logits[3].float().argmax())]),
    ]
    out = sample(logits, rows)
    lp = out.logprobs
    sampled = out.sampled_token_ids
    raw = logits.float().log_softmax(-1)
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.dtype == torch.float32
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(3, dim=-1)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    order = raw.argsort(dim=-1, descending=True)
    ranks = [int((order[i] == sampled[i]).nonzero()) + 1 for i in range(4)]
    assert lp.ranks.tolist() == ranks
    assert lp.ranks[0] == 1 and lp.ranks[3] > 1  # the presence penalty moved row 3 off its best


def test_logprobs_zero_means_sampled_token_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 12)
    out = sample(logits, [row(temperature=0.0, logprobs=0), row(temperature=0.0)])
    assert out.logprobs.token_ids.shape == (2, 1)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs.ranks.tolist() == [1, 1]
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], logits.log_softmax(-1).max(-1).values)
    assert math.isfinite(out.logprobs.logprobs.sum().item())


def test_model_dtype_logits_sample_as_their_float32_upcast():
    """Models hand the sampler logits in their own dtype (no [B, V] float32 copy for greedy
    batches): every path must draw what it draws from the exact float32 upcast."""
    torch.manual_seed(0)
    logits = (torch.randn(6, 50) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    rows = [
        row(temperature=0.0),
        row(temperature=0.8, seed=3),
        row(temperature=1.0, top_k=5, top_p=0.9, seed=4),
        row(temperature=0.7, min_p=0.1, seed=5, logprobs=2),
        row(temperature=0.0, repetition_penalty=1.3, output=[int(logits[4].float().argmax())]),
        row(temperature=1.0, frequency_penalty=0.5, output=[1, 1], seed=6),
    ]
    low, high = sample(logits, rows), sample(logits.float(), rows)
    assert torch.equal(low.sampled_token_ids, high.sampled_token_ids)
    assert low.sampled_token_ids[0] == 7
    assert torch.equal(low.logprobs.token_ids, high.logprobs.token_ids)
    torch.testing.assert_close(low.logprobs.logprobs, high.logprobs.logprobs, rtol=0, atol=0)
    greedy = [row(temperature=0.0) for _ in range(6)]  # the bare-argmax fast path
    assert torch.equal(sample(logits, greedy).sampled_token_ids, logits.float().argmax(-1))


@pytest.mark.gpu
def test_seeded_sampling_on_cuda():
    dev = torch.device("cuda")
    target = torch.zeros(1, 1000, device=dev)
    other = torch.randn(2, 1000, device=dev)
    for seed in range(5):
        alone = sample(target, [row(output=[1], seed=seed)]).sampled_token_ids
        mixed = sample(
            torch.cat([other, target]),
            [row(temperature=0.0), row(top_p=0.5), row(output=[1], seed=seed)],
        )
        assert mixed.sampled_token_ids[2] == alone[0]
    logits = torch.randn(8, 1000, device=dev)
    out = sample(logits, [row(temperature=0.0, logprobs=2) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs.ranks.eq(1).all()


@pytest.mark.gpu
def test_model_dtype_logits_on_cuda():
    """bf16 logits on the GPU (what every model hands the sampler there) draw as their float32
    upcast: greedy through the Triton argmax, seeded random rows, logprobs."""
    dev = torch.device("cuda")
    torch.manual_seed(1)
    logits = (torch.randn(8, 5000, device=dev) * 3).bfloat16()
    rows = [row(temperature=0.0) if i % 2 else row(temperature=0.8, seed=i, logprobs=2)
            for i in range(8)]
    low, high = sample(logits, rows), sample(logits.float(), rows)
    assert torch.equal(low.sampled_token_ids, high.sampled_token_ids)
    assert torch.equal(low.logprobs.logprobs, high.logprobs.logprobs)
    greedy = [row(temperature=0.0) for _ in range(8)]
    assert torch.equal(sample(logits, greedy).sampled_token_ids, logits.float().argmax(-1))


def test_seed_mixing_on_the_device_and_offset_delta():
    """mix_seeds: one non-negative generator seed per (seed key, output index), -1 for unseeded
    rows; exponential_noise's offset_delta (asynchronous speculation's correction, a device
    tensor) draws the noise of the corrected index."""
    keys = torch.tensor([7, 7, 7, -1, 123456789012345], dtype=torch.int64)
    offs = torch.tensor([0, 1, 2, 0, 0], dtype=torch.int64)
    mixed = mix_seeds(keys, offs)
    assert torch.equal(mixed, mix_seeds(keys, offs))
    assert mixed[3] == -1 and (mixed[[0, 1, 2, 4]] >= 0).all()
    assert len(set(mixed.tolist())) == 5
    many = mix_seeds(torch.full((1000,), 3, dtype=torch.int64), torch.arange(1000))
    assert many.unique().numel() == 1000
    seeds = [11, None, 12]
    a = exponential_noise(torch.Size((3, 16)), seeds, [5, 0, 9], torch.device("cpu"),
                          torch.tensor([2, 0, 0], dtype=torch.int32))
    b = exponential_noise(torch.Size((3, 16)), seeds, [3, 0, 9], torch.device("cpu"))
    assert torch.equal(a[[0, 2]], b[[0, 2]])
    c = exponential_noise(torch.Size((3, 16)), seeds, [5, 0, 9], torch.device("cpu"))
    assert not torch.equal(a[0], c[0])

"""Token sampler: bans, penalties, greedy, temperature, min-p, top-k/p, seeds, raw logprobs.

Semantics follow vLLM's v1 sampler. One `SamplingMetadata` is built per step from the batch rows
(`build_sampling_metadata`); `Sampler.forward(logits, meta)` turns `[B, V]` logits into one token
per row and, when any row asks, the raw logprobs (log_softmax of the logits as given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from krait.ops.argmax import argmax
from krait.ops.seeded_noise import seeded_exponential
from krait.runner.input_batch import host_to_device
from krait.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplingRow:
    """What the sampler needs of one batch row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before this step); may be left empty when
    # num_output_tokens is given and the penalty tensors come precomputed
    eos_token_ids: list[int]  # banned while len(output) < min_tokens, unless ignore_eos
    num_output_tokens: int | None = None  # len(output_token_ids) when that list is not given

    @property
    def num_outputs(self) -> int:
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return len(self.output_token_ids)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, tensors on the logits' device.

    Optional tensors are None when no row needs them, so the sampler can skip that stage.
    Penalty rows that are neutral (0, 0, 1) leave their `output_counts`/`prompt_mask` rows empty.
    """

    temperature: torch.Tensor  # [B] float32, 0.0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 where disabled
    seeds: list[int | None]
    seed_offsets: list[int]  # len(output_token_ids): the position being sampled
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    output_counts: torch.Tensor | None  # [B, V] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool
    banned: list[tuple[int, list[int]]]  # (row, token ids that row must not sample)
    max_num_logprobs: int | None
    all_random: bool = False  # no greedy row: the sampler may skip the greedy argmax
    # int [B] on the device, subtracted from seed_offsets (asynchronous speculation: each row's
    # rejected drafts the host has not learned yet, so its counts run ahead), or None
    seed_offset_delta: torch.Tensor | None = None
    # (row, token ids, biases) added to that row's logits first (OpenAI's logit_bias)
    bias: list[tuple[int, list[int], list[float]]] = field(default_factory=list)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty is not None
            or self.frequency_penalty is not None
            or self.repetition_penalty is not None
        )


def build_sampling_metadata(
    rows: list[SamplingRow],
    vocab_size: int,
    device: torch.device,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> SamplingMetadata:
    """Gather the batch rows' sampling parameters into tensors on `device`.

    `output_counts` [B, V] float32 / `prompt_mask` [B, V] bool, when given, are the rows' token
    statistics kept on the device by the caller; otherwise they are counted from the rows' lists."""
    params = [r.params for r in rows]
    greedy = [p.is_greedy for p in params]
    temps = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
    top_ks = [
        p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size
        for p, g in zip(params, greedy)
    ]
    top_ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
    min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
    presence = [float(p.presence_penalty) for p in params]
    frequency = [float(p.frequency_penalty) for p in params]
    repetition = [float(p.repetition_penalty) for p in params]

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def optional_f32(values: list[float], neutral: float) -> torch.Tensor | None:
        return f32(values) if any(v != neutral for v in values) else None

    pen_rows = [
        i
        for i in range(len(rows))
        if presence[i] != 0.0 or frequency[i] != 0.0 or repetition[i] != 1.0
    ]
    if not pen_rows:
        output_counts = prompt_mask = None
    elif output_counts is None:
        output_counts = _token_counts(
            rows, pen_rows, "output_token_ids", vocab_size, device, torch.float32
        )
    if not any(v != 1.0 for v in repetition):
        prompt_mask = None
    elif prompt_mask is None:
        rep_rows = [i for i in pen_rows if repetition[i] != 1.0]
        prompt_mask = _token_counts(
            rows, rep_rows, "prompt_token_ids", vocab_size, device, torch.bool
        )

    banned: list[tuple[int, list[int]]] = []
    for i, r in enumerate(rows):
        if r.num_outputs >= r.params.min_tokens:
            continue
        ids = list(r.params.stop_token_ids or [])
        # a grammar's end (EOS, allowed only where the grammar may stop) is not held back: the
        # grammar would leave nothing else to sample
        if not r.params.ignore_eos and r.params.structured_outputs is None:
            ids += r.eos_token_ids
        ids = sorted({t for t in ids if 0 <= t < vocab_size})
        if ids:
            banned.append((i, ids))

    bias = [
        (i, list(p.logit_bias), [float(v) for v in p.logit_bias.values()])
        for i, p in enumerate(params)
        if p.logit_bias
    ]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=f32(temps),
        all_greedy=all(greedy),
        top_k=(
            torch.tensor(top_ks, dtype=torch.int64, device=device)
            if any(k < vocab_size for k in top_ks)
            else None
        ),
        top_p=optional_f32(top_ps, 1.0),
        min_p=optional_f32(min_ps, 0.0),
        seeds=[p.seed for p in params],
        seed_offsets=[r.num_outputs for r in rows],
        presence_penalty=optional_f32(presence, 0.0),
        frequency_penalty=optional_f32(frequency, 0.0),
        repetition_penalty=optional_f32(repetition, 1.0),
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        banned=banned,
        max_num_logprobs=max(asked) if asked else None,
        all_random=not any(greedy),
        bias=bias,
    )


def greedy_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """The metadata of `num_rows` plain greedy rows (no bans, penalties, biases, logprobs or
    seeds), without gathering per-row parameters."""
    return SamplingMetadata(
        temperature=torch.zeros(num_rows, dtype=torch.float32, device=device), all_greedy=True,
        top_k=None, top_p=None, min_p=None, seeds=[None] * num_rows, seed_offsets=[0] * num_rows,
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        output_counts=None, prompt_mask=None, banned=[], max_num_logprobs=None,
    )


def _token_counts(
    rows: list[SamplingRow],
    which: list[int],
    field: str,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per-row token counts (float) or presence (bool) of `rows[i].<field>` for i in `which`."""
    width = vocab_size + 1  # column vocab_size collects out-of-vocabulary ids, then is cut off
    out = torch.zeros(len(rows), width, dtype=dtype, device=device)  # [B, V + 1]
    ids_per_row = [np.asarray(getattr(rows[i], field), dtype=np.int64) for i in which]
    lengths = np.array([len(a) for a in ids_per_row], dtype=np.int64)
    if lengths.sum() > 0:
        ids = np.concatenate(ids_per_row)
        ids = np.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
        flat = np.repeat(np.asarray(which, dtype=np.int64), lengths) * width + ids
        flat_t = host_to_device(flat, device)
        if dtype == torch.bool:
            out.view(-1).index_fill_(0, flat_t, True)
        else:
            ones = torch.ones(flat_t.shape[0], dtype=dtype, device=device)
            out.view(-1).index_put_((flat_t,), ones, accumulate=True)
    return out[:, :vocab_size]


@dataclass
class LogprobsTensors:
    """Raw logprobs of the sampled token and the top-k tokens of each row."""

    token_ids: torch.Tensor  # [B, k + 1] int64: column 0 the sampled token, then the top-k ids
    logprobs: torch.Tensor  # [B, k + 1] float32
    ranks: torch.Tensor  # [B] int64: rank (1 = best) of the sampled token among all tokens


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def apply_bans_and_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Float32 logits with the logit biases added, banned ids at -inf and the penalties applied;
    never edits `logits`."""
    x = logits.to(torch.float32, copy=True)  # [B, V]
    if meta.bias:
        rows = [i for i, ids, _ in meta.bias for _ in ids]
        cols = [t for _, ids, _ in meta.bias for t in ids]
        vals = [v for _, _, vs in meta.bias for v in vs]
        idx_r = torch.tensor(rows, dtype=torch.int64, device=x.device)
        idx_c = torch.tensor(cols, dtype=torch.int64, device=x.device)
        x.index_put_((idx_r, idx_c), torch.tensor(vals, device=x.device), accumulate=True)
    if meta.banned:
        rows = [i for i, ids in meta.banned for _ in ids]
        cols = [t for _, ids in meta.banned for t in ids]
        idx_r = torch.tensor(rows, dtype=torch.int64, device=x.device)
        idx_c = torch.tensor(cols, dtype=torch.int64, device=x.device)
        x[idx_r, idx_c] = float("-inf")
    if meta.needs_penalties:
        counts = meta.output_counts
        assert counts is not None, "penalties need output_counts"
        if meta.repetition_penalty is not None:
            assert meta.prompt_mask is not None, "repetition penalty needs prompt_mask"
            seen = meta.prompt_mask | (counts > 0)
            r = meta.repetition_penalty.unsqueeze(1)
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if meta.frequency_penalty is not None:
            x -= meta.frequency_penalty.unsqueeze(1) * counts
        if meta.presence_penalty is not None:
            x -= meta.presence_penalty.unsqueeze(1) * (counts > 0).to(x.dtype)
    return x


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's highest probability."""
    probs = x.softmax(dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k best tokens, then the smallest nucleus of mass >= p (at least one token)."""
    if top_k is None and top_p is None:
        return x
    vocab = x.shape[-1]
    if top_p is None:
        assert top_k is not None
        k = top_k.clamp(1, vocab)
        best = x.topk(int(k.max()), dim=-1).values  # [B, max_k]
        kth = best.gather(1, (k - 1).unsqueeze(1))
        return x.masked_fill(x < kth, float("-inf"))
    x_sorted, order = x.sort(dim=-1)  # ascending, [B, V]
    if top_k is not None:
        kth = x_sorted.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        x_sorted = x_sorted.masked_fill(x_sorted < kth, float("-inf"))
    cum = x_sorted.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - top_p.unsqueeze(1)
    drop[:, -1] = False
    x_sorted = x_sorted.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, x_sorted)


def _i64(c: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix_seeds(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int64 [B] generator seeds from a row's seed key (-1: unseeded) and the output index it
    samples, on the tensors' device (splitmix64's finalizer, int64 products wrapping): where
    the index is known on the device only (asynchronous speculation) it is mixed there."""
    x = keys * _GOLDEN + offsets
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return torch.where(keys < 0, -1, x & _SEED_MASK)


def exponential_noise(
    shape: torch.Size, seeds: list[int | None], offsets: list[int], device: torch.device,
    offset_delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exp(1) noise; a seeded row's noise depends only on (seed, offset) and the vocab size.
    offset_delta (int [B] on the device, or None) is subtracted from the offsets first."""
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_()  # [B, V]
    if any(seed is not None for seed in seeds):
        keys = [-1 if seed is None else hash(seed) & _SEED_MASK for seed in seeds]
        both = host_to_device(np.array([keys, offsets], dtype=np.int64), device)  # [2, B]
        offs = both[1] if offset_delta is None else both[1] - offset_delta.to(torch.int64)
        seeded_exponential(q, mix_seeds(both[0], offs))
    return q


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw logprobs (log_softmax of `logits` in float32) of the sampled token and the top k."""
    lp = logits.float().log_softmax(dim=-1)  # [B, V]
    sampled_lp = lp.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (lp >= sampled_lp).sum(dim=-1)
    token_ids, logprobs = sampled.unsqueeze(1), sampled_lp
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        logprobs = torch.cat([logprobs, top_lp], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=logprobs, ranks=ranks)


class Sampler(torch.nn.Module):
    """Samples one token per row of `[B, V]` logits according to `SamplingMetadata`."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.shape[0] == meta.temperature.shape[0], "one metadata row per logits row"
        if (
            meta.all_greedy
            and not meta.banned
            and not meta.bias
            and not meta.needs_penalties
            and meta.max_num_logprobs is None
        ):
            return SamplerOutput(sampled_token_ids=argmax(logits), logprobs=None)

        if meta.banned or meta.bias or meta.needs_penalties:
            x = apply_bans_and_penalties(logits, meta)
        else:
            x = logits
        if meta.all_greedy:
            sampled = argmax(x)
        else:
            sampled = self._sample(x, meta)

        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Random rows: temperature, min-p, top-k/p, exponential race; greedy rows: argmax."""
        is_greedy = meta.temperature < _GREEDY_EPS
        greedy = None if meta.all_random else x.argmax(dim=-1)
        temp = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
        x = x.float() / temp.unsqueeze(1)
        if meta.min_p is not None:
            x = apply_min_p(x, meta.min_p)
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
        probs = x.softmax(dim=-1)  # [B, V]
        q = exponential_noise(probs.shape, meta.seeds, meta.seed_offsets, probs.device,
                              meta.seed_offset_delta)
        sampled = probs.div_(q).argmax(dim=-1)
        if greedy is not None:
            sampled = torch.where(is_greedy, greedy, sampled)
        return sampled

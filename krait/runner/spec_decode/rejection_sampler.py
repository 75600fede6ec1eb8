"""Lossless verification of draft tokens: speculative sampling (vLLM's rejection sampler).

A verify step scores row r at n_r = 1 + k_r consecutive positions: its last accepted token and
its k_r drafts. `RejectionSampler.forward` turns the target model's logits there into up to n_r
output tokens per row, distributed exactly as sampling one token at a time with `Sampler`:

- the target distribution p_j of position j is the row's logits processed as `Sampler` does
  (temperature, min-p, top-k/top-p; greedy rows: the argmax);
- draft d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) (greedy rows: while it is
  the argmax); at the first rejection a token is drawn from the residual max(p_j - q_j, 0)
  and the row stops; when every draft is accepted the bonus token is drawn from p_{k_r}.
- point-mass drafts (q_j(d_j) = 1: every krait drafter's) take the coupled form of that test:
  position j draws t_j from p_j as `Sampler` would, and d_j is accepted when t_j = d_j
  (probability p_j(d_j)); at a rejection t_j is the output, a draw from p_j given t_j != d_j,
  which is the residual. A row's outputs are then the very tokens it would sample without
  drafts: seeded rows give the same output with or without speculation, whatever else shares
  the batch (the verify graphs fill short proposals of sampled rows up to k).

All positions of all rows are processed at once on the packed [T, V] logits: every position gets
its accept test and its residual (or, at a row's last position, bonus) draw, and a cumulative
product over the positions picks where each row stops. A row without drafts (k_r = 0) is a
plain decode row: it samples exactly what `Sampler` samples for it, seeds included.

Seeds: a seeded row's position j uses randomness of (seed, seed_offsets[r] + j) only, the output
index it decides: the draw is `exponential_noise` with `Sampler`'s mixing (so a k_r = 0 row
draws Sampler's token), and with draft distributions the accept test takes a uniform from
`exponential_noise` under a seed mixed with a tag. Unseeded rows draw from the global torch RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from krait.ops.argmax import argmax
from krait.ops.greedy_accept import greedy_accept
from krait.runner.input_batch import to_device
from krait.runner.sampler import (
    _SEED_MASK,
    LogprobsTensors,
    SamplingMetadata,
    apply_bans_and_penalties,
    apply_min_p,
    apply_top_k_top_p,
    compute_logprobs,
    exponential_noise,
)

_GREEDY_EPS = 1e-5  # Sampler's: temperature below it is greedy
_ACCEPT_TAG = 0x5EEDACCE  # mixed into a seed for the accept tests' uniforms


@dataclass
class RejectionSamplerOutput:
    """Tokens of a verify step; only the first num_sampled[r] positions of row r are outputs."""

    output_token_ids: torch.Tensor  # [R, max_n] int64: accepted drafts, then one drawn token; -1
    num_sampled: torch.Tensor  # [R] int32: accepted drafts + 1, in 1..n_r
    # Raw logprobs (log_softmax of the target logits as given) of every output position, shaped
    # per position: token_ids [R, max_n, k + 1] int64 (column 0 the output token, then the top
    # k), logprobs [R, max_n, k + 1] float32, ranks [R, max_n] int64. Past num_sampled[r]: ids
    # -1, logprobs 0.0, ranks 0. None when no row asks for logprobs.
    logprobs: LogprobsTensors | None


class RejectionSampler(torch.nn.Module):
    """Verifies packed draft tokens against the target model's logits (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        # the last step's index tensors, reused while the draft counts stay the same
        self._layout_key: tuple | None = None
        self._layout: _Layout | None = None

    def forward(
        self,
        target_logits: torch.Tensor,
        cu_num_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        meta: SamplingMetadata,
        num_draft_tokens: Sequence[int] | np.ndarray | None = None,
        target_argmax: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        """Accept or replace each row's drafts.

        target_logits [T, V], any float dtype: the target's logits at every position of the
        rows, row r's at cu_num_logits[r]:cu_num_logits[r + 1].
        cu_num_logits int32/int64 [R + 1]: 0, then the running sum of n_r = 1 + k_r.
        draft_token_ids int64 [sum k_r]: row r's k_r drafts, packed in row order.
        draft_probs float32 [sum k_r, V] or None: the draft distribution q each draft was drawn
        from; None for point-mass drafts (an n-gram drafter): q(d) = 1.
        meta: `build_sampling_metadata` of the R rows (seed_offsets[r] = outputs so far).
        num_draft_tokens [R]: k_r on the host, as the scheduler planned them (it must agree with
        cu_num_logits). The engine passes it: the step's index tensors are then built on the
        host and sent in one copy, and cu_num_logits is not read. None reads k_r off
        cu_num_logits, a host sync when that lives on the device.
        target_argmax int64 [T] or None: argmax(target_logits), where the caller has it
        already (a verify graph computes it); used by the all-greedy path only.

        Rows with drafts must not have banned tokens, a logit_bias or penalties (ValueError):
        those change the target distribution with every accepted token. Rows without drafts may.
        """
        num_rows = meta.temperature.shape[0]
        num_logits, vocab = target_logits.shape
        device = target_logits.device
        if num_draft_tokens is None:
            num_drafts = np.diff(np.asarray(cu_num_logits.tolist(), dtype=np.int64)) - 1
        else:
            num_drafts = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
        total_drafts = int(num_drafts.sum())
        if num_drafts.shape[0] != num_rows or (num_drafts < 0).any():
            raise ValueError(f"need k_r >= 0 for each of the {num_rows} rows, got {num_drafts}")
        if total_drafts + num_rows != num_logits:
            raise ValueError(
                f"{num_logits} logits rows for {num_rows} rows with {total_drafts} drafts"
            )
        if draft_token_ids.shape[0] != total_drafts:
            raise ValueError(f"{draft_token_ids.shape[0]} draft ids for {total_drafts} drafts")
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
            raise ValueError(f"draft_probs is {tuple(draft_probs.shape)}, need ({total_drafts}, {vocab})")
        _check_drafted_rows_are_plain(meta, num_drafts)
        max_n = int(num_drafts.max()) + 1 if num_rows else 1
        if num_rows == 0:
            empty = torch.empty(0, max_n, dtype=torch.int64, device=device)
            return RejectionSamplerOutput(empty, torch.empty(0, dtype=torch.int32, device=device),
                                          None)

        key = (num_drafts.tobytes(), device)
        if key != self._layout_key or self._layout is None:
            self._layout, self._layout_key = _layout(num_drafts, max_n, device), key
        lay = self._layout
        plain = not (meta.banned or meta.bias or meta.needs_penalties)
        if meta.all_greedy and plain and meta.max_num_logprobs is None:
            # accept while the draft is the argmax: one launch (krait/ops/greedy_accept.py)
            target = argmax(target_logits) if target_argmax is None else target_argmax  # [T]
            packed = draft_token_ids.to(device=device, dtype=torch.int64, non_blocking=True)
            tokens, num_sampled = greedy_accept(target, packed, lay.firsts, lay.num_drafts,
                                                max_n)
            return RejectionSamplerOutput(output_token_ids=tokens, num_sampled=num_sampled,
                                          logprobs=None)
        if total_drafts:
            packed = draft_token_ids.to(device=device, dtype=torch.int64, non_blocking=True)
            # a valid draft is in the vocabulary; clamped so a bad one cannot fault a gather
            drafts = torch.where(lay.is_draft, packed[lay.draft_idx].clamp_(0, vocab - 1), 0)
        else:
            drafts = torch.zeros(num_logits, dtype=torch.int64, device=device)  # [T]
            draft_probs = None

        x = target_logits
        if not plain:  # only rows without drafts have these: their one position is starts[r]
            x = target_logits.to(torch.float32, copy=True)  # [T, V]
            starts = lay.at[:, 0]
            x.index_copy_(
                0, starts, apply_bans_and_penalties(target_logits.index_select(0, starts), meta)
            )
        accept, drawn = _verify(
            x, drafts, lay.is_draft, lay.draft_idx, draft_probs, lay.row_of, meta,
            _seed_lists(meta, num_drafts),
        )

        at = lay.at
        accepted = accept[at] & lay.draft_col  # [R, max_n]
        num_accepted = accepted.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [R] leading run
        stop = num_accepted.unsqueeze(1)
        tokens = torch.where(
            lay.cols < stop, drafts[at], torch.where(lay.cols == stop, drawn[at], -1)
        )  # [R, max_n]
        num_sampled = (num_accepted + 1).to(torch.int32)

        logprobs = None
        if meta.max_num_logprobs is not None:
            out_tok = torch.where(lay.pos < num_accepted[lay.row_of], drafts, drawn)  # [T]
            lp = compute_logprobs(target_logits, out_tok, meta.max_num_logprobs)
            dead = lay.cols >= num_sampled.unsqueeze(1)  # [R, max_n] past the outputs
            logprobs = LogprobsTensors(
                token_ids=lp.token_ids[at].masked_fill_(dead.unsqueeze(2), -1),
                logprobs=lp.logprobs[at].masked_fill_(dead.unsqueeze(2), 0.0),
                ranks=lp.ranks[at].masked_fill_(dead, 0),
            )
        return RejectionSamplerOutput(
            output_token_ids=tokens, num_sampled=num_sampled, logprobs=logprobs
        )


@dataclass
class _Layout:
    """Where each packed logits row sits, and where each output position reads from."""

    row_of: torch.Tensor  # [T] int64: the row of each logits row
    pos: torch.Tensor  # [T] int64: its position j in that row
    is_draft: torch.Tensor  # [T] bool: j < k_r, a draft is scored here
    draft_idx: torch.Tensor  # [T] int64: the packed index of that draft (clamped elsewhere)
    at: torch.Tensor  # [R, max_n] int64: the logits row of (r, j) (clamped past n_r)
    cols: torch.Tensor  # [1, max_n] int64: j
    draft_col: torch.Tensor  # [R, max_n] bool: j < k_r
    firsts: torch.Tensor  # [R] int64: the logits row of (r, 0)
    num_drafts: torch.Tensor  # [R] int64: k_r


def _layout(num_drafts: np.ndarray, max_n: int, device: torch.device) -> _Layout:
    """The index tensors of a step, computed on the host from k_r and sent in one copy."""
    counts = num_drafts + 1  # [R]
    num_rows, num_logits = counts.shape[0], int(counts.sum())
    firsts = np.cumsum(counts) - counts  # [R]
    flat = np.arange(num_logits)
    row_of = np.repeat(np.arange(num_rows), counts)  # [T]
    pos = flat - firsts[row_of]  # [T]
    is_draft = pos < num_drafts[row_of]  # [T]
    # row r's j-th draft sits at cu[r] - r + j in the packed drafts
    draft_idx = np.clip(flat - row_of, 0, max(int(num_drafts.sum()) - 1, 0))  # [T]
    cols = np.arange(max_n)
    at = np.minimum(firsts[:, None] + cols, num_logits - 1)  # [R, max_n]
    draft_col = cols < num_drafts[:, None]  # [R, max_n]
    (row_of_t, pos_t, is_draft_t, draft_idx_t, at_t, cols_t, draft_col_t, firsts_t,
     num_drafts_t) = to_device(
        [row_of, pos, is_draft, draft_idx, at, cols[None], draft_col, firsts, num_drafts],
        np.int64, device, tag="spec_verify",
    )
    return _Layout(
        row_of=row_of_t, pos=pos_t, is_draft=is_draft_t.bool(), draft_idx=draft_idx_t,
        at=at_t, cols=cols_t, draft_col=draft_col_t.bool(), firsts=firsts_t,
        num_drafts=num_drafts_t,
    )


def _check_drafted_rows_are_plain(meta: SamplingMetadata, num_drafts: np.ndarray) -> None:
    """ValueError when a row with drafts has banned tokens, a logit_bias or penalties.

    Bans and biases are host lists; the penalties live on the device, so a batch that mixes
    penalised rows with drafted rows reads them back (one sync, in that case only)."""
    drafted = num_drafts > 0
    if not drafted.any():
        return
    bad = sorted({i for i, _ in meta.banned} | {i for i, _, _ in meta.bias})
    bad = [i for i in bad if drafted[i]]
    if not bad and meta.needs_penalties:
        penalised = torch.zeros_like(meta.temperature, dtype=torch.bool)  # [R]
        if meta.presence_penalty is not None:
            penalised |= meta.presence_penalty != 0.0
        if meta.frequency_penalty is not None:
            penalised |= meta.frequency_penalty != 0.0
        if meta.repetition_penalty is not None:
            penalised |= meta.repetition_penalty != 1.0
        bad = np.flatnonzero(penalised.cpu().numpy() & drafted).tolist()
    if bad:
        raise ValueError(
            f"rows {bad} have drafts and banned tokens, a logit_bias or penalties; "
            "such rows must be scheduled without drafts"
        )


@dataclass
class _Seeds:
    """Per-logits-row seed lists for `exponential_noise` (empty when no row is seeded)."""

    draw: list[int | None]  # the row's seed: the residual/bonus draw, mixed as Sampler does
    offsets: list[int]  # seed_offsets[r] + j: the output index position j decides

    @property
    def accept(self) -> list[int | None]:
        """The seeds mixed with _ACCEPT_TAG: the accept test's uniforms (draft distributions
        only; point-mass drafts take none)."""
        return [None if s is None else hash((s, _ACCEPT_TAG)) & _SEED_MASK for s in self.draw]


def _seed_lists(meta: SamplingMetadata, num_drafts: np.ndarray) -> _Seeds:
    if all(s is None for s in meta.seeds):
        return _Seeds([], [])
    counts = num_drafts + 1
    row_of = np.repeat(np.arange(len(counts)), counts)  # [T]
    firsts = np.cumsum(counts) - counts  # [R]
    pos = np.arange(int(counts.sum())) - np.repeat(firsts, counts)  # [T]
    offsets = (np.asarray(meta.seed_offsets, dtype=np.int64)[row_of] + pos).tolist()
    return _Seeds([meta.seeds[r] for r in row_of.tolist()], offsets)


def _verify(
    x: torch.Tensor,
    drafts: torch.Tensor,
    is_draft: torch.Tensor,
    draft_idx: torch.Tensor,
    draft_probs: torch.Tensor | None,
    row_of: torch.Tensor,
    meta: SamplingMetadata,
    seeds: _Seeds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logits row: (draft accepted [T] bool, the token drawn there if the row stops there
    [T] int64). The draw is from the residual at draft positions, from p elsewhere."""
    if meta.all_greedy:
        target = argmax(x)  # [T]
        return drafts == target, target
    temperature = meta.temperature[row_of]  # [T]
    is_greedy = temperature < _GREEDY_EPS
    greedy = None if meta.all_random else x.argmax(dim=-1)
    # the steps of Sampler._sample, row for row: a row without drafts gets its exact probs
    temp = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    x = x.float() / temp.unsqueeze(1)
    if meta.min_p is not None:
        x = apply_min_p(x, meta.min_p[row_of])
    x = apply_top_k_top_p(
        x,
        None if meta.top_k is None else meta.top_k[row_of],
        None if meta.top_p is None else meta.top_p[row_of],
    )
    probs = x.softmax(dim=-1)  # [T, V]
    # (asynchronous speculation: the host's output counts less the unlearned rejections)
    delta = None if meta.seed_offset_delta is None else meta.seed_offset_delta[row_of]  # [T]
    noise = exponential_noise(probs.shape, seeds.draw, seeds.offsets, probs.device,
                              delta)  # [T, V]
    if draft_probs is not None:
        col = drafts.unsqueeze(1)  # [T, 1]
        p_draft = probs.gather(1, col).squeeze(1)  # [T]
        q = draft_probs.index_select(0, draft_idx).float()  # [T, V]
        q_draft = q.gather(1, col).squeeze(1)
        # a residual of all zeros means p <= q everywhere, so p = q and nothing is rejected
        probs = torch.where(is_draft.unsqueeze(1), (probs - q).clamp_(min=0.0), probs)
        # exp(-Exp(1)) is Uniform(0, 1]: u * q <= p has probability min(1, p / q)
        u = torch.exp(-exponential_noise(torch.Size((x.shape[0], 1)), seeds.accept,
                                         seeds.offsets, x.device, delta)).squeeze(1)  # [T]
        accept = (u * q_draft <= p_draft) & (p_draft > 0)
    drawn = probs.div_(noise).argmax(dim=-1)  # the exponential race: a draw from probs
    if draft_probs is None:
        # point mass (q(d) = 1): Sampler's own draw at the position, accepted when it is the
        # draft (probability p(d)); otherwise it is the output, a draw from p given "not d",
        # which is the residual. A row so emits what it would without drafts, seeds included
        accept = drawn == drafts
    if greedy is not None:
        accept = torch.where(is_greedy, drafts == greedy, accept)
        drawn = torch.where(is_greedy, greedy, drawn)
    return accept, drawn

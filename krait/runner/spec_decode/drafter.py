"""Drafters: what proposes the tokens a speculative step verifies."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from krait.config import EngineConfig, SpeculativeConfig
from krait.runner.penalties import uses_penalties
from krait.sampling_params import SamplingParams


class Drafter(Protocol):
    """What the runner calls after each read-back step. A drafter that reads the target's
    hidden states (EAGLE, spec_decode/eagle.py) also has `observe(rows, starts, counts, first,
    hidden)`, which the runner calls after every target step (its graphs are off then), and
    `catches_up_every_call = True`: `propose` is called even when no row may draft."""

    def propose(self, token_table: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """token_table int32 [max_reqs, max_model_len] (the host token table), the rows
        (req_state indices) to draft for, their token counts and the most drafts each may
        take -> (drafts int32 [R, k], -1 padded; counts int32 [R])."""
        ...

    def on_requests_removed(self, rows: list[int]) -> None:
        """The requests at these req_state indices left the runner (finished or preempted),
        before their rows are freed: drafters that hold per-request state drop it."""
        ...


class NgramDrafter:
    """Prompt lookup over each request's prompt and output (krait/runner/spec_decode/ngram.py)."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        from krait.runner.spec_decode.ngram import NgramProposer

        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                      spec.prompt_lookup_max)

    def propose(self, token_table, rows, num_tokens, max_drafts):
        width = int(num_tokens.max(initial=1))
        return self.proposer.propose(token_table[rows, :width], num_tokens, max_drafts)

    def on_requests_removed(self, rows: list[int]) -> None:
        """Stateless: nothing to drop."""


def create_drafter(spec: SpeculativeConfig, config: EngineConfig,
                   target: torch.nn.Module | None = None) -> Drafter:
    """The drafter of `spec.method` (ngram: prompt lookup; draft_model: a second checkpoint,
    loaded here with its own caches: krait/runner/spec_decode/draft_model.py; eagle, eagle3: a
    head over the `target` model's hidden states, mtp: Qwen3-Next's own such head:
    krait/runner/spec_decode/eagle.py)."""
    if spec.method == "ngram":
        return NgramDrafter(spec)
    if spec.method == "draft_model":
        from krait.runner.spec_decode.draft_model import DraftModelDrafter  # noqa: PLC0415

        return DraftModelDrafter(spec, config)
    if spec.method in ("eagle", "eagle3", "mtp", "qwen3_next_mtp"):
        from krait.runner.spec_decode.eagle import EagleDrafter  # noqa: PLC0415

        return EagleDrafter(spec, config, target)
    raise ValueError(f"speculative_config.method={spec.method!r} is not supported yet")


def drafts_allowed(params: SamplingParams | None, num_outputs: int) -> bool:
    """Whether a request's next step may verify drafts: the rejection sampler serves
    temperature, top-k/p, min-p, seeds and logprobs, and structured rows (the engine masks each
    verified position by the grammar: `RequestGrammar.fill_along`); rows with penalties, logit
    biases or tokens still banned by min_tokens decode one token a step instead (exact either
    way)."""
    return ever_drafts(params) and num_outputs >= params.min_tokens


def ever_drafts(params: SamplingParams | None) -> bool:
    """Whether any step of a request may verify drafts (`drafts_allowed` but for min_tokens,
    which allows them later)."""
    return params is not None and not uses_penalties(params) and not params.logit_bias

"""Request: the one host-side record of a request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from krait.outputs import Logprob
from krait.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. its grammar failed to compile; stop_reason says why

    @property
    def finished(self) -> bool:
        # identity tests: this runs several times per request per step
        return self is not _WAITING and self is not _RUNNING


_WAITING, _RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


@dataclass
class Request:
    """A request carries counters, not phases: its next step is the tokens from
    `num_computed_tokens` up to `num_tokens` (a prefill chunk or one decode token)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_preemptions: int = 0
    # tokens the device is sampling for this request whose values the host has not seen yet
    # (async scheduling: the next step is scheduled before the last one's results are read);
    # an asynchronous verify step counts all it could produce, 1 + its drafts
    num_inflight: int = 0
    # tokens the runner prefills at its latest admission (the prompt; after a preemption the
    # outputs too): a step past them is a decode step
    num_prefill_tokens: int = 0
    # pipeline micro-batches: scheduled in a batch whose results are not processed yet (such a
    # request is in no other batch)
    in_batch: bool = False
    first_token_time: float | None = None
    # prefix caching: prompt tokens found cached at the first admission (-1: not admitted yet);
    # with recurrent layers, the snapshot slot its state starts from (-1: none) and the shared
    # boundary its prefill stops at to leave a snapshot (0: none)
    num_cached_tokens: int = -1
    snapshot_slot: int = -1
    snapshot_cut: int = 0
    # speculative decoding: drafts proposed for the next step, and this request's tallies
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    # asynchronous speculation: drafts the device's drafter found after the latest step the host
    # has read back (-1: none read back yet, so the next decode step tries drafting)
    num_found_drafts: int = -1
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # structured outputs: the request's matcher (krait/structured/grammar.py RequestGrammar),
    # set once its grammar is compiled; the scheduler does not start the request before
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def waiting_for_grammar(self) -> bool:
        """Structured, and its grammar is not compiled yet: not schedulable."""
        return self.grammar is None and self.params.structured_outputs is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

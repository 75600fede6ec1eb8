"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # top logprobs a request may ask for (OpenAI's top_logprobs, vLLM's default)


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, as vLLM names it: exactly one of `json` (a JSON
    schema, dict or string), `regex`, `choice` (the output is one of the strings), `grammar`
    (EBNF, xgrammar's dialect: `root ::= ...`) or `json_object=True` (any JSON object).

    `disable_any_whitespace`: JSON without free whitespace between its tokens (compact
    separators); otherwise whitespace is free, up to a few characters a run (a model cannot
    loop on whitespace). `validate()` raises ValueError naming the field."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def validate(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set, got {what}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from e
            if not isinstance(value, (dict, bool)):
                raise ValueError("structured_outputs.json: a JSON schema must be an object")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind}: must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of "
                                 "non-empty strings")
        elif value is not True:
            raise ValueError("structured_outputs.json_object: must be true")

    @property
    def kind(self) -> str:
        """The one constraint given: json, regex, choice, grammar or json_object."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, spec): the constraint as a hashable, canonical pair (the compile cache's key);
        JSON schemas are serialized with sorted keys."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                value = json.loads(value)
            spec = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            spec = json.dumps(list(value))
        elif kind == "json_object":
            spec = ""
        else:
            spec = value
        if self.disable_any_whitespace and kind in ("json", "json_object"):
            kind += ":compact"
        return kind, spec


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    `validate()` raises `ValueError` naming the offending field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0 in the OpenAI API layer) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: the token's own)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling (OpenAI's)
    # "cumulative": an output every step a request progresses (streaming); "final_only": one
    # output when it finishes (offline generation; skips per-step copies)
    output_kind: str = "cumulative"
    # a grammar the output must follow (JSON schema, regex, choice, EBNF); the request waits
    # in the scheduler until its grammar is compiled
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, repr=False, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            bad("top_k", f"must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}")
        # beyond the limit the sampler's top-k would outgrow small vocabularies mid-step
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                bad(name, f"must be in [0, {MAX_LOGPROBS}], got {k}")
            if k is not None and vocab_size is not None and k > vocab_size:
                bad(name, f"must not exceed the vocabulary size {vocab_size}, got {k}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or (vocab_size is not None and not 0 <= t < vocab_size):
                bad("logit_bias", f"holds token {t!r}, outside the vocabulary")
            if not -100.0 <= float(b) <= 100.0:
                bad("logit_bias", f"values must be in [-100, 100], got {b} for token {t}")
        if self.output_kind not in ("cumulative", "final_only"):
            bad("output_kind", f"must be 'cumulative' or 'final_only', got {self.output_kind!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if vocab_size is not None:
            for t in self.stop_token_ids or []:
                if not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"holds {t}, outside the vocabulary [0, {vocab_size})")

"""xgrammar behind a small surface: the constraint of a `StructuredOutputsParams` as an
xgrammar `Grammar` (cheap, tokenizer-free: bad schemas, regexes and grammars fail here), the
tokenizer's `TokenizerInfo`, and a request's `RequestGrammar` (its matcher).

xgrammar is imported only when a request asks for structured output; without it such a request
fails with a ValueError saying how to install it."""

from __future__ import annotations

import functools
import json
from typing import Any

from krait.sampling_params import StructuredOutputsParams

_MAX_PATTERN_LENGTH = 64  # see _bounded_strings
MAX_WHITESPACE = 4  # whitespace characters a run between JSON tokens, when whitespace is free


def load_xgrammar() -> Any:
    """The xgrammar module; a ValueError naming structured_outputs if it is not installed."""
    try:
        import xgrammar  # noqa: PLC0415
    except ImportError as e:
        raise ValueError(
            "structured_outputs: this krait has no xgrammar; install it with "
            "`pip install xgrammar` (or krait[structured]) to use response_format, guided "
            "decoding or tool_choice") from e
    return xgrammar


def build_grammar(kind: str, spec: str) -> Any:
    """The xgrammar Grammar of a `StructuredOutputsParams.key()` pair. Raises ValueError
    naming the field (structured_outputs.json / .regex / .choice / .grammar) when the
    constraint is invalid."""
    xgr = load_xgrammar()
    base, _, mode = kind.partition(":")
    compact = mode == "compact"
    json_args: dict[str, Any] = (
        dict(any_whitespace=False) if compact
        else dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE))
    try:
        if base == "json":
            schema = json.loads(spec)
            return xgr.Grammar.from_json_schema(json.dumps(_bounded_strings(schema)), **json_args)
        if base == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **json_args)
        if base == "regex":
            return xgr.Grammar.from_regex(spec)
        if base == "choice":
            options = json.loads(spec)
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in options)
            return xgr.Grammar.from_ebnf(ebnf)
        if base == "grammar":
            return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{base}: invalid ({_short(e)})") from e
    raise ValueError(f"structured_outputs: unknown kind {kind!r}")


def _bounded_strings(schema: Any) -> Any:
    """The schema with each length-bounded plain string (minLength/maxLength, no pattern or
    format) turned into the equivalent pattern of unescaped characters: xgrammar 0.2.8 lets
    raw control characters into length-bounded strings, which is not JSON. Only for bounds up
    to _MAX_PATTERN_LENGTH: its regex compiler fails on longer repetitions, so longer strings
    keep xgrammar's own rule."""
    if isinstance(schema, list):
        return [_bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings(v) for k, v in schema.items()}
    lo, hi = out.get("minLength", 0), out.get("maxLength")
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()
            and isinstance(lo, int) and isinstance(hi, (int, type(None)))
            and max(lo, hi or 0) <= _MAX_PATTERN_LENGTH):
        out.pop("minLength", None), out.pop("maxLength", None)
        span = f"{{{lo},{'' if hi is None else hi}}}"
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{span}$'
    return out


def validate_structured(params: StructuredOutputsParams) -> None:
    """Checks a constraint fully (its fields, then its grammar); ValueError naming the field.
    Constraints that passed are remembered, so the engine's check of a request the server
    checked already (off the event loop) is a lookup."""
    params.validate()
    _check_grammar(*params.key())


@functools.lru_cache(maxsize=1024)
def _check_grammar(kind: str, spec: str) -> None:
    build_grammar(kind, spec)  # raises for a bad one (errors are not cached)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo of an HF tokenizer, masks `vocab_size` wide (the model's logits;
    ids past the tokenizer's vocabulary are never allowed)."""
    xgr = load_xgrammar()
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids) or None)


class RequestGrammar:
    """One request's matcher over its compiled grammar: advanced by each accepted token only
    (never by a rejected draft or a dropped step), it fills the request's next-token mask."""

    def __init__(self, compiled: Any) -> None:
        xgr = load_xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False if the grammar does not allow it (state unchanged)."""
        return bool(self.matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """The grammar accepted its end (a stop token): the request is done."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: Any, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 CPU tensor [S, W])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def _walk(self, drafts: list[int], fill=None) -> tuple[int, int, bool]:
        """Accepts drafts in order while the grammar allows them and the output has not ended,
        `fill(j)` before looking at draft j: (drafts accepted, drafts looked at, stopped early:
        one refused or the output ended). The caller rolls the accepted ones back."""
        accepted = 0
        for j, tok in enumerate(drafts):
            if fill is not None:
                fill(j)
            if not self.accept(tok):
                return accepted, j + 1, True
            accepted += 1
            if self.is_terminated():
                return accepted, j + 1, True
        return accepted, len(drafts), False

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows in a row, stopping before one that would
        end the output (no mask follows an end); the matcher is left as it was."""
        accepted, _, _ = self._walk(drafts)
        ended = accepted > 0 and self.is_terminated()  # (by the last one accepted)
        if accepted:
            self.matcher.rollback(accepted)
        return accepted - ended

    def fill_along(self, bitmask: Any, row: int, drafts: list[int]) -> None:
        """The masks of a verify row: bitmask[row + j] after drafts[:j], j = 0 .. len(drafts);
        the matcher is left as it was. Past a draft the grammar forbids (its own mask rules it
        out, so verification rejects it there) or one that ends the output, the rows allow
        every token: nothing sampled there is kept."""
        accepted, filled, stopped = self._walk(drafts, lambda j: self.fill(bitmask, row + j))
        if not stopped:
            self.fill(bitmask, row + filled)
            filled += 1
        bitmask[row + filled : row + len(drafts) + 1] = -1  # all bits set
        if accepted:
            self.matcher.rollback(accepted)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's mask."""
    return (vocab_size + 31) // 32


def _short(e: BaseException) -> str:
    """An xgrammar error without its C++ source prefix ("[12:00:00] file.cc:83: ...")."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        if ": " in text and ".cc:" in text.split(": ", 1)[0]:
            text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__

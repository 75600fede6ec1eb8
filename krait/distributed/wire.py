"""Compact encodings of what crosses the executor's rings each step. Pickling dataclass objects
costs microseconds apiece (64 CachedRequestData and 64 SampledTokens were most of a step's
control path); lists of plain values cost far less, and the worker keeps the cached requests as
columns."""

from __future__ import annotations

import dataclasses

from krait.engine.scheduler import CachedColumns, SampledTokens, SchedulerOutput

_FIELDS = [f.name for f in dataclasses.fields(SchedulerOutput) if f.name != "cached_reqs"]


def encode_sched(s: SchedulerOutput) -> tuple:
    c = CachedColumns.of(s.cached_reqs)
    cached = (c.req_ids, c.new_block_ids, c.num_computed_tokens, c.new_token_ids)
    return cached, [getattr(s, name) for name in _FIELDS]


def decode_sched(t: tuple) -> SchedulerOutput:
    """The SchedulerOutput, its cached requests as CachedColumns (no object a row)."""
    cached, rest = t
    return SchedulerOutput(cached_reqs=CachedColumns(*cached), **dict(zip(_FIELDS, rest)))


def encode_sampled(out: dict[str, SampledTokens]):
    """(req ids, [token ids]) when no row carries logprobs, else the objects themselves."""
    toks = []
    for v in out.values():
        if v.logprobs is not None or v.ranks is not None or v.prompt_logprobs is not None:
            return out
        toks.append(v.token_ids)
    return list(out), toks


def decode_sampled(x) -> dict[str, SampledTokens]:
    if isinstance(x, tuple):
        return dict(zip(x[0], map(SampledTokens, x[1])))
    return x

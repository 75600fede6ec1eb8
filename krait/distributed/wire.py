"""Compact encodings of what crosses the executor's pipes each step. Pickling dataclass objects
costs microseconds apiece (64 CachedRequestData and 64 SampledTokens were most of a step's
control path); lists of plain values cost far less."""

from __future__ import annotations

import dataclasses

from krait.engine.scheduler import CachedRequestData, SampledTokens, SchedulerOutput


def encode_sched(s: SchedulerOutput) -> tuple:
    c = s.cached_reqs
    cached = ([r.req_id for r in c], [r.new_block_ids for r in c],
              [r.num_computed_tokens for r in c])
    rest = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
            if f.name not in ("cached_reqs",)}
    return cached, rest


def decode_sched(t: tuple) -> SchedulerOutput:
    (ids, blocks, computed), rest = t
    cached = [CachedRequestData(r, b, n) for r, b, n in zip(ids, blocks, computed)]
    return SchedulerOutput(cached_reqs=cached, **rest)


def encode_sampled(out: dict[str, SampledTokens]):
    """{req_id: token ids} when no row carries logprobs, else the objects themselves."""
    for v in out.values():
        if v.logprobs is not None or v.ranks is not None or v.prompt_logprobs is not None:
            return out
    return ("ids", {r: v.token_ids for r, v in out.items()})


def decode_sampled(x) -> dict[str, SampledTokens]:
    if isinstance(x, tuple):
        return {r: SampledTokens(ids) for r, ids in x[1].items()}
    return x

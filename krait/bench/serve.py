"""`krait bench serve`: drive a running OpenAI-compatible server and measure it.

Sends `--num-prompts` streaming completions of random token-id prompts (`--input-len` tokens,
`--output-len` tokens out with ignore_eos), arriving as a Poisson process at `--request-rate`
requests/s (all at once when it is inf), at most `--max-concurrency` in flight. Prints one JSON
object on stdout (throughputs; TTFT, TPOT, ITL and end-to-end latency mean/median/p99 in ms) and
a readable table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from krait import envs
from krait.bench.cli_args import add_serve_args as add_cli_args  # noqa: F401

FALLBACK_VOCAB = 1000  # when /v1/models does not say (e.g. another server): ids below this


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks


async def _one(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """One streaming completion, timed chunk by chunk."""
    res = RequestResult(prompt_len=len(payload["prompt"]))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message", "error")
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if not obj.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
    except Exception as exc:  # a failed request is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = chunks > 0
    if not res.ok:
        res.error = "no output"
    return res


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    return {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.median(arr)),
            f"p99_{prefix}_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """The benchmark's JSON result."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    summary.update(_stats([r.ttft for r in ok], "ttft"))
    summary.update(_stats(tpot, "tpot"))
    summary.update(_stats([x for r in ok for x in r.itl], "itl"))
    summary.update(_stats([r.latency for r in ok], "e2el"))
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def format_table(summary: dict, args: argparse.Namespace) -> str:
    lines = ["============ krait serving benchmark ============",
             f"{'base url':<32}{args.base_url}",
             f"{'request rate (req/s)':<32}{args.request_rate}",
             f"{'max concurrency':<32}{args.max_concurrency}"]
    for key, value in summary.items():
        if key == "errors":
            continue
        lines.append(f"{key:<32}{value:.2f}" if isinstance(value, float) else f"{key:<32}{value}")
    for err in summary.get("errors", []):
        lines.append(f"error: {err}")
    lines.append("=" * 49)
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict:
    """Run the benchmark against `args.base_url`; returns the summary dict."""
    import httpx

    base = args.base_url.rstrip("/")
    key = args.api_key or envs.get("KRAIT_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limit = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0),
                                 limits=limits) as client:
        resp = await client.get(f"{base}/v1/models", headers=headers)
        resp.raise_for_status()
        card = resp.json()["data"][0]
        model = args.model or card["id"]
        vocab = card.get("vocab_size") or FALLBACK_VOCAB
        max_len = card.get("max_model_len")
        if max_len and args.input_len + args.output_len > max_len:
            raise ValueError(f"input_len + output_len = {args.input_len + args.output_len} "
                             f"exceeds the server's max_model_len {max_len}")
        rng = random.Random(args.seed)
        payloads = [{
            "model": model,
            "prompt": [rng.randrange(vocab) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        } for _ in range(args.num_prompts)]
        sem = asyncio.Semaphore(limit)
        url = f"{base}/v1/completions"

        async def limited(payload: dict) -> RequestResult:
            async with sem:
                return await _one(client, url, payload, headers)

        start = time.perf_counter()
        tasks = []
        for payload in payloads:
            tasks.append(asyncio.create_task(limited(payload)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(list(results), duration)


def main(args: argparse.Namespace) -> int:
    """Entry of `krait bench serve`: JSON on stdout, a table on stderr; 1 if any request failed."""
    summary = asyncio.run(run(args))
    print(format_table(summary, args), file=sys.stderr)
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0

"""The options of `krait bench latency | throughput | prefix | serve`, apart from the benchmark
code: building the CLI's parser imports only this (argparse, no torch, numpy or transformers)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


def named_configs() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").exists())


def add_offline_args(p: argparse.ArgumentParser, kind: str) -> None:
    p.add_argument("--config", default=None, choices=named_configs(),
                   help="a realistic configuration shipped with krait (implies dummy weights)")
    if kind == "latency":
        # the engine's rows: at least the largest batch size, which is the default
        p.set_defaults(max_num_seqs=None)
        p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
        p.add_argument("--context-len", type=int, default=1024)
        p.add_argument("--prompt-lens", default="512,2048,8192")
        p.add_argument("--num-steps", type=int, default=20)
        p.add_argument("--workload", default="random", choices=["random", "repetitive"],
                       help="repetitive: prompts of a repeated phrase (ngram drafting's case)")
        p.add_argument("--structured-json", action="store_true",
                       help="constrain every decode row by a small JSON schema (an array of "
                       "digits that never ends within the run): the cost of grammar masks")
        p.add_argument("--tokenizer", default=None,
                       help="tokenizer directory for --structured-json when the model has none "
                       "(default: the bundled 512-token demo tokenizer)")
    else:
        p.add_argument("--num-prompts", type=int, default=256)
        p.add_argument("--input-len", type=int, default=256)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--hf-baseline", action="store_true",
                       help="also run Hugging Face transformers generate on the same workload")
        p.add_argument("--hf-batch-size", type=int, default=32)
        p.add_argument("--hf-max-prompts", type=int, default=64,
                       help="HF runs at most this many of the prompts (its rate is per token)")
        p.add_argument("--hf-output-len", type=int, default=None,
                       help="output tokens per prompt for HF (default: --output-len); fewer keep "
                            "long runs short and only raise HF's per-token rate (shorter contexts)")
        p.add_argument("--hf-repeats", type=int, default=2,
                       help="timed HF passes after a warm-up; the fastest is the baseline")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, choices=named_configs(),
                   help="a realistic configuration shipped with krait (implies dummy weights)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-warm", type=int, default=5, help="warm requests timed one at a time")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root (the /v1 routes are under it)")
    parser.add_argument("--model", default=None, help="model name (default: the first served)")
    parser.add_argument("--api-key", default=None,
                        help="bearer key (default: $KRAIT_API_KEY or $OPENAI_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: unlimited)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    return parser

"""In-model A/B of krait/ops/linear.py's plan constants (which kernel serves a projection), or
of another krait.ops module's switches (MODULE.CONST):
`krait bench latency` once per variant and run, each run in its own process with the variant's
constants set before the engine is built (the plan is read when the graphs are captured), the
variants interleaved so that drift hits them alike. A standalone kernel bench
(scripts/bench_gemv_rows.py) misses what a chain adds: PDL overlaps a Triton kernel's ramp with
the previous kernel's tail, and a cuBLAS launch breaks that chain.

PYTHONPATH=. python3 scripts/ab_plan.py --variant base: --variant rows:MULTI_ROW_MAX_N=16384 \
    [--repeat 2] -- --config mamba2-1.3b --batch-sizes 1 --prompt-lens "" \
    --workload repetitive --speculative-config '{"method":"ngram","num_speculative_tokens":3}'

A variant is NAME:CONST=INT[,CONST=INT...] (NAME: alone runs the plan as it is; CONST may be
MODULE.CONST of krait/ops/MODULE.py). Prints one JSON
line per (variant, run, batch): step_ms, graph_ms, verify_graph_ms, tokens_per_row_step; then one
line per (variant, batch) with the medians over the runs."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("step_ms", "graph_ms", "verify_graph_ms", "tokens_per_row_step")


def _owner(key: str):
    """The module a constant lives in: krait.ops.linear, or krait.ops.MODULE for MODULE.CONST."""
    import importlib

    module, _, attr = key.rpartition(".")
    return importlib.import_module(f"krait.ops.{module or 'linear'}"), attr


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """'rows:MULTI_ROW_MAX_N=16384' -> ('rows', {'MULTI_ROW_MAX_N': 16384}); every constant
    must be an int (or bool) one of krait.ops.linear's, or of another krait.ops module written
    MODULE.CONST (selective_state_verify.UNROLL_MAX_PAIRS=0): a misspelt one would measure the
    tree as it is."""
    name, _, body = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r}: NAME:CONST=INT[,...]")
    consts: dict[str, int] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        try:
            module, attr = _owner(key)
        except ImportError:
            module, attr = None, key
        if not isinstance(getattr(module, attr, None), int):
            raise ValueError(f"variant {text!r}: no int constant {key!r} in krait.ops")
        consts[key] = int(value)
    return name, consts


def child(consts: dict[str, int], bench_args: list[str]) -> None:
    """Sets the constants, then runs `krait bench latency` in this process."""
    from krait.cli import main

    for key, value in consts.items():
        module, attr = _owner(key)
        setattr(module, attr, type(getattr(module, attr))(value))
    main(["bench", "latency", *bench_args])


def run(consts: dict[str, int], bench_args: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(consts), "--", *bench_args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{consts}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    own, bench_args = argv[:split], argv[split + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(own)
    if args.child is not None:
        child(json.loads(args.child), bench_args)
        return
    variants = [parse_variant(v) for v in args.variant or ["base:"]]
    seen: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.repeat):
        for name, consts in variants:
            result = run(consts, bench_args)
            for row in result["decode"]:
                line = {"variant": name, "run": r, "batch": row["batch"],
                        **{f: row.get(f) for f in FIELDS}}
                print(json.dumps(line), flush=True)
                seen.setdefault((name, row["batch"]), []).append(line)
    for (name, batch), lines in seen.items():
        med = {f: statistics.median(v) if (v := [x[f] for x in lines if x[f] is not None])
               else None for f in FIELDS}
        print(json.dumps({"variant": name, "batch": batch, "median": med}), flush=True)


if __name__ == "__main__":
    main()

"""Where a batch-1 decode step's time goes inside the PDL chain, program by program.

Builds an engine of one row with KRAIT_TIMELINE=1 (krait/ops/timeline.py: each instrumented
kernel captured into the decode graph writes the global timer at its programs' entry, after
their PDL wait and at their exit), decodes a row of `--context` tokens, replays the step's graph
and prints, per launch in stream order, those times relative to the step's first entry: when
its first and last programs started (placement), when the first returned from the wait (the
kernel before finished and flushed), when the last exited, and the gap from the previous
launch's last exit. A summary per kernel follows, and the per-launch rows go to --json.

PYTHONPATH=. python3 scripts/timeline_decode.py --config qwen3-0.6b [--context 1024]
    [--launches 24] [--json out.json]    (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


def launch_rows(records: list[dict]) -> list[dict]:
    """Per launch: µs relative to the earliest entry of all, from programs that stamped."""
    starts = [int(r["entry"][r["entry"] > 0].min()) for r in records if (r["entry"] > 0).any()]
    if not starts:
        return []
    t0 = min(starts)
    rows, prev_exit = [], None

    def us(v) -> float | None:
        return None if v is None else (int(v) - t0) / 1e3

    for i, r in enumerate(records):
        e, w, x = (r[k][r[k] > 0] for k in ("entry", "waited", "exit"))
        looped = r.get("looped", torch.zeros(0, dtype=torch.int64))
        looped = looped[looped > 0]
        row = {"launch": i, "kernel": r["name"], "programs": r["programs"],
               "entry_first": us(e.min()) if len(e) else None,
               "entry_last": us(e.max()) if len(e) else None,
               "waited_first": us(w.min()) if len(w) else None,
               "looped_last": us(looped.max()) if len(looped) else None,
               "exit_median": us(x.median()) if len(x) else None,
               "exit_last": us(x.max()) if len(x) else None}
        row.update(_per_sm(r))
        row["after_prev_exit"] = (row["exit_last"] - prev_exit
                                  if row["exit_last"] is not None and prev_exit is not None
                                  else None)
        if row["exit_last"] is not None:
            prev_exit = row["exit_last"]
        rows.append(row)
    return rows


def _per_sm(r: dict) -> dict:
    """How the launch's programs spread over SMs: SMs used, the most programs on one SM, and
    how many of the last-exiting tenth of programs ran on an SM with that most."""
    if "sm" not in r or not (r["entry"] > 0).any():
        return {"sms": None, "most_per_sm": None, "tail_on_most": None}
    ran = r["entry"] > 0
    sm = r["sm"][ran]
    counts = torch.bincount(sm)
    most = int(counts.max())
    exits = r["exit"][ran]
    tail = exits.argsort(descending=True)[:max(1, len(exits) // 10)]
    on_most = int((counts[sm[tail]] == most).sum())
    return {"sms": int((counts > 0).sum()), "most_per_sm": most,
            "tail_on_most": f"{on_most}/{len(tail)}"}


def summary(rows: list[dict]) -> list[str]:
    """Mean µs per kernel: its share of the chain (last exit after the previous launch's last
    exit), its own span (first entry to last exit), wait-return to last exit."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r)
    out = [f"{'kernel':16} {'launches':>8} {'chain us':>9} {'span us':>8} {'after wait':>10} "
           f"{'placing':>8} {'loop end':>8} {'p50 exit':>8}   (loop end: the last program's loop"
           " end to the last exit; p50 exit: the median program's exit to the last's)"]
    def mean(rs: list[dict], f) -> float:
        vals = [v for v in (f(r) for r in rs) if v is not None]
        return statistics.fmean(vals) if vals else float("nan")

    for name, rs in by.items():
        out.append(
            f"{name:16} {len(rs):>8} {mean(rs, lambda r: r['after_prev_exit']):>9.2f} "
            f"{mean(rs, lambda r: _minus(r['exit_last'], r['entry_first'])):>8.2f} "
            f"{mean(rs, lambda r: _minus(r['exit_last'], r['waited_first'])):>10.2f} "
            f"{mean(rs, lambda r: _minus(r['entry_last'], r['entry_first'])):>8.2f} "
            f"{mean(rs, lambda r: _minus(r.get('exit_last'), r.get('looped_last'))):>8.2f} "
            f"{mean(rs, lambda r: _minus(r.get('exit_last'), r.get('exit_median'))):>8.2f}")
    return out


def _minus(a, b):
    return None if a is None or b is None else a - b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--launches", type=int, default=24, help="launches printed one by one")
    p.add_argument("--json", default=None, help="write every launch's row here")
    args = p.parse_args()
    os.environ["KRAIT_TIMELINE"] = "1"
    # only the decode graphs captured (no piecewise or prefill graphs: their records would mix
    # with the decode step's)
    os.environ.setdefault("KRAIT_PIECEWISE_GRAPHS", "0")

    from krait.bench.offline import _engine, _model_dir, _prompts
    from krait.cli import build_parser
    from krait.ops import timeline
    from krait.sampling_params import SamplingParams

    bench_args = build_parser().parse_args(["bench", "latency", "--config", args.config])
    engine = _engine(bench_args, _model_dir(bench_args), max_model_len=args.context + 64,
                     max_num_seqs=1, max_num_batched_tokens=2048)
    if engine.runner.cuda_graphs is None or not timeline.RECORDS:
        print("no decode graph was captured with the timeline on", file=sys.stderr)
        return 1
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True,
                            output_kind="final_only")
    engine.add_request("timeline", {"prompt_token_ids": _prompts(1, args.context, vocab, 0)[0]},
                       params)
    for _ in range(args.context // 2048 + 8):  # the prefill, then decode steps
        engine.step()
    timeline.clear()
    engine.runner.cuda_graphs.replay_ms(1, repeats=5)  # the last replay's stamps stay
    torch.cuda.synchronize()
    # launches of graphs never replayed (none expected) wrote nothing: dropped
    rows = launch_rows([r for r in timeline.read() if (r["entry"] > 0).any()])
    print(f"{'#':>4} {'kernel':16} {'progs':>6} {'entry':>8} {'last entry':>10} {'waited':>8} "
          f"{'looped':>8} {'exit p50':>8} {'exit':>8} {'+chain':>7} {'SMs':>4} {'most':>4} "
          f"{'tail':>6}   (µs from the step's first entry; SMs used, most programs on one SM,"
          " the last-exiting tenth's programs on such an SM)")
    for r in rows[:args.launches]:
        cells = [f"{r[k]:>{w}.2f}" if r[k] is not None else f"{'-':>{w}}" for k, w in
                 (("entry_first", 8), ("entry_last", 10), ("waited_first", 8),
                  ("looped_last", 8), ("exit_median", 8), ("exit_last", 8),
                  ("after_prev_exit", 7))]
        cells += [f"{r[k] if r[k] is not None else '-':>{w}}" for k, w in
                  (("sms", 4), ("most_per_sm", 4), ("tail_on_most", 6))]
        print(f"{r['launch']:>4} {r['kernel']:16} {r['programs']:>6} " + " ".join(cells))
    print("\n".join(summary(rows)))
    last = max((r["exit_last"] for r in rows if r["exit_last"] is not None), default=0.0)
    print(f"{len(rows)} instrumented launches, {last:.1f} µs from the first entry to the last exit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "context": args.context, "launches": rows}, f,
                      indent=1)
    engine.abort_request(["timeline"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

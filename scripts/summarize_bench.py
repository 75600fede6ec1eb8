"""One table from the `krait bench latency` JSON files a gpu_check.sh call leaves (lat_*.json):
model, tag (what the file name carries after the model), batch, step ms, roofline ratio, the
host's time blocked on the device a step (near 0: that run was host-bound, and its step time
says nothing about the GPU work), and the step's graph replayed back to back (the GPU's own
time, host-independent); with speculation also the verify step's graph replayed back to back and
the tokens a row emits a step (a call returns few files, so its output must carry these).

python3 scripts/summarize_bench.py DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(directory: Path) -> list[tuple]:
    out = []
    for f in sorted(directory.glob("lat_*.json")):
        try:
            d = json.loads(f.read_text())
        except (json.JSONDecodeError, OSError):
            continue  # a run that timed out or failed leaves an empty or partial file
        model = d.get("model", "?")
        tag = f.stem.removeprefix("lat_").removeprefix(model) or "-"
        for r in d.get("decode", []):
            out.append((model, tag.lstrip("_"), r["batch"], r["step_ms"], r["ratio"],
                        r.get("device_wait_ms", float("nan")),
                        r.get("graph_ms") or float("nan"),
                        r.get("verify_graph_ms") or float("nan"),
                        r.get("tokens_per_row_step") or float("nan")))
    return out


def main() -> None:
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    print(f"{'model':22} {'tag':18} {'batch':>5} {'step ms':>8} {'ratio':>6} {'wait ms':>8} "
          f"{'graph ms':>8} {'verify ms':>9} {'tok/step':>8}")
    for model, tag, batch, ms, ratio, wait, graph, verify, per_step in rows(directory):
        print(f"{model:22} {tag:18} {batch:>5} {ms:>8.3f} {ratio:>6.2f} {wait:>8.3f} "
              f"{graph:>8.3f} {verify:>9.3f} {per_step:>8.2f}")


if __name__ == "__main__":
    main()

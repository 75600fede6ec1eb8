"""Writes a draft-model checkpoint directory for a bench config: the config cut to its first
LAYERS layers (random weights under `load_format=dummy`), so the draft shares the target's
vocabulary but not its predictions (`gpu_check.sh spec`: the always-rejected draft model).

python3 scripts/draft_config.py NAME OUT_DIR [LAYERS]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from krait.bench.offline import CONFIG_DIR


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    cfg = json.loads((CONFIG_DIR / name / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    for key in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


if __name__ == "__main__":
    main()

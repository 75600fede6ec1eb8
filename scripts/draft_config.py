"""Writes a draft-model checkpoint directory for a bench config: the config cut to its first LAYERS
layers (random weights under `load_format=dummy`), sharing the target's vocabulary. Under the
same seed such a draft shares the target's embedding and first layers, and its drafts are often
accepted (on the GPU: qwen3-0.6b 0.65, but granite-4.0-h-micro 0.00). `--foreign` is the
always-rejected draft: it halves the widths (hidden, intermediate, heads), so every weight
differs, and unties the draft's lm_head from its embedding. (Small random weights leave the
residual stream near the input embedding, so a tied model's logits are about E·e_last and its
greedy token repeats the last one. Every such model agrees on that, so tied foreign drafts were
accepted throughout on the H200. An untied head picks other tokens: acceptance 0.00 on CPU for a
tiny Qwen3 target.) `--eagle` writes an EAGLE-1 head for a Llama-family config instead (one
decoder layer at the target's widths, `LlamaForCausalLMEagle`; random weights: its drafts are
rejected, so a bench shows what the head and its graphs cost).

python3 scripts/draft_config.py NAME OUT_DIR [LAYERS] [--foreign | --eagle]

NAME: a krait/bench/configs name, or a directory holding a config.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from krait.bench.offline import CONFIG_DIR


def draft_config(cfg: dict, layers: int = 2, foreign: bool = False,
                 eagle: bool = False) -> dict:
    """The draft's config.json dict for the target config `cfg` (see the module doc)."""
    cfg = dict(cfg)
    if eagle:
        layers = 1
        cfg["architectures"] = ["LlamaForCausalLMEagle"]
        cfg["model_type"] = "llama"
    if foreign:
        for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
            if isinstance(cfg.get(key), int) and cfg[key] % 2 == 0:
                cfg[key] //= 2
        # head_dim stays; Mamba2 heads follow the halved width (expand * hidden / head_dim)
        if "num_heads" in cfg and "head_dim" in cfg and cfg.get("model_type") == "mamba2":
            cfg["num_heads"] = cfg.get("expand", 2) * cfg["hidden_size"] // cfg["head_dim"]
        cfg["tie_word_embeddings"] = False
    cfg["num_hidden_layers"] = layers
    for key in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    return cfg


def read_config(name: str) -> dict:
    """A bench config by name, or the config.json of a directory."""
    path = Path(name)
    src = path / "config.json" if path.is_dir() else CONFIG_DIR / name / "config.json"
    return json.loads(src.read_text())


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name, out = args[0], Path(args[1])
    layers = int(args[2]) if len(args) > 2 else 2
    cfg = draft_config(read_config(name), layers, foreign="--foreign" in sys.argv,
                       eagle="--eagle" in sys.argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


if __name__ == "__main__":
    main()

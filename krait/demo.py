"""The built-in demo model: a small seeded random checkpoint with the bundled tokenizer.

Built on first use into a cache directory so every CLI command works on a fresh machine.
Its weights are random: the text it writes is meaningless."""

from __future__ import annotations

import os
from pathlib import Path

from krait import envs

DEMO_NOTICE = "krait: using the built-in demo model (random weights: its text is meaningless)"
DEMO_VERSION = "2"


def demo_model_dir() -> Path:
    root = Path(envs.get("KRAIT_CACHE_DIR")).expanduser()
    return root / f"demo-model-v{DEMO_VERSION}"


def _demo_config():
    """A small GraniteMoeHybrid-style hybrid: Mamba2 layers around one attention layer, MoE
    with a shared expert."""
    import transformers as tf

    return tf.GraniteMoeHybridConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=128,
        shared_intermediate_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=32,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        max_position_embeddings=2048,
        position_embedding_type="nope",
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def ensure_demo_model() -> str:
    """Returns the demo checkpoint's directory, building it (seeded) if missing."""
    d = demo_model_dir()
    if (d / "config.json").exists() and any(d.glob("*.safetensors")):
        return str(d)
    import torch
    import transformers as tf

    from krait.tokenizer_utils import save_demo_tokenizer

    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    model = tf.GraniteMoeHybridForCausalLM(_demo_config())
    model.save_pretrained(tmp)
    save_demo_tokenizer(tmp)
    try:
        tmp.rename(d)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(d)

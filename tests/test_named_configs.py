"""The realistic configurations `krait bench --config` ships: each builds krait's model class
with exactly the parameters HF transformers builds for it (on the meta device: no memory, no
weights), so a benchmark of a config that never ran here measures the real architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from krait.bench.offline import CONFIG_DIR, named_configs
from krait.models.registry import get_model_class


def test_the_issue_configs_are_shipped():
    want = {"mamba2-1.3b", "granite-4.0-h-tiny", "granite-4.0-h-micro", "nemotron-h-8b",
            "qwen3-0.6b", "llama-3.2-1b"}
    assert want <= set(named_configs())


@pytest.mark.parametrize("name", named_configs())
def test_config_builds_the_hf_architecture(name):
    hf_config = AutoConfig.from_pretrained(CONFIG_DIR / name)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            ours = get_model_class(hf_config)(hf_config)
            theirs = AutoModelForCausalLM.from_config(hf_config)
    finally:
        torch.set_default_dtype(old)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    # the sizes the models are published at (billions), as a check on the configs themselves
    published = {"bamba-9b": 9.78, "granite-4.0-h-micro": 3.19, "granite-4.0-h-tiny": 6.94,
                 "llama-3.2-1b": 1.24, "mamba2-1.3b": 1.34, "nemotron-h-8b": 8.10,
                 "qwen3-0.6b": 0.60}
    if name in published:
        assert abs(count / 1e9 - published[name]) < 0.01, count

"""Model classes by the architecture name in config.json."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Mamba2ForCausalLM": ("mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": ("bamba", "BambaForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    # EAGLE heads (speculative_config method "eagle" / "eagle3"), not models of their own
    "EagleLlamaForCausalLM": ("eagle", "EagleLlamaForCausalLM"),
    "LlamaForCausalLMEagle": ("eagle", "EagleLlamaForCausalLM"),
    "Eagle3LlamaForCausalLM": ("eagle", "Eagle3LlamaForCausalLM"),
    "LlamaForCausalLMEagle3": ("eagle", "Eagle3LlamaForCausalLM"),
    # Qwen3-Next's multi-token-prediction head (method "mtp"), read from the target's checkpoint
    "Qwen3NextMTP": ("qwen3_next_mtp", "Qwen3NextMTP"),
}


def register_model(arch: str, module: str, cls_name: str) -> None:
    _MODELS[arch] = (module, cls_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("model: config.json names no architectures")
    arch = archs[0]
    if arch not in _MODELS:
        raise ValueError(
            f"model architecture {arch!r} is not supported; supported: "
            + ", ".join(supported_architectures())
        )
    module, cls_name = _MODELS[arch]
    return getattr(importlib.import_module(f"krait.models.{module}"), cls_name)

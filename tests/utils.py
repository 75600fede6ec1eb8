"""Tiny random Hugging Face checkpoints for tests (built here; nothing is downloaded), and the
hybrid-architecture table the hybrid tests share."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 512  # the bundled demo tokenizer's size

# test name -> (HF architecture, krait.models module that implements it)
ARCHS = {
    "mamba2": ("Mamba2ForCausalLM", "mamba2"),
    "bamba": ("BambaForCausalLM", "bamba"),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    "nemotronh": ("NemotronHForCausalLM", "nemotron_h"),
    "falconh1": ("FalconH1ForCausalLM", "falcon_h1"),
}


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def device_options() -> dict:
    """CPU float32, or the device named by KRAIT_TEST_DEVICE (float32 too)."""
    return dict(device=os.environ.get("KRAIT_TEST_DEVICE", "cpu"), dtype="float32")


def require_arch(arch: str) -> None:
    """Skips while krait does not implement `arch` yet (not registered, or its file missing)."""
    from krait.models.registry import supported_architectures

    hf_arch, module = ARCHS[arch]
    if hf_arch not in supported_architectures():
        pytest.skip(f"{hf_arch} is not in krait.models.registry yet")
    name = f"krait.models.{module}"
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        pytest.skip(f"{name} is not written yet")


def _save(model, directory: Path) -> str:
    from krait.tokenizer_utils import save_demo_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_demo_tokenizer(directory)
    return str(directory)


def make_tiny_llama(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Saves a tiny random dense model (`arch`: llama, qwen3, qwen2, mistral) with the demo
    tokenizer into `path` and returns the directory."""
    import transformers as tf

    cls_cfg, cls_model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs)).eval()
    return _save(model, Path(path))


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int):
    """HF transformers (CPU, float32) greedy continuation and per-step log-softmax, one prompt
    at a time. Returns (token lists, per-token logprob-of-chosen lists, full logprob rows)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, lps, rows = [], [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                # explicit: generate otherwise masks every prompt token equal to pad_token_id
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
                eos_token_id=None,
            )
            new = out.sequences[0, len(p) :].tolist()
            logp = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.logits])
            tokens.append(new)
            lps.append([logp[i, t].item() for i, t in enumerate(new)])
            rows.append(logp)
    return tokens, lps, rows


def _hybrid_specs():
    import transformers as tf

    mamba = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    return {
        "mamba2": (
            tf.Mamba2Config,
            tf.Mamba2ForCausalLM,
            dict(mamba, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16,
                 conv_kernel=4, chunk_size=16),
        ),
        "bamba": (
            tf.BambaConfig,
            tf.BambaForCausalLM,
            dict(mamba, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
                 mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=256),
        ),
        "granitemoehybrid": (
            tf.GraniteMoeHybridConfig,
            tf.GraniteMoeHybridForCausalLM,
            dict(mamba, num_hidden_layers=3, intermediate_size=64, shared_intermediate_size=96,
                 num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                 num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
                 mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
                 mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                 max_position_embeddings=256, embedding_multiplier=2.0,
                 logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                 position_embedding_type="rope"),
        ),
        "nemotronh": (
            tf.NemotronHConfig,
            tf.NemotronHForCausalLM,
            dict(mamba, num_hidden_layers=4, hybrid_override_pattern="M*-E",
                 intermediate_size=128, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
                 n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
                 mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
                 max_position_embeddings=256),
        ),
        "falconh1": (
            tf.FalconH1Config,
            tf.FalconH1ForCausalLM,
            dict(mamba, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, mamba_n_heads=8, mamba_d_head=16,
                 mamba_d_ssm=128, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=256,
                 embedding_multiplier=1.7, lm_head_multiplier=0.6, mlp_multipliers=[0.8, 1.3],
                 key_multiplier=0.7, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                 ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.5], ssm_in_multiplier=1.3,
                 ssm_out_multiplier=0.85),
        ),
    }


def make_tiny_hybrid(path: str | Path, arch: str, seed: int = 0, **overrides) -> str:
    """Saves a tiny random hybrid checkpoint (`arch`: mamba2, bamba, granitemoehybrid,
    nemotronh, falconh1) with the demo tokenizer into `path`. Configs may need adjusting per
    transformers version: every field here is a documented config field of that class."""
    cls_cfg, cls_model, kwargs = _hybrid_specs()[arch]
    kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs)).eval()
    return _save(model, Path(path))


def qwen3_next_config(**overrides):
    """A tiny Qwen3-Next config: odd head counts (3 query heads over 1 KV head; 6 value heads
    over 2 key heads in the GDN layers), full attention first and last, a dense MLP layer among
    the MoE ones."""
    import transformers as tf

    kwargs = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=6, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2],
        max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    kwargs.update(overrides)
    return tf.Qwen3NextConfig(**kwargs)


def make_tiny_model(path: str | Path, arch: str) -> str:
    """A tiny random checkpoint of any test architecture: llama/qwen3 (dense), qwen3next
    (skipped where transformers has no Qwen3-Next: the oracle builds it), a hybrid of ARCHS."""
    if arch in ("llama", "qwen3", "qwen2", "mistral"):
        return make_tiny_llama(path, arch=arch)
    if arch == "qwen3next":
        import transformers as tf

        if not hasattr(tf, "Qwen3NextForCausalLM"):
            pytest.skip(f"transformers {tf.__version__} has no Qwen3-Next to build the model")
        return make_tiny_qwen3_next(path)
    return make_tiny_hybrid(path, arch)


def make_tiny_qwen3_next(path: str | Path, seed: int = 0, **overrides) -> str:
    """Saves a tiny random Qwen3-Next checkpoint (`qwen3_next_config(**overrides)`) with the demo
    tokenizer into `path`. HF initialises the zero-centred norms to 0 and dt_bias to 1: they get
    random values here, so that 1 + w and the gate bias are exercised."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen3NextForCausalLM(qwen3_next_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("mlp.gate.weight"):  # spread router logits: no near-ties that
                p.mul_(4.0)  # a 1e-6 batching difference could flip
    return _save(model, Path(path))


def record_proposals(drafter, replace=None) -> list[tuple[list[int], list[int]]]:
    """Wraps `drafter.propose` so that every row's proposal is recorded as (the row's tokens,
    its drafts); returns the (growing) list. `replace(tokens, step)`, when given, returns the
    drafts the target verifies instead (step: the count recorded so far), the head's own still
    recorded. Drafts a drafter left on the device are read back at once (`resolve`: the same
    drafts, one wait more)."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(token_table, rows, num_tokens, max_drafts):
        drafts, counts = propose(token_table, rows, num_tokens, max_drafts)
        if hasattr(drafter, "resolve"):  # drafts left on the device: their host copy, now
            drafter.resolve()
        for j, (row, n) in enumerate(zip(rows, num_tokens)):
            if counts[j]:
                tokens = token_table[row, :n].tolist()
                seen.append((tokens, drafts[j, : counts[j]].tolist()))
                if replace is not None:
                    drafts = drafts.copy()
                    drafts[j, : counts[j]] = replace(tokens, len(seen))[: counts[j]]
        return drafts, counts

    drafter.propose = recording
    return seen


# a JSON schema the tiny llama's constrained greedy output completes within 120 tokens
SPEC_SCHEMA = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]}, "n": {
    "type": "integer", "minimum": 0, "maximum": 999}}, "required": ["k", "n"]}


def structured_reference(path: str | Path):
    """(a tiny llama's directory, greedy SamplingParams under SPEC_SCHEMA, three prompts, their
    outputs without speculation): the references of the structured speculative tests."""
    from krait import LLM, SamplingParams, StructuredOutputsParams

    model_dir = make_tiny_llama(path)
    so = SamplingParams(temperature=0.0, max_tokens=120,
                        structured_outputs=StructuredOutputsParams(json=SPEC_SCHEMA))
    prompts = ["a b a b a b a b", "x y x y x y x y", "c d e"]
    ref = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256).generate(
        prompts, so, use_tqdm=False)
    return model_dir, so, prompts, ref

"""Greedy parity with Hugging Face for Qwen3-Next (Gated DeltaNet + gated attention + MoE with a
shared expert) through the engine scenarios the Mamba2 hybrids pass (tests/models/
test_hybrid_serving.py): chunked prefill (odd boundaries, a final chunk of one token), few
sequences with large blocks, preemption and resume, requests arriving while others decode, state
slots reused; a second shape (equal key/value heads, GDN first, tied embeddings, un-normalised
top-k, sparse step 2); the GDN layers through their Triton kernels (interpreted); speculative
decoding (the GDN verify path) with scripted and ngram drafts; and the MTP method's names
(its head: tests/models/test_spec_mtp.py)."""

from __future__ import annotations

import pytest
import torch

from krait import LLM, SamplingParams
from krait.config import SpeculativeConfig
from tests.models import test_hybrid_serving as serving
from tests.models import test_spec_decode_parity as spec
from tests.models.test_hybrid_serving import (
    PROMPTS,
    Reference,
    assert_cache_returned,
    assert_matches,
    generate_all,
    make_llm,
)
from tests.utils import hf_greedy, make_tiny_qwen3_next

# the second shape: 4 value heads over 4 key heads, linear attention first, attention last
VARIANT = dict(
    num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=4,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    tie_word_embeddings=True, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    model_dir = make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next"))
    tokens, _, rows = hf_greedy(model_dir, PROMPTS, serving.MAX_NEW)
    return Reference(model_dir, tokens, rows)


def _check_all(ref: Reference, llm: LLM) -> None:
    for i, out in enumerate(generate_all(llm)):
        assert_matches(ref, i, out)
    assert_cache_returned(llm.llm_engine)


@pytest.mark.parametrize("config", ["defaults", "chunked_7", "block_size_32_chunked_11_seqs_3"])
def test_parity(ref: Reference, config: str) -> None:
    _check_all(ref, make_llm(ref, **serving.CONFIGS[config]))


def test_parity_final_prefill_chunk_of_one_token(ref: Reference) -> None:
    serving.test_parity_final_prefill_chunk_of_one_token(lambda arch: ref, "qwen3_next")


def test_parity_with_preemption(ref: Reference) -> None:
    serving.test_parity_with_preemption(lambda arch: ref, "qwen3_next", "blocks_4x24_chunked_7")


def test_parity_requests_added_while_decoding(ref: Reference) -> None:
    serving.test_parity_requests_added_while_decoding(lambda arch: ref, "qwen3_next")


def test_parity_with_slot_reuse(ref: Reference) -> None:
    serving.test_parity_with_slot_reuse(lambda arch: ref, "qwen3_next")


def test_gdn_state_is_float32_and_sized(ref: Reference) -> None:
    """The GDN layers' recurrent state lives in the slots in float32, [slots, Hv, K, V]."""
    from krait.layers.gated_deltanet import GatedDeltaNet

    llm = make_llm(ref, max_num_seqs=2)
    state = llm.llm_engine.runner.model_state
    gdn = [m for m in state.mamba_layers if isinstance(m, GatedDeltaNet)]
    assert len(gdn) == 2 and len(state.mamba_layers) == 2
    for m in gdn:
        assert m.ssm_state.dtype == torch.float32
        assert m.ssm_state.shape[1:] == (6, 16, 8)
        assert m.conv_state.shape[1:] == (2 * 32 + 48, 3)
    assert state.chunk_size is None  # no Mamba2 SSD layout to build


def test_variant_shape_matches_hf(tmp_path) -> None:
    model_dir = make_tiny_qwen3_next(tmp_path, seed=1, **VARIANT)
    prompts = PROMPTS[2:6]
    tokens, _, rows = hf_greedy(model_dir, prompts, 12)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=9)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, want, hf_rows in zip(outs, tokens, rows):
        got = out.outputs[0]
        assert got.token_ids == want
        for step, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert abs(entry[tok].logprob - hf_rows[step, tok].item()) < 1e-3


def test_gdn_triton_kernels_match_hf(ref: Reference, monkeypatch) -> None:
    """The GDN layers' ops through their Triton kernels (interpreted): the chunked prefill and
    decode update kernels and the causal conv; the other ops stay on their references (their
    kernels have their own whole-model Triton tests, and interpreted here they would take a
    minute). A prompt of 16 tokens through chunks of 7, 7 and 2, then decode steps."""
    import krait.layers.gated_deltanet as gdn_layer
    from krait.ops import causal_conv1d, gated_delta_chunk, gated_delta_update

    ran = []
    for mod in (gated_delta_chunk, gated_delta_update, causal_conv1d):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    for name in ("gated_delta_chunk", "gated_delta_update"):
        run = getattr(gdn_layer, name)
        monkeypatch.setattr(gdn_layer, name,
                            lambda *a, run=run, name=name, **kw: ran.append(name) or run(*a, **kw))
    prompts, n = PROMPTS[4:5], 4  # 3 interpreted decode steps (each is slow)
    llm = LLM(ref.model_dir, device="cpu", dtype="float32", max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert set(ran) == {"gated_delta_chunk", "gated_delta_update"}
    for out, i in zip(outs, (4,)):
        got = out.outputs[0]
        assert got.token_ids == ref.tokens[i][:n]
        for step, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert abs(entry[tok].logprob - ref.logprobs[i][step, tok].item()) < 1e-3


def test_gdn_fused_decode_matches_hf(ref: Reference, monkeypatch) -> None:
    """Decode steps through the GDN layer's fused path (interpreted): the conv in in_proj's
    GEMV epilogue (one row) and the output norm inside the delta rule's launch, at one row and
    at two rows a step (the conv then its own launch); prefill chunks keep the chunked path."""
    import krait.layers.gated_deltanet as gdn_layer
    from krait.ops import causal_conv1d, gated_delta_chunk, gated_delta_update

    ran = []
    for mod in (gated_delta_chunk, gated_delta_update, causal_conv1d, gdn_layer):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    update, conv_linear = gdn_layer.gated_delta_update, gdn_layer.conv_linear
    monkeypatch.setattr(gdn_layer, "gated_delta_update", lambda *a, **kw: ran.append(
        ("norm", a[0].shape[0]) if kw.get("norm") else "plain") or update(*a, **kw))
    monkeypatch.setattr(gdn_layer, "conv_linear",
                        lambda *a, **kw: ran.append("conv_epilogue") or conv_linear(*a, **kw))
    n = 3
    llm = LLM(ref.model_dir, device="cpu", dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    for prompts in (PROMPTS[4:5], PROMPTS[1:3]):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, p in zip(outs, prompts):
            i = PROMPTS.index(p)
            assert out.outputs[0].token_ids == ref.tokens[i][:n]
            for step, (tok, entry) in enumerate(zip(out.outputs[0].token_ids,
                                                    out.outputs[0].logprobs)):
                assert abs(entry[tok].logprob - ref.logprobs[i][step, tok].item()) < 1e-3
    assert "conv_epilogue" in ran and ("norm", 1) in ran and ("norm", 2) in ran
    assert "plain" not in ran  # decode rows no longer take the unfused update


@pytest.mark.parametrize("shared_size", [48, 32])
def test_moe_few_route_kernels_match_hf(ref: Reference, shared_size: int, tmp_path,
                                        monkeypatch) -> None:
    """Decode steps' MoE through the few-route kernels (interpreted): top-k routes, the
    split-by-route down projection and the shared expert's sigmoid gate in the last launch;
    a shared expert of the experts' intermediate size (32) runs as one more route, another
    (the main config's 48) through its own MLP."""
    from krait.ops import fused_moe, moe_routes

    if shared_size == 48:
        model_dir, tokens, logprobs = ref.model_dir, ref.tokens[2], ref.logprobs[2]
    else:
        model_dir = make_tiny_qwen3_next(tmp_path, shared_expert_intermediate_size=shared_size)
        toks, _, rows = hf_greedy(model_dir, [PROMPTS[2]], 4)
        tokens, logprobs = toks[0], rows[0]
    calls = []
    monkeypatch.setattr(moe_routes, "use_triton", lambda t: True)
    run = fused_moe.moe_routes_triton
    monkeypatch.setattr(fused_moe, "moe_routes_triton",
                        lambda *a, **kw: calls.append(kw) or run(*a, **kw))
    n = 4
    llm = LLM(model_dir, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    got = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0]
    assert calls and all(kw["add_gate"] is not None for kw in calls)
    assert all((kw["shared"] is not None) == (shared_size == 32) for kw in calls)
    assert got.token_ids == tokens[:n]
    for step, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        assert abs(entry[tok].logprob - logprobs[step, tok].item()) < 1e-3


@pytest.fixture(scope="module")
def spec_ref(ref: Reference) -> spec.Reference:
    tokens, _, rows = hf_greedy(ref.model_dir, spec.PROMPTS, spec.MAX_NEW)
    return spec.Reference(ref.model_dir, tokens, rows)


@pytest.mark.parametrize("config", ["defaults", "chunked_7_seqs_3"])
def test_spec_parity(spec_ref: spec.Reference, config: str) -> None:
    """Drafts (scripted: a right prefix, then a wrong token) verified through the GDN verify
    path: the state after each position kept, the next step from the accepted one."""
    llm = spec.make_llm(spec_ref, **spec.CONFIGS[config])
    for i, out in enumerate(spec.generate(llm, spec._params())):
        spec.assert_matches(spec_ref, i, out.outputs[0])
    spec.assert_spec_ran(llm)


def test_spec_parity_ngram_drafter_with_preemption(spec_ref: spec.Reference) -> None:
    llm = spec.make_llm(spec_ref, scripted=False, block_size=4, num_kv_blocks=14,
                        max_model_len=56)
    seen = serving._track_requests(llm.llm_engine)
    for i, out in enumerate(spec.generate(llm, spec._params())):
        spec.assert_matches(spec_ref, i, out.outputs[0])
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0
    assert sum(r.num_preemptions for r in seen) > 0, "the pool was meant to force preemption"


def test_mtp_weights_ignored_on_load(ref: Reference) -> None:
    """A checkpoint's multi-token-prediction tensors (`mtp.*`) load as nothing; anything else
    unknown is still refused."""
    from transformers import AutoConfig

    from krait.models.loader import iterate_safetensors
    from krait.models.qwen3_next import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM(AutoConfig.from_pretrained(ref.model_dir))
    extra = [("mtp.fc.weight", torch.zeros(64, 128)), ("mtp.norm.weight", torch.zeros(64))]
    with torch.no_grad():
        model.load_weights([*iterate_safetensors(ref.model_dir), *extra])
        with pytest.raises(ValueError, match="has no place"):
            model.load_weights([*iterate_safetensors(ref.model_dir),
                                ("model.extra.weight", torch.zeros(1))])


@pytest.mark.parametrize("method", ["mtp", "qwen3_next_mtp"])
def test_mtp_method_accepted(method: str) -> None:
    """The MTP head is built (tests/models/test_spec_mtp.py): both of vLLM's names take it,
    with or without `model` (the target's own checkpoint by default)."""
    assert SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 1}).model is None

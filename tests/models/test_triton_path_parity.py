"""Whole models through their Triton kernels (interpreted on CPU) against HF transformers.

The other parity tests run the torch references on CPU; these route every op through the kernels
the GPU runs (`KRAIT_TRITON_CPU=1` under `TRITON_INTERPRET=1`), so an integration mistake in a
kernel launch (strides, dtypes, slot indices, chunk boundaries) shows up without a GPU."""

import pytest

import krait.ops.fused_moe as fused_moe_mod
from krait import LLM, SamplingParams
from tests.utils import hf_greedy, make_tiny_hybrid, make_tiny_llama

PROMPTS = [[5, 6, 7], [9] * 20, list(range(3, 38))]  # the last over two SSD chunks of 16
# the first token comes from the prefill, then 2 decode steps (each costs about a third of the
# whole chunked prefill in the interpreter): a decode from the prefill's carried state, and one
# from a decode's
NUM_TOKENS = 3
PREEMPT_TOKENS = 8  # 58 prompt tokens + 3 * 7 in 4-token blocks overfill the pool of 20


@pytest.mark.parametrize("arch", ["qwen3", "granitemoehybrid", "nemotronh", "mamba2", "qwen3+gemv",
                                  "mamba2+gemv", "granitemoehybrid+routes", "nemotronh+routes",
                                  "qwen3+tma", "mamba2+tma", "qwen3+ropefold"])
def test_triton_kernels_match_hf(arch, tmp_path, monkeypatch):
    prompts, num_tokens = PROMPTS, NUM_TOKENS
    engine_args, overrides, routes_ran, tma_ran, folded, gemv_ran = {}, {}, [], [], [], []
    want_fold = arch.endswith("+ropefold")
    if want_fold:  # decode rows split (16 keys a split at least), rope and the K/V write
        # inside the split kernel, asserted
        prompts = PROMPTS[:2]
        arch = arch.removesuffix("+ropefold")
        import krait.ops.paged_attention as paged_attention_mod
        import krait.ops.rope_attention as rope_attention_mod

        monkeypatch.setattr(paged_attention_mod, "SPLIT_MIN_KEYS", 16)

        run_fold = rope_attention_mod.decode_split_rope
        monkeypatch.setattr(rope_attention_mod, "decode_split_rope",
                            lambda *a, **kw: folded.append(1) or run_fold(*a, **kw))
    if arch.endswith("+tma"):  # one-row decode projections through the TMA GEMV: its
        # thresholds (millions of elements) lowered to the tiny models' weights, every form
        # (plain, gate_up with silu-and-mul, Mamba in_proj with the conv) asserted to run
        prompts = PROMPTS[:2]
        arch = arch.removesuffix("+tma")
        engine_args["max_num_seqs"] = 1
        import krait.layers.linear as layers_linear
        import krait.ops.linear as plan

        monkeypatch.setattr(plan, "tma_config", lambda n, k, silu=False, sms=4: dict(
            BLOCK_N=8, BLOCK_K=32, STAGES=2, SPLIT_K=1, num_warps=4))
        run_tma = layers_linear.gemv_tma
        monkeypatch.setattr(layers_linear, "gemv_tma", lambda *a, **kw: tma_ran.append(
            "silu" if kw.get("silu_mul_out") else "conv" if kw.get("conv") else "plain")
            or run_tma(*a, **kw))
    if arch.endswith("+routes"):  # the router's top-k kernel (default), and decode at batch 1
        # (2 routes of 4 experts) through the per-route expert GEMVs, asserted to run: one
        # prompt, chunked (the interpreted expert kernels are slow)
        prompts = PROMPTS[1:2]
        arch = arch.removesuffix("+routes")
        engine_args["max_num_seqs"] = 1
        run = fused_moe_mod.moe_routes_triton
        monkeypatch.setattr(fused_moe_mod, "moe_routes_triton",
                            lambda *a, **kw: routes_ran.append(1) or run(*a, **kw))
    if arch.endswith("+gemv"):  # one row a decode step: every decode projection through
        # krait/ops/gemv.py with its fusions (gate_up's activation; mamba2 with one norm group:
        # the conv in in_proj's epilogue, the gated norm in out_proj's prologue), asserted; the
        # interpreted GEMV is slow: two prompts, one of them chunked
        prompts = PROMPTS[:2]
        arch = arch.removesuffix("+gemv")
        engine_args["max_num_seqs"] = 1
        if arch == "mamba2":
            overrides["n_groups"] = 1
        import krait.layers.linear as layers_linear

        run_gemv = layers_linear.gemv_triton
        monkeypatch.setattr(layers_linear, "gemv_triton", lambda *a, **kw: gemv_ran.append(
            "silu" if kw.get("silu_mul_out") else "conv" if kw.get("conv") else
            "norm" if kw.get("norm") else "plain") or run_gemv(*a, **kw))
    if arch == "qwen3":
        d = make_tiny_llama(tmp_path / arch, arch="qwen3")
    else:
        d = make_tiny_hybrid(tmp_path / arch, arch, **overrides)
    want, want_lp, _ = hf_greedy(d, prompts, num_tokens)
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    llm = LLM(d, device="cpu", dtype="float32", max_num_batched_tokens=7,  # chunked prefill too
              **engine_args)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    for out, tokens, lps in zip(outs, want, want_lp):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for entry, tok, lp in zip(got.logprobs, got.token_ids, lps):
            assert abs(entry[tok].logprob - lp) < 1e-3
    assert bool(routes_ran) == ("max_num_seqs" in engine_args and not tma_ran and not gemv_ran)
    if tma_ran:
        assert set(tma_ran) == ({"silu", "plain"} if arch == "qwen3" else {"conv", "plain"})
    assert bool(folded) == want_fold
    if gemv_ran:
        assert set(gemv_ran) == ({"silu", "plain"} if arch == "qwen3"
                                 else {"conv", "norm", "plain"})


def test_triton_path_with_preemption_and_device_tables(tmp_path, monkeypatch):
    """Device-side input preparation keeps its tables right through preemption and resume."""
    d = make_tiny_llama(tmp_path / "llama")
    want, _, _ = hf_greedy(d, PROMPTS, PREEMPT_TOKENS)
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    llm = LLM(d, device="cpu", dtype="float32", block_size=4, num_kv_blocks=20, max_model_len=64)
    assert llm.llm_engine.runner.tables is not None
    engine = llm.llm_engine
    seen = []
    add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda req: (seen.append(req), add(req))[1]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert sum(r.num_preemptions for r in seen) > 0
    assert [o.outputs[0].token_ids for o in outs] == want

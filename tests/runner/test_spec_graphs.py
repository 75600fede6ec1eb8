"""Speculative decoding's CUDA-graph dataflow without a GPU (CudaGraphRunner(record=False) runs
each captured body eagerly over the captured buffers): verify steps of 1 + k tokens a row padded
to a captured size, decode graphs of one-token rows with the speculative metadata, and the
drafts filled up to k for the verify graphs. Eager and graph outputs are equal (issue 27's
runner invariant 6); with KRAIT_TRITON_CPU=1 the Triton kernels (the verify forms of the Mamba
conv and state update among them) and the device-side input preparation run too. Graph steps
verify drafts filled up to k; sampled rows still draw what they would without drafts (the
rejection sampler's coupled test for point-mass drafts), which the seeded-row test checks."""

from __future__ import annotations

import numpy as np
import pytest

from krait import LLM, SamplingParams
from krait.runner.cuda_graphs import CudaGraphRunner
from tests.utils import make_tiny_hybrid, make_tiny_llama, make_tiny_qwen3_next

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7], [9, 4] * 5, list(range(3, 20))]


class LastTokenDrafter:
    """Proposes one draft a row, its last token (the runner fills it up to k for the graphs)."""

    def propose(self, token_table, rows, num_tokens, max_drafts):
        drafts = np.full((len(rows), K), -1, dtype=np.int32)
        drafts[:, 0] = token_table[rows, num_tokens - 1]
        return drafts, (max_drafts > 0).astype(np.int32)


def _run(model_dir: str, graphs: bool, params: list[SamplingParams]):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=4, speculative_config=SPEC)
    runner = llm.llm_engine.runner
    runner.drafter = LastTokenDrafter()
    replays: list[int] = []
    if graphs:
        runner.cuda_graphs = CudaGraphRunner(runner, record=False)
        runner.cuda_graphs.capture_all()
        runner.verify_graphs = CudaGraphRunner(runner, record=False, tokens_per_row=1 + K)
        runner.verify_graphs.capture_all()
        real = runner.verify_graphs.run
        runner.verify_graphs.run = lambda b: (replays.append(b.num_reqs), real(b))[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [(o.outputs[0].token_ids,
            [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    return got, replays, llm.llm_engine.get_stats()


@pytest.mark.parametrize("arch", ["llama", "granitemoehybrid", "mamba2+triton", "llama+triton",
                                  "qwen3next", "qwen3next+triton"])
def test_verify_graphs_match_eager(arch: str, tmp_path, monkeypatch) -> None:
    # qwen3next: Gated DeltaNet's verify rows (causal_conv1d_verify, gated_delta_verify forming
    # the gates in the kernel) inside the verify graphs
    triton = arch.endswith("+triton")
    arch = arch.removesuffix("+triton")
    d = (make_tiny_llama(tmp_path / arch) if arch == "llama"
         else make_tiny_qwen3_next(tmp_path / arch) if arch == "qwen3next"
         else make_tiny_hybrid(tmp_path / arch, arch))
    n = 6 if triton else 12  # the interpreter is slow
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1)
              for m in ((n, n, n) if n == 6 else (n, n - 2, n - 4))]
    # +triton: the eager reference through the torch ops (greedy rows: the same tokens,
    # logprobs within float32 rounding), the graphs through the interpreted kernels
    want, _, _ = _run(d, graphs=False, params=params)
    if triton:
        monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    got, replays, stats = _run(d, graphs=True, params=params)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert np.allclose(g, w, atol=1e-4)
    assert replays and max(replays) == 3, replays  # three verify rows padded to a graph of 4
    assert stats["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("arch", ["llama", "granitemoehybrid"])
def test_a_prefill_of_one_plus_k_tokens_never_takes_the_verify_graph(arch: str, tmp_path):
    """A prompt of exactly 1 + k tokens arriving while another row verifies drafts: every row
    of that step has 1 + k tokens, but the prompt's row is a prefill row (logits at its last
    token only, its own state rules), so the step runs eagerly. The verify graph took it once:
    the synchronous path raised, the device path committed the prompt's first position's
    token (found by a differential fuzz, session 36)."""
    d = (make_tiny_llama(tmp_path / arch) if arch == "llama"
         else make_tiny_hybrid(tmp_path / arch, arch))
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    short = list(range(40, 41 + K))  # 1 + k tokens

    def run(graphs: bool) -> dict[str, list[int]]:
        llm = LLM(d, device="cpu", dtype="float32", max_num_seqs=4,
                  speculative_config=SPEC if graphs else None)
        runner = llm.llm_engine.runner
        if graphs:
            runner.drafter = LastTokenDrafter()
            runner.cuda_graphs = CudaGraphRunner(runner, record=False)
            runner.cuda_graphs.capture_all()
            runner.verify_graphs = CudaGraphRunner(runner, record=False, tokens_per_row=1 + K)
            runner.verify_graphs.capture_all()
        eng, out = llm.llm_engine, {}
        eng.add_request("a", {"prompt_token_ids": PROMPTS[1]}, greedy)
        for step in range(200):
            if step == 3:
                eng.add_request("b", {"prompt_token_ids": short}, greedy)
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
            if not eng.has_unfinished_requests():
                break
        return out

    assert run(graphs=True) == run(graphs=False)


@pytest.mark.parametrize("arch", ["llama", "granitemoehybrid"])
def test_seeded_rows_in_verify_graphs_sample_what_they_would_without_speculation(arch, tmp_path):
    """The verify graphs fill every row's proposal up to k drafts, so whether a seeded sampled
    row verifies drafts depends on the other rows. With point-mass drafts the rejection sampler
    emits Sampler's own draws (its coupled test), so the seeded row's tokens equal those of a
    run without speculation, alone. (Before, its accept tests drew other randomness and its
    tokens followed the batch: found by a differential fuzz, session 36.) The model repeats its
    last token (tied, small weights), so the drafts are often, not always, accepted."""
    rep = {"tie_word_embeddings": True, "initializer_range": 0.01}
    d = (make_tiny_llama(tmp_path / arch, **rep) if arch == "llama"
         else make_tiny_hybrid(tmp_path / arch, arch, **rep))
    seeded = [SamplingParams(temperature=0.03, seed=s, max_tokens=12, ignore_eos=True,
                             logprobs=1) for s in (1234, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    base = LLM(d, device="cpu", dtype="float32", max_num_seqs=4)
    alone = [base.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(PROMPTS, seeded)]
    got, replays, stats = _run(d, graphs=True, params=[*seeded, greedy])
    assert [t for t, _ in got[:2]] == alone
    assert replays and 0 < stats["spec_decode_num_accepted_tokens"]

"""The draft-model drafter's chained decode graphs (krait/runner/chained_graphs.py): a call's
catch-up token and its k drafts as one graph. On CPU through their record=False dataflow, on
CUDA (`gpu`) recorded. Either way: the chained path proposes exactly the stepwise path's drafts
(chained_graphs.ENABLED = False), and greedy outputs stay the target's own."""

from __future__ import annotations

import gc

import pytest
import torch

import krait.runner.chained_graphs as chained_graphs
import krait.runner.spec_decode.draft_model as draft_model
from krait import LLM, SamplingParams
from tests.models.test_spec_draft_model import (
    CONFIGS,
    PROMPTS,
    K,
    _check_greedy_continuations,
    _params,
    _perturbed_copy,
    make_llm,
    references,  # noqa: F401 (the fixture)
    run_and_check,
)
from tests.utils import make_tiny_llama, record_proposals


def _proposals(ref, draft_dir: str, chained: bool, monkeypatch, **options):
    """(proposals, drafter tallies) of one run through the drafter's graphs (record=False),
    chained or stepwise."""
    monkeypatch.setattr(chained_graphs, "ENABLED", chained)
    llm = make_llm(ref, draft_dir, **options)
    drafter = llm.llm_engine.runner.drafter
    drafter.capture_graphs(record=False)
    assert (drafter.runner.chained_graphs is not None) == chained
    assert drafter.keep_last_draft == chained
    seen = record_proposals(drafter)
    rate = run_and_check(llm, ref)
    return seen, rate, drafter


@pytest.mark.parametrize("config", ["defaults", "budget_4_seqs_2"])
def test_chained_and_stepwise_drafts_agree(references, tmp_path, monkeypatch,  # noqa: F811
                                           config: str) -> None:
    """A draft that agrees with the target in part (accepted, partly accepted and rejected
    drafts): the chained path serves most calls and proposes what the stepwise one does, each
    proposal the draft model's greedy continuation (HF); under a tight budget the calls it
    cannot serve (rows skipped, new requests) step with the last draft kept as well."""
    ref = references("llama")
    draft_dir = _perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03)
    stepwise, rate_s, d_s = _proposals(ref, draft_dir, False, monkeypatch, **CONFIGS[config])
    chained, rate_c, d_c = _proposals(ref, draft_dir, True, monkeypatch, **CONFIGS[config])
    assert d_s.num_chained_calls == 0
    assert d_c.num_chained_calls > 0
    assert 0.3 < rate_c < 0.95, rate_c
    assert chained == stepwise
    assert rate_c == rate_s
    # keeping draft k's KV too: after a full acceptance the catch-up is one token
    assert d_c.num_kept_draft_tokens > d_s.num_kept_draft_tokens
    _check_greedy_continuations(draft_dir, chained)


def _record_device_drafts(drafter) -> list[tuple[list[int], list[int]]]:
    """Wraps `drafter.draft_on_device` so that each drafted row's (true tokens, drafts) is
    read from the target's device token table right after the call (CPU tensors: no wait):
    its true count is the host's less the rejections the host has not heard of yet."""
    seen: list[tuple[list[int], list[int]]] = []
    draft = drafter.draft_on_device

    def recording(table, rejected, known, token_table, rows, num_tokens, prefilled, may_draft):
        found = draft(table, rejected, known, token_table, rows, num_tokens, prefilled,
                      may_draft)
        for j, row in enumerate(rows.tolist()):
            if found[j]:
                n = int(num_tokens[j]) - (int(rejected[row]) - int(known[row]))
                seen.append((table[row, :n].tolist(), table[row, n : n + K].tolist()))
        return found

    drafter.draft_on_device = recording
    return seen


def test_device_drafts_keep_verify_steps_async(references, tmp_path,  # noqa: F811
                                               monkeypatch) -> None:
    """With the device token table (KRAIT_TRITON_CPU=1: the Triton kernels interpreted, the
    inputs prepared on the device as on the GPU) a dense draft's chains run right after the
    target's commit, so the target's verify steps stay asynchronous (runner invariant 7): the
    host never reads a step's accepted counts before launching the next. The draft's counters
    are corrected on the device by the target's unreported rejections; every draft it wrote
    is its greedy continuation of the target's true tokens (HF), the outputs are HF's, and a
    request that takes a finished one's row gets a fresh draft sequence."""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setattr(chained_graphs, "ENABLED", True)
    ref = references("llama")
    draft_dir = _perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03)
    llm = make_llm(ref, draft_dir, max_num_seqs=2, max_model_len=256)
    engine = llm.llm_engine
    drafter = engine.runner.drafter
    assert drafter.device_drafts and engine.runner.async_spec and engine.async_scheduling
    seen = _record_device_drafts(drafter)
    proposed = record_proposals(drafter)  # (the host drafter: never called)
    n = 8  # (the interpreter is slow)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref.tokens[i][:n]
    stats = engine.get_stats()
    rate = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    assert 0.3 < rate < 1.0, rate  # accepted and rejected drafts alike
    assert seen and not proposed
    assert drafter.num_chained_calls > 0
    engine.step()  # the runner hears of the last finished requests in the next step
    assert not drafter._seqs
    assert drafter.kv.num_free_blocks == drafter.kv.num_usable_blocks
    _check_greedy_continuations(draft_dir, seen)


def test_device_drafts_with_logprobs_and_sampled_rows(references, tmp_path,  # noqa: F811
                                                      monkeypatch) -> None:
    """Rows that are not plain greedy (logprobs asked, temperature > 0) take the rejection
    sampler and `commit_sampled` before the draft model drafts on the device
    (`ModelRunner._commit_and_draft`): greedy rows with logprobs still get HF's tokens and
    logprobs, and a seeded sampled request gives the same tokens on a second run."""
    from tests.models.test_spec_decode_parity import assert_matches

    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setattr(chained_graphs, "ENABLED", True)
    ref = references("llama")
    draft_dir = _perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03)
    llm = make_llm(ref, draft_dir, max_num_seqs=2, max_model_len=256)
    runner = llm.llm_engine.runner
    assert runner.async_spec
    unfused = []
    commit = runner._commit_and_draft
    monkeypatch.setattr(runner, "_commit_and_draft",
                        lambda *a: unfused.append(a[3] is not None) or commit(*a))
    n = 6  # (the interpreter is slow)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    outs = llm.generate(prompts, _params(max_tokens=n), use_tqdm=False)
    for i, out in enumerate(outs):
        assert_matches(ref, i, out.outputs[0], n)
    assert any(unfused)  # verify steps' rows went through the rejection sampler
    sampled = SamplingParams(temperature=0.8, seed=123, max_tokens=n, ignore_eos=True)
    first, again = (llm.generate(prompts, sampled, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


@pytest.mark.parametrize("target", ["llama", "mamba2"])
def test_chained_drafts_stay_on_the_device(target, references, tmp_path,  # noqa: F811
                                          monkeypatch) -> None:
    """With device token tables and the target's verify graphs (record=False): a chained call
    writes its drafts into the target's device table and returns placeholders without reading
    them back; the verify step reads them from its inputs and writes its sampled tokens on the
    device. The outputs stay HF's and the drafts (read back a call later) the draft's greedy
    continuations. This is the synchronous path (DEVICE_DRAFTS off; several ranks take it):
    the drafts are made by `propose` after each step was read back. mamba2: a hybrid target (its verify rows' states) under a dense draft of
    the same vocabulary (random: its drafts are mostly rejected)."""
    from krait.runner.cuda_graphs import CudaGraphRunner
    from krait.runner.spec_decode.draft_model import DEVICE_DRAFT

    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    monkeypatch.setattr(chained_graphs, "ENABLED", True)
    monkeypatch.setattr(draft_model, "DEVICE_DRAFTS", False)  # the synchronous verify path
    ref = references(target)
    draft_dir = (_perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03) if target == "llama"
                 else make_tiny_llama(tmp_path / "draft"))
    llm = make_llm(ref, draft_dir, max_num_seqs=1, max_model_len=256)
    runner = llm.llm_engine.runner
    runner.cuda_graphs = CudaGraphRunner(runner, record=False)
    runner.cuda_graphs.capture_all()
    runner.verify_graphs = CudaGraphRunner(runner, record=False, tokens_per_row=1 + K)
    runner.verify_graphs.capture_all()
    drafter = runner.drafter
    assert drafter.target_tables is runner.tables is not None
    drafter.capture_graphs(record=False)
    placeholders, written = [], []
    propose, write = drafter.propose, runner._write_verified

    def proposing(*args):
        drafts, counts = propose(*args)
        placeholders.append(bool((drafts[counts > 0] == DEVICE_DRAFT).all()))
        return drafts, counts

    def writing(*args):
        written.append(write(*args))
        return written[-1]

    drafter.propose, runner._write_verified = proposing, writing
    seen = record_proposals(drafter)
    n = 7  # (the interpreter is slow)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref.tokens[0][:n]
    assert drafter.num_chained_calls > 0 and any(placeholders)
    assert any(written)
    _check_greedy_continuations(draft_dir, seen)


def test_chained_graphs_off_for_hybrid_drafts(references, monkeypatch) -> None:  # noqa: F811
    """A hybrid draft steps (its recurrent state would need slots advanced in the chain)."""
    ref = references("granitemoehybrid")
    llm = make_llm(ref, ref.model_dir, max_num_seqs=2)
    drafter = llm.llm_engine.runner.drafter
    drafter.capture_graphs(record=False)
    assert drafter.runner.chained_graphs is None and not drafter.keep_last_draft


def _cuda_run(target: str, draft: str | None, chained: bool, monkeypatch,
              device_drafts: bool = False):
    """Greedy outputs (and the proposals, with a draft and synchronous verify steps) of a CUDA
    run with graphs on."""
    monkeypatch.setattr(chained_graphs, "ENABLED", chained)
    monkeypatch.setattr(draft_model, "DEVICE_DRAFTS", device_drafts)
    spec = {"model": draft, "num_speculative_tokens": K} if draft else None
    llm = LLM(target, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128,
              gpu_memory_utilization=0.3, speculative_config=spec)
    drafter = llm.llm_engine.runner.drafter
    assert llm.llm_engine.runner.async_spec == (drafter is not None and device_drafts)
    seen = record_proposals(drafter) if drafter is not None else []
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    chained_calls = drafter.num_chained_calls if drafter is not None else 0
    has_chain = drafter is not None and drafter.runner.chained_graphs is not None
    del llm, drafter
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, seen, chained_calls, has_chain


@pytest.mark.gpu
def test_chained_draft_graphs_on_cuda(tmp_path, monkeypatch) -> None:
    """Recorded graphs on CUDA (float32 tiny models): greedy outputs with the chained draft
    graphs equal non-speculative decoding's, synchronous (the chained and stepwise paths
    propose the same drafts) and asynchronous (drafts made on the device) alike."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = make_tiny_llama(tmp_path / "target", num_hidden_layers=4)
    draft = _perturbed_copy(target, tmp_path / "draft", 0.03)
    plain, _, _, _ = _cuda_run(target, None, False, monkeypatch)
    stepwise, seen_s, calls_s, chain_s = _cuda_run(target, draft, False, monkeypatch)
    chained, seen_c, calls_c, chain_c = _cuda_run(target, draft, True, monkeypatch)
    assert chain_c and not chain_s
    assert calls_c > 0 and calls_s == 0
    assert stepwise == plain
    assert chained == plain
    assert seen_c == seen_s
    asynchronous, seen_a, calls_a, _ = _cuda_run(target, draft, True, monkeypatch, True)
    assert asynchronous == plain
    assert calls_a > 0 and not seen_a

"""HF parity for the Mamba2-hybrid families under every serving shape: krait's greedy tokens equal
HF transformers' `generate` token for token and its logprobs equal HF's log-softmax within 1e-3,
with chunked prefill (odd chunk boundaries, a final chunk of one token), few sequences, block
sizes 1 and 32, preemption and resume, requests arriving while others decode, and state slots
reused by later requests. Also: slots that cannot fit max_num_seqs fail at startup, clearly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from krait import LLM, SamplingParams
from krait.engine.engine import LLMEngine
from krait.engine.request import Request
from krait.outputs import CompletionOutput
from tests.utils import ARCHS, device_options, hf_greedy

PROMPT_LENS = [1, 2, 7, 13, 16, 17, 33, 60]
MAX_NEW = 32
NUM_LOGPROBS = 2
TOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS)


def _prompts() -> list[list[int]]:
    # ids 3.. avoid bos/eos/pad; varied so that no two prompts share a prefix
    return [[3 + (7 * i + 13 * j * j) % 500 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


PROMPTS = _prompts()


@dataclass
class Reference:
    model_dir: str
    tokens: list[list[int]]  # HF greedy continuation per prompt
    logprobs: list[torch.Tensor]  # per prompt: [MAX_NEW, vocab] log-softmax of each step


@pytest.fixture(scope="module")
def references(checkpoints) -> Callable[[str], Reference]:
    """arch -> its checkpoint and HF's greedy reference, computed once per arch."""
    cache: dict[str, Reference] = {}

    def get(arch: str) -> Reference:
        if arch not in cache:
            model_dir = checkpoints(arch)
            tokens, _, rows = hf_greedy(model_dir, PROMPTS, MAX_NEW)
            cache[arch] = Reference(model_dir, tokens, rows)
        return cache[arch]

    return get


def assert_matches(ref: Reference, i: int, out: CompletionOutput) -> None:
    """Completion `out` of prompt `i` equals HF's: same tokens, logprobs and ranks within TOL."""
    assert out.token_ids == ref.tokens[i], f"prompt {i} (len {PROMPT_LENS[i]})"
    assert out.finish_reason == "length"
    assert out.logprobs is not None and len(out.logprobs) == MAX_NEW
    hf_rows = ref.logprobs[i]
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = hf_rows[step]
        assert tok in entry and entry[tok].rank == 1  # greedy: the sampled token is the best
        assert set(entry) == set(row.topk(NUM_LOGPROBS).indices.tolist()), f"prompt {i} step {step}"
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < TOL, f"prompt {i} step {step} id {tid}"
    expected_cum = sum(hf_rows[s, t].item() for s, t in enumerate(ref.tokens[i]))
    assert out.cumulative_logprob == pytest.approx(expected_cum, abs=MAX_NEW * TOL)


def make_llm(ref: Reference, **engine_options) -> LLM:
    return LLM(ref.model_dir, **device_options(), **engine_options)


def generate_all(llm: LLM) -> list[CompletionOutput]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    return [o.outputs[0] for o in outs]


def assert_cache_returned(engine: LLMEngine) -> None:
    """After a run every attention block and state slot is back in its pool."""
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.num_free_slots == kv.num_state_slots


def _track_requests(engine: LLMEngine) -> list[Request]:
    """Records every Request the engine hands its scheduler (they carry num_preemptions)."""
    seen: list[Request] = []
    add = engine.scheduler.add_request

    def recording_add(req: Request) -> None:
        seen.append(req)
        add(req)

    engine.scheduler.add_request = recording_add
    return seen


def _record_prefill_chunks(engine: LLMEngine) -> list[tuple[int, bool]]:
    """Records (length, has_initial_state) of every prefill row the Mamba layers are given."""
    chunks: list[tuple[int, bool]] = []
    state = engine.runner.model_state
    build = state.mamba_metadata

    def recording_build(batch, *args, **kwargs):
        meta = build(batch, *args, **kwargs)
        if meta.num_prefills:
            lens = np.diff(meta.prefill_query_start_loc.cpu().numpy())
            init = meta.prefill_has_initial_state.cpu().numpy()
            chunks.extend(zip(lens.tolist(), init.tolist()))
        return meta

    state.mamba_metadata = recording_build
    return chunks


# -- parity under each engine configuration ------------------------------------------------

CONFIGS = {
    "defaults": {},
    "chunked_7": dict(max_num_batched_tokens=7),  # chunk boundaries at odd offsets
    "max_num_seqs_1": dict(max_num_seqs=1),
    "max_num_seqs_3": dict(max_num_seqs=3),
    "block_size_1": dict(block_size=1),
    "block_size_32": dict(block_size=32),
    "block_size_32_chunked_11_seqs_3": dict(
        block_size=32, max_num_batched_tokens=11, max_num_seqs=3
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity(references, arch: str, config: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, **CONFIGS[config])
    for i, out in enumerate(generate_all(llm)):
        assert_matches(ref, i, out)
    assert_cache_returned(llm.llm_engine)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_final_prefill_chunk_of_one_token(references, arch: str) -> None:
    # budget 8, one sequence at a time: prompts of 17 and 33 tokens (8k + 1) end in a chunk of 1
    ref = references(arch)
    llm = make_llm(ref, max_num_batched_tokens=8, max_num_seqs=1)
    chunks = _record_prefill_chunks(llm.llm_engine)
    for i, out in enumerate(generate_all(llm)):
        assert_matches(ref, i, out)
    assert (1, True) in chunks, (
        "a final prefill chunk of one token (with carried state) was expected"
    )
    assert chunks.count((8, True)) > 0 and max(n for n, _ in chunks) == 8


# The longest request holds 60 + 31 tokens in the cache: these pools fit it alone, not all (and
# one request of max_model_len, which the engine checks at startup).
PREEMPTION_CONFIGS = {
    "blocks_16x8": dict(block_size=16, num_kv_blocks=8, max_model_len=96),
    "blocks_4x24_chunked_7": dict(
        block_size=4, num_kv_blocks=24, max_num_batched_tokens=7, max_model_len=96
    ),
}


@pytest.mark.parametrize("config", list(PREEMPTION_CONFIGS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_with_preemption(references, arch: str, config: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, **PREEMPTION_CONFIGS[config])
    engine = llm.llm_engine
    if not engine.kv.uses_blocks:
        pytest.skip(f"{arch} has no attention blocks: a pure state-space model is never preempted")
    seen = _track_requests(engine)
    outs = generate_all(llm)
    assert len(seen) == len(PROMPTS)
    assert sum(r.num_preemptions for r in seen) > 0, "the pool was meant to force preemption"
    for i, out in enumerate(outs):
        assert_matches(ref, i, out)
    assert_cache_returned(engine)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_requests_added_while_decoding(references, arch: str) -> None:
    ref = references(arch)
    engine = make_llm(ref, max_num_batched_tokens=9).llm_engine
    done: dict[str, CompletionOutput] = {}

    def add(indices: range) -> None:
        for i in indices:
            engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, GREEDY)

    def step(n: int) -> None:
        for _ in range(n):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]

    add(range(0, 4))
    step(12)  # under budget 9 the later arrivals' prefill chunks share steps with decodes
    assert engine.scheduler.num_running > 0 and not done
    add(range(4, 6))
    step(5)
    add(range(6, 8))
    while engine.has_unfinished_requests():
        step(1)
    assert sorted(done, key=int) == [str(i) for i in range(8)]
    for i in range(8):
        assert_matches(ref, i, done[str(i)])
    assert_cache_returned(engine)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_with_slot_reuse(references, arch: str) -> None:
    # 8 requests through 2 slots: every slot serves several requests, one after another
    ref = references(arch)
    llm = make_llm(ref, max_num_seqs=2)
    kv = llm.llm_engine.kv
    assert kv.num_state_slots == 2
    handed_out: list[int] = []
    allocate = kv.allocate_slots

    def recording_allocate(req: Request) -> bool:
        had = bool(req.state_slots)
        ok = allocate(req)
        if ok and not had:
            handed_out.extend(req.state_slots)
        return ok

    kv.allocate_slots = recording_allocate
    for i, out in enumerate(generate_all(llm)):
        assert_matches(ref, i, out)
    assert len(handed_out) >= len(PROMPTS)
    assert sorted(set(handed_out)) == [0, 1]
    assert min(handed_out.count(s) for s in (0, 1)) >= 2, f"slots handed out: {handed_out}"
    assert_cache_returned(llm.llm_engine)


# -- start-up ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_slots_that_do_not_fit_fail_at_startup(checkpoints, arch: str) -> None:
    opts = device_options()
    with pytest.raises(ValueError) as err:
        LLM(
            checkpoints(arch),
            **opts,
            max_num_seqs=256,
            cpu_kv_cache_gib=1e-6,
            gpu_memory_utilization=1e-6,
        )
    msg = str(err.value)
    assert "max_num_seqs=256" in msg
    assert "lower max_num_seqs" in msg  # says how to fix it
    assert ("cpu_kv_cache_gib" if opts["device"] == "cpu" else "gpu_memory_utilization") in msg

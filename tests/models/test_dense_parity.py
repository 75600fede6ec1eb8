"""HF parity for dense decoders, the main proof of the foundation: krait's greedy tokens equal HF
transformers' `generate` token for token, and its logprobs equal HF's log-softmax within 1e-3,
under every scheduling shape (chunked prefill, few sequences, block sizes, preemption, requests
arriving while others decode)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from krait import LLM, SamplingParams
from krait.engine.engine import LLMEngine
from krait.engine.request import Request
from krait.outputs import CompletionOutput
from tests.utils import hf_greedy, make_tiny_llama

PROMPT_LENS = [1, 2, 7, 13, 16, 17, 33, 60]
MAX_NEW = 32
NUM_LOGPROBS = 2
TOL = 1e-3


def _prompts() -> list[list[int]]:
    # ids 3.. avoid bos/eos/pad; varied so that no two prompts share a prefix
    return [[3 + (7 * i + 13 * j * j) % 500 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


PROMPTS = _prompts()
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS
)


@dataclass
class Reference:
    model_dir: str
    tokens: list[list[int]]  # HF greedy continuation per prompt
    logprobs: list[torch.Tensor]  # per prompt: [MAX_NEW, vocab] log-softmax of each step


def _reference(model_dir: str) -> Reference:
    tokens, _, rows = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    return Reference(model_dir, tokens, rows)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    arch = request.param
    return _reference(make_tiny_llama(tmp_path_factory.mktemp(arch), arch=arch))


def assert_matches(ref: Reference, i: int, out: CompletionOutput) -> None:
    """Completion `out` of prompt `i` equals HF's: same tokens, logprobs and ranks within TOL."""
    assert out.token_ids == ref.tokens[i], f"prompt {i} (len {PROMPT_LENS[i]})"
    assert out.finish_reason == "length"
    assert out.logprobs is not None and len(out.logprobs) == MAX_NEW
    hf_rows = ref.logprobs[i]
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = hf_rows[step]
        top_vals, top_ids = row.topk(NUM_LOGPROBS)
        assert tok in entry and entry[tok].rank == 1  # greedy: the sampled token is the best
        assert set(entry) == set(top_ids.tolist()), f"prompt {i} step {step}"
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < TOL, f"prompt {i} step {step} id {tid}"
            hf_rank = int((row > row[tid]).sum()) + 1
            assert lp.rank == hf_rank, f"prompt {i} step {step} id {tid}"
    expected_cum = sum(hf_rows[s, t].item() for s, t in enumerate(ref.tokens[i]))
    assert out.cumulative_logprob == pytest.approx(expected_cum, abs=MAX_NEW * TOL)


def _llm(ref: Reference, **engine_options) -> LLM:
    # float32 on any device: the oracle is HF in float32
    return LLM(ref.model_dir, dtype="float32", **engine_options)


def _generate(ref: Reference, **engine_options) -> tuple[LLM, list[CompletionOutput]]:
    llm = _llm(ref, **engine_options)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    return llm, [o.outputs[0] for o in outs]


CONFIGS = {
    "defaults": {},
    "chunked_7": dict(max_num_batched_tokens=7),  # every prompt > 7 is chunked at odd offsets
    "max_num_seqs_2": dict(max_num_seqs=2),
    "block_size_1": dict(block_size=1),
    "block_size_16_chunked_5": dict(block_size=16, max_num_batched_tokens=5),
    "block_size_32": dict(block_size=32),
    "block_size_32_chunked_11_seqs_3": dict(
        block_size=32, max_num_batched_tokens=11, max_num_seqs=3
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_parity(ref: Reference, config: str) -> None:
    _, outs = _generate(ref, **CONFIGS[config])
    for i, out in enumerate(outs):
        assert_matches(ref, i, out)


def _track_requests(engine: LLMEngine) -> list[Request]:
    """Records every Request the engine hands its scheduler (they carry num_preemptions)."""
    seen: list[Request] = []
    add = engine.scheduler.add_request

    def recording_add(req: Request) -> None:
        seen.append(req)
        add(req)

    engine.scheduler.add_request = recording_add
    return seen


# The longest request holds 60 + 31 tokens in the cache: these pools fit it alone, not all
# (and one request of max_model_len=96, which the engine checks at startup).
PREEMPTION_CONFIGS = {
    "blocks_16x8": dict(block_size=16, num_kv_blocks=8, max_model_len=96),
    "blocks_4x24_chunked_7": dict(
        block_size=4, num_kv_blocks=24, max_num_batched_tokens=7, max_model_len=96
    ),
    "blocks_1x100_seqs_4": dict(block_size=1, num_kv_blocks=100, max_num_seqs=4, max_model_len=96),
}


@pytest.mark.parametrize("config", list(PREEMPTION_CONFIGS))
def test_parity_with_preemption(ref: Reference, config: str) -> None:
    llm = _llm(ref, **PREEMPTION_CONFIGS[config])
    seen = _track_requests(llm.llm_engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert len(seen) == len(PROMPTS)
    assert sum(r.num_preemptions for r in seen) > 0, "the pool was meant to force preemption"
    for i, out in enumerate(outs):
        assert_matches(ref, i, out.outputs[0])
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_usable_blocks  # every block came back


@pytest.mark.parametrize("budget", [8192, 9])
def test_parity_requests_added_while_decoding(ref: Reference, budget: int) -> None:
    llm = _llm(ref, max_num_batched_tokens=budget)
    engine = llm.llm_engine
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
    step(12)  # prompts 0-3 now decode; 4-7 join them (chunked under the small budget)
    assert engine.scheduler.num_running > 0 and not done
    add(range(4, 6))
    step(5)
    add(range(6, 8))
    while engine.has_unfinished_requests():
        step(1)
    assert sorted(done, key=int) == [str(i) for i in range(8)]
    for i in range(8):
        assert_matches(ref, i, done[str(i)])


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_parity_other_dense_architectures(arch: str, tmp_path: Path) -> None:
    ref = _reference(make_tiny_llama(tmp_path / arch, arch=arch))
    _, outs = _generate(ref)
    for i, out in enumerate(outs):
        assert_matches(ref, i, out)

"""The draft-model drafter (speculative_config={"model": DRAFT_DIR, ...}) end to end.

Greedy outputs with a draft model are HF transformers' tokens (logprobs within 1e-3) whatever
the draft proposes. A target used as its own draft must have nearly every draft accepted: that
only holds when the draft's catch-up over the verified tokens (KV and the recurrent state in
slot A), the scratch copy it drafts from (slot B) and its bookkeeping across steps, chunked
catch-ups, skipped steps, preemptions and finished requests are right."""

from __future__ import annotations

import pytest
import torch

import krait.runner.chained_graphs as chained_graphs
import krait.runner.spec_decode.draft_model as draft_model
from krait import LLM, SamplingParams
from tests.models.test_spec_decode_parity import Reference, assert_matches
from tests.utils import (
    device_options,
    hf_greedy,
    make_tiny_hybrid,
    make_tiny_llama,
    record_proposals,
)

MAX_NEW = 16
NUM_LOGPROBS = 2
TOL = 1e-3
K = 3
# short and long prompts: 1 token, repeats, and one past two SSD chunks of 16 (catch-ups cross
# chunk boundaries); several short ones decode together so that a tight budget skips some
PROMPTS = [
    [7, 8, 9] * 3,
    [11],
    [3 + (7 * j + 13 * j * j) % 500 for j in range(40)],
    [21, 22],
    [5 + (11 * j) % 400 for j in range(17)],
    [30, 31, 32, 33, 34],
]
CONFIGS = {
    "defaults": {},
    "chunked_7_seqs_3": dict(max_num_batched_tokens=7, max_num_seqs=3),
    # a verify row of 1 + K tokens takes the whole budget: the other row waits, drafted already
    "budget_4_seqs_2": dict(max_num_batched_tokens=K + 1, max_num_seqs=2),
}


@pytest.fixture(scope="module")
def references(checkpoints, tmp_path_factory):
    """name -> Reference: "llama", a hybrid arch, or "<arch>@<seed>" (another random draw)."""
    cache: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in cache:
            arch, _, seed = name.partition("@")
            if arch == "llama":
                model_dir = make_tiny_llama(tmp_path_factory.mktemp(name), seed=int(seed or 0))
            elif seed:
                checkpoints(arch)  # skips an arch krait lacks
                model_dir = make_tiny_hybrid(tmp_path_factory.mktemp(arch), arch, seed=int(seed))
            else:
                model_dir = checkpoints(arch)
            tokens, _, rows = hf_greedy(model_dir, PROMPTS, MAX_NEW)
            cache[name] = Reference(model_dir, tokens, rows)
        return cache[name]

    return get


def _params(**kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS)
    return SamplingParams(**{**base, **kw})


def make_llm(target: Reference, draft_dir: str, k: int = K, **options) -> LLM:
    spec = {"model": draft_dir, "num_speculative_tokens": k}
    return LLM(target.model_dir, **device_options(), speculative_config=spec, **options)


def run_and_check(llm: LLM, ref: Reference) -> float:
    """Generates PROMPTS, checks them against HF and that every block and slot of the target
    and of the draft came back; returns the acceptance rate."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    for i, out in enumerate(outs):
        assert_matches(ref, i, out.outputs[0])
    engine = llm.llm_engine
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.num_free_slots == kv.num_state_slots
    engine.step()  # the runner hears of the last finished requests in the next step
    drafter = engine.runner.drafter
    assert not drafter._seqs
    assert drafter.kv.num_free_blocks == drafter.kv.num_usable_blocks
    assert drafter.kv.num_free_slots == drafter.kv.num_state_slots
    stats = engine.get_stats()
    drafted = stats["spec_decode_num_draft_tokens"]
    assert drafted > 0
    return stats["spec_decode_num_accepted_tokens"] / drafted


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "mamba2", "granitemoehybrid"])
def test_self_draft_accepts_nearly_everything(references, arch: str, config: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, ref.model_dir, **CONFIGS[config])
    rate = run_and_check(llm, ref)
    assert rate > 0.9, rate
    drafter = llm.llm_engine.runner.drafter
    if config != "defaults":  # catch-ups split by the budget
        assert drafter.num_catch_up_steps > len(PROMPTS)
    if config == "budget_4_seqs_2":  # rows skipped by the scheduler reuse their first draft
        assert drafter.num_reused_first_drafts > 0


def _perturbed_copy(model_dir: str, path, scale: float) -> str:
    """The checkpoint with noise of `scale` times each weight's spread added: a draft that
    mostly agrees with its target."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("config", ["defaults", "chunked_7_seqs_3"])
@pytest.mark.parametrize("arch", ["granitemoehybrid", "llama"])
def test_drafts_are_the_draft_models_greedy_continuation(references, tmp_path, arch: str,
                                                        config: str) -> None:
    """A draft that agrees with the target only in part: every proposal is the draft model's
    own greedy continuation of the verified tokens (HF, recomputed from scratch), so the
    draft's state is right after partial acceptances too; outputs stay exact."""
    ref = references(arch)
    draft_dir = _perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03)
    llm = make_llm(ref, draft_dir, **CONFIGS[config])
    drafter = llm.llm_engine.runner.drafter
    seen = record_proposals(drafter)
    rate = run_and_check(llm, ref)
    assert 0.3 < rate < 0.95, rate  # accepted and rejected drafts alike
    _check_greedy_continuations(draft_dir, seen)
    # a dense draft keeps the KV of the drafts the target accepted (the catch-up starts past
    # them), and the proposals above are still HF's; a hybrid one recomputes them
    kept = drafter.num_kept_draft_tokens
    assert kept > 0 if arch == "llama" else kept == 0, kept


def _check_greedy_continuations(draft_dir: str, seen: list) -> None:
    """Every recorded (tokens, drafts) pair: the drafts are HF's greedy continuation of the
    tokens under the draft checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for tokens, drafts in seen:
            ids = torch.tensor([tokens])
            want = []
            for _ in drafts:
                want.append(int(hf(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
            assert drafts == want, (len(tokens), drafts, want)


def test_foreign_draft_is_lossless(references) -> None:
    ref = references("nemotronh")
    draft = references("nemotronh@1")
    rate = run_and_check(make_llm(ref, draft.model_dir), ref)
    assert rate < 0.5, rate


def test_hybrid_draft_for_dense_target(references) -> None:
    ref = references("llama")
    rate = run_and_check(make_llm(ref, references("granitemoehybrid").model_dir,
                                  max_num_batched_tokens=7, max_num_seqs=3), ref)
    assert 0.0 <= rate < 0.5, rate


def test_dense_draft_for_hybrid_target(references) -> None:
    ref = references("mamba2")
    # the llama draft's positional limit (256) caps max_model_len (mamba2 alone: 4096)
    run_and_check(make_llm(ref, references("llama").model_dir, max_model_len=256), ref)


@pytest.mark.parametrize("arch", ["granitemoehybrid", "llama"])
def test_target_preemption(references, arch: str) -> None:
    ref = references(arch)
    llm = make_llm(ref, ref.model_dir, block_size=4, num_kv_blocks=14, max_model_len=56)
    seen = []
    add = llm.llm_engine.scheduler.add_request
    llm.llm_engine.scheduler.add_request = lambda r: (seen.append(r), add(r))
    rate = run_and_check(llm, ref)
    assert sum(r.num_preemptions for r in seen) > 0, "the pool was meant to force preemption"
    assert rate > 0.9, rate


def test_draft_pool_too_small_for_every_request(references, monkeypatch) -> None:
    """A draft pool of 6 blocks: rows that do not fit get no drafts (or are dropped when they
    cannot grow) and come back later; outputs stay exact."""
    size = draft_model.draft_cache_size
    monkeypatch.setattr(draft_model, "draft_cache_size",
                        lambda *a: (min(size(*a)[0], 7), size(*a)[1]))
    ref = references("granitemoehybrid")
    llm = make_llm(ref, ref.model_dir)
    assert llm.llm_engine.runner.drafter.kv.num_usable_blocks == 6
    assert run_and_check(llm, ref) > 0.9


def test_draft_decode_graph_path(references) -> None:
    """The draft's one-token steps through decode graphs (CudaGraphRunner(record=False): the
    graph dataflow without CUDA)."""
    from krait.runner.cuda_graphs import CudaGraphRunner

    ref = references("granitemoehybrid")
    llm = make_llm(ref, ref.model_dir, max_num_seqs=4)
    runner = llm.llm_engine.runner.drafter.runner
    graphs = CudaGraphRunner(runner, record=False)
    graphs.capture_all()
    runner.cuda_graphs = graphs
    replays = []
    run = graphs.run
    graphs.run = lambda batch: replays.append(batch.num_reqs) or run(batch)
    assert run_and_check(llm, ref) > 0.9
    assert replays


def test_bad_draft_models_are_refused(references, tmp_path) -> None:
    ref = references("llama")
    other = make_tiny_llama(tmp_path / "v520", vocab_size=520)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocab_size"):
        make_llm(ref, other)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*no such directory"):
        make_llm(ref, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size"):
        LLM(ref.model_dir, **device_options(), speculative_config={
            "model": ref.model_dir, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2})


@pytest.mark.parametrize("arch", ["granitemoehybrid", "llama"])
def test_one_token_catch_ups_replay_decode_graphs(references, tmp_path, arch: str) -> None:
    """A draft that agrees with the target in part, through its decode graphs (record=False):
    a catch-up of one token a row (every draft rejected) is a decode step and replays them, so
    fewer catch-ups run eagerly than there are; every proposal is still the draft model's
    greedy continuation (the hybrid's slot A advanced by the decode step as by a chunk)."""
    ref = references(arch)
    draft_dir = _perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03)
    llm = make_llm(ref, draft_dir)
    drafter = llm.llm_engine.runner.drafter
    drafter.capture_graphs(record=False)
    runner = drafter.runner
    eager = []
    forward = runner.forward
    runner.forward = lambda batch: eager.append(batch.num_reqs) or forward(batch)
    seen = record_proposals(drafter)
    rate = run_and_check(llm, ref)
    assert 0.3 < rate < 0.95, rate
    assert len(eager) < drafter.num_catch_up_steps, (len(eager), drafter.num_catch_up_steps)
    # catch-ups of up to 1 + k tokens a row run as one-token steps the graphs serve: the eager
    # forwards are the calls that admitted a new request (its prompt, a prefill)
    assert len(eager) <= len(PROMPTS), eager
    _check_greedy_continuations(draft_dir, seen)


@pytest.mark.parametrize("arch", ["granitemoehybrid", "llama"])
def test_one_token_catch_up_steps_restore_the_known_tokens(references, tmp_path, arch: str,
                                                           monkeypatch) -> None:
    """With the device token table (KRAIT_TRITON_CPU=1: the Triton kernels interpreted, the
    inputs gathered on the device as on the GPU) a decode graph writes each row's argmax after
    its position, over the verified token a catch-up of several one-token steps reads next;
    the drafter writes it back. Every proposal is still the draft model's greedy continuation,
    and the outputs HF's. (A hybrid draft catches up 1 + accepted tokens: the argmax written
    after its last accepted draft is the rejected draft, not the target's token.)"""
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    # the stepwise path (a dense draft's chained graphs keep every draft's KV: its catch-ups
    # are one token; tests/models/test_spec_draft_chained.py runs those over this table)
    monkeypatch.setattr(chained_graphs, "ENABLED", False)
    ref = references(arch)
    draft_dir = _perturbed_copy(ref.model_dir, tmp_path / "draft", 0.03)
    llm = make_llm(ref, draft_dir, max_num_seqs=1)  # one graph to capture
    drafter = llm.llm_engine.runner.drafter
    assert drafter.runner.tables is not None
    drafter.capture_graphs(record=False)
    restored = []
    restore = drafter._restore_next_tokens
    monkeypatch.setattr(drafter, "_restore_next_tokens",
                        lambda ids, *a: restored.append(len(ids)) or restore(ids, *a))
    seen = record_proposals(drafter)
    prompts = PROMPTS[:1]  # (the interpreter is slow)
    n = 7
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(max_tokens=n),
                        use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref.tokens[i][:n]
    assert restored  # catch-ups of two tokens a row ran as two one-token steps
    _check_greedy_continuations(draft_dir, seen)

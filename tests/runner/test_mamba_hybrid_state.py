"""State-slot invariants of MambaHybridModelState (DESIGN.md invariants 3, 4, 5 and 8), checked
through real engines over tiny random checkpoints: speculative buffers exist only with
speculation, postprocess_state's edge cases, slots reset on assignment and never shared, a final
one-token prefill chunk equal to a decode, and preemption that frees slots and resumes exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from krait import LLM, SamplingParams
from krait.config import SpeculativeConfig
from krait.engine.engine import LLMEngine
from krait.engine.kv_cache_manager import cdiv
from krait.engine.request import Request
from krait.layers.mamba2 import MambaMetadata
from krait.outputs import CompletionOutput
from krait.runner.input_batch import build_input_batch
from krait.runner.model_states.mamba_hybrid import MambaHybridModelState
from krait.runner.request_states import RequestStates
from tests.utils import ARCHS, device_options, make_tiny_model

ATTENTION_HYBRIDS = ["bamba", "granitemoehybrid", "nemotronh", "falconh1"]
PROMPT_LENS = [1, 5, 13, 16, 17, 29, 33, 40]
PROMPTS = [[3 + (11 * i + 7 * j * j) % 500 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
TOL = 1e-4  # same model, different batch shapes or kernels (chunk scan vs. state update)


def hybrid_state(llm: LLM) -> MambaHybridModelState:
    state = llm.llm_engine.runner.model_state
    assert isinstance(state, MambaHybridModelState)
    return state


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_same_outputs(got: list[CompletionOutput], want: list[CompletionOutput]) -> None:
    """Same tokens; the sampled tokens' logprobs within TOL."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"prompt {i}"
        for step, (tok, lg, lw) in enumerate(zip(g.token_ids, g.logprobs, w.logprobs)):
            assert abs(lg[tok].logprob - lw[tok].logprob) < TOL, f"prompt {i} step {step}"


def record_mixer_inputs(llm: LLM) -> list[MambaMetadata]:
    """Records the MambaMetadata the first Mamba layer receives at every forward."""
    metas: list[MambaMetadata] = []
    layer = hybrid_state(llm).mamba_layers[0]
    layer.register_forward_pre_hook(lambda _mod, args: metas.append(args[1]))
    return metas


def prefill_chunks(metas: list[MambaMetadata]) -> list[tuple[int, bool]]:
    """(length, has_initial_state) of every prefill row in `metas`."""
    chunks: list[tuple[int, bool]] = []
    for m in metas:
        if m.num_prefills:
            lens = np.diff(m.prefill_query_start_loc.cpu().numpy()).tolist()
            chunks.extend(zip(lens, m.prefill_has_initial_state.cpu().tolist()))
    return chunks


def speculative_state(llm: LLM, k: int) -> MambaHybridModelState:
    """A second model state over the engine's model, built as speculative decoding with k
    draft tokens builds it."""
    engine = llm.llm_engine
    config = dataclasses.replace(engine.config, speculative=SpeculativeConfig("ngram", k))
    return MambaHybridModelState(engine.runner.model, config)


# -- invariant 3 ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_invariant_3_no_speculative_buffers_without_speculation(checkpoints, arch: str) -> None:
    llm = LLM(
        checkpoints(arch),
        **device_options(),
        max_num_batched_tokens=7,
        max_num_seqs=3,
        enforce_eager=True,  # graph replays would hide the layer inputs
    )
    state = hybrid_state(llm)
    assert state.num_accepted_tokens is None and state.replay_ctl is None
    assert state.slots_per_request == 1
    # no kept inputs for the deferred commit either
    assert all(getattr(m, "ssm_replay", None) is None for m in state.mamba_layers)
    metas = record_mixer_inputs(llm)
    generate(llm, PROMPTS[:5])
    assert any(m.num_decodes and m.num_prefills for m in metas), "expected mixed steps"
    assert any(m.num_decodes and not m.num_prefills for m in metas), "expected pure decodes"
    for m in metas:
        assert m.num_accepted_tokens is None
        assert m.num_decode_draft_tokens is None
        assert m.decode_query_start_loc is None and m.decode_state_slots is None
        assert m.decode_idx_mapping is None
        assert m.num_decode_tokens == m.num_decodes  # plain decoding: one token per decode row
        assert m.state_indices.dtype == torch.int32
        assert (m.state_indices >= 0).all()


def test_invariant_3_speculative_buffers_mark_rows(checkpoints) -> None:
    # with speculation on: accepted counts exist; draft counts are 0 for a decode row without
    # drafts and -1 for a row that is not a decode row
    llm = LLM(checkpoints("mamba2"), **device_options(), max_num_seqs=4)
    state = speculative_state(llm, k=2)
    assert state.slots_per_request == 3
    assert state.num_accepted_tokens is not None
    assert state.num_accepted_tokens.dtype == torch.int32
    assert state.num_accepted_tokens.tolist() == [1, 1, 1, 1]
    # the Mamba2 state update's deferred commit: a control word a request row, nothing kept
    assert state.replay_ctl.dtype == torch.int32 and state.replay_ctl.tolist() == [0] * 4
    state.allocate_caches(8, 4 * state.slots_per_request)  # the engine is not stepped again
    for m in state.mamba_layers:
        kept_x, kept_dt, kept_b, ctl = m.ssm_replay
        assert ctl is state.replay_ctl
        assert kept_x.shape[:3] == kept_dt.shape[:3] == kept_b.shape[:3] == (2, 4, 3)
    block_size = llm.llm_engine.config.cache.block_size
    states = RequestStates(4, 64, cdiv(64, block_size), state.slots_per_request)
    state.request_states = states
    params = SamplingParams(temperature=0.0)
    states.add("decode", list(range(3, 9)), 5, 5, 0, params, [], [3, 4, 5], [])
    states.add("prefill", list(range(3, 11)), 8, 0, 0, params, [], [0, 1, 2], [])
    batch = build_input_batch(states, ["decode", "prefill"], [1, 8], block_size, state.device)
    meta = state.mamba_metadata(batch)
    assert meta.num_decodes == 1 and meta.num_prefills == 1
    assert meta.state_indices.tolist() == [3, 0]  # each row starts from its first slot
    assert meta.num_accepted_tokens is state.num_accepted_tokens
    assert meta.num_decode_draft_tokens.tolist() == [0, -1]
    # the decode row as a verify batch: its tokens, all its slots, its request row
    assert meta.decode_query_start_loc.tolist() == [0, 1]
    assert meta.decode_state_slots.tolist() == [[3, 4, 5]]
    assert meta.decode_idx_mapping.tolist() == [states.index["decode"]]
    assert meta.decode_state_slots.dtype == meta.decode_query_start_loc.dtype == torch.int32


def test_invariant_5_verify_columns_take_conv_only_slots(checkpoints, tmp_path) -> None:
    # Mamba2's SSM state is committed once a step from slot column 0, so columns 1..k are
    # conv windows alone: conv-only slots past the full ones, with no SSM state behind them.
    # Gated DeltaNet layers keep a full state per position: no conv-only slots for them
    llm = LLM(checkpoints("mamba2"), **device_options(), max_num_seqs=4)
    state = speculative_state(llm, k=2)
    assert state.conv_only_columns == 2
    assert 0 < state.conv_bytes_per_slot() < state.state_bytes_per_slot()
    state.allocate_caches(8, 5, 8)  # 4 request slots + 1 snapshot, 4 x 2 conv-only
    for m in state.mamba_layers:
        assert m.ssm_state.shape[0] == 5 and m.conv_state.shape[0] == 13
    # a reset touches a conv-only slot's window and nothing past the SSM state's rows
    for m in state.mamba_layers:
        m.conv_state.fill_(1.0)
        m.ssm_state.fill_(1.0)
    state.add_requests([(0, [2, 9, 12])])
    for m in state.mamba_layers:
        assert m.conv_state[[2, 9, 12]].abs().sum() == 0 and m.conv_state[3].min() == 1
        assert m.ssm_state[2].abs().sum() == 0 and m.ssm_state[3].min() == 1
    assert speculative_state(llm, k=0).conv_only_columns == 0
    gdn = LLM(make_tiny_model(tmp_path / "qwen3next", "qwen3next"), **device_options(),
              max_num_seqs=2)
    assert speculative_state(gdn, k=2).conv_only_columns == 0


def test_engine_sizes_conv_only_slots(checkpoints) -> None:
    # with ngram drafts (k = 3) a mamba2 engine holds max_num_seqs full slots and 3 conv-only
    # slots a request; the state memory a request is 1 full slot + 3 conv windows
    llm = LLM(checkpoints("mamba2"), **device_options(), max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.llm_engine
    kv, state = engine.kv, hybrid_state(llm)
    assert kv.num_state_slots == 4 and len(kv._free_conv_slots) == 12
    assert all(m.ssm_state.shape[0] == 4 for m in state.mamba_layers)
    assert all(m.conv_state.shape[0] == 16 for m in state.mamba_layers)
    outs = generate(llm, PROMPTS[:6], SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))
    plain = generate(LLM(checkpoints("mamba2"), **device_options(), max_num_seqs=4),
                     PROMPTS[:6], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


# -- invariant 4 ---------------------------------------------------------------------------

IDX = [2, -1, 0]


def _idx(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)  # [rows]


def test_invariant_4_postprocess_state_is_a_noop_without_speculation(checkpoints) -> None:
    llm = LLM(checkpoints("mamba2"), **device_options(), max_num_seqs=4)
    state = hybrid_state(llm)
    generate(llm, PROMPTS[:2])  # leaves non-zero states in the slots
    before = [(m.conv_state.clone(), m.ssm_state.clone()) for m in state.mamba_layers]
    dev = state.device
    state.postprocess_state(_idx(IDX, dev), 0)
    state.postprocess_state(_idx(IDX, dev), 3)
    state.postprocess_state(_idx(IDX, dev), _idx([0, 1, 3], dev))
    state.postprocess_state(_idx([], dev), 0)
    state.postprocess_state(_idx([], dev), _idx([], dev))
    assert state.num_accepted_tokens is None
    for m, (conv, ssm) in zip(state.mamba_layers, before):
        assert torch.equal(m.conv_state, conv) and torch.equal(m.ssm_state, ssm)
    assert generate(llm, PROMPTS[:1])[0].finish_reason == "length"  # the engine still serves


def test_invariant_4_postprocess_state_records_accepted_counts(checkpoints) -> None:
    llm = LLM(checkpoints("mamba2"), **device_options(), max_num_seqs=4)
    state = speculative_state(llm, k=3)
    acc = state.num_accepted_tokens
    dev = state.device

    def run(num_sampled) -> list[int]:
        acc.fill_(7)
        state.postprocess_state(_idx(IDX, dev), num_sampled)
        return acc.tolist()

    assert run(0) == [1, 7, 1, 7]  # a step that samples nothing counts as the neutral 1
    assert run(3) == [3, 7, 3, 7]
    assert run(_idx([0, 5, 2], dev)) == [2, 7, 1, 7]  # -1 rows skipped, 0 -> 1
    acc.fill_(7)
    state.postprocess_state(_idx([], dev), 0)
    state.postprocess_state(_idx([], dev), _idx([], dev))
    assert acc.tolist() == [7, 7, 7, 7]


# -- invariant 5 ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_invariant_5_slot_is_reset_when_assigned(checkpoints, arch: str) -> None:
    model_dir = checkpoints(arch)
    prompts = PROMPTS[2:5]
    want = generate(LLM(model_dir, **device_options()), prompts)

    llm = LLM(model_dir, **device_options(), max_num_seqs=1)  # one slot, reused by each request
    state = hybrid_state(llm)
    add = state.add_requests
    assigned: list[int] = []

    def poison() -> None:
        for m in state.mamba_layers:
            m.conv_state.fill_(float("nan"))
            m.ssm_state.fill_(float("nan"))

    def checking_add(new: list[tuple[int, list[int]]], restores=None) -> None:
        poison()  # whatever an earlier owner (or anyone) left there
        add(new, restores)
        for m in state.mamba_layers:
            for _, slots in new:
                for s in slots:
                    assert not m.conv_state[s].any() and not m.ssm_state[s].any(), f"slot {s}"
        assigned.extend(s for _, slots in new for s in slots)

    state.add_requests = checking_add
    assert_same_outputs(generate(llm, prompts), want)
    assert assigned == [0, 0, 0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_invariant_5_live_requests_never_share_a_slot(checkpoints, arch: str) -> None:
    opts = dict(max_num_seqs=3, max_num_batched_tokens=7, enforce_eager=True)
    if arch != "mamba2":
        # tight: preemption frees and retakes slots
        opts.update(block_size=4, num_kv_blocks=20, max_model_len=80)
    llm = LLM(checkpoints(arch), **device_options(), **opts)
    engine = llm.llm_engine
    kv, sched, states = engine.kv, engine.scheduler, engine.runner.states
    metas = record_mixer_inputs(llm)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    busiest = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [r.state_slots for r in sched.running]
        flat = [s for slots in live for s in slots]
        assert all(len(slots) == kv.slots_per_request for slots in live)
        assert len(set(flat)) == len(flat), f"shared slots: {live}"
        assert kv.num_free_slots + len(flat) == kv.num_state_slots  # no slot lost
        rows = [states.state_slots[i, 0] for i in states.index.values()]
        assert len(set(rows)) == len(rows)
        busiest = max(busiest, len(live))
    for m in metas:
        real = m.state_indices[m.state_indices >= 0].tolist()
        assert len(set(real)) == len(real)
    assert busiest == 3
    assert kv.num_free_slots == kv.num_state_slots


@pytest.mark.parametrize("arch", list(ARCHS))
def test_invariant_5_final_one_token_prefill_chunk_equals_decode(checkpoints, arch: str) -> None:
    llm = LLM(
        checkpoints(arch),
        **device_options(),
        max_num_batched_tokens=8,
        max_num_seqs=1,
        enforce_eager=True,
    )
    metas = record_mixer_inputs(llm)
    q = PROMPTS[3]  # 16 tokens
    assert len(q) == 16
    decoded = generate(llm, [q], dataclasses.replace(GREEDY, max_tokens=9))[0]
    # its first sampled token went through a decode step; now make it the prompt's last token,
    # which arrives as a final prefill chunk of one token (16 + 1 = 8 + 8 + 1)
    metas.clear()
    p = q + decoded.token_ids[:1]
    chunked = generate(llm, [p], dataclasses.replace(GREEDY, max_tokens=8))[0]
    assert prefill_chunks(metas) == [(8, False), (8, True), (1, True)]
    assert chunked.token_ids == decoded.token_ids[1:]
    for step, tok in enumerate(chunked.token_ids):
        got, want = chunked.logprobs[step][tok], decoded.logprobs[step + 1][tok]
        assert abs(got.logprob - want.logprob) < TOL, f"step {step}"


# -- invariant 8 ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ATTENTION_HYBRIDS)
def test_invariant_8_preemption_frees_slots_and_resumes_identically(checkpoints, arch) -> None:
    model_dir = checkpoints(arch)
    want = generate(LLM(model_dir, **device_options()), PROMPTS)
    # the longest request needs 40 + 11 cache tokens: 4 blocks of 16, all of the pool
    llm = LLM(model_dir, **device_options(), block_size=16, num_kv_blocks=4, max_model_len=64)
    engine: LLMEngine = llm.llm_engine
    kv, sched = engine.kv, engine.scheduler
    preempt = sched._preempt
    freed: list[list[int]] = []

    def checking_preempt(victim: Request) -> None:
        slots, free_before = list(victim.state_slots), kv.num_free_slots
        assert len(slots) == kv.slots_per_request
        preempt(victim)
        assert victim.state_slots == [] and victim.block_ids == []
        assert kv.num_free_slots == free_before + len(slots)
        freed.append(slots)

    sched._preempt = checking_preempt
    got = generate(llm, PROMPTS)
    assert freed, "the pool was meant to force preemption"
    assert_same_outputs(got, want)
    assert kv.num_free_slots == kv.num_state_slots
    assert kv.num_free_blocks == kv.num_usable_blocks

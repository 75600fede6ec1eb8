"""DESIGN.md's invariants for the dense runner path, each in a test named after it."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from krait import LLM, SamplingParams
from krait.config import EngineConfig
from krait.engine.kv_cache_manager import cdiv
from krait.layers.attention import Attention
from krait.ops.paged_attention import paged_attention_ref, paged_attention_triton
from krait.runner.input_batch import InputBatch, build_input_batch
from krait.runner.model_runner import ModelRunner
from krait.runner.model_states.default import DefaultModelState
from krait.runner.request_states import RequestStates
from krait.sampling_params import SamplingParams as SP
from tests.utils import make_tiny_llama

CPU = torch.device("cpu")
BLOCK = 4
NUM_BLOCKS = 64
# (req_id, prompt len, outputs so far, num_computed_tokens, tokens this step): two decode rows
# first, then a prefill chunk at an odd offset
ROWS = [("d0", 5, 1, 5, 1), ("d1", 18, 3, 20, 1), ("p0", 30, 0, 7, 9)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("inv"), arch="llama")


def _config(model_dir: str, max_model_len: int) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=model_dir, device="cpu", block_size=BLOCK, max_model_len=max_model_len,
        max_num_seqs=8,
    )


def _fill_states(states: RequestStates) -> None:
    """Adds ROWS with disjoint block ids (block 0, the null block, is never used)."""
    next_block = 1
    for rid, n_prompt, n_out, computed, n_sched in ROWS:
        tokens = [3 + (7 * j + len(rid)) % 500 for j in range(n_prompt + n_out)]
        num_blocks = cdiv(computed + n_sched, BLOCK)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        states.add(rid, tokens, n_prompt, computed, 0, SP(), blocks, [], [1])


def _states(max_model_len: int) -> RequestStates:
    states = RequestStates(8, max_model_len, cdiv(max_model_len, BLOCK), 0)
    _fill_states(states)
    return states


def _batch(states: RequestStates, **padding) -> InputBatch:
    ids = [r[0] for r in ROWS]
    return build_input_batch(states, ids, [r[4] for r in ROWS], BLOCK, CPU, **padding)


def _model_state(model_dir: str, max_model_len: int) -> DefaultModelState:
    layers = torch.nn.ModuleList([Attention(4, 2, 16, 0.25), Attention(4, 2, 16, 0.25)])
    ms = DefaultModelState(layers, _config(model_dir, max_model_len))
    ms.allocate_caches(NUM_BLOCKS, 0)
    return ms


def test_invariant_1_idx_mapping_int32_and_padding_rows() -> None:
    states = _states(256)
    batch = _batch(states, num_reqs_padded=6, num_tokens_padded=16)
    assert batch.num_reqs == 3 and batch.num_reqs_padded == 6
    assert batch.idx_mapping.dtype == torch.int32 and batch.idx_mapping_np.dtype == np.int32
    expected = [states.index[r[0]] for r in ROWS] + [-1, -1, -1]
    assert batch.idx_mapping.tolist() == expected
    assert batch.idx_mapping_np.tolist() == expected
    assert batch.query_start_loc.dtype == torch.int32
    assert batch.query_start_loc.tolist() == [0, 1, 2, 11, 11, 11, 11]  # padding rows: empty
    assert batch.seq_lens.tolist() == [6, 21, 16, 0, 0, 0]
    assert batch.seq_lens_cpu_upper_bound.tolist() == [6, 21, 16, 0, 0, 0]
    assert batch.is_prefilling.tolist() == [False, False, True, False, False, False]
    assert batch.num_decodes == 2
    assert (batch.block_table[3:] == 0).all()  # padding rows see only the null block
    assert batch.logits_indices.tolist() == [0, 1, 10]
    # the real part equals the unpadded batch
    plain = _batch(states)
    assert plain.idx_mapping.tolist() == expected[:3]
    assert torch.equal(batch.input_ids[:11], plain.input_ids)
    assert torch.equal(batch.positions[:11], plain.positions)
    assert torch.equal(batch.slot_mapping[:11], plain.slot_mapping)


def test_invariant_1_slot_mapping_minus_one_for_padded_tokens() -> None:
    states = _states(256)
    batch = _batch(states, num_reqs_padded=4, num_tokens_padded=16)
    slots = batch.slot_mapping.tolist()
    assert batch.slot_mapping.dtype == torch.int64
    assert slots[11:] == [-1] * 5
    pos = batch.positions.tolist()
    assert pos[:11] == [5, 20, *range(7, 16)]
    row_of_token = [0, 1] + [2] * 9
    for t in range(11):
        i = states.index[ROWS[row_of_token[t]][0]]
        block = states.block_table[i, pos[t] // BLOCK]
        assert block != 0 and slots[t] == block * BLOCK + pos[t] % BLOCK
    assert len(set(slots[:11])) == 11
    assert batch.input_ids[11:].tolist() == [0] * 5


def test_invariant_1_padded_rows_change_nothing(model_dir: str) -> None:
    """The model run on a padded batch gives the same hidden states for real tokens and the
    same KV cache: padding rows (-1) and padding tokens (slot -1) write nowhere."""
    runner = ModelRunner(_config(model_dir, 256))
    runner.initialize_cache(NUM_BLOCKS, 0)
    _fill_states(runner.states)
    torch.manual_seed(0)
    caches = [a.kv_cache for a in runner.model_state.attn_layers]
    for c in caches:
        c.normal_()
    initial = [c.clone() for c in caches]
    with torch.inference_mode():
        plain = runner.forward(_batch(runner.states))
    after_plain = [c.clone() for c in caches]
    for c, c0 in zip(caches, initial):
        c.copy_(c0)
    padded_batch = _batch(runner.states, num_reqs_padded=6, num_tokens_padded=16)
    with torch.inference_mode():
        padded = runner.forward(padded_batch)
    assert padded.shape[0] == 16
    torch.testing.assert_close(padded[:11], plain, rtol=0, atol=1e-6)
    for c, c_plain in zip(caches, after_plain):
        assert torch.equal(c, c_plain)
    # block 0 (the null block) was not written either
    for c, c0 in zip(caches, initial):
        assert torch.equal(c[:, 0], c0[:, 0])


def test_invariant_2_max_seq_len_real_batch_vs_capture(model_dir: str) -> None:
    ms = _model_state(model_dir, 256)
    batch = _batch(_states(256), num_reqs_padded=6, num_tokens_padded=16)
    # a padding row's bound must not leak into the metadata
    batch.seq_lens_cpu_upper_bound[3:] = 200
    meta = ms.prepare_attn(batch, for_capture=False).attn
    assert meta.max_seq_len == 21  # max(seq_lens_cpu_upper_bound[:num_reqs])
    assert meta.max_query_len == 9
    assert meta.num_reqs == 3 and meta.num_tokens == 11
    captured = ms.prepare_attn(batch, for_capture=True).attn
    assert captured.max_seq_len == 256  # only capture uses max_model_len
    assert captured.max_query_len == 9


def test_invariant_2_decode_metadata_independent_of_max_model_len(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same decode+prefill batch under max_model_len 64 and 4096: identical metadata (the
    block table is only wider, with null blocks) and identical attention output."""
    monkeypatch.setenv("KRAIT_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the tiny model's limit is 256
    metas = []
    for max_len in (64, 4096):
        ms = _model_state(model_dir, max_len)
        metas.append(ms.prepare_attn(_batch(_states(max_len)), for_capture=False).attn)
    small, large = metas
    assert small.max_seq_len == large.max_seq_len == 21
    assert small.max_query_len == large.max_query_len
    assert (small.num_reqs, small.num_tokens) == (large.num_reqs, large.num_tokens)
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(small, name), getattr(large, name)), name
    # the block table the step carries spans the rows' real lengths, not max_model_len
    assert torch.equal(large.block_table, small.block_table)

    # the Triton kernel runs interpreted on CPU, natively where CUDA is and no interpreter
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cuda" if torch.cuda.is_available() and not interpret else "cpu"
    torch.manual_seed(0)
    q = torch.randn(11, 4, 16, device=dev)  # [tokens, heads, dim]
    # [blocks, block_size, kv_heads, dim]
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, 2, 16, device=dev)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, 2, 16, device=dev)
    for op in (paged_attention_ref, paged_attention_triton):
        outs = [
            op(q, k_cache, v_cache, m.query_start_loc.to(dev), m.seq_lens.to(dev),
               m.block_table.to(dev), m.max_query_len, m.max_seq_len, 0.25)
            for m in (small, large)
        ]
        assert torch.equal(outs[0], outs[1]), op.__name__
        assert torch.isfinite(outs[0]).all()


def test_invariant_4_postprocess_state_default(model_dir: str) -> None:
    """Dense models keep no state beyond the KV cache: every accepted form of the call leaves
    the caches untouched, -1 rows and empty batches included."""
    ms = _model_state(model_dir, 256)
    for a in ms.attn_layers:
        a.kv_cache.normal_()
    before = [a.kv_cache.clone() for a in ms.attn_layers]
    idx = torch.tensor([0, 2, -1, -1], dtype=torch.int32)
    seq_lens = torch.tensor([6, 16, 0, 0], dtype=torch.int32)
    calls = [
        (idx, torch.tensor([1, 0, 0, 0], dtype=torch.int32), seq_lens),  # 0: a mid-prefill chunk
        (idx, 1, seq_lens),
        (idx, 0, None),
        (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), None),
    ]
    for args in calls:
        assert ms.postprocess_state(*args) is None
    for a, b in zip(ms.attn_layers, before):
        assert torch.equal(a.kv_cache, b)
    assert ms.slots_per_request == 0 and ms.state_bytes_per_slot() == 0


def test_invariant_6_new_blocks_not_assumed_zero(model_dir: str) -> None:
    """A cache full of NaN before the first step changes nothing: no read of a slot that was
    not written in this request's life."""
    prompts = [{"prompt_token_ids": [3 + (5 * j) % 400 for j in range(n)]} for n in (1, 6, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=0)
    results = []
    for fill in (0.0, math.nan):
        llm = LLM(
            model_dir, block_size=BLOCK, max_num_batched_tokens=7, num_kv_blocks=24,
            max_model_len=24 * BLOCK,
        )
        for a in llm.llm_engine.runner.model_state.attn_layers:
            a.kv_cache.fill_(fill)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]
        )
    assert results[0] == results[1]
    assert all(math.isfinite(cum) for _, cum in results[1])

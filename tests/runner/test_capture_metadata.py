"""Decode-graph capture metadata (invariant 2's capture half) on CPU."""

import numpy as np
import pytest

from krait import LLM
from tests.utils import make_tiny_hybrid, make_tiny_llama


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    dense = LLM(make_tiny_llama(root / "llama"), device="cpu", dtype="float32", max_num_seqs=8,
                max_model_len=200)
    hybrid = LLM(make_tiny_hybrid(root / "granite", "granitemoehybrid"), device="cpu",
                 dtype="float32", max_num_seqs=8, max_model_len=200)
    return [dense.llm_engine.runner, hybrid.llm_engine.runner]


def test_invariant_2_capture_metadata_sized_for_any_decode_batch(runners):
    for runner in runners:
        batch = runner.dummy_decode_batch(8)
        assert batch.num_reqs == 0 and batch.num_reqs_padded == 8
        assert batch.idx_mapping.dtype.is_floating_point is False
        assert np.all(batch.idx_mapping_np == -1)
        meta = runner.model_state.prepare_attn(batch, for_capture=True)
        # a graph whose attention launch is sized for zero queries would skip attention
        assert meta.attn.max_query_len == 1
        assert meta.attn.max_seq_len == 200
        assert meta.attn.slot_mapping.tolist() == [-1] * 8


def test_invariant_1_padded_decode_rows_have_no_state_slot(runners):
    hybrid = runners[1]
    meta = hybrid.model_state.prepare_attn(hybrid.dummy_decode_batch(4), for_capture=True)
    assert meta.mamba.state_indices.tolist() == [-1] * 4
    assert meta.mamba.num_prefills == 0 and meta.mamba.num_decode_tokens == 4


def test_profile_run_respects_max_num_seqs(runners):
    # 200-token rows: a 8192-token profile would need 42 rows, more than max_num_seqs=8
    runners[0].profile_run(8192)


def test_replay_copy_fills_leading_block_table_columns():
    import torch

    from krait.runner.attention_metadata import AttentionMetadata
    from krait.runner.cuda_graphs import copy_tensors

    def meta(width: int, fill: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=2, num_tokens=2,
            query_start_loc=torch.full((3,), fill, dtype=torch.int32),
            seq_lens=torch.full((2,), fill, dtype=torch.int32),
            block_table=torch.full((2, width), fill, dtype=torch.int32),
            slot_mapping=torch.full((2,), fill, dtype=torch.int64),
            max_query_len=1, max_seq_len=8,
        )

    captured, step = meta(6, 0), meta(2, 7)
    copy_tensors(captured, step)
    assert captured.block_table[:, :2].eq(7).all() and captured.block_table[:, 2:].eq(0).all()
    assert captured.seq_lens.eq(7).all() and captured.slot_mapping.eq(7).all()
    assert captured.max_seq_len == 8  # ints stay as captured

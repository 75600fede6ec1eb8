"""AttentionMetadata.short_rows: a verify step's one-token rows are built once a forward (by its
first attention layer) and reused by the others; a new forward over the same metadata (a CUDA
graph's warm-up, then its capture) builds them again."""

from __future__ import annotations

import torch

from krait.ops.paged_attention import token_rows
from krait.runner.attention_metadata import AttentionMetadata


def _meta(max_query_len: int) -> AttentionMetadata:
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=2, num_tokens=8, query_start_loc=qsl,
        seq_lens=torch.tensor([20, 9], dtype=torch.int32),
        block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        slot_mapping=torch.zeros(8, dtype=torch.int64), max_query_len=max_query_len,
        max_seq_len=20)


def test_short_rows_built_once_a_forward(monkeypatch):
    monkeypatch.setattr("krait.runner.attention_metadata.use_triton", lambda t: True)
    meta = _meta(4)
    first, second = object(), object()
    rows = meta.short_rows(first, 8)
    want = token_rows(meta.query_start_loc, meta.seq_lens, meta.block_table, 8)
    for got, ref in zip(rows, want, strict=True):
        assert torch.equal(got, ref)
    assert meta.short_rows(second, 8) is rows  # the forward's other layers reuse them
    again = meta.short_rows(first, 8)  # the first layer again: a new forward
    assert again is not rows
    assert meta.short_rows(second, 8) is again
    assert meta.short_rows(second, 6) is not again  # another token count: built for it


def test_short_rows_only_for_short_query_rows(monkeypatch):
    monkeypatch.setattr("krait.runner.attention_metadata.use_triton", lambda t: True)
    assert _meta(1).short_rows(object(), 8) is None  # decode rows take the split kernel as is
    assert _meta(64).short_rows(object(), 8) is None  # prefill rows: the varlen kernel
    monkeypatch.setattr("krait.runner.attention_metadata.use_triton", lambda t: False)
    assert _meta(4).short_rows(object(), 8) is None  # the torch reference needs none

"""Greedy argmax (krait/ops/argmax.py) against torch.argmax: first index of the maximum,
ties across and within blocks, ragged vocabularies, counters reset for the next launch."""

import pytest
import torch

from krait.ops import argmax as am


@pytest.mark.parametrize("rows,vocab,block", [(1, 1000, 128), (3, 4096, 256), (5, 777, 64)])
def test_matches_torch(rows, vocab, block):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    for _ in range(2):  # the second launch finds the counters back at zero
        got = am.argmax_triton(x, block=block)
        assert torch.equal(got, x.argmax(dim=-1))
    assert int(am._COUNTERS[x.device].abs().sum()) == 0


def test_ties_pick_the_first_index():
    x = torch.zeros(2, 600)
    x[0, [70, 10, 500]] = 3.0  # ties inside a block and across blocks
    x[1, [599, 300]] = 1.0
    assert am.argmax_triton(x, block=64).tolist() == [10, 300] == x.argmax(-1).tolist()


def test_bf16_and_strided_rows():
    x = torch.randn(4, 300).to(torch.bfloat16)
    wide = torch.zeros(4, 512, dtype=torch.bfloat16)
    wide[:, :300] = x
    assert torch.equal(am.argmax_triton(wide[:, :300], block=64), x.float().argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
def test_real_vocab_gpu(rows):
    x = torch.randn(rows, 151936, device="cuda")
    x[:, 151935] = x.max() + 1  # the maximum in the last, partial block
    assert torch.equal(am.argmax_triton(x), x.argmax(dim=-1))

"""The grammar-mask op (krait/ops/token_bitmask.py): the Triton kernel through the CPU
interpreter against the torch reference and a plain bit-by-bit oracle; -1 rows skipped, rows
without a mask untouched, logits wider than the mask forbidden past it."""

import pytest
import torch

from krait.ops import token_bitmask as tb

IMPLS = [tb.apply_token_bitmask_reference, tb.apply_token_bitmask_triton]


def _oracle(logits, bitmask, rows):
    out = logits.clone()
    for s, r in enumerate(rows.tolist()):
        if r < 0:
            continue
        for t in range(logits.shape[1]):
            w = t // 32
            ok = w < bitmask.shape[1] and (int(bitmask[s, w]) >> (t % 32)) & 1
            if not ok:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("impl", IMPLS, ids=["ref", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,words", [(100, 4), (130, 4), (64, 2)])  # 130 > 32 * 4 bits
def test_matches_oracle(impl, dtype, vocab, words):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1  # every bit set: nothing masked (beyond the mask's width)
    rows = torch.tensor([3, -1, 0], dtype=torch.int32)
    want = _oracle(logits, bitmask, rows)
    got = logits.clone()
    if impl is tb.apply_token_bitmask_triton:
        got = impl(got, bitmask, rows, block=64)
    else:
        got = impl(got, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 2, 4]], logits[[1, 2, 4]])  # rows without a mask untouched


def test_empty_and_dispatch():
    logits = torch.randn(2, 40)
    same = logits.clone()
    for impl in IMPLS:
        impl(logits, torch.empty(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    assert torch.equal(logits, same)
    only_token_3 = torch.tensor([[1 << 3, 0]], dtype=torch.int32)
    tb.apply_token_bitmask(logits, only_token_3, torch.tensor([1], dtype=torch.int32))
    assert logits[1].argmax().item() == 3 and torch.isinf(logits[1]).sum() == 39
    assert torch.equal(logits[0], same[0])


def test_matches_xgrammar_when_installed():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 200, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 7), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = tb.apply_token_bitmask_triton(logits.clone(), bitmask,
                                        torch.arange(3, dtype=torch.int32), block=64)
    assert torch.equal(got, want)

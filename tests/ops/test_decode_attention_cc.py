"""The CUDA-core decode attention (KRAIT_DECODE_CUDA_CORE=1) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from krait.ops.decode_attention_cc import decode_attention_cc
from krait.ops.paged_attention import paged_attention_ref, paged_attention_triton
from tests.ops.test_paged_attention_split import _decode_batch

SEQ_LENS = [1, 130, 0, 517, 64, 33]  # one-token row, long rows, a padding row


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 32), (6, 2, 40), (4, 4, 32), (16, 2, 32)])
@pytest.mark.parametrize("window", [None, 37])
def test_matches_reference(hq, hkv, d, window):
    q, kc, vc, qsl, sl, bt = _decode_batch(SEQ_LENS, hq, hkv, d=d, seed=hq + d)
    args = (q, kc, vc, qsl, sl, bt, 1, max(SEQ_LENS), 0.2, window)
    want = paged_attention_ref(*args)
    out = torch.zeros_like(q)
    decode_attention_cc(q, kc, vc, out, qsl, sl, bt, 0.2, window)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_fp8_caches_and_dispatch(monkeypatch):
    q, kc, vc, qsl, sl, bt = _decode_batch(SEQ_LENS, 8, 2, seed=3)
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    args = (q, kc, vc, qsl, sl, bt, 1, max(SEQ_LENS), 0.2, None)
    want = paged_attention_ref(*args)
    monkeypatch.setenv("KRAIT_DECODE_CUDA_CORE", "1")
    got = paged_attention_triton(*args, num_splits=1)  # the varlen kernel's decode rows
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

"""Arrival counters (krait/ops/arrival.py): one zeroed buffer per pool and device, grown when a
launch needs more, and an outgrown buffer kept alive for the CUDA graphs that captured it."""

import torch

from krait.ops import arrival


def test_counters_grow_and_keep_the_outgrown_buffer():
    pool: dict = {}
    dev = torch.device("cpu")
    first = arrival.arrival_counters(pool, dev, 8)
    assert first.dtype == torch.int32 and first.numel() >= 8 and not first.any()
    assert arrival.arrival_counters(pool, dev, 100) is first  # fits: the same buffer
    grown = arrival.arrival_counters(pool, dev, first.numel() + 1)
    assert grown is not first and grown.numel() > first.numel() and not grown.any()
    # a graph captured with `first` still addresses it: it must not be freed and reused
    assert any(t is first for t in arrival._RETIRED)
    assert arrival.arrival_counters(pool, dev, 8) is grown

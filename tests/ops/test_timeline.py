"""krait/ops/timeline.py (KRAIT_TIMELINE) and scripts/timeline_decode.py's arithmetic: the stamps
are written on the GPU only (their sm_90 compile: tests/ops/test_sm90_compile.py)."""

from __future__ import annotations

import pytest
import torch

from krait.ops import timeline
from tests.utils import load_script


def _script():
    return load_script("timeline_decode")


def test_off_the_gpu_and_outside_a_capture_nothing_is_recorded(monkeypatch):
    monkeypatch.setenv("KRAIT_TIMELINE", "1")
    before = list(timeline.RECORDS)
    assert timeline_args_cpu() == {"TL": False}
    assert timeline.RECORDS == before
    monkeypatch.delenv("KRAIT_TIMELINE")
    assert timeline.timeline_args("gemv", (4, 2), torch.device("cpu")) == {"TL": False}


def timeline_args_cpu() -> dict:
    return timeline.timeline_args("rms_norm", (1,), torch.device("cpu"))


def test_launch_rows_and_summary_from_stamps():
    mod = _script()  # importing the script needs no GPU
    ns = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    records = [  # two programs each; a 0 is a slot a program never wrote
        {"name": "gemv", "programs": 2, "entry": ns(1000, 1500), "waited": ns(2000, 2100),
         "exit": ns(5000, 6000)},
        {"name": "rms_norm", "programs": 1, "entry": ns(3000), "waited": ns(6200),
         "exit": ns(7000)},
        {"name": "gemv", "programs": 2, "entry": ns(6500, 0), "waited": ns(7200, 0),
         "exit": ns(9000, 0)},
    ]
    rows = mod.launch_rows(records)
    assert [r["kernel"] for r in rows] == ["gemv", "rms_norm", "gemv"]
    assert rows[0]["entry_first"] == 0.0 and rows[0]["entry_last"] == 0.5
    assert rows[0]["exit_last"] == 5.0 and rows[0]["after_prev_exit"] is None
    assert rows[1]["after_prev_exit"] == 1.0  # 6.0 after the gemv's 5.0 (t0: 1000 ns)
    assert rows[2]["entry_last"] == 5.5 and rows[2]["after_prev_exit"] == 2.0  # zeros skipped
    table = "\n".join(mod.summary(rows))
    assert "gemv" in table and "rms_norm" in table


@pytest.mark.gpu
def test_stamps_of_a_captured_chain_are_ordered_gpu(monkeypatch):
    """Two RMSNorms and a GEMV captured into a graph with KRAIT_TIMELINE=1: after a replay each
    program's entry <= waited <= exit, and each launch exits after the one before."""
    from krait.ops.gemv import gemv_triton
    from krait.ops.rms_norm import rms_norm_triton

    monkeypatch.setenv("KRAIT_TIMELINE", "1")
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    proj = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)

    def chain():
        return rms_norm_triton(gemv_triton(rms_norm_triton(x, w, 1e-6), proj)[:, :2048], w, 1e-6)

    first = len(timeline.RECORDS)
    chain()  # compiles the stamping kernels outside the capture (scratch stamps, no records)
    assert len(timeline.RECORDS) == first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    assert [name for name, _, _ in timeline.RECORDS[first:]] == ["rms_norm", "gemv", "rms_norm"]
    timeline.clear()
    graph.replay()
    torch.cuda.synchronize()
    recs = timeline.read()[first:]
    for r in recs:
        assert (r["entry"] > 0).all() and (r["waited"] >= r["entry"]).all()
        assert (r["exit"] >= r["waited"]).all()
    assert recs[0]["exit"].max() <= recs[1]["waited"].min()  # the wait: the kernel before done
    assert recs[1]["exit"].max() <= recs[2]["waited"].min()

"""The decode graph's L2 weight prefetch (KRAIT_L2_PREFETCH): which weight is prefetched after
which projection's launch point, through the whole model, and that tokens never change."""

from __future__ import annotations

import gc

import pytest
import torch

from krait import LLM
from krait.ops.linear import linear, set_weight_hook
from krait.runner.weight_prefetch import WeightPrefetch, prefetch_lead, weight_prefetch_for
from krait.sampling_params import SamplingParams
from tests.utils import make_tiny_hybrid, make_tiny_llama


def test_lead_knob(monkeypatch):
    monkeypatch.delenv("KRAIT_L2_PREFETCH", raising=False)
    assert prefetch_lead() == 0 and weight_prefetch_for(torch.device("cpu")) is None
    monkeypatch.setenv("KRAIT_L2_PREFETCH", "2")
    assert weight_prefetch_for(torch.device("cpu")).lead == 2
    for bad in ("-1", "x"):
        monkeypatch.setenv("KRAIT_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match="KRAIT_L2_PREFETCH"):
            prefetch_lead()
    monkeypatch.setenv("KRAIT_L2_PREFETCH", "1")
    monkeypatch.setenv("KRAIT_L2_PREFETCH_MODE", "bogus")
    with pytest.raises(ValueError, match="KRAIT_L2_PREFETCH_MODE"):
        weight_prefetch_for(torch.device("cpu"))


def test_schedule_follows_projection_order():
    weights = [torch.randn(n, 8) for n in (4, 16, 2, 6)]
    x = torch.randn(1, 8)
    p = WeightPrefetch(torch.device("cpu"), lead=1, max_bytes=200)
    with p.capturing():
        for w in weights:
            linear(x, w)
    linear(x, weights[0])  # after the capture: no longer noted
    assert [w is v for (w, _, _), v in zip(p.noted, weights)] == [True] * 4
    # W_j waits for projection j-1's launch point; the first has none; bytes capped at 200
    assert [(n, t) for _, n, t in p.noted] == [(0, -1), (200, 0), (64, 1), (192, 2)]
    assert set_weight_hook(None) is None  # the hook was removed

    p2 = WeightPrefetch(torch.device("cpu"), lead=2, max_bytes=1 << 20)
    with p2.capturing():
        for w in weights:
            linear(x, w)
    assert [t for _, _, t in p2.noted] == [-1, -1, 0, 1]


PROMPTS = ([5, 6, 7], [9] * 11, list(range(3, 20)))


def _greedy(d, device: str, record: bool):
    """Greedy tokens and logprobs of PROMPTS through decode graphs (on CPU: the graph body run
    eagerly, CudaGraphRunner(record=False)); returns them with the engine's runner."""
    from krait.runner.cuda_graphs import CudaGraphRunner

    gc.collect()  # the previous engine's cache
    if device == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(d, device=device, dtype="float32", max_num_seqs=4, max_model_len=128,
              **({"gpu_memory_utilization": 0.3} if device == "cuda" else {}))
    runner = llm.llm_engine.runner
    if not record:
        runner.cuda_graphs = CudaGraphRunner(runner, record=False)
        runner.cuda_graphs.capture_all()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [round(e[t].logprob, 3) for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs], runner


def test_decode_capture_prefetches_every_projection(tmp_path, monkeypatch):
    """Through the engine's decode-graph path (the body run eagerly on CPU): every projection
    of the step is noted in order, ending with the lm_head, and the tokens match prefetch off."""
    d = make_tiny_llama(tmp_path / "qwen3", arch="qwen3")
    monkeypatch.setenv("KRAIT_L2_PREFETCH", "1")
    on, runner = _greedy(d, "cpu", record=False)
    monkeypatch.setenv("KRAIT_L2_PREFETCH", "0")
    off, _ = _greedy(d, "cpu", record=False)
    assert on == off
    noted = runner.cuda_graphs.prefetch.noted
    model = runner.model
    assert len(noted) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down a layer; lm_head
    assert noted[-1][0] is model.lm_head.weight
    assert [t for _, _, t in noted] == list(range(-1, len(noted) - 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "granitemoehybrid"])
def test_prefetched_decode_graphs_give_the_same_tokens(arch, tmp_path, monkeypatch):
    d = (make_tiny_llama(tmp_path / arch, arch="qwen3") if arch == "qwen3"
         else make_tiny_hybrid(tmp_path / arch, arch))
    monkeypatch.setenv("KRAIT_L2_PREFETCH", "0")
    want, _ = _greedy(d, "cuda", record=True)
    for mode in ("line", "evict_last", "bulk"):
        monkeypatch.setenv("KRAIT_L2_PREFETCH_MODE", mode)
        monkeypatch.setenv("KRAIT_L2_PREFETCH", "1")
        got, runner = _greedy(d, "cuda", record=True)
        assert runner.cuda_graphs.prefetch is not None and runner.cuda_graphs.graphs
        assert [t for t, _ in got] == [t for t, _ in want], mode

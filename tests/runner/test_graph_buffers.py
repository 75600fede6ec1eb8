"""A decode graph's replay builds its inputs in the captured buffers (no copies) and writes its
greedy tokens into the device token table: each piece against the path it replaces, on CPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from krait import LLM
from krait.engine.kv_cache_manager import cdiv
from krait.ops.prepare_inputs import prepare_inputs_ref, prepare_inputs_triton
from krait.ops.write_tokens import write_tokens_ref, write_tokens_triton
from krait.runner.cuda_graphs import copy_tensors
from krait.runner.device_tables import DeviceTables
from krait.runner.input_batch import build_input_batch
from krait.runner.request_states import RequestStates
from krait.sampling_params import SamplingParams
from tests.utils import make_tiny_hybrid

BLOCK, LEN = 4, 64


@pytest.mark.parametrize("write", [write_tokens_triton, write_tokens_ref])
def test_write_tokens_skips_padding_rows_and_full_rows(write):
    table = torch.arange(5 * LEN, dtype=torch.int32).view(5, LEN)
    want = table.clone()
    rows = torch.tensor([3, -1, 0, 2], dtype=torch.int32)
    pos = torch.tensor([7, 5, LEN, 0], dtype=torch.int32)  # row 0 is at max_model_len
    tokens = torch.tensor([111, 222, 333, 444, 555], dtype=torch.int64)  # longer than rows
    write(table, rows, pos, tokens)
    want[3, 7], want[2, 0] = 111, 444
    assert torch.equal(table, want)


@pytest.mark.parametrize("prepare", [prepare_inputs_triton, prepare_inputs_ref])
def test_prepare_inputs_into_captured_buffers(prepare):
    g = np.random.default_rng(0)
    tokens = torch.from_numpy(g.integers(0, 500, (4, LEN)).astype(np.int32))
    blocks = torch.from_numpy(g.permutation(4 * 16).reshape(4, 16).astype(np.int32) + 1)
    idx = torch.tensor([2, 0, -1], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    computed = torch.tensor([9, 30, 0], dtype=torch.int32)
    args = (idx, qsl, computed, tokens, blocks, BLOCK, 8, 3)
    fresh = prepare_inputs_ref(*args)
    out = (torch.full((3,), 7, dtype=torch.int64), torch.full((3,), 7, dtype=torch.int64),
           torch.full((3,), 7, dtype=torch.int64), torch.full((3, 16), 9, dtype=torch.int32))
    got = prepare(*args, out=out) if prepare is prepare_inputs_triton else None
    if got is None:
        from krait.ops.prepare_inputs import prepare_inputs

        got = prepare_inputs(*args, out=out)
    for a, b, o in zip(fresh, got, out):
        assert torch.equal(a, b) and b.data_ptr() == o.data_ptr()
    assert out[3][:, 8:].eq(9).all()  # columns past this step's width untouched


def _decode_states() -> tuple[RequestStates, DeviceTables]:
    """Three decode rows (each row's next token is its last known one)."""
    states = RequestStates(8, LEN, cdiv(LEN, BLOCK), 0)
    tables = DeviceTables(8, LEN, cdiv(LEN, BLOCK), torch.device("cpu"))
    next_block = 1
    for j, n in enumerate([5, 17, 30]):
        toks = [(3 * t + j) % 97 for t in range(n)]
        blocks = list(range(next_block, next_block + cdiv(n, BLOCK)))
        next_block += len(blocks)
        i = states.add(f"r{j}", toks, n - 1, n - 1, 0, SamplingParams(), blocks, [], [1])
        tables.set_row(i, toks)
        tables.add_blocks(i, 0, blocks)
    tables.flush()
    return states, tables


def test_build_input_batch_into_captured_batch_matches_a_fresh_one():
    states, tables = _decode_states()
    cpu = torch.device("cpu")
    pad = dict(num_reqs_padded=4, num_tokens_padded=4, pad_decode=True, tables=tables)
    captured = build_input_batch(states, [], [], BLOCK, cpu, full_block_table=True, **pad)
    ids = ["r2", "r0", "r1"]
    fresh = build_input_batch(states, ids, [1, 1, 1], BLOCK, cpu, **pad)
    into = build_input_batch(states, ids, [1, 1, 1], BLOCK, cpu, into=captured, **pad)
    for name in ("idx_mapping", "query_start_loc", "seq_lens", "input_ids", "positions",
                 "slot_mapping", "block_table", "logits_indices"):
        a, b = getattr(fresh, name), getattr(into, name)
        assert torch.equal(a, b), name
        if name != "logits_indices":  # unused by the graph: a cached [0, n)
            assert b.data_ptr() == getattr(captured, name).data_ptr(), name
    assert captured.idx_mapping.tolist() == fresh.idx_mapping.tolist()
    assert captured.input_ids.tolist() == fresh.input_ids.tolist()
    with pytest.raises(ValueError, match="into"):  # a prefill chunk has no place in a graph
        build_input_batch(states, ["r0"], [4], BLOCK, cpu, num_reqs_padded=4,
                          num_tokens_padded=7, tables=tables, into=captured)


def test_hybrid_metadata_into_captured_and_copy_skips_own_memory(tmp_path):
    llm = LLM(make_tiny_hybrid(tmp_path / "g", "granitemoehybrid"), device="cpu",
              dtype="float32", max_num_seqs=4, max_model_len=64)
    runner = llm.llm_engine.runner
    ms = runner.model_state
    captured = ms.prepare_attn(runner.dummy_decode_batch(4), for_capture=True)
    states = runner.states
    i = states.add("x", [1, 2, 3], 2, 2, 0, SamplingParams(), [1], [3], [1])
    batch = build_input_batch(states, ["x"], [1], runner.block_size, runner.device,
                              num_reqs_padded=4, num_tokens_padded=4, pad_decode=True)
    meta = ms.prepare_attn(batch, into=captured)
    assert meta.mamba.state_indices.data_ptr() == captured.mamba.state_indices.data_ptr()
    assert captured.mamba.state_indices.tolist() == [int(states.state_slots[i, 0]), -1, -1, -1]
    before = captured.mamba.state_indices.clone()
    copy_tensors(captured, meta)  # nothing to copy for the Mamba part; attention is copied
    assert torch.equal(captured.mamba.state_indices, before)
    assert torch.equal(captured.attn.seq_lens, meta.attn.seq_lens)
    states.remove("x")


def test_capture_pauses_python_gc(monkeypatch):
    # a collection inside a capture could free an earlier engine's graph pool (a cudaFree that
    # invalidates the capture): capture_all collects first and pauses the GC while it captures
    from krait.runner import cuda_graphs

    seen = []
    runner = type("R", (), {"config": type("C", (), {"scheduler": type("S", (), {
        "max_num_seqs": 4})()})()})()
    g = cuda_graphs.CudaGraphRunner(runner)
    monkeypatch.setattr(g, "_capture", lambda n: seen.append(gc.isenabled()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 0))
    assert gc.isenabled()
    g.capture_all()
    assert seen == [False, False, False] and gc.isenabled()


@pytest.mark.parametrize("arch", ["qwen3", "granitemoehybrid", "qwen3+split",
                                  "granitemoehybrid+routes", "granitemoehybrid+fused",
                                  "qwen3next"])
def test_decode_graph_path_matches_eager_on_cpu(arch, tmp_path, monkeypatch):
    """The whole decode-graph dataflow without a GPU: inputs built into the captured buffers,
    greedy tokens written by the graph body, sampled rows overwriting them, padded rows, graphs
    of several sizes as requests finish (CudaGraphRunner(record=False) runs the body eagerly;
    the graphs of one row take the one-row GEMVs). +split: the decode rows' keys split over
    several programs (the split-KV kernel and its combine); +routes: 16 experts, so every
    decode graph (padded rows too) takes the few-route expert GEMVs; +fused: dense granite
    layers with one norm group, so the graph of one row takes every GEMV fusion (the conv in
    in_proj's epilogue, reading the row's slot from the captured buffers; the gated norm in
    out_proj's prologue); qwen3next: Qwen3-Next's Gated DeltaNet decode (the conv update and
    the delta-rule update forming its gates in the kernel, over the captured slot indices) and
    its gated attention."""
    import krait.ops.paged_attention as paged_attention_mod
    import krait.ops.seeded_noise as seeded_noise
    from krait.runner.cuda_graphs import CudaGraphRunner
    from tests.utils import make_tiny_llama, make_tiny_qwen3_next

    if arch.endswith("+split"):
        arch = arch.removesuffix("+split")
        monkeypatch.setattr(paged_attention_mod, "SPLIT_MIN_KEYS", 16)  # the batches split
    overrides, routes_rows, fused = {}, [], []
    want_routes = want_fused = False
    if arch.endswith("+fused"):
        arch = arch.removesuffix("+fused")
        want_fused = True
        overrides.update(num_local_experts=0, mamba_n_groups=1)
        import krait.layers.mamba2 as mamba2_mod

        for name in ("conv_linear", "gated_norm_linear"):
            real = getattr(mamba2_mod, name)
            monkeypatch.setattr(mamba2_mod, name, lambda *a, _n=name, _f=real, **kw:
                                fused.append(_n) or _f(*a, **kw))
    if arch.endswith("+routes"):
        arch = arch.removesuffix("+routes")
        want_routes = True
        overrides["num_local_experts"] = 16  # top-2: up to 4 rows take the route GEMVs
        import krait.ops.fused_moe as fused_moe_mod

        real_routes = fused_moe_mod.moe_routes_triton
        monkeypatch.setattr(fused_moe_mod, "moe_routes_triton",
                            lambda *a, **kw: routes_rows.append(a[0].shape[0])
                            or real_routes(*a, **kw))
    gdn_steps = []
    if arch == "qwen3next":
        import krait.layers.gated_deltanet as gdn_mod

        real_update = gdn_mod.gated_delta_update
        monkeypatch.setattr(gdn_mod, "gated_delta_update", lambda *a, **kw: gdn_steps.append(
            "A_log" in kw) or real_update(*a, **kw))
    d = (make_tiny_llama(tmp_path / arch, arch=arch) if arch == "qwen3"
         else make_tiny_qwen3_next(tmp_path / arch) if arch == "qwen3next"
         else make_tiny_hybrid(tmp_path / arch, arch, **overrides))
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9] * 11, list(range(3, 20)))]
    # after the one prefill step, decode steps of 3, 2 and 1 rows (graphs 4, 2 and 1): the
    # fewest that replay three graph sizes (each interpreted step is slow)
    mixed = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=3, max_tokens=3, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 2, 3)]
    # all-greedy batches (the graph's own token write stands) once; the interpreter is slow
    param_sets = (mixed, greedy) if arch == "qwen3" else (mixed,)
    real_use_triton = seeded_noise.use_triton

    def run(graphs: bool) -> tuple[list, int]:
        # the graphs: device tables and the Triton kernels (interpreted); the eager reference:
        # the torch references (the interpreter is slow), but the Triton kernel's seeded noise
        # stream, so that the seeded row draws as the graphs' does
        monkeypatch.setenv("KRAIT_TRITON_CPU", "1" if graphs else "0")
        monkeypatch.setattr(seeded_noise, "use_triton",
                            real_use_triton if graphs else (lambda t: True))
        llm = LLM(d, device="cpu", dtype="float32", max_num_seqs=4)
        runner = llm.llm_engine.runner
        replays = []
        if graphs:
            runner.cuda_graphs = CudaGraphRunner(runner, record=False)
            runner.cuda_graphs.capture_all()
            real_run = runner.cuda_graphs.run
            runner.cuda_graphs.run = lambda b: (replays.append(b.num_reqs), real_run(b))[1]
        out = []
        for params in param_sets:
            res = llm.generate(prompts, params, use_tqdm=False)
            out.append([(o.outputs[0].token_ids,
                         [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         if o.outputs[0].logprobs else None) for o in res])
        return out, replays

    want, _ = run(graphs=False)
    got, replays = run(graphs=True)
    # the same tokens; logprobs within float32 rounding (the graphs run the kernels and split
    # keys by max_model_len, the eager reference the torch ops: rounding to 4 decimals could
    # split a value)
    assert [[t for t, _ in rows] for rows in got] == [[t for t, _ in rows] for rows in want]
    for got_rows, want_rows in zip(got, want):
        for (_, got_lp), (_, want_lp) in zip(got_rows, want_rows):
            assert (got_lp is None) == (want_lp is None)
            if got_lp is not None:
                assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
    assert max(replays) == 3 and min(replays) == 1  # padded to 4, then smaller graphs
    if want_routes:
        assert 4 in routes_rows  # the padded graph of 4 rows ran the route GEMVs
    if arch == "qwen3next":  # every decode step formed its gates in the update
        assert gdn_steps and all(gdn_steps)
    if want_fused:  # the batch-1 steps (and the graph of 1 row) took both
        assert {"conv_linear", "gated_norm_linear"} <= set(fused)


def test_decode_graph_rows_must_be_at_their_last_known_token():
    # the graph writes each row's greedy token at its sequence length: a row whose next token is
    # already known (a recomputed output) must run eagerly, or the write would overwrite it
    from types import SimpleNamespace

    from krait.runner.model_runner import ModelRunner

    states, _ = _decode_states()
    runner = SimpleNamespace(states=states)

    def rows(*ids: str) -> np.ndarray:
        return np.array([states.index[r] for r in ids])

    assert ModelRunner._rows_sample(runner, rows("r0", "r1", "r2"))
    states.num_tokens[states.index["r1"]] += 1  # r1 knows one more token than it computed
    assert not ModelRunner._rows_sample(runner, rows("r0", "r1"))
    assert ModelRunner._rows_sample(runner, rows("r0", "r2"))

"""`krait bench latency|throughput` end to end on CPU with a tiny model: JSON on stdout with the
fields docs/benchmarks.md quotes, the HF baseline in the same run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.utils import load_script, make_tiny_llama


def _bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "krait", "bench", *args, "--device", "cpu", "--dtype", "float32"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    return json.loads(out.stdout)


def test_throughput_with_hf_baseline(tmp_path):
    d = make_tiny_llama(tmp_path / "m")
    r = _bench("throughput", "--model", str(d), "--num-prompts", "6", "--input-len", "10",
               "--output-len", "5", "--hf-baseline", "--hf-max-prompts", "2", "--hf-batch-size", "2")
    assert r["kind"] == "throughput" and r["num_prompts"] == 6
    assert r["output_tok_per_s"] > 0 and r["steps"] >= 5
    assert r["hf"]["num_prompts"] == 2 and r["hf"]["output_tok_per_s"] > 0
    passes = r["hf"]["output_tok_per_s_each_pass"]  # a warm-up, then two timed passes
    assert len(passes) == 2 and r["hf"]["output_tok_per_s"] == max(passes)
    assert abs(r["speedup_vs_hf"] - r["output_tok_per_s"] / r["hf"]["output_tok_per_s"]) < 1e-6
    # the workload's roofline (CPU: nominal ceilings) and the ratio it would reach against HF
    assert r["roofline_tok_per_s"] > 0
    assert abs(r["fraction_of_roofline"] - r["output_tok_per_s"] / r["roofline_tok_per_s"]) < 1e-9
    assert abs(r["roofline_speedup_vs_hf"]
               - r["roofline_tok_per_s"] / r["hf"]["output_tok_per_s"]) < 1e-6
    # krait on exactly HF's workload (its 2 prompts, 5 tokens each) for a same-workload ratio
    same = r["krait_on_hf_workload"]
    assert same["num_prompts"] == 2 and same["output_len"] == 5 and same["output_tok_per_s"] > 0
    assert abs(r["speedup_same_workload"]
               - same["output_tok_per_s"] / r["hf"]["output_tok_per_s"]) < 1e-6


def test_latency_rows_carry_a_roofline(tmp_path):
    d = make_tiny_llama(tmp_path / "m")
    r = _bench("latency", "--model", str(d), "--batch-sizes", "1,2", "--context-len", "16",
               "--prompt-lens", "8", "--num-steps", "4")
    assert [row["batch"] for row in r["decode"]] == [1, 2]
    for row in r["decode"]:
        assert row["step_ms"] > 0 and row["roofline_ms"] > 0
        assert 0 <= row["device_wait_ms"] < row["step_ms"]  # CPU: nothing to wait for
        assert row["graph_ms"] is None  # no CUDA graphs on the CPU
        assert abs(row["ratio"] - row["step_ms"] / row["roofline_ms"]) < 1e-6
    assert r["prefill"] and r["prefill"][0]["prompt_len"] == 8
    assert r["max_num_seqs"] == 2  # sized by the largest batch unless --max-num-seqs is larger


def test_latency_engine_takes_a_larger_max_num_seqs(tmp_path):
    d = make_tiny_llama(tmp_path / "m")
    r = _bench("latency", "--model", str(d), "--batch-sizes", "1", "--context-len", "8",
               "--prompt-lens", "", "--num-steps", "2", "--max-num-seqs", "8")
    assert r["max_num_seqs"] == 8 and [row["batch"] for row in r["decode"]] == [1]


def test_summarize_bench_reads_the_latency_files(tmp_path):
    """scripts/summarize_bench.py: one row per (file, decode batch); unreadable files skipped."""
    from scripts.summarize_bench import rows

    doc = {"model": "qwen3-0.6b", "decode": [
        {"batch": 1, "step_ms": 1.2, "ratio": 3.7, "device_wait_ms": 0.4, "graph_ms": 1.1,
         "verify_graph_ms": 1.3, "tokens_per_row_step": 4.0},  # a speculative run's row
        {"batch": 64, "step_ms": 3.3, "ratio": 1.55, "device_wait_ms": 1.7, "graph_ms": 3.2}]}
    (tmp_path / "lat_qwen3-0.6b_epi.json").write_text(json.dumps(doc))
    (tmp_path / "lat_broken.json").write_text("")  # a run cut by its time box
    got = rows(tmp_path)
    assert got[0] == ("qwen3-0.6b", "epi", 1, 1.2, 3.7, 0.4, 1.1, 1.3, 4.0)
    assert got[1][:7] == ("qwen3-0.6b", "epi", 64, 3.3, 1.55, 1.7, 3.2)
    assert len(got) == 2 and all(math.isnan(v) for v in got[1][7:])  # no speculation there


@pytest.mark.gpu
def test_latency_graph_ms_on_cuda(tmp_path):
    """On the GPU each decode row also carries its graph's back-to-back replay time (the GPU's
    own step time), and the engine goes on serving after the replays."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    d = make_tiny_llama(tmp_path / "m")
    out = subprocess.run(
        [sys.executable, "-m", "krait", "bench", "latency", "--model", str(d), "--batch-sizes",
         "1,4", "--context-len", "16", "--prompt-lens", "", "--num-steps", "8"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    r = json.loads(out.stdout)
    for row in r["decode"]:
        assert 0 < row["graph_ms"] < 10 * row["step_ms"]


@pytest.mark.gpu
def test_verify_graph_time_only_after_it_served_real_rows(tmp_path):
    """`replay_ms` (the bench's verify_graph_ms) times a verify graph only once a step replayed
    it on real rows: before, its inputs are the capture's dummy rows (a MoE routes them unlike
    real ones), and the time would say nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from krait import LLM, SamplingParams

    d = make_tiny_llama(tmp_path / "m")
    llm = LLM(d, speculative_config={"model": d, "num_speculative_tokens": 2})
    verify = llm.llm_engine.runner.verify_graphs
    assert verify.replay_ms(1) is None
    llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert 0 < verify.replay_ms(1) < 10


def test_workload_roofline_adds_prefills_and_decode_steps():
    """An offline workload's roofline: per wave of rows, each prompt's prefill (the larger of
    its bytes and FLOPs terms), then one decode step per further token at its context."""
    from krait.bench.roofline import Ceilings, ModelBytes, workload_seconds

    mb = ModelBytes(dense_weight_bytes=1000, expert_bytes_per_layer=[], kv_bytes_per_token=10,
                    state_bytes_per_seq=5, active_params=100, attn_flops_per_token_pair=0)
    c = Ceilings(copy_bytes_per_s=1000.0, matmul_flops_per_s=1e6)
    # 3 prompts of 4 tokens, 3 tokens each, waves of 2 then 1 row
    prefill = max((1000 + 4 * 10 + 5) / 1000, 2 * 100 * 4 / 1e6)  # bytes-bound: 1.045 s
    def step(rows, ctx):  # weights, each row's KV read at ctx + the new token, state in and out
        return (1000 + rows * 10 * (ctx + 1) + rows * 2 * 5) / 1000
    want = 2 * prefill + step(2, 5) + step(2, 6) + prefill + step(1, 5) + step(1, 6)
    assert abs(workload_seconds(c, mb, 3, 4, 3, max_batch=2) - want) < 1e-9


def test_hf_baseline_halves_its_batch_when_out_of_memory(tmp_path, monkeypatch, capsys):
    """A batch HF cannot fit (its torch Mamba2 scan asks tens of GiB) is retried at half the
    size; the result names the batch that ran and the one asked for."""
    from transformers import AutoConfig

    from krait.bench import offline

    real = offline.hf_generate

    def small_batches_only(model, dev, batch, new_tokens):
        if len(batch) > 1:
            raise torch.OutOfMemoryError("fake: batch too large")
        return real(model, dev, batch, new_tokens)

    monkeypatch.setattr(offline, "hf_generate", small_batches_only)
    config = AutoConfig.from_pretrained(make_tiny_llama(tmp_path / "m"))
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    r = offline.hf_generate_rate(config, torch.float32, torch.device("cpu"), prompts, 2, 4)
    assert r["batch_size"] == 1 and r["requested_batch_size"] == 4
    assert r["output_tok_per_s"] > 0 and len(r["output_tok_per_s_each_pass"]) == 2
    assert "retrying at batch 1" in capsys.readouterr().err


def test_latency_structured_json(tmp_path):
    """--structured-json: every decode row under a grammar that outlasts the run."""
    pytest.importorskip("xgrammar")
    from krait.bench import offline
    from krait.cli import build_parser, resolve_model

    d = make_tiny_llama(tmp_path / "m")  # in process: a subprocess would import all again
    args = build_parser().parse_args(
        ["bench", "latency", "--model", str(d), "--batch-sizes", "2", "--context-len", "8",
         "--prompt-lens", "", "--num-steps", "4", "--structured-json", "--device", "cpu",
         "--dtype", "float32"])
    args.model = resolve_model(args)
    r, _ = offline.bench_latency(args)
    assert r["structured_json"]["minItems"] == 1 << 24 and r["structured_tokenizer"] == str(d)
    assert [row["batch"] for row in r["decode"]] == [2] and r["decode"][0]["step_ms"] > 0


def test_ab_plan_variants_and_runs(tmp_path):
    """scripts/ab_plan.py: a variant names int constants of krait/ops/linear.py's plan (a
    misspelt one is refused: it would measure the plan as it is), and each run is one
    `krait bench latency` in its own process with them set."""
    ab = load_script("ab_plan")
    assert ab.parse_variant("rows:MULTI_ROW_MAX_N=16384,MULTI_ROW_MAX_ROWS=4") == (
        "rows", {"MULTI_ROW_MAX_N": 16384, "MULTI_ROW_MAX_ROWS": 4})
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("loops:selective_state_verify.UNROLL_MAX_PAIRS=0") == (
        "loops", {"selective_state_verify.UNROLL_MAX_PAIRS": 0})
    for bad in ("rows:MULTI_ROW_MAX_NN=1", ":MULTI_ROW_MAX_N=1", "x:nomodule.CONST=1",
                "x:selective_state_verify.NO_SUCH=1"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)
    d = make_tiny_llama(tmp_path / "m")
    out = subprocess.run(
        [sys.executable, "scripts/ab_plan.py", "--variant", "base:", "--variant",
         "rows:MULTI_ROW_MAX_N=16384", "--repeat", "1", "--", "--model", str(d), "--device", "cpu",
         "--dtype", "float32", "--batch-sizes", "1", "--prompt-lens", "", "--context-len", "8",
         "--num-steps", "4"],
        capture_output=True, text=True, timeout=600, check=True, cwd=ab.ROOT)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [x["variant"] for x in lines] == ["base", "rows", "base", "rows"]
    assert all(x["median"]["step_ms"] > 0 for x in lines[2:])

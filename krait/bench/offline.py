"""`krait bench latency` and `krait bench throughput`: JSON on stdout, a table on stderr."""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

# the options live in krait.bench.cli_args (the CLI's parser needs no torch); names kept here
from krait.bench.cli_args import CONFIG_DIR, named_configs  # noqa: F401
from krait.bench.cli_args import add_offline_args as add_cli_args  # noqa: F401
from krait.bench.roofline import (
    decode_bytes,
    measure_ceilings,
    model_bytes,
    prefill_cost,
    roofline_seconds,
    workload_seconds,
)
from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.sampling_params import SamplingParams, StructuredOutputsParams


def _engine(args, model: str, **over) -> LLMEngine:
    from krait.cli import engine_kwargs

    kw = engine_kwargs(args)
    if args.config:
        kw["load_format"] = "dummy"
        # random weights: a prompt length past the config's max_position_embeddings (nemotron-h-8b
        # declares 4096; the prefill rows go to 8192) measures speed all the same
        os.environ.setdefault("KRAIT_ALLOW_LONG_MAX_MODEL_LEN", "1")
    kw.update(over)
    return LLMEngine(EngineConfig.from_kwargs(model=model, **kw))


# --structured-json: a grammar every row keeps following for the whole run (2**24 items)
BENCH_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 1 << 24}


def _structured_tokenizer(args) -> str:
    """The tokenizer directory grammar masks are built from: --tokenizer, the model's own, or
    the bundled demo tokenizer written to a temporary directory."""
    from krait.tokenizer_utils import get_tokenizer, save_demo_tokenizer  # noqa: PLC0415

    if args.tokenizer:
        return args.tokenizer
    model = _model_dir(args)
    if get_tokenizer(model) is not None:
        return model
    directory = tempfile.mkdtemp(prefix="krait-bench-tokenizer-")
    save_demo_tokenizer(directory)
    return directory


def _model_dir(args) -> str:
    return str(CONFIG_DIR / args.config) if args.config else args.model


def _prompts(n: int, length: int, vocab: int, seed: int, workload: str = "random"
             ) -> list[list[int]]:
    """Random token ids; `workload="repetitive"`: each prompt a random phrase of 16 tokens
    repeated (prompt lookup then finds continuations, the case ngram drafting is for)."""
    rng = np.random.default_rng(seed)
    if workload == "repetitive":
        phrase = rng.integers(10, max(vocab - 10, 11), size=(n, 16))
        return np.tile(phrase, (1, -(-length // 16)))[:, :length].tolist()
    return rng.integers(10, max(vocab - 10, 11), size=(n, length)).tolist()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _emit(result: dict, rows: list[str]) -> None:
    print("\n".join(rows), file=sys.stderr)
    print(json.dumps(result, indent=1))


def bench_latency(args) -> dict:
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    prompt_lens = [int(x) for x in args.prompt_lens.split(",")] if args.prompt_lens else []
    budget = max(args.max_num_batched_tokens, *prompt_lens, 1)
    # early rows of a big batch decode while later rows still prefill: leave them room
    prefill_steps = -(-max(batch_sizes) * args.context_len // budget)
    spec = args.speculative_config or {}
    per_step = 1 + int(spec.get("num_speculative_tokens", 0))  # tokens a row may gain a step
    need = args.context_len + (prefill_steps + args.num_steps + 8) * per_step + 16
    max_len = args.max_model_len or max([need, *prompt_lens]) + 16
    if need > max_len:
        raise ValueError(f"max_model_len {max_len} is too short for this run (needs {need})")
    structured = getattr(args, "structured_json", False)
    over = {}
    if structured:
        over["tokenizer"] = _structured_tokenizer(args)
    engine = _engine(
        args, _model_dir(args), max_model_len=max_len,
        max_num_seqs=max(args.max_num_seqs or 0, *batch_sizes), max_num_batched_tokens=budget,
        **over,
    )
    dev = engine.config.device
    ceil = measure_ceilings(dev)
    mb = _model_bytes(engine)
    vocab = engine.config.model.vocab_size
    out = {"kind": "latency", "model": args.config or args.model, "device": _device_name(dev),
           "context_len": args.context_len, "max_model_len": max_len,
           "max_num_seqs": engine.config.scheduler.max_num_seqs,
           "copy_TBps": ceil.copy_bytes_per_s / 1e12, "matmul_TFLOPs": ceil.matmul_flops_per_s / 1e12,
           "decode": [], "prefill": []}
    if structured:
        out["structured_json"] = BENCH_SCHEMA
        out["structured_tokenizer"] = over["tokenizer"]
    spec = engine.config.speculative
    if spec is not None:
        out["speculative_config"] = {"method": spec.method, "k": spec.num_speculative_tokens}
    rows = [f"{'batch':>6} {'step ms':>9} {'roofline ms':>12} {'ratio':>6} {'tok/s':>9} "
            f"{'wait ms':>8} {'graph ms':>9}" + ("  tok/step accept" if spec else "")]
    for b in batch_sizes:
        ms, wait, graph_ms, s = _decode_step_ms(engine, b, args.context_len, args.num_steps,
                                                vocab, dev, args.workload, structured)
        roof = roofline_seconds(ceil, decode_bytes(mb, b, args.context_len + args.num_steps)) * 1e3
        # wait: host time blocked on the device a step; ~0 means the host is the bottleneck.
        # graph_ms: the GPU's own time a step (the graph replayed back to back)
        tok_s = b * s["tokens_per_row_step"] / ms * 1e3
        row = {"batch": b, "step_ms": ms, "roofline_ms": roof, "ratio": ms / roof,
               "tok_per_s": tok_s, "device_wait_ms": wait, "graph_ms": graph_ms}
        if spec is not None:  # a step emits 1 + accepted drafts tokens a row
            row.update(s)
        out["decode"].append(row)
        graph_col = f"{graph_ms:>9.3f}" if graph_ms is not None else f"{'-':>9}"
        line = (f"{b:>6} {ms:>9.3f} {roof:>12.3f} {ms / roof:>6.2f} {tok_s:>9.0f} "
                f"{wait:>8.3f} {graph_col}")
        if spec is not None:
            line += f"  {s['tokens_per_row_step']:>8.2f} {s['acceptance_rate']:>6.2f}"
        rows.append(line)
    rows.append(f"{'prompt':>6} {'prefill ms':>10} {'roofline ms':>12} {'ratio':>6} "
                f"{'wait ms':>8}")
    for p in prompt_lens:
        ms, wait = _prefill_ms(engine, p, vocab, dev)
        by, fl = prefill_cost(mb, p)
        roof = roofline_seconds(ceil, by, fl) * 1e3
        out["prefill"].append({"prompt_len": p, "ms": ms, "roofline_ms": roof, "ratio": ms / roof,
                               "device_wait_ms": wait})
        rows.append(f"{p:>6} {ms:>10.3f} {roof:>12.3f} {ms / roof:>6.2f} {wait:>8.3f}")
    return out, rows


def _decode_step_ms(
    engine, batch, context, steps, vocab, dev, workload: str = "random", structured: bool = False,
) -> tuple[float, float, float | None, dict]:
    """(median step ms, host ms blocked on the device a step, device ms of the step's graph
    replayed back to back — None without CUDA graphs, speculative-decoding figures of the timed
    steps: tokens a row gained a step, acceptance rate) of `batch` rows at `context`;
    `structured`: every row under BENCH_SCHEMA's grammar (each step then syncs)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=None, ignore_eos=True, output_kind="final_only",
        structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA, disable_any_whitespace=True)
        if structured else None,
    )
    ids = [f"lat{batch}_{i}" for i in range(batch)]
    for rid, prompt in zip(ids, _prompts(batch, context, vocab, seed=batch, workload=workload)):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    # steady state: steps back to back (with async scheduling the host prepares step N+1
    # while the device runs step N), never drained in between: each step() returns when the
    # step before it is read back, so the time between returns is a step's. Timed in four
    # windows of consecutive steps so that a median is still taken (a window that began from a
    # drained device would pay one pipeline refill in every steps / 4)
    group = max(steps // 4, 1)
    _sync(dev)
    engine.step()  # refills the pipeline
    marks = [(time.perf_counter(), engine.device_wait_s)]
    stats0 = engine.get_stats()
    for _ in range(4):
        for _ in range(group):
            engine.step()
        marks.append((time.perf_counter(), engine.device_wait_s))
    _sync(dev)
    stats1 = engine.get_stats()
    gained = stats1["generation_tokens_total"] - stats0["generation_tokens_total"]
    drafted = (stats1.get("spec_decode_num_draft_tokens", 0)
               - stats0.get("spec_decode_num_draft_tokens", 0))
    accepted = (stats1.get("spec_decode_num_accepted_tokens", 0)
                - stats0.get("spec_decode_num_accepted_tokens", 0))
    spec = {"tokens_per_row_step": gained / (batch * 4 * group) if gained else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "draft_tokens": drafted, "accepted_tokens": accepted}
    times = [(b[0] - a[0]) * 1e3 / group for a, b in zip(marks, marks[1:])]
    waits = [(b[1] - a[1]) * 1e3 / group for a, b in zip(marks, marks[1:])]
    running = sum(1 for r in sched.running if r.request_id.startswith(f"lat{batch}_"))
    graphs = getattr(engine.runner, "cuda_graphs", None)  # None: worker ranks
    # the same step's graph with no host work between replays: what the GPU takes (its writes
    # repeat into these rows' caches and state, which are dropped next)
    graph_ms = graphs.replay_ms(batch) if graphs is not None and dev.type == "cuda" else None
    verify = getattr(engine.runner, "verify_graphs", None)  # speculative decoding: the 1 + k token step's graph
    if verify is not None and dev.type == "cuda":
        spec["verify_graph_ms"] = verify.replay_ms(batch)  # None: no full verify step ran
    engine.abort_request(ids)
    if running != batch:
        raise RuntimeError(f"decode batch {batch}: only {running} rows ran (preempted or finished)")
    return statistics.median(times), statistics.median(waits), graph_ms, spec


def _prefill_ms(engine, prompt_len, vocab, dev) -> tuple[float, float]:
    """(median ms of a one-request prefill, host ms of it blocked on the device)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = _prompts(1, prompt_len, vocab, seed=prompt_len)[0]
    times, waits = [], []
    for rep in range(4):
        rid = f"pre{prompt_len}_{rep}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        _sync(dev)
        t, w = time.perf_counter(), engine.device_wait_s
        while engine.has_unfinished_requests():
            engine.step()
        _sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
        waits.append((engine.device_wait_s - w) * 1e3)
    return statistics.median(times[1:]), statistics.median(waits[1:])


def bench_throughput(args) -> dict:
    model = _model_dir(args)
    max_len = args.max_model_len or args.input_len + args.output_len + 16
    engine = _engine(args, model, max_model_len=max_len)
    dev = engine.config.device
    vocab = engine.config.model.vocab_size
    prompts = _prompts(args.num_prompts, args.input_len, vocab, seed=args.seed)
    warm = _prompts(args.num_prompts, args.input_len, vocab, seed=args.seed + 1)
    n_out, elapsed, step_kinds = _krait_run(engine, prompts, warm, args.output_len)
    out = {"kind": "throughput", "model": args.config or args.model, "device": _device_name(dev),
           "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "elapsed_s": elapsed,
           "output_tok_per_s": n_out / elapsed,
           "total_tok_per_s": (n_out + args.num_prompts * args.input_len) / elapsed,
           "steps": len(step_kinds), "steps_with_prefill": sum(step_kinds)}
    # the workload at this machine's roofline: what no engine could beat (the same model
    # bytes and ceilings as `bench latency`)
    ceil = measure_ceilings(dev)
    mb = _model_bytes(engine)
    max_batch = min(args.num_prompts, engine.config.scheduler.max_num_seqs)
    roof_s = workload_seconds(ceil, mb, args.num_prompts, args.input_len, args.output_len,
                              max_batch)
    out["roofline_tok_per_s"] = args.num_prompts * args.output_len / roof_s
    out["fraction_of_roofline"] = out["output_tok_per_s"] / out["roofline_tok_per_s"]
    rows = [f"krait: {n_out} tokens in {elapsed:.2f} s = {n_out / elapsed:.1f} output tok/s "
            f"({len(step_kinds)} steps, {sum(step_kinds)} with prompt tokens); this workload's "
            f"roofline {out['roofline_tok_per_s']:.0f} tok/s "
            f"({out['fraction_of_roofline']:.0%} of it)"]
    print(rows.pop(0), file=sys.stderr, flush=True)  # before a baseline that may run long
    if args.hf_baseline:
        # krait on exactly HF's workload too (its prompts and output length): a same-workload
        # ratio beside the headline one, which sets krait's full workload against HF's subset
        hf_prompts = prompts[: args.hf_max_prompts]
        hf_out_len = args.hf_output_len or args.output_len
        n_sub, t_sub, _ = _krait_run(engine, hf_prompts, warm[: len(hf_prompts)], hf_out_len,
                                     tag="hf-")
        out["krait_on_hf_workload"] = {"num_prompts": len(hf_prompts), "output_len": hf_out_len,
                                       "elapsed_s": t_sub, "output_tok_per_s": n_sub / t_sub}
        hf_config = engine.config.model.hf_config
        dtype = engine.config.model.dtype
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            print(f"HF baseline starts with {torch.cuda.memory_allocated(dev) / 2**30:.2f} GiB "
                  "still allocated", file=sys.stderr, flush=True)
        hf = hf_generate_rate(hf_config, dtype, dev, hf_prompts, hf_out_len, args.hf_batch_size,
                              args.hf_repeats)
        out["hf"] = hf
        out["speedup_vs_hf"] = out["output_tok_per_s"] / hf["output_tok_per_s"]
        same = out["krait_on_hf_workload"]["output_tok_per_s"]
        out["speedup_same_workload"] = same / hf["output_tok_per_s"]
        # the headline ratio an engine at the roofline would reach against this baseline
        out["roofline_speedup_vs_hf"] = out["roofline_tok_per_s"] / hf["output_tok_per_s"]
        rows.append(f"HF transformers: {hf['output_tok_per_s']:.1f} output tok/s, the best of "
                    f"{len(hf['output_tok_per_s_each_pass'])} passes "
                    f"(batch {hf['batch_size']}, {hf['output_len']} new tokens); "
                    f"krait / HF = {out['speedup_vs_hf']:.1f}x (at the roofline: "
                    f"{out['roofline_speedup_vs_hf']:.1f}x)")
        rows.append(f"same workload ({len(hf_prompts)} prompts, {hf_out_len} new tokens): krait "
                    f"{same:.1f} output tok/s = {out['speedup_same_workload']:.1f}x HF")
    return out, rows


def _krait_run(engine: LLMEngine, prompts: list[list[int]], warm: list[list[int]],
               output_len: int, tag: str = "") -> tuple[int, float, list[bool]]:
    """(output tokens, seconds, per step: whether it computed prompt tokens) of the prompts
    with `output_len` tokens each (ignore_eos), after a warm-up: the same workload on the `warm`
    prompts (Triton compiles and specializes on the prefill chunk layouts, batch sizes and
    context lengths the timed run will see: with a few tokens each, the first run on a fresh
    machine measured 24% below the next)."""
    dev = engine.config.device
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind="final_only")
    for i, p in enumerate(warm):
        engine.add_request(f"{tag}warm{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()
    _sync(dev)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}tp{i}", {"prompt_token_ids": p}, params)
    n_out = 0
    step_kinds = []  # per step: True when it computes prompt tokens (eager), else decode only
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        step_kinds.append(out.total_num_scheduled_tokens > len(out.num_scheduled_tokens))
        return out

    engine.scheduler.schedule = recording_schedule
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    n_out += len(o.outputs[0].token_ids)
        _sync(dev)
    finally:
        engine.scheduler.schedule = schedule
    return n_out, time.perf_counter() - t, step_kinds


def hf_generate_rate(hf_config, dtype, dev, prompts, output_len, batch_size,
                     repeats: int = 2) -> dict:
    """HF transformers generate on the same config (random weights) and prompts: a short
    untimed warm-up, then `repeats` timed passes; the fastest pass is the baseline (its rate
    moved ±7% between runs on the H200: the best of several keeps a ratio honest). A batch
    that runs out of GPU memory (HF's torch fallback of the Mamba2 chunk scan asks tens of GiB
    at batch 32 × 256 tokens) is retried at half the batch, down to 1; the result names the
    batch size that ran."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):  # random init on the device: minutes on the CPU for billions
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    requested = batch_size
    while True:
        try:
            rates, times = _hf_passes(model, dev, prompts, output_len, batch_size, repeats)
            break
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
        batch_size //= 2  # after the except block: its traceback no longer holds the tensors
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"HF baseline: out of memory, retrying at batch {batch_size}", file=sys.stderr,
              flush=True)
    del model
    best = max(range(len(rates)), key=rates.__getitem__)
    return {"num_prompts": len(prompts), "batch_size": batch_size,
            "requested_batch_size": requested, "output_len": output_len,
            "elapsed_s": times[best], "output_tok_per_s": rates[best],
            "output_tok_per_s_each_pass": rates}


def hf_generate(model, dev, batch: list[list[int]], new_tokens: int) -> int:
    """Output tokens of one greedy HF `generate` call on `batch` (equal-length prompts)."""
    x = torch.tensor(batch, device=dev)
    y = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return (y.shape[1] - x.shape[1]) * y.shape[0]


def _hf_passes(model, dev, prompts, output_len, batch_size,
               repeats: int) -> tuple[list[float], list[float]]:
    """(output tok/s, seconds) of each timed pass over the prompts, after a warm-up."""
    rates, times = [], []
    with torch.no_grad():
        hf_generate(model, dev, prompts[:batch_size], 2)  # warm-up: kernel loading and setup
        for _ in range(max(repeats, 1)):
            n_out = 0
            _sync(dev)
            t = time.perf_counter()
            for i in range(0, len(prompts), batch_size):
                n_out += hf_generate(model, dev, prompts[i : i + batch_size], output_len)
            _sync(dev)
            times.append(time.perf_counter() - t)
            rates.append(n_out / times[-1])
    return rates, times


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def main(args) -> int:
    if args.bench_cmd == "prefix":
        from krait.bench.prefix import bench_prefix

        fn = bench_prefix
    else:
        fn = bench_latency if args.bench_cmd == "latency" else bench_throughput
    result, rows = fn(args)
    result["versions"] = {"torch": torch.__version__, "krait": _krait_version()}
    _emit(result, rows)
    return 0


def _krait_version() -> str:
    import krait

    return krait.__version__


def _model_bytes(engine):
    """The model's bytes for the roofline: the in-process runner's, or (worker ranks) the whole
    model's built on the meta device (the roofline of one device holding all of it)."""
    import torch

    if engine.runner is not None:
        return model_bytes(engine.runner.model, engine.runner.model_state)
    from krait.models.registry import get_model_class
    from krait.runner.model_states import create_model_state

    cfg = engine.config
    old = torch.get_default_dtype()
    torch.set_default_dtype(cfg.model.dtype)
    try:
        with torch.device("meta"):
            model = get_model_class(cfg.model.hf_config)(cfg.model.hf_config)
    finally:
        torch.set_default_dtype(old)
    return model_bytes(model, create_model_state(model, cfg))

"""Where a speculative step's host time goes: ms per engine step and a per-phase breakdown for
no speculation, ngram, a draft model and an EAGLE head, at batch 1 and batch 8.

PYTHONPATH=. python3 scripts/spec_host_profile.py [--modes none,ngram,draft_model,eagle]
    [--batches 1,8] [--config qwen3-0.6b] [--sync-phases] [--graphs] [--cprofile] [--steps 48]
    [--device-tables] [--count-ops] [--workload random|repetitive]

Models: by default tiny random ones built in a temp dir with the test helpers (a 4-layer
Qwen3 target; the draft its `scripts/draft_config.py --foreign` config, 2 layers at half width,
with random weights of another seed; a random EAGLE-1 head: drafts nearly always rejected), so on CPU kernel time is negligible and what is measured is host work.
`--config NAME` takes a bench config (krait/bench/configs, or a directory with a config.json;
dummy weights) as the target, its first 2 layers at half width as the draft
(scripts/draft_config.py --foreign) and a random EAGLE-1 head of its hidden size: the GPU case. The device is CUDA when available (bfloat16),
else CPU (float32, one thread). Greedy requests of random prompts, `--steps` tokens each; each
(mode, batch) runs once to warm up, then `--repeats` times, the fastest run reported.

Phases are timed by wrappers this script puts on the engine's, the runners' and the drafter's
methods (no instrumentation in the engine). On CUDA the timers see launch (host) time only,
unless `--sync-phases`, which synchronizes the device around each timed phase (then a phase's
time includes its kernels, and the step total includes the syncs). Phases nest: `propose`
holds the drafter runner's `draft.*` steps (`draft.catch_up_step`: the steps before the last
max(drafts) - 1 of a call, which are `draft.one_token_step`; `.eager`: those of them that
replayed no graph; `draft.chained_replay`: a call's steps as one chained graph); `target.verify_forward` holds the target's build_input_batch and forward
(or graph replay) of verify steps. `--graphs` (CPU only) puts the target's and the drafter's
CUDA-graph paths in their record=False form (eager bodies over the captured buffers, as the
tests do): slower on CPU, but it shows which steps would replay a graph on the GPU.

`--device-tables` (CPU): device-side input preparation (DeviceTables) through the ops' torch
references, so ngram takes the GPU's asynchronous path (drafts made on the "device", accepted
counts read one step late: ModelRunner._execute_verify_async). `--count-ops` adds one more run
that counts, per engine step and outside the models' forwards (eager ones and graph replays),
the krait.ops dispatcher calls (each a Triton launch or more on the GPU; their references'
torch ops are not counted), the other aten ops the host issues (torch dispatch), and the calls
of `to_device`, `host_to_device` and `device_to_host` (each one copy); its times are not used.
`--workload repetitive`: prompts of a repeated 8-token cycle (prompt lookup's case: ngram drafts
mostly accepted on models that continue the cycle, rejected on random ones).

Prints one JSON object per (mode, batch): ms_per_step (mean and median), forward_ms_per_step
(eager forwards and graph replays) and other_ms_per_step (everything else: the host's
bookkeeping), forwards_per_step (eager forwards and graph replays a step, target and draft),
phases {name: ms per step, calls per step}; `--cprofile` also prints cProfile's top functions
(by own time) to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from krait import LLM, SamplingParams

# the phases that are model forwards (eager, or graph replays); they do not nest in each other
FORWARDS = ("target.forward", "target.cuda_graphs_replay", "target.verify_graphs_replay",
            "draft.forward", "draft.graph_replay", "draft.chained_replay")


class Timers:
    """Accumulated wall time and calls per phase name; `wrap` times a callable under a name."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync and torch.cuda.is_available()
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def add(self, name: str, dt: float) -> None:
        if self.on:
            self.total[name] += dt
            self.calls[name] += 1

    def wrap(self, name, fn):
        """fn timed under `name`; `name` may be a callable of fn's arguments (or None: untimed)."""

        def timed(*args, **kwargs):
            key = name(*args, **kwargs) if callable(name) else name
            if key is None or not self.on:
                return fn(*args, **kwargs)
            if self.sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.add(key, time.perf_counter() - t0)

        timed.__wrapped__ = fn
        return timed


def patch(obj, attr: str, timers: Timers, name) -> None:
    """Replaces obj.attr (a method, looked up on the instance or module) with a timed one."""
    if hasattr(obj, attr):
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))


def instrument(llm: LLM, timers: Timers) -> None:
    """Timed wrappers on the engine, the target runner, its drafter and a drafter's runner."""
    import krait.runner.model_runner as mr

    engine = llm.llm_engine
    runner = engine.runner
    patch(engine, "step", timers, "engine_step")
    patch(engine.scheduler, "schedule", timers, "schedule")
    patch(engine.scheduler, "update_from_output", timers, "update_from_output")
    patch(engine, "_read_back", timers, "read_back")
    patch(engine, "_propose_drafts", timers, "propose_drafts")
    patch(runner, "execute_model", timers, "target.execute_model")
    patch(runner, "_verify", timers, "target.verify_forward")
    patch(runner, "_reject", timers, "target.rejection_sampler")
    patch(runner, "_execute_verify", timers, "target.execute_verify")
    patch(runner, "_execute_verify_async", timers, "target.execute_verify_async")
    patch(runner, "_observe", timers, "target.observe")
    patch(runner, "forward", timers, "target.forward")
    patch(runner, "_sample_and_update", timers, "target.sample_and_update")
    drafter = runner.drafter
    runners = {id(runner.states): "target"}
    if drafter is not None:
        patch(drafter, "observe", timers, "drafter.observe")
        draft = getattr(drafter, "runner", None)
        if draft is not None:
            runners[id(draft.states)] = "draft"
            instrument_draft_steps(drafter, draft, timers)
            patch(draft, "forward", timers, "draft.forward")
            patch(draft, "_sample_and_update", timers, "draft.sample_and_update")
            if getattr(draft, "cuda_graphs", None) is not None:
                patch(draft.cuda_graphs, "run", timers, "draft.graph_replay")
            if getattr(draft, "chained_graphs", None) is not None:
                patch(draft.chained_graphs, "run", timers, "draft.chained_replay")
        patch(drafter, "propose", timers, "propose")
    for m in ("cuda_graphs", "verify_graphs"):
        g = getattr(runner, m, None)
        if g is not None:
            patch(g, "run", timers, f"target.{m}_replay")

    def which(states, *a, **k):
        return f"{runners.get(id(states), 'other')}.build_input_batch"

    mr.build_input_batch = timers.wrap(which, mr.build_input_batch)


def emulate_graphs(llm: LLM, k: int) -> None:
    """CPU: CudaGraphRunner(record=False) as the target's decode and verify graphs and as the
    drafter's (as the tests do): the graph dataflow, run eagerly."""
    from krait.runner.cuda_graphs import CudaGraphRunner

    runner = llm.llm_engine.runner
    runner.cuda_graphs = CudaGraphRunner(runner, record=False)
    runner.cuda_graphs.capture_all()
    if runner.num_spec_tokens:
        runner.verify_graphs = CudaGraphRunner(runner, record=False, tokens_per_row=1 + k)
        runner.verify_graphs.capture_all()
    drafter = runner.drafter
    if hasattr(drafter, "capture_graphs"):
        drafter.capture_graphs(record=False)
    elif type(drafter).__name__ == "DraftModelDrafter":
        drafter.runner.cuda_graphs = CudaGraphRunner(drafter.runner, record=False)
        drafter.runner.cuda_graphs.capture_all()


def instrument_draft_steps(drafter, draft, timers: Timers) -> None:
    """Times each step a `propose` launches on the drafter's runner: the last max(drafts) - 1
    are its one-token steps, the ones before its catch-up steps (so whatever a step's rows
    look like). Each kind also under `.eager`: the steps that replayed no graph (on the GPU,
    a graph replay costs the host far less than an eager forward)."""
    calls: list[tuple[float, bool]] = []
    replays = [0]
    execute, propose = draft.execute_model, drafter.propose

    def step(sched):
        if not timers.on:
            return execute(sched)
        if timers.sync:
            torch.cuda.synchronize()
        before = replays[0]
        t0 = time.perf_counter()
        out = execute(sched)
        if timers.sync:
            torch.cuda.synchronize()
        calls.append((time.perf_counter() - t0, replays[0] > before))
        return out

    def proposing(*args):
        calls.clear()
        drafts, counts = propose(*args)
        one = max(int(counts.max(initial=0)) - 1, 0)
        for q, (dt, replayed) in enumerate(calls):
            kind = "draft.one_token_step" if q >= len(calls) - one else "draft.catch_up_step"
            timers.add(kind, dt)
            if not replayed:
                timers.add(kind + ".eager", dt)
        return drafts, counts

    graphs = getattr(draft, "cuda_graphs", None)
    if graphs is not None:
        run = graphs.run

        def counted(batch):
            replays[0] += 1
            return run(batch)

        graphs.run = counted
    draft.execute_model = step
    drafter.propose = proposing


class OpCounter:
    """Counts, while `on` and outside the models' forwards, krait.ops dispatcher calls (by
    name), the aten ops issued around them (not inside them) and the host/device copies
    (`to_device`, `host_to_device`, `device_to_host` calls)."""

    COPIES = ("to_device", "host_to_device", "device_to_host")

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.depth = 0  # inside a counted op or a forward: aten ops there are not counted
        self.on = False
        self.prefix = ""  # "verify.": inside ModelRunner._execute_verify_async

    def add(self, key: str) -> None:
        self.counts[key] += 1
        if self.prefix:
            self.counts[self.prefix + key] += 1

    def wrap(self, key: str, fn, count: bool = True):
        def counted(*args, **kwargs):
            if self.on and self.depth == 0 and count:
                self.add(key)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        counted.__wrapped__ = fn
        return counted

    def install(self, llm: LLM) -> None:
        """Wraps every krait.ops dispatcher and copy helper where krait's modules bound them
        (once a process), and this engine's forwards (runner.forward, graph runs) as uncounted
        regions; `_execute_verify_async` also counts its calls, its contents under `verify.`."""
        import inspect

        if not getattr(OpCounter, "_patched", False):
            OpCounter._patched = True
            seen: dict[int, object] = {}
            for name, mod in list(sys.modules.items()):
                if not name.startswith("krait") or mod is None:
                    continue
                for attr, fn in list(vars(mod).items()):
                    if not inspect.isfunction(fn):
                        continue
                    home = getattr(fn, "__module__", "") or ""
                    if home == "krait.runner.input_batch" and attr in self.COPIES:
                        key = f"copy.{attr}"
                    elif (home.startswith("krait.ops.") and not attr.startswith("_")
                          and not attr.endswith(("_ref", "_triton")) and attr != "use_triton"
                          and home != "krait.ops._dispatch"):
                        key = f"op.{attr}"
                    else:
                        continue
                    if id(fn) not in seen:
                        seen[id(fn)] = self.wrap(key, fn)
                    setattr(mod, attr, seen[id(fn)])
        runner = llm.llm_engine.runner
        runner.forward = self.region(runner.forward)
        for m in ("cuda_graphs", "verify_graphs"):
            g = getattr(runner, m, None)
            if g is not None:
                g.run = self.region(g.run)
        verify = runner._execute_verify_async

        def counted_verify(*args, **kwargs):
            if self.on:
                self.counts["verify_steps"] += 1
            self.prefix, prefix = "verify.", self.prefix
            try:
                return verify(*args, **kwargs)
            finally:
                self.prefix = prefix

        runner._execute_verify_async = counted_verify

    def region(self, fn):
        """fn, its contents not counted (a forward)."""
        def uncounted(*args, **kwargs):
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return uncounted

    def mode(self):
        """A TorchDispatchMode counting the aten ops outside counted regions."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.on and counter.depth == 0:
                    counter.add("aten")
                    counter.add(f"aten.{func.__name__}")
                return func(*args, **(kwargs or {}))

        return Aten()


def build_models(root: Path, config: str | None) -> dict[str, str]:
    """{"target", "draft", "head"}: checkpoint directories (see the module doc)."""
    from tests.models.test_spec_eagle import make_head
    from tests.utils import make_tiny_llama

    sys.path.insert(0, str(Path(__file__).parent))
    from draft_config import draft_config, read_config

    if config is None:
        target = make_tiny_llama(root / "target", arch="qwen3", num_hidden_layers=4)
        # the foreign draft: scripts/draft_config.py --foreign of the target, random weights
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
        d = draft_config(read_config(target), 2, foreign=True)
        draft = make_tiny_llama(root / "draft", arch="qwen3", seed=1,
                                **{k: d[k] for k in keys})
        head = make_head(root / "head", "eagle")
        return {"target": target, "draft": draft, "head": head}
    cfg = read_config(config)
    (root / "draft").mkdir(parents=True)
    (root / "draft" / "config.json").write_text(json.dumps(draft_config(cfg, 2, foreign=True)))
    head = make_head(root / "head", "eagle", hidden_size=cfg["hidden_size"],
                     vocab_size=cfg["vocab_size"],
                     max_position_embeddings=cfg.get("max_position_embeddings", 4096))
    from krait.bench.offline import CONFIG_DIR

    target = config if Path(config).is_dir() else str(CONFIG_DIR / config)
    return {"target": target, "draft": str(root / "draft"), "head": head}


def speculative(mode: str, models: dict[str, str], k: int) -> dict | None:
    if mode == "none":
        return None
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if mode == "draft_model":
        return {"model": models["draft"], "num_speculative_tokens": k}
    if mode == "eagle":
        return {"method": "eagle", "model": models["head"], "num_speculative_tokens": k}
    raise ValueError(mode)


def run_mode(mode: str, batches: list[int], models: dict[str, str], args) -> list[dict]:
    cuda = torch.cuda.is_available()
    opts = dict(device="cuda" if cuda else "cpu",
                dtype=args.dtype or ("bfloat16" if cuda else "float32"),
                max_num_seqs=max(batches), max_model_len=args.prompt_len + args.steps + 16,
                speculative_config=speculative(mode, models, args.k), seed=0,
                enforce_eager=args.enforce_eager)
    if args.config:
        opts |= dict(load_format="dummy", gpu_memory_utilization=0.5)
    if args.device_tables and not cuda:
        import krait.runner.model_runner as mr

        use_triton, mr.use_triton = mr.use_triton, lambda t: True  # DeviceTables on CPU
        try:
            llm = LLM(models["target"], **opts)
        finally:
            mr.use_triton = use_triton
        assert mode != "ngram" or llm.llm_engine.runner.async_spec
    else:
        llm = LLM(models["target"], **opts)
    vocab = llm.llm_engine.config.model.vocab_size
    if args.graphs and not cuda:
        emulate_graphs(llm, args.k)
    timers = Timers(args.sync_phases)
    instrument(llm, timers)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    out = []
    for b in batches:
        if args.workload == "repetitive":  # a repeated 8-token cycle a prompt
            prompts = [{"prompt_token_ids": np.resize(rng.integers(10, vocab - 10, 8),
                                                      args.prompt_len).tolist()}
                       for _ in range(b)]
        else:
            prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, args.prompt_len)
                        .tolist()} for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        engine = llm.llm_engine
        step = engine.step
        best = None
        for _ in range(args.repeats):  # the fastest run (the least disturbed by other load)
            step_times: list[float] = []

            def timed_step(step=step, step_times=step_times):
                t0 = time.perf_counter()
                try:
                    return step()
                finally:
                    step_times.append(time.perf_counter() - t0)

            engine.step = timed_step
            timers.reset()
            timers.on = True
            prof = cProfile.Profile() if args.cprofile else None
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            if prof:
                prof.disable()
            timers.on = False
            engine.step = step
            if best is None or wall < best[0]:
                best = (wall, step_times, outs, prof, dict(timers.total), dict(timers.calls))
        wall, step_times, outs, prof, total, calls = best
        steps = len(step_times)
        forward = sum(total.get(k, 0.0) for k in FORWARDS)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res = {
            "mode": mode, "batch": b, "device": opts["device"], "steps": steps,
            "tokens": tokens, "tokens_per_step": round(tokens / max(steps, 1) / b, 3),
            "ms_per_step_mean": round(1e3 * sum(step_times) / max(steps, 1), 3),
            "ms_per_step_median": round(1e3 * statistics.median(step_times), 3),
            "wall_s": round(wall, 3),
            # the models' forwards (eager ones and graph replays) and everything else
            "forward_ms_per_step": round(1e3 * forward / max(steps, 1), 3),
            "other_ms_per_step": round(1e3 * (sum(step_times) - forward) / max(steps, 1), 3),
            # eager forwards and graph replays a step, of the target and of a drafter's runner
            "forwards_per_step": {
                k: round(calls.get(k, 0) / max(steps, 1), 2) for k in FORWARDS},
            "phases": {k: {"ms_per_step": round(1e3 * v / max(steps, 1), 4),
                           "calls_per_step": round(calls[k] / max(steps, 1), 2)}
                       for k, v in sorted(total.items(), key=lambda kv: -kv[1])},
        }
        if args.count_ops:
            res["per_step_outside_forwards"] = count_ops(llm, prompts, params)
        print(json.dumps(res), flush=True)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.cprofile_top)
            print(f"== cProfile {mode} batch {b} (by own time)\n{s.getvalue()}", file=sys.stderr)
        out.append(res)
    del llm
    return out


def count_ops(llm: LLM, prompts, params) -> dict:
    """One more run under an OpCounter: {what: calls per engine step} (see the module doc)."""
    counter = getattr(llm, "_op_counter", None)
    if counter is None:
        counter = llm._op_counter = OpCounter()
        counter.install(llm)
    engine = llm.llm_engine
    step, steps = engine.step, [0]

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    counter.counts.clear()
    counter.on = True
    try:
        with counter.mode():
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        counter.on = False
        engine.step = step
    n = max(steps[0], 1)
    counts = dict(counter.counts)
    nv = counts.pop("verify_steps", 0)
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    per_step = {k: round(v / n, 2) for k, v in top
                if not k.startswith("verify.") and (not k.startswith("aten.") or v / n >= 0.5)}
    per_verify = {k[7:]: round(v / nv, 2) for k, v in top
                  if k.startswith("verify.") and (not k.startswith("verify.aten.") or v >= nv)}
    return {"verify_steps_per_step": round(nv / n, 2), "per_step": per_step,
            "per_verify_step": per_verify}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="none,ngram,draft_model,eagle")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--config", default=None,
                   help="a krait/bench/configs name or a config directory (dummy weights)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="max_tokens of each request")
    p.add_argument("--dtype", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--sync-phases", action="store_true",
                   help="CUDA: synchronize around every timed phase")
    p.add_argument("--repeats", type=int, default=3, help="measured runs; the fastest reported")
    p.add_argument("--graphs", action="store_true",
                   help="CPU: the target's and the drafter's CUDA-graph paths in their "
                        "record=False form (eager bodies over the captured buffers), to count "
                        "which steps would replay a graph on the GPU")
    p.add_argument("--device-tables", action="store_true",
                   help="CPU: device-side input preparation through the ops' torch references "
                        "(ngram then takes the asynchronous path)")
    p.add_argument("--count-ops", action="store_true",
                   help="one more run counting ops, aten ops and copies a step outside forwards")
    p.add_argument("--workload", choices=("random", "repetitive"), default="random")
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--cprofile-top", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # steadier under other load; tiny models gain nothing from more
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), args.config)
        for mode in args.modes.split(","):
            run_mode(mode, [int(b) for b in args.batches.split(",")], models, args)


if __name__ == "__main__":
    main()

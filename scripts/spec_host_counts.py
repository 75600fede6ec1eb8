"""Counts a speculative step's host-side launches, per engine step, on CPU, through the GPU's
code paths: Triton kernels run in the interpreter (KRAIT_TRITON_CPU=1, TRITON_INTERPRET=1, set
here), so the runners keep device token tables and prepare inputs as on CUDA, and CUDA graphs
run in their record=False form (spec_host_profile.py's --graphs).

PYTHONPATH=. python3 scripts/spec_host_counts.py [--modes none,draft_model] [--batches 1]
    [--steps 10] [--top 25]

Counted outside graph bodies (what a replay does on the GPU is not host work): Triton launches
(by kernel), aten ops (TorchDispatchMode, not those inside a Triton launch), host-to-device
copies (`host_to_device`, `to_device`, `Tensor.to(device)`) and device-to-host copies
(`device_to_host`, `Tensor.to("cpu")`), each split by phase: `propose` (the engine's
`_propose_drafts`: the drafter), `execute` (the target's `execute_model`), `other`. On the GPU
machine a Triton launch costs the host ~20-40 us and a small copy ~50-100 us, so the counts,
not this CPU's times, say what a step costs there. Prints one JSON object per (mode, batch).
"""

from __future__ import annotations

import os

os.environ.setdefault("KRAIT_TRITON_CPU", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from spec_host_profile import build_models, emulate_graphs, speculative  # noqa: E402

from krait import LLM, SamplingParams  # noqa: E402


class Tally:
    """Counts by (phase, kind, name); `quiet` > 0 inside graph bodies and Triton launches."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
        self.phase = ["other"]
        self.quiet = 0
        self.on = False

    def add(self, kind: str, name: str) -> None:
        if self.on and not self.quiet:
            self.counts[(self.phase[-1], kind)][name] += 1


def install(llm: LLM, tally: Tally) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    import krait
    from krait.runner import chained_graphs, cuda_graphs
    from krait.runner import input_batch as ib

    def quiet(fn):
        def wrapped(*a, **k):
            tally.quiet += 1
            try:
                return fn(*a, **k)
            finally:
                tally.quiet -= 1
        return wrapped

    run = InterpretedFunction.run

    def launch(self, *a, **k):
        tally.add("triton", getattr(self.fn, "__name__", "?"))
        tally.quiet += 1
        try:
            return run(self, *a, **k)
        finally:
            tally.quiet -= 1

    InterpretedFunction.run = launch
    cuda_graphs.CudaGraphRunner._body = quiet(cuda_graphs.CudaGraphRunner._body)
    chained_graphs.ChainedDecodeGraphs._body = quiet(chained_graphs.ChainedDecodeGraphs._body)

    def copies(name, kind, fn):
        def wrapped(*a, **k):
            tally.add(kind, name)
            tally.quiet += 1  # (its own Tensor.to is not counted twice)
            try:
                return fn(*a, **k)
            finally:
                tally.quiet -= 1
        return wrapped

    originals = {ib.host_to_device: copies("host_to_device", "h2d", ib.host_to_device),
                 ib.to_device: copies("to_device", "h2d", ib.to_device),
                 ib.device_to_host: copies("device_to_host", "d2h", ib.device_to_host)}
    for mod in list(sys.modules.values()):  # every module that imported them by name
        if getattr(mod, "__name__", "").startswith(krait.__name__):
            for attr, val in list(vars(mod).items()):
                if callable(val) and val in originals:
                    setattr(mod, attr, originals[val])

    def phase(name, fn):
        def wrapped(*a, **k):
            tally.phase.append(name)
            try:
                return fn(*a, **k)
            finally:
                tally.phase.pop()
        return wrapped

    engine = llm.llm_engine
    engine._propose_drafts = phase("propose", engine._propose_drafts)
    engine.executor.execute_model = phase("execute", engine.executor.execute_model)


class Ops(TorchDispatchMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.tally.add("aten", str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


class Copies(TorchFunctionMode):
    """Tensor.to with a device: "cpu" (a string: how the runner writes its read-backs) is a
    device-to-host copy, a torch.device (the runner's device) a host-to-device one."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            dev = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(dev, str) and dev == "cpu":
                self.tally.add("d2h", "Tensor.to(cpu)")
            elif isinstance(dev, torch.device):
                self.tally.add("h2d", "Tensor.to(device)")
        return func(*args, **kwargs)


def run_mode(mode: str, batch: int, models: dict, args) -> dict:
    llm = LLM(models["target"], device="cpu", dtype="float32", max_num_seqs=batch,
              max_model_len=args.prompt_len + args.steps + 16,
              speculative_config=speculative(mode, models, args.k), seed=0)
    emulate_graphs(llm, args.k)
    tally = Tally()
    install(llm, tally)
    vocab = llm.llm_engine.config.model.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, args.prompt_len).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    step = engine.step
    steps = [0]

    def counted_step():
        steps[0] += 1
        tally.on = steps[0] > 2  # past the prefill and the first decode
        return step()

    engine.step = counted_step
    with Ops(tally), Copies(tally):
        outs = llm.generate(prompts, params, use_tqdm=False)
    tally.on = False
    n = max(steps[0] - 2, 1)
    res: dict = {"mode": mode, "batch": batch, "steps_counted": n,
                 "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    totals: dict[str, dict[str, float]] = defaultdict(dict)
    detail: dict[str, dict] = {}
    for (ph, kind), c in sorted(self_items(tally.counts)):
        totals[kind][ph] = round(sum(c.values()) / n, 2)
        detail[f"{ph}.{kind}"] = {k: round(v / n, 2) for k, v in c.most_common(args.top)}
    res["per_step"] = {k: dict(v, total=round(sum(v.values()), 2)) for k, v in totals.items()}
    res["detail"] = detail
    return res


def self_items(counts):
    return [(k, v) for k, v in counts.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="none,draft_model")
    p.add_argument("--batches", default="1")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="max_tokens of each request")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), None)
        for mode in args.modes.split(","):
            for b in args.batches.split(","):
                print(json.dumps(run_mode(mode, int(b), models, args)), flush=True)


if __name__ == "__main__":
    main()

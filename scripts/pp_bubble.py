"""The pipeline bubble on CPU (gloo): PP=2 over the real engine, executor and workers, each
stage's forward made to take a fixed time per token (a sleep of --ms-per-token, on top of the
tiny model's own few milliseconds), so that stage time dominates. Runs the same decode-heavy
workload with micro-batch pipelining (async scheduling: 2 micro-batches in flight) and
without (one batch at a time: stages in sequence), and reports throughput and the stages'
busy fraction (1 - bubble).

    PYTHONPATH=. python scripts/pp_bubble.py --requests 8 --max-tokens 24 --ms-per-token 5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from krait.distributed.worker import Worker


class SlowStageWorker(Worker):
    """A Worker whose stage forward sleeps ms_per_token per token (KRAIT workers get it
    through MultiprocExecutor's worker_cls)."""

    ms_per_token = 5.0

    def __init__(self, config, rank, init_method, timeout_s) -> None:
        super().__init__(config, rank, init_method, timeout_s)
        from krait.distributed import pipeline

        stage = pipeline.current()
        run = stage.run
        per_token = self.ms_per_token / 1e3

        def slow_run(layers, final_norm, x, positions, *rest):
            # the stage's first layer sleeps: after the input came from the stage before
            return run(_SlowFirstLayer(layers, stage.start, per_token * positions.shape[0]),
                       final_norm, x, positions, *rest)

        stage.run = slow_run


class _SlowFirstLayer:
    """The layer list, whose layer `first` sleeps `delay_s` when the stage looks it up."""

    def __init__(self, layers, first: int, delay_s: float) -> None:
        self.layers, self.first, self.delay_s = layers, first, delay_s

    def __getitem__(self, i: int):
        if i == self.first:
            time.sleep(self.delay_s)
        return self.layers[i]


def _measure(model: str, args, pipelined: bool) -> dict:
    from krait import LLM, SamplingParams
    from krait.distributed.executor import MultiprocExecutor
    from krait.engine import engine as engine_mod

    SlowStageWorker.ms_per_token = args.ms_per_token
    engine_mod.create_executor = lambda cfg: MultiprocExecutor(cfg, worker_cls=SlowStageWorker)
    llm = LLM(model, device="cpu", dtype="float32", pipeline_parallel_size=2,
              max_num_seqs=args.requests, max_model_len=128, num_kv_blocks=256,
              async_scheduling=pipelined)
    prompts = [{"prompt_token_ids": [3 + (7 * j + k) % 500 for j in range(8)]}
               for k in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.llm_engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = 8 * args.requests
    # each stage sleeps once per token it computes (prompts and decodes alike)
    busy = (prompt_tokens + tokens) * args.ms_per_token / 1e3
    return {"pipelined": pipelined, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "stage_busy_fraction": round(min(busy / wall, 1.0), 3),
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ms-per-token", type=float, default=5.0)
    args = ap.parse_args()
    from tests.utils import make_tiny_llama

    model = make_tiny_llama(tempfile.mkdtemp() + "/m")
    off = _measure(model, args, pipelined=False)
    on = _measure(model, args, pipelined=True)
    assert on.pop("token_ids") == off.pop("token_ids"), "pipelining changed the tokens"
    print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens,
                      "ms_per_token_per_stage": args.ms_per_token, "without": off, "with": on,
                      "speedup": round(off["wall_s"] / on["wall_s"], 2)}))


if __name__ == "__main__":
    main()

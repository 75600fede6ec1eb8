"""`krait serve | generate | bench`."""

from __future__ import annotations

# Building the parser imports only argparse and the light option modules (krait.bench.cli_args,
# krait.server.cli_args): torch, transformers and fastapi are imported by the handler that runs,
# so `krait --help` and a bad option answer at once (tests/test_cli.py checks).
import argparse
import json
import sys

# modules `krait.server.api_server` imports that the server extras provide: without one of them
# `krait serve` has no server options and says what is missing
_SERVER_MODULES = ("fastapi", "pydantic", "starlette", "prometheus_client")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: demo)")
    p.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="read each step's tokens back before scheduling the next")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: keys and values in float8 e4m3 (half the KV bytes of bf16)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--mamba-block-size", type=int, default=None,
                   help="prefix caching with recurrent layers: tokens between state snapshots "
                        "(a multiple of --block-size; default: the Mamba chunk size)")
    p.add_argument("--num-state-snapshots", type=int, default=None,
                   help="prefix caching with recurrent layers: snapshots the cache holds "
                        "(default: a tenth of the cache memory)")
    p.add_argument("--mamba-ssm-cache-dtype", default="float32")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks a layer is split across (one worker process each)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages the layers are split into")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray", "uni"],
                   help="how ranks run: mp (worker processes; the default for several ranks), "
                        "ray (Ray actors; RAY_ADDRESS or a local Ray), uni (one process)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, vLLM\'s keys: '
                        '\'{"method": "ngram", "num_speculative_tokens": 3}\'')


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        load_format=args.load_format,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_block_size=args.mamba_block_size,
        num_state_snapshots=args.num_state_snapshots,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )


def resolve_model(args: argparse.Namespace) -> str:
    """The model directory; the demo model (announced on stderr) when none is given."""
    model = args.model_opt or args.model
    if model is None:
        from krait.demo import DEMO_NOTICE, ensure_demo_model

        print(DEMO_NOTICE, file=sys.stderr)
        model = ensure_demo_model()
    return model


def cmd_generate(args: argparse.Namespace) -> int:
    from krait import LLM, SamplingParams

    llm = LLM(model=resolve_model(args), **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Hello, my name is"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        if args.json:
            print(json.dumps({"prompt": o.prompt, "text": o.outputs[0].text,
                              "token_ids": o.outputs[0].token_ids,
                              "finish_reason": o.outputs[0].finish_reason}))
        else:
            print(f"Prompt: {o.prompt!r}\nOutput: {o.outputs[0].text!r}\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    error = getattr(args, "server_import_error", None)
    if not error:
        try:
            from krait.server import api_server
        except ImportError as e:
            error = str(e)
    if error:
        print(f"krait serve needs the server extras (fastapi, uvicorn, pydantic, "
              f"prometheus-client): {error}", file=sys.stderr)
        return 2
    from krait.config import EngineConfig

    is_demo = (args.model_opt or args.model) is None
    args.model = resolve_model(args)
    if is_demo and not args.served_model_name:
        args.served_model_name = ["krait-demo"]
    name = (args.served_model_name or [args.model])[0]
    args.engine_config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    url = f"http://{args.host}:{args.port}"
    print(f"krait: serving {name!r} at {url}/v1\n  try: curl {url}/v1/completions "
          f"-H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
          file=sys.stderr)
    return api_server.run_server(args) or 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "serve":
        from krait.bench import serve

        return serve.main(args) or 0
    from krait.bench import offline

    if not args.config:
        args.model = resolve_model(args)
    return offline.main(args) or 0


def _missing_module(names: tuple[str, ...]) -> str | None:
    """The first of these top-level modules that is not installed (found, not imported)."""
    from importlib.util import find_spec

    def found(name: str) -> bool:
        try:
            return find_spec(name) is not None
        except ValueError:  # in sys.modules without a spec (a stand-in): there
            return True

    return next((name for name in names if not found(name)), None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="krait", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete prompts offline and print them")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per completion")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    missing = _missing_module(_SERVER_MODULES)
    if missing is None:
        from krait.server import cli_args as server_args

        server_args.add_cli_args(s)
    else:  # fastapi missing
        s.set_defaults(server_import_error=f"No module named {missing!r}")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks (JSON on stdout)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    from krait.bench import cli_args as bench_args

    for name in ("latency", "throughput"):
        bp = bsub.add_parser(name)
        add_engine_args(bp)
        bench_args.add_offline_args(bp, name)
        bp.set_defaults(func=cmd_bench)
    bp = bsub.add_parser("prefix", help="prefix caching on a shared-prefix workload")
    add_engine_args(bp)
    bench_args.add_prefix_args(bp)
    bp.set_defaults(func=cmd_bench)
    bs = bsub.add_parser("serve")
    bench_args.add_serve_args(bs)
    bs.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    import logging

    from krait import envs

    logging.basicConfig(
        level=envs.get("KRAIT_LOG_LEVEL"), format="%(name)s %(levelname)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))

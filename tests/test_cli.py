"""`python -m krait generate` in a subprocess, with a checkpoint and with the demo model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from krait.demo import DEMO_NOTICE
from tests.utils import make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def run_krait(args: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KRAIT_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "krait", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("cli_model"), arch="llama")


def test_generate_with_model(model: str, tmp_path: Path) -> None:
    args = ["generate", "--model", model, "--prompt", "hi", "--max-tokens", "4", "--json",
            "--ignore-eos"]
    proc = run_krait(args, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    out = json.loads(line)
    assert out["prompt"] == "hi"
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"
    assert isinstance(out["text"], str)
    assert DEMO_NOTICE not in proc.stderr
    assert not (tmp_path / "cache").exists()  # no demo model was built


def test_generate_plain_output_positional_model(model: str, tmp_path: Path) -> None:
    args = ["generate", model, "--prompt", "hi", "--prompt", "yo", "--max-tokens", "4"]
    proc = run_krait(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Prompt: 'hi'" in proc.stdout and "Prompt: 'yo'" in proc.stdout
    assert proc.stdout.count("Output: ") == 2


def test_generate_without_model_uses_demo(tmp_path: Path) -> None:
    proc = run_krait(["generate", "--prompt", "hi", "--max-tokens", "3", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert DEMO_NOTICE in proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt"] == "hi" and 1 <= len(out["token_ids"]) <= 3
    assert any(tmp_path.glob("demo-model-*/config.json"))  # built under KRAIT_CACHE_DIR


# What `krait --help` must not import: together about two seconds of start-up that every CLI
# call (and every test running the CLI in a subprocess) paid before the handlers imported them.
HEAVY = {"torch", "transformers", "fastapi", "pydantic", "starlette", "uvicorn", "numpy",
         "triton", "tokenizers", "safetensors"}

_HELP_SCRIPT = """
import contextlib, io, json, sys
from krait.cli import main
out = {}
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    out[" ".join(argv)] = buf.getvalue()
print(json.dumps({"help": out, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_help_imports_no_heavy_module() -> None:
    cmds = [[], ["generate"], ["serve"], ["bench"], ["bench", "latency"], ["bench", "throughput"],
            ["bench", "prefix"], ["bench", "serve"]]
    proc = _python("-c", _HELP_SCRIPT, json.dumps([[*c, "--help"] for c in cmds]))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert not HEAVY & set(result["modules"]), sorted(HEAVY & set(result["modules"]))
    helps = result["help"]
    assert "{generate,serve,bench}" in helps["--help"]
    # the options of the modules that define them, though those modules were not imported
    assert "--max-num-batched-tokens" in helps["generate --help"]
    assert "--batch-sizes" in helps["bench latency --help"] and "--config" in helps[
        "bench latency --help"]
    assert "--hf-baseline" in helps["bench throughput --help"]
    assert "--prefix-len" in helps["bench prefix --help"]
    assert "--request-rate" in helps["bench serve --help"]
    if importlib.util.find_spec("fastapi") is not None:
        assert "--served-model-name" in helps["serve --help"]


def test_package_names_are_lazy() -> None:
    code = ("import sys, krait\n"
            "assert 'torch' not in sys.modules, 'import krait imported torch'\n"
            "from krait import LLM, EngineConfig, SamplingParams\n"
            "import krait.llm, krait.config\n"
            "assert LLM is krait.LLM is krait.llm.LLM\n"
            "assert EngineConfig is krait.EngineConfig is krait.config.EngineConfig\n"
            "assert {'LLM', 'EngineConfig'} <= set(dir(krait))\n"
            "ns = {}\n"
            "exec('from krait import *', ns)\n"
            "assert set(krait.__all__) <= set(ns), set(krait.__all__) - set(ns)\n"
            "try:\n"
            "    krait.no_such_name\n"
            "except AttributeError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('krait.no_such_name')\n")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr

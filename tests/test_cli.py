"""`python -m krait generate` in a subprocess, with a checkpoint and with the demo model."""

from __future__ import annotations

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

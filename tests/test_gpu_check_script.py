"""scripts/gpu_check.sh is only run on the GPU machine, where a mistake costs device time:
its syntax, its modes, the files it runs and the variables it sets are checked here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from krait import envs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_usage_lists_every_mode():
    text = SCRIPT.read_text()
    usage = set(re.search(r"gpu_check\.sh \[([\w|]+)\]", text).group(1).split("|"))
    modes = set(re.findall(r"^  (\w+)\)", text, re.M))
    accepted = set(re.search(r"^case \$what in ([\w|]+)\) ;;", text, re.M).group(1).split("|"))
    assert usage == modes == accepted


def test_an_unknown_mode_prints_the_usage():
    out = subprocess.run(["bash", str(SCRIPT), "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "gpu_check.sh [" in out.stdout


def test_every_file_it_runs_exists():
    text = SCRIPT.read_text()
    paths = set(re.findall(r"\b((?:scripts|tests)/[\w/]+\.py)\b", text))
    assert paths and not sorted(p for p in paths if not (ROOT / p).exists())


def test_every_variable_it_sets_is_one_krait_reads():
    """A run under a misspelt or removed variable would measure the defaults."""
    knobs = set(re.findall(r"\b(KRAIT_[A-Z0-9_]+)=", SCRIPT.read_text())) - {"KRAIT_TEST_GPU"}
    assert sorted(knobs - set(envs.VARIABLES)) == []

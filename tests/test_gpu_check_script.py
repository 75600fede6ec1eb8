"""scripts/gpu_check.sh is only run on the GPU machine, where a mistake costs device time:
its syntax, its modes and the knobs its A/B runs set are checked here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_usage_lists_every_mode():
    text = SCRIPT.read_text()
    usage = set(re.search(r"gpu_check\.sh \[([\w|]+)\]", text).group(1).split("|"))
    modes = set(re.findall(r"^  (\w+)\)", text, re.M))
    assert usage == modes


def test_every_knob_it_sets_is_read_by_krait():
    """An A/B of a misspelt variable would measure the defaults twice."""
    text = SCRIPT.read_text()
    knobs = set(re.findall(r"\b(KRAIT_[A-Z0-9_]+)=", text)) - {"KRAIT_TEST_GPU"}
    source = "\n".join(p.read_text() for p in (ROOT / "krait").rglob("*.py"))
    missing = sorted(k for k in knobs if f'"{k}"' not in source)
    assert not missing, missing
    readme = (ROOT / "README.md").read_text()
    undocumented = sorted(k for k in knobs if k not in readme)
    assert not undocumented, undocumented

"""krait/envs.py lists every environment variable krait reads: a read of another `KRAIT_*` name
anywhere under krait/ fails here, as does a listed variable nothing reads."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from krait import envs

ROOT = Path(__file__).resolve().parents[1] / "krait"
# a read names its variable in a string literal: os.environ.get("KRAIT_X"), envs.get("KRAIT_X")
READ = re.compile(r"""["'](KRAIT_[A-Z0-9_]+)["']""")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in ROOT.rglob("*.py")}


def test_every_variable_krait_reads_is_listed():
    unlisted = sorted({f"{name} ({path})" for path, text in _sources().items()
                       for name in READ.findall(text) if name not in envs.VARIABLES})
    assert not unlisted, unlisted


def test_every_listed_variable_is_read_and_documented():
    read = {name for path, text in _sources().items() if path != "envs.py"
            for name in READ.findall(text)}
    assert sorted(set(envs.VARIABLES) - read) == []
    assert len(envs.VARIABLES) <= 9
    for name, (default, what) in envs.VARIABLES.items():
        assert isinstance(default, str) and what, name


def test_reads_go_through_the_reader():
    """Only krait/envs.py reads the environment for a KRAIT_* name (a write, as
    os.environ.setdefault, is not a read)."""
    direct = re.compile(r"""(?:environ\.get|getenv|environ\[)\(?\s*["']KRAIT_""")
    offenders = sorted(path for path, text in _sources().items()
                       if path != "envs.py" and direct.search(text))
    assert not offenders, offenders


def test_get_returns_the_default_and_refuses_unlisted_names(monkeypatch):
    monkeypatch.delenv("KRAIT_LOG_LEVEL", raising=False)
    assert envs.get("KRAIT_LOG_LEVEL") == "INFO"
    monkeypatch.setenv("KRAIT_LOG_LEVEL", "DEBUG")
    assert envs.get("KRAIT_LOG_LEVEL") == "DEBUG"
    with pytest.raises(KeyError):
        envs.get("KRAIT_NOT_A_VARIABLE")


def test_environ_get_follows_os_environ(monkeypatch):
    """The reader reads the store behind os.environ: every write through it (monkeypatch, a
    user's os.environ[...] = ...) is seen at once."""
    monkeypatch.delenv("KRAIT_TEST_READ", raising=False)
    assert envs.environ_get("KRAIT_TEST_READ") is None
    assert envs.environ_get("KRAIT_TEST_READ", "d") == "d"
    monkeypatch.setenv("KRAIT_TEST_READ", "1")
    assert envs.environ_get("KRAIT_TEST_READ") == "1"
    os.environ["KRAIT_TEST_READ"] = "x"
    assert envs.environ_get("KRAIT_TEST_READ", "d") == "x"
    monkeypatch.delenv("KRAIT_TEST_READ")
    assert envs.environ_get("KRAIT_TEST_READ", "d") == "d"

"""scripts/ablate_decode.py runs on the GPU only; its kernel classes and its patching are
checked here: every class names kernels that exist, and an arm's kernels launch nothing."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.utils import load_script


def _script():
    return load_script("ablate_decode")


def test_every_class_names_existing_kernels():
    mod = _script()
    for name, kernels in mod.CLASSES.items():
        for module, kernel in kernels:
            assert hasattr(importlib.import_module(module), kernel), (name, module, kernel)


def test_a_skipped_class_launches_nothing(monkeypatch):
    mod = _script()
    gemv_mod = importlib.import_module("krait.ops.gemv")
    monkeypatch.setattr(gemv_mod, "_gemv_kernel", gemv_mod._gemv_kernel)  # restored after
    mod.skip(["gemv"])
    assert isinstance(gemv_mod._gemv_kernel, mod._NoLaunch)
    y = gemv_mod.gemv_triton(torch.ones(1, 64), torch.ones(16, 64))  # launches nothing
    assert y.shape == (1, 16)


def test_unknown_classes_are_refused(monkeypatch):
    mod = _script()
    monkeypatch.setattr("sys.argv", ["ablate_decode.py", "--skip", "gemv,nope"])
    with pytest.raises(SystemExit):
        mod.main()

import torch

from krait.ops._dispatch import use_triton


class _FakeCuda:
    is_cuda = True


def test_cpu_tensors_use_reference():
    assert not use_triton(torch.ones(2))


def test_cuda_tensors_use_triton_unless_forced(monkeypatch):
    monkeypatch.delenv("KRAIT_TORCH_OPS", raising=False)
    assert use_triton(_FakeCuda())
    monkeypatch.setenv("KRAIT_TORCH_OPS", "1")
    assert not use_triton(_FakeCuda())

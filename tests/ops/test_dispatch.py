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


def test_next_pow2_matches_triton():
    import triton

    from krait.ops._dispatch import next_pow2

    for n in list(range(0, 2100)) + [4095, 4096, 4097, 100352, 151936]:
        assert next_pow2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    import triton

    from krait.ops._dispatch import cdiv

    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)

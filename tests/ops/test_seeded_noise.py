import pytest
import torch

from krait.ops.seeded_noise import seeded_exponential_ref, seeded_exponential_triton


@pytest.mark.parametrize("impl", [seeded_exponential_ref, seeded_exponential_triton],
                         ids=["ref", "triton"])
def test_rows_depend_only_on_their_seed(impl):
    V = 5000
    a = torch.full((3, V), -7.0)
    impl(a, torch.tensor([11, -1, 12]))
    b = torch.full((2, V), -7.0)
    impl(b, torch.tensor([12, 11]))
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])  # order and neighbours don't matter
    assert a[1].eq(-7.0).all()  # unseeded rows untouched
    assert not torch.equal(a[0], a[2])


@pytest.mark.parametrize("impl", [seeded_exponential_ref, seeded_exponential_triton],
                         ids=["ref", "triton"])
def test_noise_is_exponential(impl):
    q = torch.empty(4, 20000)
    impl(q, torch.tensor([1, 2, 3, 4]))
    assert (q > 0).all()
    assert abs(q.mean().item() - 1.0) < 0.03 and abs(q.var().item() - 1.0) < 0.08

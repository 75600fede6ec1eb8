import pytest
import torch

from krait.ops.num_accepted import fill_num_accepted_ref, fill_num_accepted_triton

IMPLS = [fill_num_accepted_ref, fill_num_accepted_triton]


@pytest.mark.parametrize("impl", IMPLS, ids=["ref", "triton"])
@pytest.mark.parametrize("num_sampled", [0, 3])
def test_invariant_4_fill_skips_padding_and_maps_zero_to_one_int(impl, num_sampled):
    acc = torch.full((4,), 7, dtype=torch.int32)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)
    impl(acc, idx, num_sampled)
    want = max(num_sampled, 1)
    assert acc.tolist() == [want, 7, want, 7]


@pytest.mark.parametrize("impl", IMPLS, ids=["ref", "triton"])
def test_invariant_4_fill_with_tensor_num_sampled(impl):
    acc = torch.full((4,), 7, dtype=torch.int32)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)
    impl(acc, idx, torch.tensor([0, 5, 3], dtype=torch.int32))
    assert acc.tolist() == [3, 7, 1, 7]


@pytest.mark.parametrize("impl", IMPLS, ids=["ref", "triton"])
def test_invariant_4_empty_batch_returns_at_once(impl):
    acc = torch.full((4,), 7, dtype=torch.int32)
    impl(acc, torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    impl(acc, torch.empty(0, dtype=torch.int32), 0)
    assert acc.tolist() == [7, 7, 7, 7]

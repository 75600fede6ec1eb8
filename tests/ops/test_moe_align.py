import pytest
import torch

from krait.ops.fused_moe import moe_align, moe_align_triton


@pytest.mark.parametrize("T,k,E,block_m", [(1, 2, 4, 16), (37, 6, 64, 16), (300, 2, 8, 64)])
def test_triton_align_matches_torch_up_to_order_within_an_expert(T, k, E, block_m):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    want_sorted, want_experts = moe_align(ids, E, block_m)
    got_sorted, got_experts = moe_align_triton(ids, E, block_m)
    assert torch.equal(got_experts, want_experts)
    assert got_sorted.shape == want_sorted.shape
    n = T * k
    for b in range(len(want_experts)):
        rows = slice(b * block_m, (b + 1) * block_m)
        if want_experts[b] < 0:
            assert (got_sorted[rows] == n).all()
    # per expert run: the same routes, in any order
    flat = ids.reshape(-1)
    for e in range(E):
        blocks = (want_experts == e).nonzero().flatten().tolist()
        idx = torch.cat([torch.arange(b * block_m, (b + 1) * block_m) for b in blocks]) if blocks \
            else torch.empty(0, dtype=torch.long)
        got = sorted(t for t in got_sorted[idx].tolist() if t < n)
        want = sorted(t for t in want_sorted[idx].tolist() if t < n)
        assert got == want == sorted((flat == e).nonzero().flatten().tolist())

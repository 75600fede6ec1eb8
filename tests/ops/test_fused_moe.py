import pytest
import torch

from krait.layers.moe import FusedMoE, load_expert_weights
from krait.ops.fused_moe import fused_moe, fused_moe_ref, fused_moe_triton, moe_align
from krait.ops.moe_routes import route_topk_ref


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_case(T, H, inter, E, k, activation, seed=0, device="cpu", dtype=torch.float32):
    rows = 2 * inter if activation == "silu" else inter
    x = randn(T, H, seed=seed)
    w13 = randn(E, rows, H, seed=seed + 1, scale=H**-0.5)
    w2 = randn(E, H, inter, seed=seed + 2, scale=inter**-0.5)
    weights, ids = route_topk_ref(randn(T, E, seed=seed + 3), k, renormalize=True)
    cast = dict(device=device, dtype=dtype)
    return x.to(**cast), w13.to(**cast), w2.to(**cast), weights.to(device), ids.to(device)


def naive(x, w13, w2, weights, ids, activation):
    """One token, one route at a time, in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            if activation == "silu":
                h = torch.nn.functional.silu(h[:inter]) * h[inter:]
            else:
                h = torch.relu(h) ** 2
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_reference_matches_naive(activation):
    case = make_case(T=9, H=24, inter=20, E=5, k=2, activation=activation)
    out = fused_moe_ref(*case, activation=activation)
    assert out.shape == (9, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive(*case, activation), atol=1e-5, rtol=1e-5)
    # off CUDA the dispatcher picks the reference
    torch.testing.assert_close(fused_moe(*case, activation=activation), out)


def test_align_groups_routes_by_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]], dtype=torch.int32)
    sorted_ids, expert_ids = moe_align(ids, num_experts=5, block_m=4)
    blocks = sorted_ids.view(-1, 4)
    n = ids.numel()
    assert blocks.shape[0] == expert_ids.shape[0]
    seen = []
    for block, e in zip(blocks.tolist(), expert_ids.tolist()):
        real = [r for r in block if r < n]
        if e < 0:
            assert not real
            continue
        assert real and all(int(ids.view(-1)[r]) == e for r in real)
        seen += real
    assert sorted(seen) == list(range(n))
    assert expert_ids.tolist()[:3] == [0, 1, 3]


@pytest.mark.parametrize("activation,T,k", [("silu", 37, 2), ("relu2", 13, 3)])
def test_triton_matches_reference(activation, T, k):
    case = make_case(T=T, H=48, inter=40, E=4, k=k, activation=activation, seed=7)
    torch.testing.assert_close(
        fused_moe_triton(*case, activation=activation),
        fused_moe_ref(*case, activation=activation),
        atol=1e-4, rtol=1e-4,
    )


def test_triton_bf16_and_one_token():
    case = make_case(T=1, H=32, inter=16, E=6, k=2, activation="silu", seed=3, dtype=torch.bfloat16)
    out = fused_moe_triton(*case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fused_moe_ref(*case), atol=2e-2, rtol=2e-2)


def test_layer_loads_layouts_and_routes():
    E, H, inter = 3, 8, 6
    full = make_case(T=5, H=H, inter=inter, E=E, k=2, activation="silu", seed=11)
    x, w13, w2, weights, ids = full
    stacked = FusedMoE(E, H, inter)
    stacked.load_expert("w13", None, w13)
    stacked.load_expert("down", None, w2)
    assert stacked.fully_loaded("w13") and stacked.fully_loaded("w2")
    per_expert = FusedMoE(E, H, inter)
    for e in range(E):
        per_expert.load_expert("gate", e, w13[e, :inter])
        per_expert.load_expert("up", e, w13[e, inter:])
        assert per_expert.fully_loaded("w13") == (e == E - 1)
        per_expert.load_expert("w2", e, w2[e])
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(stacked(x, weights, ids), expected)
    torch.testing.assert_close(per_expert(x, weights, ids), expected)
    with pytest.raises(ValueError):
        per_expert.load_expert("gate", 0, w13[0])
    relu = FusedMoE(E, H, inter, activation="relu2")
    with pytest.raises(ValueError):
        relu.load_expert("gate", 0, w13[0, :inter])


def test_load_expert_weights_passes_other_tensors_through():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Linear(2, 2)
            self.experts = FusedMoE(2, 4, 3, activation="relu2")

    block = Block()
    ckpt = [("norm.weight", torch.ones(2, 2))]
    ckpt += [(f"e.{e}.up", randn(3, 4, seed=e)) for e in range(2)]
    ckpt += [(f"e.{e}.down", randn(4, 3, seed=5 + e)) for e in range(2)]

    def match(name):
        if not name.startswith("e."):
            return None
        _, e, kind = name.split(".")
        return "experts", kind, int(e)

    out = list(load_expert_weights(block, ckpt, match))
    assert [n for n, _ in out] == ["norm.weight", "experts.w13", "experts.w2"]
    torch.testing.assert_close(block.experts.w13.data[1], ckpt[2][1])
    torch.testing.assert_close(block.experts.w2.data[0], ckpt[3][1])


def test_route_topk_ref():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route_topk_ref(logits, 2, renormalize=True)
    assert ids.dtype == torch.int32 and ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    w, _ = route_topk_ref(logits, 2, renormalize=False)
    torch.testing.assert_close(w, torch.softmax(logits, -1)[:, [1, 2]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("T", [256, 1])
def test_gpu_triton_matches_reference_real_sizes(activation, T):
    case = make_case(T=T, H=1536, inter=512, E=64, k=6, activation=activation, seed=1,
                     device="cuda", dtype=torch.bfloat16)
    out = fused_moe_triton(*case, activation=activation)
    ref = fused_moe_ref(*case, activation=activation)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)

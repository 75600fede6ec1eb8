"""The MoE's few-route path (krait/ops/moe_routes.py) against the torch references."""

import pytest
import torch

import krait.ops.moe_routes as moe_routes
from krait.ops.fused_moe import fused_moe, fused_moe_ref
from krait.ops.moe_routes import (
    moe_routes_triton,
    route_topk,
    route_topk_ref,
    route_topk_triton,
    use_moe_routes,
)
from tests.ops.test_fused_moe import make_case


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("round_to_dtype", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_matches_reference(renormalize, round_to_dtype, dtype):
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(1)).to(dtype)  # [T, E]
    w, ids = route_topk_triton(logits, 3, renormalize, round_to_dtype)
    w_ref, ids_ref = route_topk_ref(logits, 3, renormalize, round_to_dtype)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6 if dtype == torch.float32 else 1e-2)


def test_route_topk_ties_pick_the_lowest_index():
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0]])
    _, ids = route_topk_triton(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 4]]


def test_route_topk_nan_rows_keep_valid_ids():
    """A padded graph row may hold garbage: every id must still index an expert."""
    logits = torch.tensor([[float("nan")] * 6, [0.1, float("nan"), 0.3, -1.0, 2.0, 0.0]])
    for renormalize in (True, False):
        w, ids = route_topk_triton(logits, 3, renormalize)
        assert ((ids >= 0) & (ids < 6)).all()
        assert ids[1].tolist() == [4, 2, 0]
        assert w[0].tolist() == [0.0, 0.0, 0.0]  # no NaN weights from an all-NaN row


def test_route_topk_dispatch(monkeypatch):
    logits = torch.randn(3, 8)
    calls = []
    monkeypatch.setattr(moe_routes, "route_topk_triton",
                        lambda *a: calls.append(a) or route_topk_ref(*a))
    route_topk(logits, 2, True)  # CPU tensors: the reference
    assert not calls
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")  # the Triton path: the kernel
    route_topk(logits, 2, True)
    assert len(calls) == 1


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("T,k,with_add", [(1, 2, False), (2, 3, True), (3, 1, True)])
def test_routes_match_reference(activation, T, k, with_add):
    x, w13, w2, tw, ids = make_case(T=T, H=40, inter=24, E=7, k=k, activation=activation, seed=5)
    add = torch.randn(T, 40, generator=torch.Generator().manual_seed(9)) if with_add else None
    act = 1 if activation == "silu" else 2
    out = moe_routes_triton(x, w13, w2, tw, ids, act, add)
    ref = fused_moe_ref(x, w13, w2, tw, ids, activation)
    ref = ref if add is None else ref + add
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_routes_bf16_rounding_matches_reference():
    """bf16: the intermediate, each weighted route and the sum rounded where the reference does."""
    x, w13, w2, tw, ids = make_case(T=2, H=64, inter=32, E=8, k=2, activation="silu", seed=2,
                                    dtype=torch.bfloat16)
    add = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = moe_routes_triton(x, w13, w2, tw, ids, 1, add)
    assert out.dtype == torch.bfloat16
    ref = fused_moe_ref(x, w13, w2, tw, ids) + add
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fused_moe_takes_the_routes_only_for_few_routes(monkeypatch):
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    x = torch.zeros(1, 4)
    assert use_moe_routes(x, num_routes=4, num_experts=8)
    assert not use_moe_routes(x, num_routes=5, num_experts=8)  # experts read once per route
    assert not use_moe_routes(x, num_routes=0, num_experts=8)
    x, w13, w2, tw, ids = make_case(T=2, H=32, inter=16, E=8, k=2, activation="silu", seed=3)
    add = torch.randn(2, 32)
    torch.testing.assert_close(fused_moe(x, w13, w2, tw, ids, "silu", add),
                               fused_moe_ref(x, w13, w2, tw, ids) + add, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_routes_real_sizes(activation, T):
    """granite-4.0-h-tiny's experts (64 of 1536 x 512, top-6), bf16, with the shared add."""
    x, w13, w2, tw, ids = make_case(T=T, H=1536, inter=512, E=64, k=6, activation=activation,
                                    seed=1, device="cuda", dtype=torch.bfloat16)
    add = torch.randn(T, 1536, device="cuda").to(torch.bfloat16)
    out = moe_routes_triton(x, w13, w2, tw, ids, 1 if activation == "silu" else 2, add)
    ref = fused_moe_ref(x, w13, w2, tw, ids, activation) + add
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    logits = torch.randn(T, 64, device="cuda")  # float32: no ties for torch to order its own way
    w, i = route_topk_triton(logits, 6, True)
    w_ref, i_ref = route_topk_ref(logits, 6, True)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("forms", [dict(up_tma=None, down_tma=None), {},
                                   dict(up_tma=(16, 128, 8, 3), down_tma=(64, 128, 8, 4))])
def test_gpu_qwen3_next_shared_route_real_sizes(T, forms):
    """Qwen3-Next-80B's experts (512 of 2048 x 512, top-10) with the shared expert as a route
    and its sigmoid gate, bf16, at the launcher's tiles (split by route) and in the TMA forms,
    against torch."""
    from krait.ops.activation import silu_and_mul_ref

    x, w13, w2, tw, ids = make_case(T=T, H=2048, inter=512, E=512, k=10, activation="silu",
                                    seed=3, device="cuda", dtype=torch.bfloat16)
    ws13 = (torch.randn(1024, 2048, device="cuda") * 2048 ** -0.5).bfloat16()
    ws2 = (torch.randn(2048, 512, device="cuda") * 512 ** -0.5).bfloat16()
    gate = torch.randn(T, 1, device="cuda").bfloat16()
    cfg = dict(moe_routes.routes_config(T, 10, 2048, 512), **forms)
    out = moe_routes_triton(x, w13, w2, tw, ids, 1, add_gate=gate, shared=(ws13, ws2),
                            config=cfg)
    F = torch.nn.functional
    shared = F.linear(silu_and_mul_ref(F.linear(x, ws13)), ws2) * torch.sigmoid(gate)
    ref = fused_moe_ref(x, w13, w2, tw, ids) + shared
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert not moe_routes._COUNTERS[x.device].any()


@pytest.mark.parametrize("T", [1, 4])
def test_split_down_equals_the_route_loop(T):
    """The split down projection (one program a route, the last arrival sums) gives the loop's
    bits, and leaves its arrival counters at zero for the next launch (graph-safe)."""
    x, w13, w2, tw, ids = make_case(T=T, H=64, inter=32, E=8, k=3, activation="silu", seed=3,
                                    dtype=torch.bfloat16)
    add = torch.randn(T, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    base = moe_routes.routes_config(T, 3, 64, 32)
    outs = []
    for split in (False, True, True):  # twice split: the counters were reset by the first
        cfg = dict(base, down=(*base["down"][:3], split))
        outs.append(moe_routes_triton(x, w13, w2, tw, ids, 1, add, config=cfg))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert not moe_routes._COUNTERS[x.device].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_gated_add_matches_torch(T, dtype):
    """add_gate: the shared expert's output times sigmoid(its gate logit), added in the last
    launch (Qwen3-Next), as torch computes it (bf16: within rounding; the interpreter's casts
    do not round as CUDA's do)."""
    x, w13, w2, tw, ids = make_case(T=T, H=64, inter=32, E=8, k=2, activation="silu", seed=7,
                                    dtype=dtype)
    g = torch.Generator().manual_seed(8)
    add = torch.randn(T, 64, generator=g).to(dtype)
    gate = torch.randn(T, 1, generator=g).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    out = moe_routes_triton(x, w13, w2, tw, ids, 1, add, add_gate=gate)
    routed = moe_routes_triton(x, w13, w2, tw, ids, 1)
    torch.testing.assert_close(out.float(), (routed + add * torch.sigmoid(gate)).float(), **tol)
    torch.testing.assert_close(fused_moe(x, w13, w2, tw, ids, "silu", add, gate).float(),
                               (fused_moe_ref(x, w13, w2, tw, ids)
                                + add * torch.sigmoid(gate)).float(), **tol)
    with pytest.raises(ValueError, match="add_gate"):
        fused_moe(x, w13, w2, tw, ids, "silu", None, gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_shared_expert_as_a_route_matches_torch(T, dtype):
    """shared = (gate_up, down): the shared expert runs as one more route a token in the same
    two launches, its output (times sigmoid(gate)) the add: as the separate MLP computes it."""
    from krait.ops.activation import silu_and_mul_ref

    x, w13, w2, tw, ids = make_case(T=T, H=64, inter=32, E=8, k=2, activation="silu", seed=11,
                                    dtype=dtype)
    g = torch.Generator().manual_seed(12)
    ws13 = (torch.randn(64, 64, generator=g) * 0.2).to(dtype)  # [2I, H]
    ws2 = (torch.randn(64, 32, generator=g) * 0.2).to(dtype)  # [H, I]
    gate = torch.randn(T, 1, generator=g).to(dtype)
    shared = torch.nn.functional.linear(silu_and_mul_ref(torch.nn.functional.linear(x, ws13)),
                                        ws2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for add_gate in (None, gate):
        out = moe_routes_triton(x, w13, w2, tw, ids, 1, add_gate=add_gate, shared=(ws13, ws2))
        add = shared if add_gate is None else shared * torch.sigmoid(add_gate)
        torch.testing.assert_close(out.float(), (fused_moe_ref(x, w13, w2, tw, ids)
                                                 + add).float(), **tol)
    assert not moe_routes._COUNTERS[x.device].any()
    with pytest.raises(ValueError, match="shared expert"):
        moe_routes_triton(x, w13, w2, tw, ids, 1, add=shared, shared=(ws13, ws2))


TMA = dict(up_tma=(16, 32, 4, 2), down_tma=(16, 32, 4, 2))  # interpreter-sized boxes


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("T,k,with_add", [(1, 2, False), (2, 3, True), (3, 1, True)])
def test_tma_forms_match_reference(activation, T, k, with_add):
    """The launches' TMA forms (the expert rows through tensor-descriptor boxes, the down one
    split by route) at odd shapes: column tiles past the intermediate and hidden sizes."""
    x, w13, w2, tw, ids = make_case(T=T, H=40, inter=24, E=7, k=k, activation=activation, seed=5)
    add = torch.randn(T, 40, generator=torch.Generator().manual_seed(9)) if with_add else None
    act = 1 if activation == "silu" else 2
    cfg = dict(moe_routes.routes_config(T, k, 40, 24), **TMA)
    out = moe_routes_triton(x, w13, w2, tw, ids, act, add, config=cfg)
    ref = fused_moe_ref(x, w13, w2, tw, ids, activation)
    ref = ref if add is None else ref + add
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not moe_routes._COUNTERS[x.device].any()


@pytest.mark.parametrize("T", [1, 3])
def test_tma_forms_with_the_shared_route_equal_the_plain_kernels(T):
    """With a gated shared expert as a route, each TMA form (up, down, both) gives the plain
    kernels' bits at the same K step (the same products, summed in the same order)."""
    x, w13, w2, tw, ids = make_case(T=T, H=64, inter=32, E=8, k=2, activation="silu", seed=11)
    g = torch.Generator().manual_seed(12)
    ws13 = torch.randn(64, 64, generator=g) * 0.2  # [2I, H]
    ws2 = torch.randn(64, 32, generator=g) * 0.2  # [H, I]
    gate = torch.randn(T, 1, generator=g)
    base = dict(moe_routes.routes_config(T, 2, 64, 32), up=(16, 32, 4), down=(16, 32, 4, True))
    outs = [moe_routes_triton(x, w13, w2, tw, ids, 1, add_gate=gate, shared=(ws13, ws2),
                              config=dict(base, **forms))
            for forms in ({}, dict(up_tma=TMA["up_tma"]), dict(down_tma=TMA["down_tma"]), TMA)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert not moe_routes._COUNTERS[x.device].any()


def test_tma_forms_need_tma_readable_weights():
    """A weight TMA cannot read (rows not 16-byte aligned) keeps the plain kernels."""
    x, w13, w2, tw, ids = make_case(T=1, H=10, inter=6, E=4, k=2, activation="silu", seed=2)
    cfg = dict(moe_routes.routes_config(1, 2, 10, 6), **TMA)
    torch.testing.assert_close(moe_routes_triton(x, w13, w2, tw, ids, 1, config=cfg),
                               fused_moe_ref(x, w13, w2, tw, ids), atol=1e-5, rtol=1e-5)

"""The multi-row GEMV (krait/ops/gemv_rows.py: 2-8 rows, W through TMA into a dot) against
F.linear in the interpreter (every row count, partial tiles, split K, the silu-and-mul
epilogue, bf16), its sm_90 compile (TMA bulk copies, wgmma, nothing spilled), the plan and the
layer dispatch that route verify-step calls to it, and real sizes on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from krait.ops import linear as plan
from krait.ops.gemv_rows import _COUNTERS, MAX_ROWS, RING_BYTES, gemv_rows, rows_config
from tests.ops.sm90 import compile_sm90, sm90_available


def _inputs(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    return x, w


def _silu_and_mul(proj: torch.Tensor) -> torch.Tensor:
    half = proj.shape[1] // 2
    return F.silu(proj[:, :half]) * proj[:, half:]


def _counters_zero() -> bool:
    return int(_COUNTERS.get(torch.device("cpu"), torch.zeros(1)).abs().sum()) == 0


# small boxes keep the interpreter quick; N and K past the last whole tile in each
VARIANTS = {
    "plain": dict(BLOCK_N=16, BLOCK_K=32, STAGES=3, SPLIT_K=1),
    "split2": dict(BLOCK_N=16, BLOCK_K=32, STAGES=2, SPLIT_K=2),
    "split3": dict(BLOCK_N=32, BLOCK_K=32, STAGES=2, SPLIT_K=3),
    "early": dict(BLOCK_N=16, BLOCK_K=32, STAGES=2, SPLIT_K=2, EARLY_BOX=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_gemv_rows_matches_linear(variant, m):
    x, w = _inputs(m, 40, 200, seed=m)  # 40 = 2.5 tiles of 16; K 200 ends mid-box
    for _ in range(2):  # split K: the second launch finds the counters back at zero
        y = gemv_rows(x, w, config=VARIANTS[variant])
        assert y.shape == (m, 40) and y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert _counters_zero()


@pytest.mark.parametrize("n,k", [(17, 8), (70, 96), (64, 1000)])
def test_gemv_rows_odd_shapes_and_default_config(n, k):
    # K 8: one box mostly past K; K 1000 with the default config: K split on the interpreter's
    # 4 "SMs"; one empty slice possible (k_per_split rounded up to whole boxes)
    x, w = _inputs(4, n, k, seed=n)
    torch.testing.assert_close(gemv_rows(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gemv_rows(x, w, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=8)),
                               F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert _counters_zero()


@pytest.mark.parametrize("split,early", [(1, False), (2, False), (3, True)])
@pytest.mark.parametrize("m", [2, 4, 7])
def test_gemv_rows_silu_mul_epilogue_matches_gate_up_then_silu_and_mul(m, split, early):
    # W = [gate; up] ([2N, K]), N = 20: the last gate box reads up rows (masked at the store),
    # the last up box zeros past 2N
    x, w = _inputs(m, 2 * 20, 136, seed=10 * m + split)
    cfg = dict(BLOCK_N=16, BLOCK_K=32, STAGES=2, SPLIT_K=split, EARLY_BOX=early)
    for _ in range(2):
        got = gemv_rows(x, w, config=cfg, silu_mul_out=True)
        assert got.shape == (m, 20)
        torch.testing.assert_close(got, _silu_and_mul(F.linear(x, w)), atol=1e-5, rtol=1e-5)
    assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_rows_half_inputs_accumulate_in_float32(dtype):
    x, w = _inputs(4, 48, 264, dtype=dtype, seed=3)
    y = gemv_rows(x, w, config=dict(BLOCK_N=16, BLOCK_K=64, STAGES=2, SPLIT_K=2))
    assert y.dtype == dtype and y.shape == (4, 48)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
    got = gemv_rows(x, w, config=dict(BLOCK_N=16, BLOCK_K=64), silu_mul_out=True)
    # each half rounded to the dtype first, as a gate_up GEMM then silu_and_mul would
    want = _silu_and_mul(F.linear(x.float(), w.float()).to(dtype).float())
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()


def test_gemv_rows_strided_input():
    x, w = _inputs(3, 24, 64, seed=4)
    wide = torch.zeros(3, 128)
    wide[:, ::2] = x
    torch.testing.assert_close(gemv_rows(wide[:, ::2], w, dict(BLOCK_N=16, BLOCK_K=32)),
                               F.linear(x, w), atol=1e-5, rtol=1e-5)
    rows = torch.zeros(6, 64)
    rows[::2] = x  # rows strided (x.stride(0) = 128)
    torch.testing.assert_close(gemv_rows(rows[::2], w, dict(BLOCK_N=16, BLOCK_K=32)),
                               F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_rows_rejects_what_it_cannot_serve():
    x, w = _inputs(4, 16, 64)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv_rows(torch.randn(9, 64), w)
    with pytest.raises(ValueError, match="K=32"):
        gemv_rows(torch.randn(4, 32), w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        gemv_rows(torch.randn(64), w)
    with pytest.raises(ValueError, match="dtype|bfloat16"):
        gemv_rows(x.bfloat16(), w)
    with pytest.raises(ValueError, match="gate_up"):
        gemv_rows(x, w[:15], silu_mul_out=True)
    with pytest.raises(ValueError, match="16-byte"):
        xb, wb = _inputs(4, 8, 100, dtype=torch.bfloat16)  # 200-byte rows
        gemv_rows(xb, wb)
    with pytest.raises(ValueError, match="16-byte"):
        gemv_rows(x, w.t().contiguous().t())  # not contiguous
    with pytest.raises(ValueError, match="BLOCK_K"):
        gemv_rows(x, w, config=dict(BLOCK_K=512))
    with pytest.raises(ValueError, match="BLOCK_N"):
        gemv_rows(x, w, config=dict(BLOCK_N=8))


# the benchmarked models' projections [N, K] (gate_ups [2I, H]); qwen3-0.6b, mamba2-1.3b,
# granite-4.0-h-micro (attention qkv and o, mamba in_proj and out_proj, shared MLP)
SHAPES = [(4096, 1024, False), (1024, 2048, False), (6144, 1024, True), (1024, 3072, False),
          (8512, 2048, False), (2048, 4096, False), (3072, 2048, False), (2048, 2048, False),
          (16384, 2048, True), (2048, 8192, False)]


@pytest.mark.parametrize("n,k,silu", SHAPES)
def test_rows_config_covers_the_sms_within_the_ring(n, k, silu):
    for itemsize in (2, 4):
        cfg = rows_config(4, n, k, silu, 132, itemsize)
        assert cfg == rows_config(8, n, k, silu, 132, itemsize)  # not by the row count
        assert cfg["BLOCK_N"] in (64, 128) and cfg["num_warps"] == cfg["BLOCK_N"] // 16
        boxes = 2 if silu else 1
        assert cfg["STAGES"] * boxes * cfg["BLOCK_N"] * cfg["BLOCK_K"] * itemsize <= RING_BYTES
        programs = -(-(n // boxes) // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
        assert programs >= 132, cfg  # a wave at least (3 where K is deep enough to split)


def _compile(block_n: int, block_k: int, stages: int, num_warps: int, split: int = 1,
             silu: bool = False, early_box: bool = False, dtype: str = "bf16") -> dict:
    types = dict(x_ptr=f"*{dtype}", w_desc=f"tensordesc<{dtype}[{block_n}, {block_k}]>",
                 w_ptr=f"*{dtype}", y_ptr=f"*{dtype}", part_ptr="*fp32", count_ptr="*i32")
    return compile_sm90("krait.ops.gemv_rows", "_gemv_rows_kernel", types, dict(
        SPLIT_K=split, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=True,
        SILU_MUL=silu, IEEE=dtype == "fp32", EARLY_BOX=early_box), num_warps=num_warps)


@pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
@pytest.mark.parametrize("block_n,block_k,stages,num_warps,split,silu,early_box", [
    (64, 128, 4, 4, 1, False, False), (128, 128, 4, 8, 4, False, True),
    (64, 128, 4, 4, 2, True, False), (128, 64, 4, 8, 1, True, True)])
def test_gemv_rows_compiles_to_bulk_copies_and_wgmma_without_spills(
        block_n, block_k, stages, num_warps, split, silu, early_box):
    r = _compile(block_n, block_k, stages, num_warps, split, silu, early_box)
    print(f"\ngemv_rows sm_90 N{block_n} K{block_k} S{stages} w{num_warps} split={split} "
          f"silu={silu} early={early_box}: {r}")
    assert r["local"] == 0 and r["pdl"] and r["wgmma"], r
    assert r["bulk_tensor_copies"] > 0 and r["mbarrier_waits"] > 0, r
    boxes = 2 if silu else 1
    assert r["dynamic_shared"] >= (stages - 1) * boxes * block_n * block_k * 2, r


@pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
def test_gemv_rows_float32_compiles_without_spills():
    # float32 (the GPU parity tests' models): the exact dot, no tensor cores, still TMA boxes
    cfg = rows_config(4, 4096, 1024, False, 132, 4)
    r = _compile(cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["STAGES"], cfg["num_warps"],
                 cfg["SPLIT_K"], dtype="fp32")
    assert r["local"] == 0 and r["bulk_tensor_copies"] > 0 and not r["wgmma"], r


def test_plan_sends_verify_rows_to_the_multi_row_gemv():
    # where the H200 measured it faster than cuBLAS at 4 rows: the narrow outputs (qwen3 o and
    # down) and the gate_ups over K <= 1024 (qwen3's); cuBLAS keeps the wide and big ones
    assert plan.multi_row_gemv(4, 1024, 2048) and plan.multi_row_gemv(8, 1024, 3072)
    assert not plan.multi_row_gemv(4, 4096, 1024)  # qwen3 qkv
    assert not plan.multi_row_gemv(4, 8512, 2048)  # mamba2 in_proj
    assert not plan.multi_row_gemv(4, 2048, 4096)  # mamba2 out_proj
    assert not plan.multi_row_gemv(1, 1024, 2048)  # one row: the one-row plan
    assert not plan.multi_row_gemv(9, 1024, 2048)  # a wider batch: cuBLAS
    assert not plan.multi_row_gemv(4, 1024, plan.MULTI_ROW_MAX_ELEMENTS // 1024 + 1)
    assert plan.multi_row_gate_up(4, 6144, 1024)  # qwen3
    assert not plan.multi_row_gate_up(4, 16384, 2048)  # granite
    assert not plan.multi_row_gate_up(1, 6144, 1024) and not plan.multi_row_gate_up(9, 6144, 1024)
    n = plan.MULTI_ROW_GATE_UP_MAX_ELEMENTS // 1024
    assert plan.multi_row_gate_up(4, n, 1024) and not plan.multi_row_gate_up(4, n + 2, 1024)


@pytest.fixture
def routes(monkeypatch):
    """The layer dispatch with CPU tensors standing in for CUDA ones (the kernels through the
    interpreter): records which kernel each call took."""
    from krait.layers import linear as layer

    calls = []

    def spy(name):
        real = getattr(layer, name)
        return lambda *a, **kw: calls.append((name, a[0].shape[0], kw)) or real(*a, **kw)

    for name in ("gemv_rows", "gemv_triton", "gemv_tma"):
        monkeypatch.setattr(layer, name, spy(name))
    monkeypatch.setenv("KRAIT_TRITON_CPU", "1")
    return layer, calls


def _cuda_like(layer, monkeypatch):
    """Lets CPU tensors of 2-8 rows take the multi-row path (`_few_rows` without its CUDA
    check)."""
    monkeypatch.setattr(layer, "_few_rows", lambda x: x.dim() == 2 and 2 <= x.shape[0] <= 8
                        and layer.use_triton(x))


def test_linear_routes_few_cuda_rows_to_the_multi_row_gemv(routes, monkeypatch):
    layer, calls = routes
    x, w = _inputs(4, 40, 64, seed=1)
    assert not layer._few_rows(x)  # CPU tensors: never the multi-row GEMV, even forced
    torch.testing.assert_close(layer.linear(x, w), F.linear(x, w))
    assert calls == []
    _cuda_like(layer, monkeypatch)
    torch.testing.assert_close(layer.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.linear(x[:2], w), F.linear(x[:2], w), atol=1e-5,
                               rtol=1e-5)
    assert calls == [("gemv_rows", 4, {}), ("gemv_rows", 2, {})]
    calls.clear()
    layer.linear(x, w, torch.zeros(40))  # a bias: cuBLAS
    layer.linear(torch.zeros(9, 64), w)  # 9 rows: cuBLAS
    layer.linear(x[:, :50], torch.zeros(40, 50))  # 200-byte rows: TMA cannot read them
    layer.linear(x.bfloat16(), w.bfloat16().t().contiguous().t())  # not contiguous
    head = torch.zeros(1, 64).expand(plan.MULTI_ROW_MAX_ELEMENTS // 64 + 1, 64)
    layer.linear(x, head)  # past the bound (a view: no memory behind it): cuBLAS
    assert calls == []
    layer.linear(x[:1], w)  # one row: the one-row GEMV, as before
    assert calls == [("gemv_triton", 1, {})]


def test_gated_mlp_routes_few_rows_through_the_silu_mul_epilogue(routes, monkeypatch):
    layer, calls = routes
    x, gu = _inputs(4, 2 * 24, 48, seed=8)  # [4, H], [2I, H]
    _, down = _inputs(4, 48, 24, seed=9)  # [H, I]
    proj = F.linear(x, gu)  # [4, 2I]
    want = F.linear(_silu_and_mul(proj), down)
    _cuda_like(layer, monkeypatch)
    torch.testing.assert_close(layer.silu_mlp(x, gu, down), want, atol=1e-5, rtol=1e-5)
    assert calls == [("gemv_rows", 4, {"silu_mul_out": True}), ("gemv_rows", 4, {})]
    calls.clear()
    torch.testing.assert_close(layer.silu_mul_linear(proj, down), want, atol=1e-5, rtol=1e-5)
    assert calls == [("gemv_rows", 4, {})]  # the activation kernel, then the multi-row GEMV
    calls.clear()
    torch.testing.assert_close(layer.silu_mlp(x[:1], gu, down), want[:1], atol=1e-5,
                               rtol=1e-5)  # one row: the one-row GEMV's epilogue, as before
    assert calls == [("gemv_triton", 1, {"silu_mul_out": True}), ("gemv_triton", 1, {})]
    calls.clear()
    layer.silu_mlp(x, gu, down, torch.zeros(48))  # a gate_up bias: cuBLAS, then the activation
    assert calls == [("gemv_rows", 4, {})]  # and the down projection through `linear`


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("n,k,silu", SHAPES)
def test_gemv_rows_real_sizes_gpu(m, n, k, silu):
    """The benchmarked models' projections in bf16 with the default configs, against F.linear
    in float32 (then silu_and_mul); twice, for the split-K counters."""
    x, w = (t.cuda() for t in _inputs(m, n, k, dtype=torch.bfloat16, seed=n + m))
    want = F.linear(x.float(), w.float())
    if silu:
        want = _silu_and_mul(want)
    for _ in range(2):
        got = gemv_rows(x, w, silu_mul_out=silu)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert ((got.float() - want).norm() / want.norm()) < 1e-2

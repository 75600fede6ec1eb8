"""krait/ops/linear.py: the plan from a projection's shape to its kernel, at the benchmarked
models' shapes (pure functions: no tensors, no environment)."""

from __future__ import annotations

from krait.ops import linear as plan

M = 1 << 20


def test_one_row_projections_up_to_the_bound_take_the_gemv():
    assert plan.row_gemv(1, 1024, 2048)  # qwen3 o_proj
    assert plan.row_gemv(1, 8512, 2048)  # mamba2 in_proj (17.4M)
    assert plan.row_gemv(1, 2048, 8192)  # granite-micro MLP down (16.8M)
    assert not plan.row_gemv(1, 151936, 1024)  # an lm_head: cuBLAS
    assert not plan.row_gemv(2, 1024, 2048)  # two rows: cuBLAS
    n = plan.ROW_GEMV_MAX_ELEMENTS // 64
    assert plan.row_gemv(1, n, 64) and not plan.row_gemv(1, n + 1, 64)


def test_gated_mlps_activate_in_the_gate_up_epilogue_up_to_its_bound():
    assert plan.gate_up_epilogue(1, 16384, 2048)  # granite-micro gate_up (33.5M)
    assert plan.gate_up_epilogue(1, 6144, 1024)  # qwen3
    assert not plan.gate_up_epilogue(4, 6144, 1024)
    assert not plan.gate_up_epilogue(1, plan.GATE_UP_GEMV_MAX_ELEMENTS // 1024 + 1, 1024)


def test_tma_takes_the_big_weights_and_loads_their_first_box_early():
    in_proj = plan.tma_plan(8512, 2048)  # mamba2's 17.4M: wide, one slice, box early
    assert in_proj == dict(BLOCK_N=16, BLOCK_K=256, STAGES=3, SPLIT_K=1, num_warps=4,
                           EARLY_BOX=True)
    down = plan.tma_plan(2048, 8192)  # granite-micro's 16.8M: K split
    assert down["SPLIT_K"] == 4 and down["EARLY_BOX"]
    gate_up = plan.tma_plan(6144, 1024, silu_mul_out=True)  # qwen3's 6.3M: no early box
    assert gate_up is not None and "EARLY_BOX" not in gate_up
    assert plan.tma_plan(16384, 2048, silu_mul_out=True)["EARLY_BOX"]  # granite's 33.5M
    n = plan.TMA_EARLY_BOX_MIN_ELEMENTS // 1024
    assert "EARLY_BOX" not in plan.tma_plan(n - 2, 1024, silu_mul_out=True)
    assert plan.tma_plan(n, 1024, silu_mul_out=True)["EARLY_BOX"]
    for n, k in [(4096, 1024), (1024, 2048), (2048, 4096)]:  # small or narrow: gemv.py
        assert plan.tma_plan(n, k) is None
    assert plan.tma_plan(8512, 2048, has_bias=True) is None
    assert plan.tma_plan(8512, 2048, tma_readable=False) is None


def test_the_conv_epilogue_takes_a_one_slice_tma_config_or_gemv():
    assert plan.one_slice_tma_plan(8512, 2048) == plan.tma_plan(8512, 2048)
    assert plan.one_slice_tma_plan(2048, 8192) is None  # the TMA config splits K
    assert plan.conv_epilogue(1, 8512, 2048, 4)
    assert not plan.conv_epilogue(1, 8512, 2048, 3)  # the width must be a power of two
    assert not plan.conv_epilogue(2, 8512, 2048, 4)
    assert not plan.conv_epilogue(1, 32 * M, 2048, 4)  # past the bound
    # Qwen3-Next-80B's GDN in_proj (25M elements, past the plain GEMV's bound): the TMA GEMV
    # with the conv in its epilogue, one slice
    assert not plan.row_gemv(1, 12352, 2048) and plan.conv_epilogue(1, 12352, 2048, 4)
    assert plan.one_slice_tma_plan(12352, 2048) is not None


def test_gated_norm_prologue_takes_programs_inside_one_norm_group():
    # mamba2-1.3b's out_proj [2048, 4096] (K split in two): one group of 4096 channels
    assert plan.gated_norm_prologue(1, 2048, 4096, 4096, 16)
    # 4 groups of 1024 under programs of 2048 columns each: a sum per K tile, not taken
    assert not plan.gated_norm_prologue(1, 2048, 4096, 1024, 16)
    assert not plan.gated_norm_prologue(1, 2048, 4096, 4096, 24)  # partials must tile groups
    assert not plan.gated_norm_prologue(2, 2048, 4096, 4096, 16)
    cfg = plan.norm_config(2048, 4096, 4096)
    assert cfg["BLOCK_K"] == 512 and cfg["SPLIT_K"] == 2
    assert plan.norm_config(64, 128, 64)["BLOCK_K"] == 64  # halved until it divides the group
    assert plan.norm_config(64, 128, 24) is None  # tiles under 16 columns

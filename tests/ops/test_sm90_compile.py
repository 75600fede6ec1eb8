"""The newest kernels compile for sm_90 without a GPU (the interpreter skips Triton's front
end: a re-typed loop-carried variable once cost a device call), within a register budget that
keeps the memory-bound ones at full occupancy and with nothing spilled."""

from __future__ import annotations

import pytest

from krait.ops.selective_state_verify import LOOP_MAXNREG
from tests.ops.sm90 import compile_sm90, sm90_available

pytestmark = pytest.mark.skipif(not sm90_available(), reason="Triton without its CUDA tools")
BF, F32, I32 = "*bf16", "*fp32", "*i32"


GEMV_TYPES = dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, y_ptr=BF, part_ptr=F32, count_ptr=I32)
GEMV_PLAIN = dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, EPILOGUE=0, PARTS=1)


@pytest.mark.parametrize("pdl", [False, True])
def test_gemv_compiles_without_spills(pdl):
    from krait.ops.gemv import SILU_MUL

    r = compile_sm90("krait.ops.gemv", "_gemv_kernel", GEMV_TYPES, dict(
        GEMV_PLAIN, SPLIT_K=4, PROLOGUE=SILU_MUL, PDL=pdl))
    # the weight streams in 16-byte loads; with PDL the kernel waits for the previous one
    assert r["local"] == 0 and r["vector_loads"] > 0 and r["scalar_loads"] == 0, r
    assert r["pdl"] == pdl


@pytest.mark.parametrize("split", [1, 4])
def test_gemv_gate_up_epilogue_compiles_without_spills(split):
    from krait.ops.gemv import PLAIN, SILU_MUL

    r = compile_sm90("krait.ops.gemv", "_gemv_kernel", GEMV_TYPES, dict(
        GEMV_PLAIN, SPLIT_K=split, PROLOGUE=PLAIN, EPILOGUE=SILU_MUL, PDL=True), num_warps=8)
    assert r["local"] == 0 and r["vector_loads"] > 0 and r["scalar_loads"] == 0, r
    assert r["pdl"] and r["regs"] <= 128, r


@pytest.mark.parametrize("split", [1, 2])
def test_gemv_norm_gated_prologue_compiles_without_spills(split):
    # mamba2's out_proj: the gated norm from the state update's partials; the norm weight
    # loads in the loop's layout (no shared-memory round trip)
    from krait.ops.gemv import NORM

    types = dict(GEMV_TYPES, x_ptr=F32, norm_ptr=BF, norm_part_ptr=F32, eps="fp32")
    r = compile_sm90("krait.ops.gemv", "_gemv_kernel", types, dict(
        GEMV_PLAIN, SPLIT_K=split, PROLOGUE=NORM, PDL=True, PARTS=256), num_warps=8)
    assert r["local"] == 0 and r["pdl"] and r["regs"] <= 128 and r["loop_barriers"] == 0, r


def test_gemv_conv_epilogue_compiles_without_spills():
    # mamba2's in_proj convolving its xBC columns in the epilogue
    from krait.ops import gemv

    types = dict(GEMV_TYPES, slots_ptr=I32, cw_ptr=BF, cb_ptr=BF, cs_ptr=BF)
    r = compile_sm90("krait.ops.gemv", "_gemv_kernel", types, dict(
        GEMV_PLAIN, SPLIT_K=1, PROLOGUE=gemv.PLAIN, PDL=True, EPILOGUE=gemv.CONV, CONV_WIDTH=4,
        CONV_BIAS=True, CONV_SILU=True), num_warps=8)
    assert r["local"] == 0 and r["pdl"] and r["regs"] <= 128 and r["loop_barriers"] == 0, r


def test_pdl_kernels_compile():
    # the grid-dependency instructions in kernels of the decode chain
    types = dict(x_ptr=BF, res_ptr=BF, w_ptr=BF, out_ptr=BF, sum_ptr=BF, eps="fp32",
                 x_scale="fp32")
    r = compile_sm90("krait.ops.rms_norm", "_rms_norm_kernel", types,
                     dict(HAS_RESIDUAL=True, SCALE_X=False, BLOCK_D=1024, PDL=True))
    assert r["pdl"]
    r = compile_sm90("krait.ops.activation", "_silu_and_mul_kernel", dict(x_ptr=BF, out_ptr=BF),
                     dict(BLOCK=1024, PDL=True))
    assert r["pdl"]


def _compile_decode_split(cache: str, prefetch: bool = False) -> dict:
    """The split-KV decode kernel at qwen3's shapes over a cache of type `cache`."""
    types = dict(q_ptr=BF, k_cache_ptr=cache, v_cache_ptr=cache, part_acc_ptr=F32,
                 part_ml_ptr=F32, qsl_ptr=I32, seq_lens_ptr=I32, block_table_ptr=I32,
                 qk_scale="fp32")
    return compile_sm90("krait.ops.paged_attention", "_decode_split_kernel", types, dict(
        GROUP=2, USE_WINDOW=False, DOT_PRECISION="tf32", NUM_SPLITS=8, BLOCK_M=16, BLOCK_N=64,
        BLOCK_D=128, PDL=True, PREFETCH=prefetch),
        odd=("block_size", "sliding_window", "head_dim"))


def test_prefetching_decode_split_compiles():
    for cache in (BF, "*fp8e4nv"):
        r = _compile_decode_split(cache, prefetch=True)
        assert r["pdl"] and r["local"] == 0, r


def test_pdl_attention_and_rope_compile():
    r = _compile_decode_split(BF)
    assert r["pdl"] and r["local"] == 0, r
    types = dict(q_ptr=BF, k_ptr=BF, v_ptr=BF, q_out_ptr=BF, pos_ptr="*i64", cs_ptr=F32,
                 qw_ptr=BF, kw_ptr=BF, eps="fp32", k_cache_ptr=BF, v_cache_ptr=BF,
                 slot_ptr="*i64")
    r = compile_sm90("krait.ops.rope_kv_write", "_rope_kv_write_kernel", types, dict(
        NORM=True, IS_NEOX=True, BLOCK_H=16, BLOCK_D=128, PDL=True))
    assert r["pdl"] and r["local"] == 0, r


def test_pdl_mamba_decode_kernels_compile():
    types = dict(state_ptr=F32, x_ptr=BF, dt_ptr=BF, A_ptr=F32, B_ptr=BF, C_ptr=BF, D_ptr=F32,
                 dt_bias_ptr=F32, y_ptr=BF, slots_ptr=I32, dt_min="fp32", dt_max="fp32")
    r = compile_sm90("krait.ops.selective_state_update", "_ssu_kernel", types, dict(
        DT_SOFTPLUS=True, DT_CLAMP=False, BLOCK_P=16, BLOCK_N=128, PDL=True, GATED=False))
    assert r["pdl"] and r["local"] == 0, r
    # the gated output for the norm in out_proj's prologue (the state tile read before the
    # PDL wait)
    r = compile_sm90("krait.ops.selective_state_update", "_ssu_kernel",
                     dict(types, z_ptr=BF, g_ptr=F32, part_ptr=F32), dict(
                         DT_SOFTPLUS=True, DT_CLAMP=False, BLOCK_P=16, BLOCK_N=128,
                         PDL=True, GATED=True))
    assert r["pdl"] and r["local"] == 0, r
    types = dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, states_ptr=BF, out_ptr=BF, slots_ptr=I32)
    r = compile_sm90("krait.ops.causal_conv1d", "_conv_update_kernel", types, dict(
        WIDTH=4, HAS_BIAS=True, SILU=True, BLOCK_K=4, BLOCK_D=256, PDL=True))
    assert r["pdl"] and r["local"] == 0, r
    types = dict(x_ptr=BF, z_ptr=BF, w_ptr=BF, out_ptr=BF, eps="fp32")
    r = compile_sm90("krait.ops.gated_rms_norm", "_gated_rms_norm_kernel", types, dict(
        HAS_Z=True, BLOCK_M=1, BLOCK_G=4096, PDL=True))
    assert r["pdl"] and r["local"] == 0, r
    # Qwen3-Next's GDN output norm: the gate after the norm, one head's weight for all heads
    r = compile_sm90("krait.ops.gated_rms_norm", "_gated_rms_norm_kernel", types, dict(
        HAS_Z=True, BLOCK_M=32, BLOCK_G=128, PDL=True, GATE_AFTER=True, GROUP_WEIGHT=True))
    assert r["pdl"] and r["local"] == 0, r


@pytest.mark.parametrize("tok", ["*i64", I32])
def test_write_tokens_compiles(tok):
    # runs inside every decode graph: a front-end type error would only show on the GPU
    types = dict(table_ptr=I32, rows_ptr=I32, pos_ptr=I32, tok_ptr=tok, n="i32", width="i32",
                 stride_row="i32")
    r = compile_sm90("krait.ops.write_tokens", "_write_tokens_kernel", types, dict(BLOCK=64))
    assert r["local"] == 0, r


def test_write_drafts_compiles():
    # runs after every draft-model chain (asynchronous verify steps)
    types = dict(table_ptr=I32, rows_ptr=I32, last_ptr="*i64", drafts_ptr="*i64", k="i32",
                 width="i32", stride_row="i32", stride_d="i32")
    r = compile_sm90("krait.ops.write_tokens", "_write_drafts_kernel", types, dict(BLOCK_K=4))
    assert r["local"] == 0, r


def test_prefill_attention_compiles_without_spills():
    """The varlen kernel shares `_attend_tile` with the decode split kernel."""
    types = dict(q_ptr=BF, k_cache_ptr=BF, v_cache_ptr=BF, out_ptr=BF, qsl_ptr=I32,
                 seq_lens_ptr=I32, block_table_ptr=I32, qk_scale="fp32")
    r = compile_sm90("krait.ops.paged_attention", "_paged_attention_kernel", types, dict(
        GROUP=2, USE_WINDOW=False, DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=128, BLOCK_D=128,
        PDL=True), num_warps=8, odd=("sliding_window",))
    assert r["local"] == 0 and r["pdl"], r


def test_fp8_kv_cache_kernels_compile():
    """An fp8 (e4m3) cache: the writes round and saturate, the attention kernels widen it."""
    F8 = "*fp8e4nv"
    types = dict(key_ptr=BF, value_ptr=BF, k_cache_ptr=F8, v_cache_ptr=F8, slot_ptr="*i64")
    r = compile_sm90("krait.ops.kv_write", "_write_kv_kernel", types,
                     dict(BLOCK_H=8, BLOCK_D=128), odd=("num_heads", "head_dim", "block_size"))
    assert r["local"] == 0, r
    types = dict(q_ptr=BF, k_ptr=BF, v_ptr=BF, q_out_ptr=BF, pos_ptr="*i64", cs_ptr=F32,
                 qw_ptr=BF, kw_ptr=BF, eps="fp32", k_cache_ptr=F8, v_cache_ptr=F8,
                 slot_ptr="*i64")
    r = compile_sm90("krait.ops.rope_kv_write", "_rope_kv_write_kernel", types, dict(
        NORM=True, IS_NEOX=True, BLOCK_H=16, BLOCK_D=128, PDL=True))
    assert r["local"] == 0, r
    r = _compile_decode_split(F8)
    # the tiles widen in registers: no byte-wise gather of a transposed fp8 V from shared memory
    assert r["local"] == 0 and r["shared_byte_loads"] == 0, r
    types = dict(q_ptr=BF, k_cache_ptr=F8, v_cache_ptr=F8, out_ptr=BF, qsl_ptr=I32,
                 seq_lens_ptr=I32, block_table_ptr=I32, qk_scale="fp32")
    r = compile_sm90("krait.ops.paged_attention", "_paged_attention_kernel", types, dict(
        GROUP=2, USE_WINDOW=False, DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=128, BLOCK_D=128,
        PDL=True), num_warps=8, odd=("sliding_window",))
    assert r["local"] == 0, r



@pytest.mark.parametrize("shared", [False, True])
def test_moe_route_kernels_compile_without_spills(shared, monkeypatch):
    """The MoE's few-route path: the router's top-k and the two expert GEMVs at
    granite-4.0-h-tiny's shapes (64 experts, top-6, 1536 x 512) at the launcher's batch-1
    tiles: the down projection split by route, with a shared expert as one more route
    (Qwen3-Next) or an add."""
    from krait.ops import moe_routes

    monkeypatch.setattr(moe_routes, "interpreting", lambda: False)  # the GPU's tiles
    cfg = moe_routes.routes_config(1, 6, 1536, 512)
    assert cfg["down"][3]  # split by route at one token
    r = compile_sm90("krait.ops.moe_routes", "_route_topk_kernel",
                     dict(logits_ptr=BF, w_ptr=F32, ids_ptr=I32),
                     dict(TOPK=6, TOPK_PAD=8, RENORM=True, ROUND_W=True, BLOCK_E=64, PDL=True))
    assert r["pdl"] and r["local"] == 0, r
    bn, bk, nw = cfg["up"]
    up = compile_sm90("krait.ops.moe_routes", "_route_up_kernel",
                      dict(x_ptr=BF, w_ptr=BF, ids_ptr=I32, mid_ptr=BF, ws_ptr=BF),
                      dict(TOPK=6, ACT=1, SHARED=shared, BLOCK_N=bn, BLOCK_K=bk, PDL=True),
                      num_warps=nw)
    bn, bk, nw, split = cfg["down"]
    down = compile_sm90("krait.ops.moe_routes", "_route_down_kernel",
                        dict(mid_ptr=BF, w_ptr=BF, ids_ptr=I32, tw_ptr=F32, add_ptr=BF,
                             gate_ptr=BF, out_ptr=BF, part_ptr=F32, count_ptr=I32, ws_ptr=BF),
                        dict(TOPK=6, HAS_ADD=not shared, ADD_GATE=shared, SHARED=shared,
                             SPLIT_ROUTES=split, BLOCK_N=bn, BLOCK_K=bk, PDL=True),
                        num_warps=nw)
    for r in (up, down):  # the expert rows stream in 16-byte loads; x is born in their layout
        assert r["pdl"] and r["local"] == 0 and r["vector_loads"] > 0, r
        assert r["loop_barriers"] == 0, r
    # one token's TMA forms: the expert rows in [1, BLOCK_N, BLOCK_K] boxes of the stacked
    # weights, the shared expert's in [BLOCK_N, BLOCK_K] boxes
    for name, form, args, flags in (
            ("_route_up_tma_kernel", cfg["up_tma"], dict(x_ptr=BF, ids_ptr=I32, mid_ptr=BF),
             dict(ACT=1)),
            ("_route_down_tma_kernel", cfg["down_tma"],
             dict(mid_ptr=BF, ids_ptr=I32, tw_ptr=F32, add_ptr=BF, gate_ptr=BF, out_ptr=BF,
                  part_ptr=F32, count_ptr=I32), dict(HAS_ADD=not shared, ADD_GATE=shared))):
        bn, bk, nw, stages = form
        r = compile_sm90("krait.ops.moe_routes", name,
                         dict(args, w_desc=f"tensordesc<bf16[1, {bn}, {bk}]>",
                              ws_desc=f"tensordesc<bf16[{bn}, {bk}]>"),
                         dict(flags, TOPK=6, SHARED=shared, BLOCK_N=bn, BLOCK_K=bk,
                              STAGES=stages, PDL=True), num_warps=nw)
        assert r["pdl"] and r["local"] == 0 and r["bulk_tensor_copies"] > 0, (name, r)


def test_timeline_stamps_compile():
    # KRAIT_TIMELINE (krait/ops/timeline.py): each instrumented kernel of the decode chain reads
    # the global timer at entry, after its PDL wait and at exit; off, it reads none
    from krait.ops import gemv

    tl_types = dict(tl_ptr="*i64")
    cases = [
        ("krait.ops.rms_norm", "_rms_norm_kernel",
         dict(x_ptr=BF, res_ptr=BF, w_ptr=BF, out_ptr=BF, sum_ptr=BF, eps="fp32",
              x_scale="fp32"), dict(HAS_RESIDUAL=True, SCALE_X=False, BLOCK_D=1024, PDL=True), 4),
        ("krait.ops.gemv", "_gemv_kernel", GEMV_TYPES,
         dict(GEMV_PLAIN, SPLIT_K=2, PROLOGUE=gemv.PLAIN, PDL=True), 8),
        ("krait.ops.selective_state_update", "_ssu_kernel",
         dict(state_ptr=F32, x_ptr=BF, dt_ptr=BF, A_ptr=F32, B_ptr=BF, C_ptr=BF, D_ptr=F32,
              dt_bias_ptr=F32, y_ptr=BF, slots_ptr=I32, dt_min="fp32", dt_max="fp32"),
         dict(DT_SOFTPLUS=True, DT_CLAMP=False, BLOCK_P=16, BLOCK_N=128, PDL=True), 4),
        ("krait.ops.paged_attention", "_decode_combine_kernel",
         dict(out_ptr=BF, part_acc_ptr=F32, part_ml_ptr=F32, qsl_ptr=I32, seq_lens_ptr=I32),
         dict(NUM_SPLITS=8, BLOCK_D=128, PDL=True), 4),
    ]
    for module, kernel, types, constexprs, warps in cases:
        off = compile_sm90(module, kernel, types, constexprs, num_warps=warps)
        on = compile_sm90(module, kernel, dict(types, **tl_types), dict(constexprs, TL=True),
                          num_warps=warps)
        assert off["timer_reads"] == 0 and on["timer_reads"] >= 3, (kernel, on)
        assert on["local"] == 0 and on["pdl"], (kernel, on)


@pytest.mark.parametrize("warps,rope", [(4, False), (8, False), (8, True)])
def test_decode_split_compiles_without_spills(warps, rope):
    # 8 warps while the grid fits one program an SM; ROPE: q/k norm, rotary and the K/V write
    # in the kernel (qwen3's shape: 2 query heads a kv head, head dim
    # 128, 16 splits)
    types = dict(q_ptr=BF, k_cache_ptr=BF, v_cache_ptr=BF, part_acc_ptr=F32, part_ml_ptr=F32,
                 qsl_ptr=I32, seq_lens_ptr=I32, block_table_ptr=I32, qk_scale="fp32",
                 k_new_ptr=BF, v_new_ptr=BF, pos_ptr="*i64", cs_ptr=F32, qw_ptr=BF, kw_ptr=BF,
                 eps="fp32", slot_ptr="*i64")
    r = compile_sm90("krait.ops.paged_attention", "_decode_split_kernel", types, dict(
        GROUP=2, USE_WINDOW=False, DOT_PRECISION="tf32", NUM_SPLITS=16, BLOCK_M=16, BLOCK_N=64,
        BLOCK_D=128, PDL=True, PREFETCH=True, ROPE=rope, NORM=rope, IS_NEOX=True),
        num_warps=warps)
    assert r["local"] == 0 and r["pdl"], r


@pytest.mark.parametrize("group,head_dim", [(2, 128), (8, 256)])  # qwen3-0.6b, Qwen3-Next
@pytest.mark.parametrize("q_max", [4, 8])
@pytest.mark.parametrize("programs", [1, 1000])  # within the (CPU's 4) SMs: 8 warps; past: 4
def test_verify_split_compiles_without_spills(group, head_dim, q_max, programs):
    """The split kernel's multi-token form (verify rows of up to q_max tokens) at the tiles,
    warps and prefetch its launcher picks: nothing spilled, below the 255-register cap (head_dim
    256 over 32 score rows took 255 at 4 warps)."""
    import torch

    from krait.ops import paged_attention as pa

    block_m, block_n, warps, prefetch = pa.split_tiles(q_max, group, head_dim, programs,
                                                       torch.device("cpu"))
    types = dict(q_ptr=BF, k_cache_ptr=BF, v_cache_ptr=BF, part_acc_ptr=F32, part_ml_ptr=F32,
                 qsl_ptr=I32, seq_lens_ptr=I32, block_table_ptr=I32, qk_scale="fp32")
    r = compile_sm90("krait.ops.paged_attention", "_decode_split_kernel", types, dict(
        GROUP=group, USE_WINDOW=False, DOT_PRECISION="tf32", NUM_SPLITS=16, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=head_dim, PDL=True, PREFETCH=prefetch, Q_FIRST=warps == 8,
        Q_MAX=q_max), num_warps=warps, num_stages=pa.SPLIT_STAGES,
        odd=("block_size", "sliding_window", "head_dim"))
    assert _fits(r) and r["pdl"] and r["regs"] < 255, (warps, block_n, prefetch, r)
    r = compile_sm90("krait.ops.paged_attention", "_decode_combine_kernel", dict(
        out_ptr=BF, part_acc_ptr=F32, part_ml_ptr=F32, qsl_ptr=I32, seq_lens_ptr=I32),
        dict(NUM_SPLITS=16, BLOCK_D=head_dim, PDL=True, PER_TOKEN=True))
    assert r["local"] == 0 and r["pdl"], r


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("state,block_p", [(F32, 8), (BF, 16), (F32, 16)])
def test_mamba_verify_ssm_kernel_compiles(state, block_p, unroll):
    # speculative verify: the kept tokens replayed, then the row's 1 + k tokens in a loop with
    # the state tile in registers, their inputs kept (unit strides as a real launch
    # specializes them); the loops as loops or unrolled over 4 columns
    types = dict(state_ptr=state, x_ptr=BF, dt_ptr=BF, A_ptr=F32, B_ptr=BF, C_ptr=BF, D_ptr=F32,
                 dt_bias_ptr=F32, y_ptr=BF, qsl_ptr=I32, slots_ptr=I32, ctl_ptr=I32,
                 idx_ptr=I32, rx_ptr=BF, rdt_ptr=BF, rb_ptr=BF, dt_min="fp32", dt_max="fp32")
    r = compile_sm90("krait.ops.selective_state_verify", "_ssv_kernel", types, dict(
        DT_SOFTPLUS=True, DT_CLAMP=False, BLOCK_P=block_p, BLOCK_N=128, PDL=True, stride_s_n=1,
        stride_x_p=1, stride_B_n=1, stride_C_n=1, UNROLL=unroll, COLS=4, COLS_P2=4),
        maxnreg=None if unroll else LOOP_MAXNREG)
    # the looped form under its register cap: nothing spilled. Its loops convert x, B and C
    # into the state tile's row and column slices through shared memory (2 barriers a kept
    # token, 6 an own one, as the SASS shows: session 38); no more than that
    assert r["pdl"] and r["local"] == 0 and r["loop_barriers"] <= 8 and r["regs"] <= 128, r


@pytest.mark.parametrize("channel_last", [True, False])
def test_mamba_verify_conv_kernel_compiles(channel_last):
    # the conv over a verify row's tokens at once, the engine's channel-last state and the
    # dim-major one
    types = dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, states_ptr=BF, out_ptr=BF, qsl_ptr=I32,
                 slots_ptr=I32, num_acc_ptr=I32, idx_ptr=I32)
    unit = dict(stride_s_d=1) if channel_last else dict(stride_s_k=1)
    r = compile_sm90("krait.ops.causal_conv1d_verify", "_conv_verify_kernel", types, dict(
        WIDTH=4, HAS_BIAS=True, SILU=True, BLOCK_T=4, BLOCK_W=4, BLOCK_D=128, PDL=True,
        stride_x_d=1, stride_w_k=1, stride_sl_c=1, **unit),
        odd=() if channel_last else ("stride_s_d",))  # [slots, 4352, 3]: stride 3 a channel
    assert r["pdl"] and r["local"] == 0 and r["regs"] <= 128, r


# Gated DeltaNet (Qwen3-Next-80B: 16 key heads, 32 value heads, K = V = 128) at the tiles its
# launchers pick for decode batches 1 and 64 and an 8k-token prefill; the float32 [K, V] state
# stays in registers without spilling, and each kernel's shared memory fits an SM's 227 KiB.
GDN_HK, GDN_HV, GDN_K, GDN_V = 16, 32, 128, 128
GDN_STEP = dict(q_ptr=BF, k_ptr=BF, v_ptr=BF, g_ptr=BF, beta_ptr=BF, o_ptr=BF, state_ptr=F32,
                slots_ptr=I32, scale="fp32", alog_ptr=BF, dtb_ptr=BF)


def _fits(r: dict) -> bool:
    from tests.ops.sm90 import SM90_MAX_SHARED

    return r["local"] == 0 and r["shared"] + r["dynamic_shared"] <= SM90_MAX_SHARED


@pytest.mark.parametrize("batch,gate,norm", [(1, True, True), (64, True, True),
                                             (1, True, False), (64, False, False)])
def test_gdn_decode_update_compiles_without_spills(batch, gate, norm):
    # gate: g and beta formed in the kernel from the raw a, b; norm: the output norm by each
    # head's last program to arrive (both: the layer's decode path); with PDL, as launched
    from krait.ops.gated_delta_update import state_blocks

    bk, bv = state_blocks(GDN_K, GDN_V, batch * GDN_HV, 132)
    assert (bk, bv) == (128, 16 if batch == 1 else 32)  # batch 1: 256 programs, not 128
    types = GDN_STEP if gate else dict(GDN_STEP, g_ptr=F32, alog_ptr=F32, dtb_ptr=F32)
    extra = {}
    if norm:
        types = dict(types, z_ptr=BF, nw_ptr=BF, eps="fp32", scr_ptr=F32, part_ptr=F32,
                     count_ptr=I32)
        extra = dict(NORM=True, VP=GDN_V, NVB=GDN_V // bv, NVBP=GDN_V // bv)
    r = compile_sm90("krait.ops.gated_delta_update", "_gdn_update_kernel", types,
                     dict(QK_L2NORM=True, GATE=gate, BK=bk, BV=bv, PDL=True, **extra))
    # the state rows stream in 16-byte loads
    assert _fits(r) and r["regs"] <= 128 and r["vector_loads"] > 0 and r["pdl"], r


def test_gdn_verify_compiles_without_spills():
    from krait.ops.gated_delta_update import state_blocks

    bk, bv = state_blocks(GDN_K, GDN_V, 64 * GDN_HV, 132)
    r = compile_sm90("krait.ops.gated_delta_verify", "_gdn_verify_kernel",
                     dict(GDN_STEP, qsl_ptr=I32, acc_ptr=I32, idx_ptr=I32),
                     dict(QK_L2NORM=True, GATE=True, BK=bk, BV=bv))
    assert _fits(r) and r["regs"] <= 128, r


@pytest.mark.parametrize("kernel,variant", [
    ("diag_inv", {}), ("prep", {}), ("state", {}), ("out", {}), ("prep", {"WU_LOWP": True}),
    # seq_ptr is query_start_loc, searched in 4 steps (8 to 15 sequences)
    ("diag_inv", {"SEQ_STEPS": 4}), ("prep", {"SEQ_STEPS": 4}), ("out", {"SEQ_STEPS": 4})])
def test_gdn_prefill_kernels_compile_within_shared_memory(kernel, variant):
    # the prefill kernels at bf16 with bf16 scratch, at the launcher's tiles and options: the
    # window products on the tensor cores (wgmma; the one-warp diagonal-block inverse on
    # mma), nothing spilled, the sequential pass's pipelined loads within shared memory;
    # variant: constexprs of chunk_config's options (WU_LOWP, SEQ_FROM_QSL's SEQ_STEPS)
    import torch

    from krait.ops import gated_delta_chunk as gdc

    cfg = gdc.chunk_config(GDN_K, GDN_V, torch.bfloat16)
    assert cfg["LOWP"] and cfg["BT"] == 64 and cfg["BV"] == 32
    tiles = dict(QK_L2NORM=True, BK=cfg["BK"], **variant)
    rows = dict(g_ptr=F32, beta_ptr=BF, seq_ptr=I32, slots_ptr=I32)
    mod = "krait.ops.gated_delta_chunk"
    if kernel == "diag_inv":
        r = compile_sm90(mod, "_gdn_diag_inv_kernel", dict(rows, k_ptr=BF, dinv_ptr=F32),
                         dict(tiles, DOT_PRECISION=cfg["PRECISION"], BC=cfg["BC"]),
                         num_warps=cfg["DIAG_WARPS"])
    elif kernel == "prep":
        r = compile_sm90(mod, "_gdn_prep_kernel", dict(
            rows, k_ptr=BF, v_ptr=BF, dinv_ptr=F32, kn_ptr=BF, w_ptr=BF, u_ptr=BF, gam_ptr=F32),
            dict(tiles, DOT_PRECISION=cfg["PRECISION"],
                 SOLVE_PRECISION=cfg["SOLVE_PRECISION"], BT=cfg["BT"], BC=cfg["BC"],
                 BV=cfg["BV_PREP"]), num_warps=cfg["PREP_WARPS"], maxnreg=cfg["PREP_MAXNREG"])
    elif kernel == "state":
        r = compile_sm90(mod, "_gdn_state_kernel", dict(
            kn_ptr=BF, w_ptr=BF, u_ptr=BF, gam_ptr=F32, h_ptr=BF, state_ptr=F32, qsl_ptr=I32,
            slots_ptr=I32, init_ptr=I32), dict(DOT_PRECISION=cfg["PRECISION"], BT=cfg["BT"],
                                               BK=cfg["BK"], BV=cfg["BV"], **variant),
            num_warps=cfg["STATE_WARPS"], num_stages=cfg["STATE_STAGES"])
    else:
        r = compile_sm90(mod, "_gdn_out_kernel", dict(
            q_ptr=BF, kn_ptr=BF, w_ptr=BF, u_ptr=BF, gam_ptr=F32, h_ptr=BF, o_ptr=BF, seq_ptr=I32,
            slots_ptr=I32, scale="fp32"), dict(tiles, DOT_PRECISION=cfg["PRECISION"],
                                                BT=cfg["BT"], BV=cfg["BV_OUT"]),
            num_warps=cfg["OUT_WARPS"], num_stages=cfg["OUT_STAGES"],
            maxnreg=cfg["OUT_MAXNREG"])
    print(kernel, variant, r)
    assert _fits(r) and (r["wgmma"] or kernel == "diag_inv"), r


# Qwen3-Next-80B's other new shapes: gated attention with head_dim 256 (16 query heads over 2
# KV heads: GROUP 8; partial rotary over 64 of the 256 dims) and the router over 512 experts,
# top-10, at the tiles and launch options their launchers pick.
def _qwen3_next_decode_split(warps: int) -> dict:
    from krait.ops import paged_attention as pa

    types = dict(q_ptr=BF, k_cache_ptr=BF, v_cache_ptr=BF, part_acc_ptr=F32, part_ml_ptr=F32,
                 qsl_ptr=I32, seq_lens_ptr=I32, block_table_ptr=I32, qk_scale="fp32",
                 k_new_ptr=BF, v_new_ptr=BF, pos_ptr="*i64", cs_ptr=F32, qw_ptr=BF, kw_ptr=BF,
                 eps="fp32", slot_ptr="*i64")
    return compile_sm90("krait.ops.paged_attention", "_decode_split_kernel", types, dict(
        GROUP=8, USE_WINDOW=False, DOT_PRECISION="tf32", NUM_SPLITS=16, BLOCK_M=16,
        BLOCK_N=pa.DECODE_BLOCK_N, BLOCK_D=256, PDL=True,
        PREFETCH=pa.decode_prefetch(warps, pa.DECODE_BLOCK_N, 256), Q_FIRST=warps == 8,
        ROPE=True, NORM=True, IS_NEOX=True), num_warps=warps, num_stages=pa.SPLIT_STAGES)


@pytest.mark.parametrize("warps", [4, 8])
def test_qwen3_next_decode_attention_compiles(warps):
    r = _qwen3_next_decode_split(warps)
    assert _fits(r) and r["pdl"], r


@pytest.mark.parametrize("query_len", [8192, 8])  # a prefill chunk, a verify row of 1 + 7
def test_qwen3_next_prefill_attention_compiles(query_len):
    from krait.ops import paged_attention as pa

    # 128-row tiles, 8 warps, 2 stages: 64-key tiles at head_dim 256 (128 asked 320 KiB)
    cfg = pa._launch_config(query_len, 8, interpret=False, head_dim=256)
    assert cfg["BLOCK_N"] == 64 and pa._launch_config(query_len, 8, False)["BLOCK_N"] == (
        128 if query_len > 8 else 64)
    types = dict(q_ptr=BF, k_cache_ptr=BF, v_cache_ptr=BF, out_ptr=BF, qsl_ptr=I32,
                 seq_lens_ptr=I32, block_table_ptr=I32, qk_scale="fp32")
    r = compile_sm90("krait.ops.paged_attention", "_paged_attention_kernel", types, dict(
        GROUP=8, USE_WINDOW=False, DOT_PRECISION="tf32", BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_D=256, PDL=True), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], odd=("sliding_window",))
    assert _fits(r), r


def test_qwen3_next_router_compiles():
    r = compile_sm90("krait.ops.moe_routes", "_route_topk_kernel",
                     dict(logits_ptr=BF, w_ptr=F32, ids_ptr=I32),
                     dict(TOPK=10, TOPK_PAD=16, RENORM=True, ROUND_W=True, BLOCK_E=512, PDL=True))
    assert _fits(r) and r["pdl"], r


I64 = "*i64"


def test_speculative_commit_kernels_compile():
    # the asynchronous ngram step's device work: the fused greedy accept + commit + drafts
    # (a debug barrier inside a per-program branch, ngram_row called from it), and the
    # separate kernels it replaces for sampled rows
    types = dict(table_ptr=I32, rejected_ptr=I32, idx_ptr=I32, brow_ptr=I64, first_ptr=I64,
                 lrow_ptr=I64, npos_ptr=I64, ids_ptr=I64, pos_ptr=I64, target_ptr=I64,
                 out_ptr=I64)
    for ngram in (True, False):  # (False: the draft model drafts after it)
        r = compile_sm90("krait.ops.spec_commit", "_commit_greedy_kernel", types, dict(
            MAX_N=4, BLOCK_N=4, BLOCK=256, BLOCK_K=4, NGRAM=ngram))
        assert r["local"] == 0, r
    r = compile_sm90("krait.ops.greedy_accept", "_greedy_accept_kernel", dict(
        target_ptr=I64, drafts_ptr=I64, firsts_ptr=I64, ndraft_ptr=I64, tok_ptr=I64,
        nsamp_ptr=I32), dict(BLOCK=4))
    assert r["local"] == 0, r
    r = compile_sm90("krait.ops.ngram_propose", "_ngram_propose_kernel", dict(
        table_ptr=I32, rows_ptr=I32, ntok_ptr=I32, counts_ptr=I32), dict(
        MAX_N=4, BLOCK=256, BLOCK_K=4))
    assert r["local"] == 0, r
    for delta in (False, True):
        r = compile_sm90("krait.ops.spec_commit", "_commit_sampled_kernel", dict(
            table_ptr=I32, rejected_ptr=I32, rows_ptr=I32, start_ptr=I64, delta_ptr=I32,
            tok_ptr=I64, nsamp_ptr=I32, npos_ptr=I32, next_ptr=I32), dict(
            HAS_NSAMP=True, HAS_DELTA=delta, BLOCK=4))
        assert r["local"] == 0, r

"""Which kernel serves a decode projection: a pure plan from shapes to a kernel choice (no
tensors, no environment). krait/layers/linear.py follows it on the Triton path: one-row
projections stream their weight through the decode GEMV (krait/ops/gemv.py), or through the TMA
GEMV (krait/ops/gemv_tma.py) where that streams faster; everything else is cuBLAS.

At batch 1 a decode step reads every weight once and does little else, so the choice is how
fast each weight streams; the bounds below are where each kernel measured fastest in the
batch-1 chains of the benchmarked models on the H200 (docs/benchmarks.md, docs/decode_gemv.md).
With more rows gemv.py's FMA loop costs M times the work and cuBLAS wins over it; 2-8 rows (a
speculative verify step's 1 + k at batch 1) take the multi-row GEMV instead
(krait/ops/gemv_rows.py: W read once for all rows through TMA into wgmma), up to the bounds
below; more rows, or bigger weights (the lm_heads), stay on cuBLAS.
"""

from __future__ import annotations

from krait.ops.gemv import default_config, norm_one_group
from krait.ops.gemv_tma import tma_config

# one-row projections of at most this many weight elements take the GEMV: every projection of
# the benchmarked models but the gated MLPs' gate_up (which take the GEMV with the activation
# in its epilogue, up to GATE_UP_GEMV_MAX_ELEMENTS) and the lm_heads (100M+, cuBLAS)
ROW_GEMV_MAX_ELEMENTS = 20 << 20
# a one-row Mamba or Gated DeltaNet in_proj with its decode conv in the epilogue takes the GEMV
# up to this size (one conv launch fewer a layer): Qwen3-Next-80B's GDN in_proj is 25M elements
# (cuBLAS streamed it at 3.3 TB/s, 15.2 us at batch 1 on the H200, as fast as the TMA GEMV's wide
# config streams mamba2's: the conv launch is the gain)
CONV_GEMV_MAX_ELEMENTS = 32 << 20
# a one-row gated MLP's gate_up up to this size runs the GEMV with silu-and-mul in its epilogue
# (each program streams its columns' gate rows and up rows): no activation launch, and the down
# projection then reads the activated row
GATE_UP_GEMV_MAX_ELEMENTS = 64 << 20
# TMA GEMVs over weights this large load their first box before the PDL wait (EARLY_BOX): it
# streams while the previous kernel drains; on smaller weights it cost more than it hid
TMA_EARLY_BOX_MIN_ELEMENTS = 12 << 20
# calls of 2 to MULTI_ROW_MAX_ROWS rows (speculative verify rows at batch 1) take the multi-row
# GEMV (krait/ops/gemv_rows.py) only where it measured faster than cuBLAS on the H200
# (`scripts/bench_gemv_rows.py`, docs/benchmarks.md): narrow outputs, N <= MULTI_ROW_MAX_N
# (qwen3's o and down: 2.6x and 1.4x at 4 rows, where cuBLAS splits K and adds a reduce
# kernel), and gate_ups over K <= MULTI_ROW_GATE_UP_MAX_K (qwen3's, 1.06x, silu-and-mul in the
# epilogue). cuBLAS kept the wide and the big ones (mamba2/granite in_proj 0.82x, out_proj
# 0.94x, granite gate_up 0.78x, qkv 0.78-0.93x).
MULTI_ROW_MAX_ROWS = 8
MULTI_ROW_MAX_N = 1024
MULTI_ROW_MAX_ELEMENTS = ROW_GEMV_MAX_ELEMENTS
MULTI_ROW_GATE_UP_MAX_K = 1024
MULTI_ROW_GATE_UP_MAX_ELEMENTS = GATE_UP_GEMV_MAX_ELEMENTS


def row_gemv(rows: int, n: int, k: int) -> bool:
    """A projection of `rows` input rows against a weight [n, k] through the GEMV: one row,
    at most ROW_GEMV_MAX_ELEMENTS weight elements."""
    return rows == 1 and n * k <= ROW_GEMV_MAX_ELEMENTS


def multi_row_gemv(rows: int, n: int, k: int) -> bool:
    """A projection of `rows` input rows against a weight [n, k] through the multi-row GEMV:
    2 to MULTI_ROW_MAX_ROWS rows, at most MULTI_ROW_MAX_N output columns and
    MULTI_ROW_MAX_ELEMENTS weight elements."""
    return (2 <= rows <= MULTI_ROW_MAX_ROWS and n <= MULTI_ROW_MAX_N
            and n * k <= MULTI_ROW_MAX_ELEMENTS)


def multi_row_gate_up(rows: int, n: int, k: int) -> bool:
    """A gated MLP over `rows` rows with gate_up [n = 2I, k] runs the multi-row GEMV with the
    activation in its epilogue (then the down projection as `multi_row_gemv` says): 2 to
    MULTI_ROW_MAX_ROWS rows, K at most MULTI_ROW_GATE_UP_MAX_K, at most
    MULTI_ROW_GATE_UP_MAX_ELEMENTS weight elements."""
    return (2 <= rows <= MULTI_ROW_MAX_ROWS and k <= MULTI_ROW_GATE_UP_MAX_K
            and n * k <= MULTI_ROW_GATE_UP_MAX_ELEMENTS)


def gate_up_epilogue(rows: int, n: int, k: int) -> bool:
    """A gated MLP over `rows` rows with gate_up [n = 2I, k] runs the gate_up GEMV with the
    activation in its epilogue (then the down projection as `row_gemv` says); otherwise the
    gate_up goes as `row_gemv` says and the activation rides in the down GEMV's prologue (or
    its own launch)."""
    return rows == 1 and n * k <= GATE_UP_GEMV_MAX_ELEMENTS


def tma_plan(n: int, k: int, silu_mul_out: bool = False, has_bias: bool = False,
             tma_readable: bool = True, num_sms: int = 132) -> dict | None:
    """The TMA GEMV's config for a one-row projection the GEMV serves, against a weight [n, k]
    ([2N, k] with `silu_mul_out`), or None where krait/ops/gemv.py streams it faster
    (`tma_config`), the weight has a bias, or TMA cannot read it (`tma_readable`: contiguous,
    16-byte aligned rows)."""
    if has_bias or not tma_readable:
        return None
    cfg = tma_config(n, k, silu_mul_out, num_sms)
    if cfg is not None and n * k >= TMA_EARLY_BOX_MIN_ELEMENTS:
        cfg["EARLY_BOX"] = True
    return cfg


def one_slice_tma_plan(n: int, k: int, has_bias: bool = False, tma_readable: bool = True,
                       num_sms: int = 132) -> dict | None:
    """`tma_plan` for a projection whose epilogue (the conv) needs each program to stream all
    of K: None where the TMA config splits K."""
    cfg = tma_plan(n, k, False, has_bias, tma_readable, num_sms)
    return cfg if cfg is not None and cfg["SPLIT_K"] == 1 else None


def conv_epilogue(rows: int, n: int, k: int, conv_width: int) -> bool:
    """A Mamba (or Gated DeltaNet) layer's decode conv in its in_proj GEMV's epilogue (one launch
    fewer a layer): one row, at most CONV_GEMV_MAX_ELEMENTS weight elements, a power-of-two conv
    width."""
    return (rows == 1 and n * k <= CONV_GEMV_MAX_ELEMENTS
            and conv_width & (conv_width - 1) == 0)


def norm_config(n: int, k: int, group_size: int) -> dict[str, int] | None:
    """The one-row GEMV config for a weight [n, k] with K tiles inside one norm group of
    `group_size` channels (halved from the default until they divide the group), or None below
    16 columns a tile."""
    cfg = default_config(1, n, k)
    while group_size % cfg["BLOCK_K"]:
        cfg["BLOCK_K"] //= 2
    return cfg if cfg["BLOCK_K"] >= 16 else None


def gated_norm_prologue(rows: int, n: int, k: int, group_size: int, part_size: int) -> bool:
    """A Mamba mixer's gated RMSNorm in its out_proj GEMV's prologue (weight [n, k]), from the
    gated state update's sums of squares over runs of `part_size` channels (one launch fewer a
    layer): one row through the GEMV, partials that tile the norm groups, and each GEMV
    program's columns inside one norm group (it then loads the group's partials once and scales
    its dots at the end; groups smaller than a program's columns would cost a sum per K tile)."""
    if not row_gemv(rows, n, k) or group_size % part_size:
        return False
    cfg = norm_config(n, k, group_size)
    return cfg is not None and norm_one_group(k, group_size, cfg)

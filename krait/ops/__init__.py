"""Dense ops: each module holds a Triton kernel, its torch reference and a dispatcher."""

from krait.ops.activation import relu2, silu_and_mul
from krait.ops.kv_write import write_kv
from krait.ops.paged_attention import paged_attention
from krait.ops.rms_norm import fused_add_rms_norm, rms_norm
from krait.ops.rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "fused_add_rms_norm",
    "paged_attention",
    "relu2",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]

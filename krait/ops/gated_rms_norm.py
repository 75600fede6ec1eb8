"""Gated, grouped RMSNorm of Mamba2 (Hugging Face `MambaRMSNormGated`).

h = x.float(); h = h * silu(z.float()) when z is given; every group of `group_size` channels is
RMS-normalised on its own; out = weight * h.to(x.dtype), returned in x's dtype.

gate_after=True is Qwen3-Next's `Qwen3NextRMSNormGated` (the gate after the norm): out =
(weight * norm(x).to(x.dtype)).float() * silu(z.float()), returned in x's dtype; weight may be
one group's ([group_size], shared by every group: a Gated DeltaNet head's norm).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    num_rows, group_size, eps,
    stride_x, stride_z, stride_out,
    HAS_Z: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
    PDL: tl.constexpr, GATE_AFTER: tl.constexpr = False, GROUP_WEIGHT: tl.constexpr = False,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # One program: BLOCK_M rows x one group of channels.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK_G)
    row_ok = rows < num_rows
    col_ok = tl.arange(0, BLOCK_G) < group_size
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    h = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    h = h.to(tl.float32)  # [BLOCK_M, BLOCK_G]
    if HAS_Z:
        z = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
        z = z.to(tl.float32)
        if not GATE_AFTER:
            h = h * z * tl.sigmoid(z)
    var = tl.sum(h * h, axis=1) / group_size  # [BLOCK_M]
    h = h * tl.rsqrt(var + eps)[:, None]
    h = h.to(out_ptr.dtype.element_ty).to(tl.float32)
    w_cols = tl.arange(0, BLOCK_G) if GROUP_WEIGHT else cols
    w = tl.load(w_ptr + w_cols, mask=col_ok, other=0.0).to(tl.float32)
    out = (w[None, :] * h).to(out_ptr.dtype.element_ty)
    if HAS_Z and GATE_AFTER:
        out = (out.to(tl.float32) * (z * tl.sigmoid(z))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], out, mask=mask)


def _norm_warps(block_g: int, block_m: int) -> int:
    """Warps a program: 16 for one group of 4096+ channels a program (Mamba2's one-group norm
    of verify rows: 1.5-3.3 against 2.0-4.2 us a call on 4 warps, H100, 4 and 256 rows;
    docs/benchmarks.md, session 30), else 4 (8 past 4096 elements a program)."""
    if block_g >= 4096:
        return 16
    return 4 if block_g * block_m <= 4096 else 8


def _rows(t: Tensor) -> Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def gated_rms_norm_triton(
    x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int,
    gate_after: bool = False, num_warps: int | None = None,
) -> Tensor:
    """Triton launcher of `gated_rms_norm` (`num_warps` overrides the warps a program)."""
    dim = x.shape[-1]
    assert dim % group_size == 0, "group_size must divide the channel count"
    assert weight.numel() in (dim, group_size)
    x2 = _rows(x)
    z2 = _rows(z) if z is not None else x2
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [T, D]
    num_rows = x2.shape[0]
    if num_rows > 0:
        block_g = next_pow2(group_size)
        block_m = max(1, min(64, 4096 // block_g))
        grid = (cdiv(num_rows, block_m), dim // group_size)
        pdl = use_pdl(x2)
        _gated_rms_norm_kernel[grid](
            x2, z2, weight.contiguous(), out,
            num_rows, group_size, eps,
            x2.stride(0), z2.stride(0), out.stride(0),
            HAS_Z=z is not None, BLOCK_M=block_m, BLOCK_G=block_g, GATE_AFTER=gate_after,
            GROUP_WEIGHT=weight.numel() != dim,
            num_warps=num_warps or _norm_warps(block_g, block_m), **pdl_args(pdl),
        )
    return out if x.dim() == 2 else out.view(x.shape)


def gated_rms_norm_ref(
    x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int,
    gate_after: bool = False,
) -> Tensor:
    """Torch reference of `gated_rms_norm`."""
    h = x.float()
    if z is not None and not gate_after:
        h = h * F.silu(z.float())
    *prefix, dim = h.shape
    hg = h.view(*prefix, dim // group_size, group_size)  # [..., groups, group_size]
    hg = hg * torch.rsqrt(hg.square().mean(-1, keepdim=True) + eps)
    h = hg.view(*prefix, dim)
    if weight.numel() != dim:  # one group's weight, shared
        weight = weight.repeat(dim // group_size)
    out = (weight.float() * h.to(x.dtype).float()).to(x.dtype)
    if z is not None and gate_after:
        out = (out.float() * F.silu(z.float())).to(x.dtype)
    return out


def gated_rms_norm(
    x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int,
    gate_after: bool = False,
) -> Tensor:
    """x, z [T, D], weight [D] -> [T, D] in x's dtype (HF MambaRMSNormGated, gate applied first).

    `group_size` must divide D; each group of channels gets its own RMS statistic.
    gate_after: the gate multiplies the normed, weighted value instead (HF
    Qwen3NextRMSNormGated); weight may then be [group_size], shared by the groups.
    """
    if use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps, group_size, gate_after)
    return gated_rms_norm_ref(x, z, weight, eps, group_size, gate_after)

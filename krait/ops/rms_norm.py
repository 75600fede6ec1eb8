"""RMSNorm and fused residual-add + RMSNorm with Hugging Face rounding semantics.

h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)  (in x's dtype)
The fused residual add takes an optional scale of x (Granite's `residual + out * multiplier`),
rounded to x's dtype before the add as the unfused multiply would be.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import next_pow2, use_triton
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl
from krait.ops.timeline import ENTRY, EXIT, WAITED, stamp, timeline_args


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    dim, eps, x_scale,
    stride_x, stride_res, stride_out, stride_sum,
    HAS_RESIDUAL: tl.constexpr, SCALE_X: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, TL: tl.constexpr = False, tl_ptr=None,
):
    pdl_trigger(PDL)
    stamp(TL, tl_ptr, ENTRY)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_wait(PDL)
    stamp(TL, tl_ptr, WAITED)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        if SCALE_X:
            x = (x * x_scale).to(sum_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the model dtype before it is normalized, as in HF.
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / dim
    h = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)
    stamp(TL, tl_ptr, EXIT)


def _launch(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, x_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    dim = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [T, D]
    if residual is None:
        res2, summed = x2, out
    else:
        res2 = residual.reshape(-1, dim)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        summed = torch.empty_like(out)  # [T, D]
    pdl = use_pdl(x2) and weight.is_contiguous()  # PDL loads the weight before the wait
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, summed,
            dim, eps, float(x_scale),
            x2.stride(0), res2.stride(0), out.stride(0), summed.stride(0),
            HAS_RESIDUAL=residual is not None, SCALE_X=x_scale != 1.0,
            BLOCK_D=next_pow2(dim), **pdl_args(pdl),
            **timeline_args("rms_norm", (x2.shape[0],), x.device),
        )
    if x.dim() == 2:  # the models' case: no views to build (~3 us each on the host)
        return out, summed
    return out.view(x.shape), summed.view(x.shape)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Triton launcher of `rms_norm`."""
    return _launch(x, None, weight, eps)[0]


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Torch reference of `rms_norm`."""
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, D], weight [D] -> [T, D] in x's dtype (HF RMSNorm semantics)."""
    return rms_norm_triton(x, weight, eps) if use_triton(x) else rms_norm_ref(x, weight, eps)


def fused_add_rms_norm_triton(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, x_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Triton launcher of `fused_add_rms_norm`."""
    return _launch(x, residual, weight, eps, x_scale)


def fused_add_rms_norm_ref(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, x_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Torch reference of `fused_add_rms_norm`."""
    if x_scale != 1.0:
        x = x * x_scale
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps), summed


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, x_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(s), s) with s = x * x_scale + residual; x * x_scale and the sum are each
    rounded to x's dtype.

    Functional: neither input is modified.
    """
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, x_scale)
    return fused_add_rms_norm_ref(x, residual, weight, eps, x_scale)

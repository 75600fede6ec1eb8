"""MLP activations: gated SiLU (`silu_and_mul`) and squared ReLU (`relu2`, NemotronH); the
sigmoid output gate of Qwen3-Next's attention (`sigmoid_gate`)."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, next_pow2, use_triton
from krait.ops.pdl import pdl_args, pdl_trigger, pdl_wait, use_pdl

_BLOCK = 1024


@triton.jit
def _row_block(n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A row-wise elementwise program's (row, its BLOCK columns, their mask against n), after
    the PDL wait."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return tl.program_id(0).to(tl.int64), cols, cols < n


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    row, cols, mask = _row_block(inter, BLOCK, PDL)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.maximum(x, 0.0)
    tl.store(out_ptr + offs, (r * r).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, n, head_dim, stride_x, stride_gt, stride_gh,
                         stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row, cols, mask = _row_block(n, BLOCK, PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + (cols // head_dim) * stride_gh + cols % head_dim,
                mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch.sigmoid's rounding
    tl.store(out_ptr + row * stride_out + cols, (x * s).to(dtype), mask=mask)


def silu_and_mul_triton(x: Tensor) -> Tensor:
    """Triton launcher of `silu_and_mul`."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)  # [T, I]
    if x2.shape[0] > 0 and inter > 0:
        grid = (x2.shape[0], cdiv(inter, _BLOCK))
        pdl = use_pdl(x2)
        _silu_and_mul_kernel[grid](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=_BLOCK,
                                   **pdl_args(pdl))
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: Tensor) -> Tensor:
    """Torch reference of `silu_and_mul`."""
    inter = x.shape[-1] // 2
    h = x.float()
    return (F.silu(h[..., :inter]) * h[..., inter:]).to(x.dtype)


def silu_and_mul(x: Tensor) -> Tensor:
    """[T, 2I] -> [T, I]: silu(x[:, :I]) * x[:, I:], computed in float32, returned in x's dtype."""
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)


def relu2_triton(x: Tensor) -> Tensor:
    """Triton launcher of `relu2`."""
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n > 0:
        _relu2_kernel[(cdiv(n, _BLOCK),)](xc, out, n, BLOCK=_BLOCK)
    return out


def relu2_ref(x: Tensor) -> Tensor:
    """Torch reference of `relu2`."""
    return torch.relu(x.float()).square().to(x.dtype)


def relu2(x: Tensor) -> Tensor:
    """relu(x) ** 2, elementwise, any shape (NemotronH MLP)."""
    return relu2_triton(x) if use_triton(x) else relu2_ref(x)


def sigmoid_gate_triton(x: Tensor, gate: Tensor) -> Tensor:
    """Triton launcher of `sigmoid_gate`."""
    T, H, D = gate.shape
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(T, H * D, dtype=x.dtype, device=x.device)  # [T, H * D]
    if T > 0:
        assert gate.stride(-1) == 1 and x2.shape == (T, H * D)
        block = min(_BLOCK, next_pow2(H * D))
        _sigmoid_gate_kernel[(T, cdiv(H * D, block))](
            x2, gate, out, H * D, D, x2.stride(0), gate.stride(0), gate.stride(1),
            out.stride(0), BLOCK=block, **pdl_args(use_pdl(x2)))
    return out


def sigmoid_gate_ref(x: Tensor, gate: Tensor) -> Tensor:
    """Torch reference of `sigmoid_gate` (HF's arithmetic)."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    """x [T, H * D] * sigmoid(gate) for gate [T, H, D] (a strided view: each head's D gate
    values, e.g. the second half of its q_proj rows), in x's dtype, in one launch."""
    return sigmoid_gate_triton(x, gate) if use_triton(x) else sigmoid_gate_ref(x, gate)

"""Mamba2 single-token state update (decode) with per-row state slots.

dt' = clamp(softplus(dt + dt_bias), *dt_limit); h = exp(dt' A) h + dt' x B^T; y = h C + D x,
per head (h: [P, N]); head h reads group h // (H // G) of B and C. Row b reads and writes
ssm_states[state_indices[b]]; -1 skips the row (nothing written, its output rows unspecified).
Math is float32 (the state is read and written in its own dtype, fp32 or bf16); y is in x's dtype.
"""

import torch
from torch import Tensor

from krait.ops._dispatch import use_triton
from krait.ops.mamba_ssd import discretize_dt_ref

# ----------------------------------------------------------------------------- torch reference


def selective_state_update_ref(
    ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor, dt_bias: Tensor, state_indices: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Torch reference of `selective_state_update`."""
    heads, groups = x.shape[1], B.shape[1]
    out = torch.zeros_like(x)  # [B, H, P]
    rows = (state_indices >= 0).nonzero().squeeze(1)
    slots = state_indices[rows].long()
    d = discretize_dt_ref(dt[rows], dt_bias, dt_softplus, dt_limit)  # [n, H]
    bh = B[rows].float().repeat_interleave(heads // groups, dim=1)  # [n, H, N]
    ch = C[rows].float().repeat_interleave(heads // groups, dim=1)  # [n, H, N]
    xs = x[rows].float()  # [n, H, P]
    decay = torch.exp(d * A.float())[..., None, None]  # [n, H, 1, 1]
    state = ssm_states[slots].float() * decay + (d[..., None] * xs)[..., None] * bh[:, :, None, :]
    y = (state @ ch.unsqueeze(-1)).squeeze(-1) + D.float()[:, None] * xs  # [n, H, P]
    ssm_states[slots] = state.to(ssm_states.dtype)
    out[rows] = y.to(x.dtype)
    return out


# ----------------------------------------------------------------------------- public


def selective_state_update(
    ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor, dt_bias: Tensor, state_indices: Tensor, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """One decode token per row; returns y [B, H, P] in x's dtype.

    ssm_states [num_slots, H, P, N] updated in place; x [B, H, P]; dt [B, H] raw; A, D,
    dt_bias [H]; B, C [B, G, N]; state_indices int32 [B] (-1: skip the row).
    """
    if use_triton(x):
        return selective_state_update_triton(
            ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_softplus, dt_limit
        )
    return selective_state_update_ref(
        ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_softplus, dt_limit
    )

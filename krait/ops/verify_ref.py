"""What the verify ops' torch references share: each row's starting state."""

from __future__ import annotations

import torch
from torch import Tensor


def verify_start_states(states: Tensor, state_slots: Tensor, num_accepted: Tensor,
                        idx_mapping: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(slots [R, C] int64, live rows [R] bool, scratch [R, *state] float32): each live row's
    state read from slot column `num_accepted - 1` of its request (clamped to the row's C
    columns) into a float32 scratch, every initial state read before any write. A row is live
    when its `idx_mapping` entry and its first slot are not -1."""
    rows, num_cols = state_slots.shape
    slots = state_slots.long()
    req = idx_mapping.long()
    live = (req >= 0) & (slots[:, 0] >= 0)  # [R]
    col = (num_accepted[req.clamp(min=0)].long() - 1).clamp(0, num_cols - 1)  # [R]
    src = slots.gather(1, col[:, None]).squeeze(1)  # [R]
    scratch = torch.zeros((rows, *states.shape[1:]), dtype=torch.float32, device=states.device)
    scratch[live] = states[src[live]].float()
    return slots, live, scratch

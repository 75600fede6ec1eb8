"""A speculative verify batch for the Mamba verify ops (tests/ops/test_selective_state_verify.py,
tests/ops/test_causal_conv1d_verify.py), and their oracle: the single-token op run token by token
from each row's source slot, the state copied into each destination slot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NUM_COLS = 4  # S: 1 + 3 draft tokens
# (n_r, num_accepted of the row's request, request index or -1)
ROWS = [
    (4, 1, 5),   # source column 0, which is also the first destination
    (1, 3, 0),   # a single token from column 2
    (2, 2, -1),  # a padding row (idx_mapping -1): its slots stay untouched
    (3, 2, 7),   # source column 1, also the second destination
    (2, 1, 2),   # state_slots[r, 0] -1: skipped, its other slots stay untouched
    (2, 4, 3),   # source column 3, not a destination
]
DEAD_SLOTS_ROW = 4
MAX_REQS = 8


@dataclass
class VerifyBatch:
    query_start_loc: Tensor  # int32 [R + 1]
    state_slots: Tensor  # int32 [R, S]
    num_accepted: Tensor  # int32 [max_reqs]
    idx_mapping: Tensor  # int32 [R]
    num_slots: int
    live: list[int]  # rows that are computed
    sources: dict[int, int]  # live row -> its source slot
    dests: dict[int, list[int]]  # live row -> its destination slots, one a token

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def tokens(self, r: int) -> range:
        return range(int(self.query_start_loc[r]), int(self.query_start_loc[r + 1]))

    def live_tokens(self) -> Tensor:
        """int64 [n]: the packed tokens of the computed rows (the others' outputs are
        unspecified)."""
        return torch.tensor([t for r in self.live for t in self.tokens(r)], dtype=torch.long)

    def untouched(self) -> list[int]:
        """Slots no computed row writes (sources that are not destinations included)."""
        written = {s for r in self.live for s in self.dests[r]}
        return [s for s in range(self.num_slots) if s not in written]


def verify_batch(seed: int = 0, rows: list[tuple[int, int, int]] | None = None,
                 spare_slots: int = 3) -> VerifyBatch:
    """`ROWS` (or `rows`) with state slots drawn at random from R * S + spare_slots."""
    rows = ROWS if rows is None else rows
    g = torch.Generator().manual_seed(seed)
    num_slots = len(rows) * NUM_COLS + spare_slots
    slots = torch.randperm(num_slots, generator=g)[: len(rows) * NUM_COLS]
    slots = slots.view(len(rows), NUM_COLS).to(torch.int32)
    if rows is ROWS:
        slots[DEAD_SLOTS_ROW, 0] = -1
    num_accepted = torch.ones(MAX_REQS, dtype=torch.int32)
    for _, acc, req in rows:
        if req >= 0:
            num_accepted[req] = acc
    lens = [n for n, _, _ in rows]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    idx = torch.tensor([req for _, _, req in rows], dtype=torch.int32)
    live = [r for r, (_, _, req) in enumerate(rows) if req >= 0 and slots[r, 0] >= 0]
    sources = {r: int(slots[r, rows[r][1] - 1]) for r in live}
    dests = {r: slots[r, : rows[r][0]].tolist() for r in live}
    return VerifyBatch(qsl, slots, num_accepted, idx, num_slots, live, sources, dests)


def token_by_token(states: Tensor, batch: VerifyBatch, out_like: Tensor,
                   step: Callable[[Tensor, int, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """The oracle: for each computed row, its source slot copied into a spare slot, then per
    token `step(work, t, spare)` (the single-token op on packed token t, updating the spare
    slot of `work` in place; returns its output row) and the spare slot copied into the token's
    destination. Returns (outputs like `out_like`, zero for skipped rows; the new states)."""
    work = torch.cat([states, states[:1]])  # [num_slots + 1, ...], the last one spare
    spare = work.shape[0] - 1
    spare_idx = torch.tensor([spare], dtype=torch.int32)
    out = torch.zeros_like(out_like)
    for r in batch.live:
        work[spare] = work[batch.sources[r]].clone()
        for t, dst in zip(batch.tokens(r), batch.dests[r]):
            out[t] = step(work, t, spare_idx)
            work[dst] = work[spare].clone()
    return out, work[:-1]

"""Attention block pool and state-slot pool.

Block 0 is the null block: never handed out, it backs padded rows (CUDA graphs) so that
their writes land nowhere that matters.
"""

from __future__ import annotations

from collections import deque

from krait.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out attention blocks as tokens arrive and state slots per running request."""

    NULL_BLOCK = 0

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
        slots_per_request: int = 0,
    ) -> None:
        # num_blocks == 0: the model has no attention layers (pure state-space model).
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.uses_blocks = num_blocks > 0
        self._free_blocks: deque[int] = deque(range(1, num_blocks))
        self.num_state_slots = num_state_slots
        self.slots_per_request = slots_per_request
        self._free_slots: deque[int] = deque(range(num_state_slots))

    # -- attention blocks ---------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return max(self.num_blocks - 1, 0)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        if not self.uses_blocks:
            return 0
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(total - len(request.block_ids), 0)

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Blocks so that the request can hold `num_computed_tokens + num_new_tokens` tokens.
        Returns the newly added block ids, or None (nothing changed) if the pool is short."""
        if request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size:
            return []  # fits in the blocks it holds (most decode steps)
        need = self.blocks_needed(request, num_new_tokens)
        if need > len(self._free_blocks):
            return None
        new = [self._free_blocks.popleft() for _ in range(need)]
        request.block_ids.extend(new)
        return new

    # -- state slots ------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slots(self, request: Request) -> bool:
        """Gives a request its state slots if it has none; False if the pool is short."""
        if self.slots_per_request == 0 or request.state_slots:
            return True
        if len(self._free_slots) < self.slots_per_request:
            return False
        request.state_slots = [self._free_slots.popleft() for _ in range(self.slots_per_request)]
        return True

    # -- both -------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        self._free_blocks.extend(request.block_ids)
        request.block_ids = []
        self._free_slots.extend(request.state_slots)
        request.state_slots = []

    def usage(self) -> float:
        """Fraction of attention blocks (or, without attention, state slots) in use."""
        if self.uses_blocks:
            return 1.0 - len(self._free_blocks) / max(self.num_usable_blocks, 1)
        if self.num_state_slots:
            return 1.0 - len(self._free_slots) / self.num_state_slots
        return 0.0

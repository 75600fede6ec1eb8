"""Attention block pool and state-slot pool, with optional prefix caching.

Block 0 is the null block: never handed out, it backs padded rows (CUDA graphs) so that
their writes land nowhere that matters.

Prefix caching: every full block is keyed by a hash of its tokens chained to the previous
block's key. Blocks are reference-counted; a free block keeps its key (and contents) until it is
handed out again, oldest-freed first, so a later request with the same prefix starts from it. A
request always computes at least its last prompt token.

Models with recurrent (Mamba) layers also need the layers' state where the cached prefix ends:
a hit ends at a boundary of the hybrid cache block (`state_block_size` tokens, a multiple of the
attention block) whose state snapshot exists (`StateSnapshotPool`). The scheduler stops prefill
chunks at boundaries worth a snapshot (`prefill_cut`) and asks for one where a chunk ends on a
boundary (`reserve_snapshot`); the runner copies the state after the step, and it becomes
visible once that step's output is processed (`publish_snapshots`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from krait.engine.request import Request
from krait.engine.state_snapshots import StateSnapshotPool

logger = logging.getLogger(__name__)


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
        enable_prefix_caching: bool = False,
        state_block_size: int = 0,
        snapshot_slots: list[int] | None = None,
        conv_slots: list[int] | None = None,
    ) -> None:
        """`conv_slots`: a pool of conv-only state slots (speculative decoding's per-position
        conv windows under Mamba2's deferred commit); a request then takes its first slot from
        the `num_state_slots` full ones and the other slots_per_request - 1 from this pool."""
        # num_blocks == 0: the model has no attention layers (pure state-space model).
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.uses_blocks = num_blocks > 0
        # recurrent layers: snapshots of their state every state_block_size tokens
        self.recurrent = slots_per_request > 0
        self.state_block_size = state_block_size
        self.snapshots: StateSnapshotPool | None = None
        if enable_prefix_caching and self.recurrent:
            if not snapshot_slots or state_block_size <= 0 or state_block_size % block_size:
                raise ValueError(
                    "prefix caching with recurrent layers needs snapshot slots and a state block "
                    f"size that is a multiple of block_size={block_size}; got "
                    f"{len(snapshot_slots or [])} slots, state_block_size={state_block_size}")
            self.snapshots = StateSnapshotPool(snapshot_slots)
        self.prefix_caching = enable_prefix_caching and (self.uses_blocks or self.recurrent)
        # free blocks, oldest-freed first (a dict as an ordered set: O(1) removal on a cache hit)
        self._free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._ref = [0] * max(num_blocks, 1)
        self._key_of: dict[int, int] = {}  # block -> key of the full block it holds
        self._block_of: dict[int, int] = {}  # key -> block
        self._keys: dict[str, list[int]] = {}  # request id -> keys of its full blocks
        self._published: dict[str, int] = {}  # request id -> leading blocks already published
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found in the cache
        self.num_state_slots = num_state_slots
        self.slots_per_request = slots_per_request
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self._free_conv_slots: deque[int] | None = deque(conv_slots) if conv_slots else None
        self._conv_slot_ids = frozenset(conv_slots or ())

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
        new = [self._take_free_block() for _ in range(need)]
        request.block_ids.extend(new)
        return new

    def _take_free_block(self) -> int:
        block, _ = self._free_blocks.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]  # its old contents are about to be overwritten
        self._ref[block] = 1
        return block

    # -- prefix caching -----------------------------------------------------------------
    def _block_keys(self, request: Request) -> list[int]:
        """Keys of the request's full blocks, extended as its tokens grow."""
        keys = self._keys.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(keys), request.num_tokens // bs):
            parent = keys[-1] if keys else 0
            keys.append(hash((parent, tuple(request.token_slice(i * bs, (i + 1) * bs)))))
        return keys

    def match_prefix(self, request: Request) -> int:
        """For a request being admitted without blocks: takes the cached blocks of its longest
        cached prefix (never covering its last token) and returns how many tokens they hold.
        With recurrent layers the prefix also ends where a state snapshot exists, which the
        request's fresh slot is restored from (`request.snapshot_slot`)."""
        if not self.prefix_caching or request.block_ids or request.snapshot_slot >= 0:
            return 0
        self.prefix_queries += request.num_tokens
        if self.snapshots is not None:
            hit = self._match_recurrent(request)
        else:
            keys = self._block_keys(request)[: (request.num_tokens - 1) // self.block_size]
            hit = self._take_cached_blocks(request, keys) * self.block_size
        self.prefix_hits += hit
        return hit

    def _cached_run(self, keys: list[int]) -> int:
        """How many of the leading `keys` have a cached block."""
        n = 0
        for key in keys:
            if key not in self._block_of:
                break
            n += 1
        return n

    def _take_cached_blocks(self, request: Request, keys: list[int]) -> int:
        """Gives the request (a reference to) the cached blocks of the leading `keys`; returns
        how many it took."""
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._free_blocks[block]
            self._ref[block] += 1
            request.block_ids.append(block)
        return len(request.block_ids)

    def _match_recurrent(self, request: Request) -> int:
        """The deepest state-block boundary before the request's last token where its
        snapshot exists and (with attention layers) every block before it is cached."""
        pool, bs, sb = self.snapshots, self.block_size, self.state_block_size
        keys = self._block_keys(request)
        n = request.num_tokens
        deepest = (n - 1) // sb * sb
        cached = self._cached_run(keys[: deepest // bs]) * bs if self.uses_blocks else deepest
        hit, slot = 0, None
        for b in range(min(deepest, cached // sb * sb), 0, -sb):
            slot = pool.lookup(keys[b // bs - 1])
            if slot is not None:
                hit = b
                break
        if hit:
            if self.uses_blocks:
                self._take_cached_blocks(request, keys[: hit // bs])
            request.snapshot_slot = slot
        # a boundary past the hit that an earlier prompt crossed too is shared: the prefill
        # stops there so that the next request finds a snapshot
        bounds = [(b, keys[b // bs - 1]) for b in range(sb, n + 1, sb)]
        request.snapshot_cut = max(
            (b for b, key in bounds if b > hit and pool.seen(key) and not pool.has(key)),
            default=0)
        pool.mark_seen([key for _, key in bounds])
        if n <= sb:
            logger.debug("request %s: its %d prompt tokens are fewer than the hybrid cache "
                         "block (%d), so it cannot hit the prefix cache", request.request_id, n, sb)
        return hit

    def prefill_cut(self, request: Request, start: int, n: int) -> int:
        """`n` scheduled tokens from `start`, or fewer so that the chunk ends on the state
        boundary worth a snapshot: a shared one (`snapshot_cut`), else the last one the
        request's known tokens reach."""
        if self.snapshots is None:
            return n
        sb = self.state_block_size
        last = request.num_tokens // sb * sb
        for b in sorted((request.snapshot_cut, last)):
            if start < b < start + n:
                return b - start
        return n

    def reserve_snapshot(self, request: Request, end: int) -> tuple[int, int] | None:
        """(request's state slot, snapshot slot) when a step that computes the request's
        tokens up to `end` should leave a snapshot there, else None."""
        pool = self.snapshots
        if pool is None or end % self.state_block_size or end > request.num_tokens:
            return None
        key = self._block_keys(request)[end // self.block_size - 1]
        slot = pool.reserve(key)
        return None if slot is None else (request.state_slots[0], slot)

    def publish_snapshots(self, saves: list[tuple[int, int]]) -> None:
        """The step that wrote these snapshots has been processed."""
        for _, slot in saves:
            self.snapshots.publish(slot)

    def cache_full_blocks(self, request: Request) -> None:
        """Publishes the request's blocks that its computed tokens have filled."""
        if not self.prefix_caching:
            return
        known = min(request.num_computed_tokens, request.num_tokens)  # in-flight tokens excluded
        full = min(known // self.block_size, len(request.block_ids))
        done = self._published.get(request.request_id, 0)
        if full <= done:
            return  # no block filled since the last call (most decode steps)
        self._published[request.request_id] = full
        keys = self._block_keys(request)
        for i in range(done, full):
            block = request.block_ids[i]
            if block in self._key_of or keys[i] in self._block_of:
                continue  # published already, or the same tokens live in another block
            self._key_of[block] = keys[i]
            self._block_of[keys[i]] = block

    # -- state slots ------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slots(self, request: Request) -> bool:
        """Gives a request its state slots if it has none; False if the pool is short."""
        if self.slots_per_request == 0 or request.state_slots:
            return True
        conv = self._free_conv_slots
        if conv is None:
            if len(self._free_slots) < self.slots_per_request:
                return False
            request.state_slots = [self._free_slots.popleft()
                                   for _ in range(self.slots_per_request)]
            return True
        if not self._free_slots or len(conv) < self.slots_per_request - 1:
            return False
        request.state_slots = [self._free_slots.popleft(),
                               *(conv.popleft() for _ in range(self.slots_per_request - 1))]
        return True

    # -- both -------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        # a request's last blocks are the least likely to be shared: they are evicted first
        for block in reversed(request.block_ids):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free_blocks[block] = None
        request.block_ids = []
        request.snapshot_slot = -1
        request.snapshot_cut = 0
        self._keys.pop(request.request_id, None)
        self._published.pop(request.request_id, None)
        for slot in request.state_slots:
            (self._free_conv_slots if slot in self._conv_slot_ids else self._free_slots).append(slot)
        request.state_slots = []

    def usage(self) -> float:
        """Fraction of attention blocks (or, without attention, state slots) in use."""
        if self.uses_blocks:
            return 1.0 - len(self._free_blocks) / max(self.num_usable_blocks, 1)
        if self.num_state_slots:
            return 1.0 - len(self._free_slots) / self.num_state_slots
        return 0.0

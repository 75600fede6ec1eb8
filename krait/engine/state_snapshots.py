"""The recurrent-state snapshot pool behind prefix caching for hybrid and Mamba2 models.

A Mamba layer's state after token t cannot be rebuilt from cached attention blocks, so the
engine keeps copies of it at block boundaries (every `block_size` tokens of the hybrid cache
block). A snapshot is an extra state slot in the same per-layer state tensors as the requests'
slots, keyed by the chained hash of the tokens before its boundary (the attention blocks' key
of the block that ends there). Snapshots are copied into a request's fresh slot on a hit, never
shared, and evicted least recently used first.

A slot's life: free -> reserved (a step copies a request's state into it after its forward) ->
published (when the step's output is processed, so no request admitted earlier can read it
before it is written) -> evicted (taken again for another reservation) -> reserved ...
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshotPool:
    """Snapshot slots: reserved for a key, published once written, looked up by key."""

    def __init__(self, slot_ids: list[int], max_seen_keys: int = 1 << 16) -> None:
        self.slot_ids = list(slot_ids)
        self._free: list[int] = list(reversed(self.slot_ids))
        self._published: OrderedDict[int, int] = OrderedDict()  # key -> slot, LRU first
        self._reserved: dict[int, int] = {}  # slot -> key, written by a step in flight
        self._pending_keys: set[int] = set()
        # boundary keys of prompts seen (hashes only): a boundary seen before without a
        # snapshot is shared, and the next prefill that crosses it stops there to save one
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._max_seen = max_seen_keys

    @property
    def num_slots(self) -> int:
        return len(self.slot_ids)

    @property
    def num_published(self) -> int:
        return len(self._published)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, key: int) -> int | None:
        """The slot holding the snapshot for `key` (marked recently used), or None."""
        slot = self._published.get(key)
        if slot is not None:
            self._published.move_to_end(key)
        return slot

    def has(self, key: int) -> bool:
        """A snapshot for `key` exists or is being written."""
        return key in self._published or key in self._pending_keys

    def reserve(self, key: int) -> int | None:
        """A slot for a new snapshot of `key`: a free one, else the least recently used
        published one. None when every slot is reserved by steps in flight, or the key is
        already held."""
        if self.has(key):
            return None
        if self._free:
            slot = self._free.pop()
        elif self._published:
            _, slot = self._published.popitem(last=False)
        else:
            return None
        self._reserved[slot] = key
        self._pending_keys.add(key)
        return slot

    def publish(self, slot: int) -> None:
        """The step that writes `slot` has been processed: its snapshot can be hit."""
        key = self._reserved.pop(slot, None)
        if key is None:
            return
        self._pending_keys.discard(key)
        self._published[key] = slot

    # -- sharing detection -------------------------------------------------------------
    def seen(self, key: int) -> bool:
        return key in self._seen

    def mark_seen(self, keys: list[int]) -> None:
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self._max_seen:
            self._seen.popitem(last=False)

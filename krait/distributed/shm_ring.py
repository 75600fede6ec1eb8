"""A shared-memory broadcast ring: one writer, `num_readers` readers, `num_slots` slots (vLLM's
shm MessageQueue, reduced to what the executor needs).

Layout of the block (int64 words): per reader a "messages read" counter and a "sleeping" flag
(one cache line each), then the slots, each a header [seq, size, targets] and `slot_bytes` of payload. Message m
(1-based) goes to slot (m - 1) % num_slots. The writer may reuse a slot once every reader has
read past the message it held; it writes the payload, then the size and targets, and last the
slot's seq = m. A reader waits for seq == m, reads, and then publishes its counter = m. The
ordering relies on the stores of one process becoming visible in program order (x86-64 TSO,
as vLLM's ring does).

A payload larger than a slot is not copied: the slot says so (size -1) and the writer sends it
on the readers' pipes instead (`PIPE`). A message carries a bit mask of the readers it is for;
the others skip it (and still count it read).

Waiting (`wait_until`): a reader polls, yielding the core, for SPIN_S; then it raises its
sleeping flag and blocks on its pipe, and the writer, seeing the flag after a write, sends an
empty wake-up message on that pipe. A busy, shared host (more runnable processes than cores)
favours a woken process over a spinning one, so spinning longer only loses there. (The flag
and the slot's seq are a store then a load on each side, which x86 may reorder: a wake-up can
be missed, and then the bounded block, BLOCK_S, ends the wait.)"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

_LINE = 8  # int64 words per cache line
_SLOT_HEADER = 3  # seq, size, targets
PIPE = object()  # a message of this ring that travels on the reader's pipe
ALL = -1  # targets: every reader


@dataclass(frozen=True)
class RingHandle:
    """What a reader process needs to attach (picklable)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


class ShmRing:
    """One end of a ring; `create` makes the block (the writer's side, which unlinks it),
    `attach` opens it in another process."""

    def __init__(self, handle: RingHandle, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self.handle = handle
        self._shm = shm
        self._owner = owner
        self._words = shm.buf.cast("q")
        self._bytes = shm.buf
        slot_words = _SLOT_HEADER + handle.slot_bytes // 8
        base = handle.num_readers * _LINE
        # word offset of every slot's header
        self._slot = [base + k * slot_words for k in range(handle.num_slots)]
        self._written = 0  # writer: messages written
        self._read = 0  # reader: messages read
        self.reader = -1

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> ShmRing:
        slot_bytes = (slot_bytes + 7) // 8 * 8
        size = 8 * (num_readers * _LINE + num_slots * (_SLOT_HEADER + slot_bytes // 8))
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = bytes(size)
        return cls(RingHandle(shm.name, num_readers, num_slots, slot_bytes), shm, owner=True)

    @classmethod
    def attach(cls, handle: RingHandle, reader: int = -1) -> ShmRing:
        """Opens the ring; `reader` is this process's reader index (-1: the writer)."""
        ring = cls(handle, shared_memory.SharedMemory(name=handle.name), owner=False)
        ring.reader = reader
        return ring

    # -- writer ---------------------------------------------------------------------------
    def try_write(self, data: bytes, targets: int = ALL) -> bool:
        """Writes one message unless its slot is still unread by some reader (False). A
        payload larger than a slot is marked PIPE: the caller sends it on the pipes."""
        h = self.handle
        m = self._written + 1
        words = self._words
        oldest = m - h.num_slots  # the message this slot held
        if oldest > 0:
            for r in range(h.num_readers):
                if words[r * _LINE] < oldest:
                    return False
        w = self._slot[(m - 1) % h.num_slots]
        n = len(data)
        if n <= h.slot_bytes:
            start = 8 * (w + _SLOT_HEADER)
            self._bytes[start:start + n] = data
        else:
            n = -1
        words[w + 1] = n
        words[w + 2] = targets
        words[w] = m  # last: the message is complete
        self._written = m
        return True

    def write(self, data: bytes, targets: int = ALL,
              check: Callable[[], None] | None = None) -> bool:
        """Writes one message, waiting (`check` called meanwhile, which may raise) for its slot
        to be read; returns whether it went on the pipes instead (too large for a slot)."""
        if not self.try_write(data, targets):
            wait_until(lambda: self.try_write(data, targets) or None, check)
        return len(data) > self.handle.slot_bytes

    def sleepers(self, targets: int = ALL) -> list[int]:
        """The readers of `targets` that sleep on their pipe (wake each with an empty message)."""
        words = self._words
        return [r for r in range(self.handle.num_readers)
                if words[r * _LINE + 1] and (targets == ALL or (targets >> r) & 1)]

    # -- reader ---------------------------------------------------------------------------
    def set_sleeping(self, on: bool) -> None:
        if self._bytes is not None:  # (not closed: a wait that raised may have shut it)
            self._words[self.reader * _LINE + 1] = int(on)

    def try_read(self):
        """The next message for this reader: bytes, PIPE (read it from the pipe), or None (not
        written yet). Messages for other readers are skipped."""
        h = self.handle
        words = self._words
        while True:
            m = self._read + 1
            w = self._slot[(m - 1) % h.num_slots]
            if words[w] != m:
                return None
            n, targets = words[w + 1], words[w + 2]
            mine = targets == ALL or (targets >> self.reader) & 1
            if mine:
                if n < 0:
                    out = PIPE
                else:
                    start = 8 * (w + _SLOT_HEADER)
                    out = bytes(self._bytes[start:start + n])
            self._read = m
            words[self.reader * _LINE] = m
            if mine:
                return out

    def read(self, check: Callable[[], None] | None = None,
             block: Callable[[float], None] | None = None):
        """The next message for this reader (waits: `wait_until`); `block(timeout)` waits for
        the pipe this reader's wake-ups come on."""
        if block is None:
            return wait_until(self.try_read, check)

        def sleep(timeout: float) -> None:
            self.set_sleeping(True)
            try:
                if not self.try_peek():
                    block(timeout)
            finally:
                self.set_sleeping(False)

        return wait_until(self.try_read, check, sleep)

    def try_peek(self) -> bool:
        """Whether the next message (for any reader) is written."""
        m = self._read + 1
        return self._words[self._slot[(m - 1) % self.handle.num_slots]] == m

    # -- end ------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmaps the block; the creator also unlinks it."""
        self._words.release()
        self._bytes = None
        try:
            self._shm.close()
        except BufferError:
            pass
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


SPIN_S = 1e-4  # poll this long, yielding the core, before blocking
BLOCK_S = 0.005  # the longest block between polls (a missed wake-up costs at most this)
CHECK_EVERY_S = 0.001


def wait_until(poll: Callable[[], object], check: Callable[[], None] | None = None,
               block: Callable[[float], None] | None = None):
    """poll()'s first result that is not None: polling for SPIN_S (yielding the core each
    round, `check` about every CHECK_EVERY_S: it raises to abandon the wait), then between
    polls `block(BLOCK_S)`; without `block` it keeps polling (the output rank while a step's
    tokens are on their way from the GPU: it sends them the moment they land)."""
    out = poll()
    if out is not None:
        return out
    now = time.perf_counter
    start = now()
    next_check = start + CHECK_EVERY_S
    while True:
        out = poll()
        if out is not None:
            return out
        t = now()
        if t >= next_check:
            if check is not None:
                check()
            next_check = t + CHECK_EVERY_S
        if block is None or t - start < SPIN_S:
            os.sched_yield()
        else:
            block(BLOCK_S)

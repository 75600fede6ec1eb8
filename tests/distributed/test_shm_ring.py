"""The shared-memory broadcast ring in one process: messages reach every reader in order across
wrap-arounds, a full ring refuses a write until its slowest reader has read, a message for
some readers is skipped by the others, a payload larger than a slot is marked for the pipe,
and the block is unlinked when the writer closes it."""

from __future__ import annotations

import os

import pytest

from krait.distributed.shm_ring import PIPE, ShmRing

pytestmark = pytest.mark.timeout(30)


def test_ring_order_targets_overflow_and_unlink() -> None:
    ring = ShmRing.create(2, num_slots=3, slot_bytes=16)
    readers = [ShmRing.attach(ring.handle, reader=r) for r in range(2)]
    try:
        for k in range(7):  # wraps the 3 slots twice
            assert ring.try_write(b"m%d" % k)
            assert [r.try_read() for r in readers] == [b"m%d" % k] * 2
        assert all(r.try_read() is None for r in readers)
        for k in range(3):
            assert ring.try_write(b"x%d" % k)
        assert not ring.try_write(b"full")  # nobody has read the oldest yet
        assert readers[0].try_read() == b"x0"
        assert not ring.try_write(b"full")  # reader 1 has not
        assert readers[1].try_read() == b"x0"
        assert ring.try_write(b"only-1", targets=1 << 1)
        assert [readers[0].try_read(), readers[0].try_read()] == [b"x1", b"x2"]
        assert readers[0].try_read() is None  # skipped the message for reader 1
        assert [readers[1].try_read() for _ in range(3)] == [b"x1", b"x2", b"only-1"]
        assert ring.write(b"y" * 17)  # larger than a slot: it goes on the pipes
        assert [r.try_read() for r in readers] == [PIPE, PIPE]
        readers[1].set_sleeping(True)
        assert ring.sleepers() == [1] and ring.sleepers(1 << 0) == []
    finally:
        for r in readers:
            r.close()
        ring.close()
    assert not os.path.exists(f"/dev/shm/{ring.handle.name}")

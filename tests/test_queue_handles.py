"""RowQueue handles: a closed queue's handle never reaches another queue,
however often its slot is reopened (issue 17, item 16)."""

from __future__ import annotations

import numpy as np
import pytest

import shmask
from shmask._native import lib

LAST_GENERATION = (1 << 32) - 1  # shm_queue.generation is a uint32


def set_generation(writer: shmask.Writer, slot: int, generation: int) -> None:
    """Test-only stand-in for reopening a closed slot many times: writes the
    generation into the Writer's private queue table (C memory of this
    process, not shared memory). The core has no API for it; billions of
    open+close calls would take hours."""
    queue = writer._ring.queues[slot]
    assert not queue.mode, "only a closed slot"
    queue.generation = generation


def append_one(writer: shmask.Writer, handle: int) -> None:
    writer.append_step(np.array([handle], np.int64), np.array([1], np.int32),
                       np.array([11], np.int32), np.zeros(1, np.float32))


def test_reopening_a_slot_2_pow_24_times_never_lets_a_stale_handle_append(writer):
    """A handle's generation was 24 bits: 2^24 reopenings of a slot (35 s of
    open+close) made a stale handle match the new queue and append into it.
    Now the handle carries the slot's whole 32-bit generation, and a slot
    whose generation would wrap retires: never reopened."""
    queues = [writer.open_queue("support") for _ in range(64)]  # the first table, full
    first = queues[0]
    slot, stale = first.slot, first.handle
    first.close()  # the only free slot: the next open takes it
    for generation in (1 << 24, LAST_GENERATION):  # the old field's wrap; the uint32's last
        set_generation(writer, slot, generation)
        victim = writer.open_queue("support")
        assert victim.slot == slot and victim.handle != stale
        with pytest.raises(shmask.InvalidRowsError, match="not the handle of an open RowQueue"):
            append_one(writer, stale)
        assert victim.rows == 0
        append_one(writer, victim.handle)  # the new queue's own handle works
        assert victim.rows == 1
        victim.close()
    # The slot's generations are spent: it is retired, and the next queue
    # gets a new slot (the table grows) instead of generation 0 again.
    assert int(writer._ring.n_free) == 0
    newcomer = writer.open_queue("support")
    assert newcomer.slot != slot and int(writer._ring.n_queues) == 128
    with pytest.raises(shmask.InvalidRowsError, match="not the handle of an open RowQueue"):
        append_one(writer, stale)
    for _ in range(200):  # reopenings cycle through the other free slots, never the retired one
        again = writer.open_queue("support")
        assert again.slot != slot
        again.close()
    assert newcomer.rows == 0


def test_a_full_queue_table_is_refused_clearly(writer):
    """2^16 slots, open or retired, is the table's limit: the next open
    raises a ShmaskError that says so (no handle is ever made from a reused
    generation). Each closed slot's generation is set to the last one, so
    its next open and close retires it."""
    slots = 1 << lib.SHM_HANDLE_SLOT_BITS
    assert slots == 1 << 16
    opens = 0
    with pytest.raises(shmask.ShmaskError, match="open or retired"):
        while opens < 4 * slots:  # bounded: a slot that never retires fails the test
            queue = writer.open_queue("selected")
            opens += 1
            queue.close()
            set_generation(writer, queue.slot, LAST_GENERATION)  # retired already, or next time
    assert int(writer._ring.n_queues) == slots and int(writer._ring.n_free) == 0
    assert opens == 2 * slots  # each slot: its first queue, then its last generation's

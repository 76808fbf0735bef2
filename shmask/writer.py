"""The producer side (a scheduler rank): one ring, many RowQueues.

Rows are staged per request in RowQueue buffers that live in the ring
itself; taking a queue publishes its buffer in place (no copy of the payload
at emission) and returns a ChunkRef. When the ring cannot hold a buffer,
even after reclaiming and waiting up to SHMASK_FULL_WAIT_MS, that queue
stages in private memory and its chunk travels inline in the ref: slower,
never wrong, never blocked forever.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._native import ffi, lib
from ._native_errors import raise_for
from .config import Config
from .errors import InvalidRowsError, ShmaskError
from .refs import (
    ENTRY_DTYPE,
    KIND_EMPTY,
    KIND_INLINE,
    KIND_SHM,
    MODE_SUPPORT,
    ChunkRef,
    RefBatch,
    mode_code,
    payload_bytes,
)
from .segment import Segment, collect_garbage

log = logging.getLogger("shmask")

_INITIAL_SLOTS = 64
_WARN_INTERVAL_S = 10.0


@dataclass
class WriterStats:
    """Counters of one Writer (`Writer.stats`)."""

    chunks: int = 0
    rows: int = 0
    payload_bytes: int = 0
    inline_chunks: int = 0
    inline_bytes: int = 0
    full_waits: int = 0
    expired: int = 0
    staging_moves: int = 0


class Writer:
    """Creates one ring segment and publishes chunks into it.

    Not thread-safe: one Writer belongs to one producer thread.
    """

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config.from_env()
        self.stats = WriterStats()
        self.segment: Segment | None = None
        self.epoch = secrets.randbits(63)
        self._capacity = 0
        self._base = ffi.NULL  # the ring's address; NULL under SHMASK_TRANSPORT=inline
        self._max_row = self.config.max_tokens
        self._full_wait_s = self.config.full_wait_ms / 1000.0
        self._lease_ns = int(self.config.lease_s * 1e9)
        self._last_warning = 0.0
        self._last_corruption_report = -_WARN_INTERVAL_S
        self._pending_warnings = 0
        if self.config.transport == "shm":
            collect_garbage(self.config.name_prefix)
            self._capacity = self.config.ring_capacity_bytes
            self.segment = Segment.create(self.config.name_prefix, self._capacity, self.epoch)
            self._base = self.segment.base
            self._view = np.frombuffer(self.segment.mapping, dtype=np.uint8)
        # The RowQueue table lives in C memory; the copy loop reads it directly.
        self._table = ffi.new("shm_queue[]", _INITIAL_SLOTS)
        self._table_size = _INITIAL_SLOTS
        self._free_slots = list(range(_INITIAL_SLOTS - 1, -1, -1))
        self._private: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._queues: dict[int, RowQueue] = {}
        self._restaging = -1
        self._source_cursor = ffi.new("uint64_t *")
        self._bad_row = ffi.new("int64_t *")
        self._position = ffi.new("uint64_t *")
        self._reclaim_result = ffi.new("shm_reclaim_result *")
        self._layout = ffi.new("shm_layout *")
        self.closed = False

    # ------------------------------------------------------------ identity
    @property
    def segment_name(self) -> str:
        return self.segment.name if self.segment else ""

    # ------------------------------------------------------ one-shot publish
    def publish(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                mode: str = "support") -> ChunkRef:
        """Publish one chunk (CSR rows of one request) by copying it in."""
        self._check_open()
        code = mode_code(mode)
        lengths = _as_array(lengths, np.int32, "lengths")
        ids = _as_array(ids, np.int32, "ids")
        logprobs = _as_array(logprobs, np.float32, "logprobs")
        rows, nnz = lengths.size, ids.size
        if lengths.ndim != 1 or ids.ndim != 1 or logprobs.ndim != 1:
            raise InvalidRowsError("publish takes 1-D lengths, ids and logprobs (CSR)")
        expected_logprobs = nnz if code == MODE_SUPPORT else rows
        if logprobs.size != expected_logprobs:
            raise InvalidRowsError(
                f"logprobs has {logprobs.size} values; {mode} mode needs {expected_logprobs}"
            )
        rc = lib.shm_validate_lengths(ffi.from_buffer("int32_t[]", lengths), rows, nnz,
                                      self._max_row)
        if rc:
            raise InvalidRowsError(
                f"lengths must be 0..{self._max_row} (SHMASK_MAX_TOKENS) and sum to "
                f"len(ids)={nnz}"
            )
        if rows == 0:
            return ChunkRef(KIND_EMPTY, code, "", 0, 0, 0, 0, 0, None)
        position = self._reserve(code, rows, nnz) if self.segment else None
        if position is None:
            payload = lengths.tobytes() + ids.tobytes() + logprobs.tobytes()
            return self._inline_ref(code, rows, nnz, payload)
        dest_lengths, dest_ids, dest_logprobs = self._record_arrays(position, code, rows, nnz)
        dest_lengths[:] = lengths
        dest_ids[:] = ids
        dest_logprobs[:] = logprobs
        return self._publish_record(position, code, rows, nnz)

    # ------------------------------------------------------------ RowQueues
    def open_queue(self, mode: str = "support") -> RowQueue:
        """A queue for one request's rows; close it when the request ends."""
        self._check_open()
        code = mode_code(mode)
        if not self._free_slots:
            self._grow_table()
        slot = self._free_slots.pop()
        entry = self._table[slot]
        ffi.memmove(ffi.addressof(entry), b"\0" * ffi.sizeof("shm_queue"), ffi.sizeof("shm_queue"))
        entry.mode = code
        entry.next_rows = self.config.queue_rows
        queue = RowQueue(self, slot, code)
        self._queues[slot] = queue
        return queue

    def append_step(self, queues: Sequence[RowQueue] | np.ndarray, lengths: np.ndarray,
                    ids: np.ndarray, logprobs: np.ndarray) -> None:
        """Append one decode step's rows: row i goes to queues[i].

        `queues` is a sequence of RowQueue or an int array of their slots (the
        fast path: engines keep a request -> slot table). `ids` is [B, W]
        padded (row i is ids[i, :lengths[i]]) or flat CSR (rows consecutive).
        `logprobs` has the shape of `ids` (support mode) or [B] (selected).
        """
        self._check_open()
        slots = _slots_array(queues)
        lengths = _as_array(lengths, np.int32, "lengths")
        ids = _as_array(ids, np.int32, "ids")
        logprobs = _as_array(logprobs, np.float32, "logprobs")
        batch = slots.size
        if lengths.shape != (batch,):
            raise InvalidRowsError(f"lengths has shape {lengths.shape}; expected ({batch},)")
        if batch == 0:
            return
        if ids.ndim == 2:
            if ids.shape[0] != batch:
                raise InvalidRowsError(f"ids has {ids.shape[0]} rows; expected {batch}")
            row_stride = ids.shape[1]
            if row_stride == 0:
                row_stride = 1  # every length must then be 0; stride only bounds them
        elif ids.ndim == 1:
            row_stride = 0
        else:
            raise InvalidRowsError(f"ids must be [B, W] or flat CSR, got shape {ids.shape}")
        first = self._queue_entry(int(slots[0]))
        mode = first.mode if first is not None else 0
        if mode == MODE_SUPPORT and logprobs.size != ids.size:
            raise InvalidRowsError(
                f"support mode: logprobs has {logprobs.size} values, ids has {ids.size}"
            )
        if mode != MODE_SUPPORT and logprobs.size != batch:
            raise InvalidRowsError(f"selected mode: logprobs must be [{batch}], got {logprobs.shape}")
        c_slots = ffi.from_buffer("int32_t[]", slots)
        c_lengths = ffi.from_buffer("int32_t[]", lengths)
        c_ids = ffi.from_buffer("int32_t[]", ids)
        c_logprobs = ffi.from_buffer("float[]", logprobs)
        self._source_cursor[0] = 0
        row = 0
        while True:
            done = lib.shm_append_step(
                self._base, self._table, self._table_size, c_slots, batch, c_lengths, c_ids,
                c_logprobs, row_stride, ids.size, logprobs.size, mode, self._max_row, row,
                self._source_cursor, self._bad_row,
            )
            if done == batch:
                return
            if done < 0:
                bad = int(self._bad_row[0])
                raise_for(int(done), f"append_step row {bad} (slot {int(slots[bad])}, "
                                     f"length {int(lengths[bad])})")
            row = int(done)
            self._grow_queue(int(slots[row]), int(lengths[row]))

    def take_batch(self, queues: Sequence[RowQueue], final: bool = False) -> RefBatch:
        """Take every queue (one emission): one RefBatch, entry i for queues[i].

        Ring buffers are published in place and each queue gets its next
        buffer, all in one native call; `final` drops the buffers instead
        (the requests ended)."""
        self._check_open()
        for queue in queues:
            if queue.writer is not self or queue.closed:
                raise ShmaskError(f"{queue!r} is closed or belongs to another Writer")
        entries, inline_chunks = self._take_into_entries(_slots_array(queues), final)
        segments = [(self.segment_name, self.epoch)] if self.segment else []
        self.reclaim()
        return RefBatch.build(segments, entries, inline_chunks)

    # ------------------------------------------------------------ lifecycle
    def reclaim(self, move_staging: bool = False) -> None:
        """Return released (and lease-expired) records to the ring. With
        `move_staging`, queue buffers that block the tail are moved out of
        the way (to the head, else to private memory), each at most once."""
        if self.segment is None:
            return
        moved: set[int] = set()
        while True:
            lib.shm_reclaim(self._base, time.monotonic_ns(), self._lease_ns, self._reclaim_result)
            result = self._reclaim_result
            if result.expired:
                self.stats.expired += int(result.expired)
                log.warning("reclaimed %d chunk(s) not released within SHMASK_LEASE_S=%s",
                            int(result.expired), self.config.lease_s)
            if result.blocked_state == lib.SHM_STATE_CORRUPT:
                self._report_corruption(int(result.blocked_position))
            if not move_staging or result.blocked_state != lib.SHM_STATE_STAGING:
                return
            position = int(result.blocked_position)
            slot = int(lib.shm_staging_owner(self._base, position))
            if slot in moved or not self._move_staging(slot, position):
                return
            moved.add(slot)

    def _report_corruption(self, position: int) -> None:
        # Only a process that maps the ring writable can do this; the ring
        # stops reclaiming there (chunks then go inline) rather than guess.
        now = time.monotonic()
        if now - self._last_corruption_report >= _WARN_INTERVAL_S:
            log.error("ring %s: record header at position %d was overwritten; reclaim "
                      "stopped there", self.segment_name, position)
            self._last_corruption_report = now

    def close(self) -> None:
        """Close every queue and unlink the segment. Readers that still hold
        views keep their pages; new opens of this segment fail cleanly."""
        if self.closed:
            return
        for queue in list(self._queues.values()):
            queue.close()
        self.closed = True
        if self.segment is not None:
            self.segment.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ring_usage(self) -> tuple[int, int]:
        """(bytes in use between tail and head, ring capacity)."""
        if self.segment is None:
            return 0, 0
        return int(lib.shm_load_head(self._base) - lib.shm_load_tail(self._base)), self._capacity

    # ------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self.closed:
            raise ShmaskError("Writer is closed")

    def _queue_entry(self, slot: int):  # type: ignore[no-untyped-def]
        if 0 <= slot < self._table_size and self._table[slot].mode:
            return self._table[slot]
        return None

    def _grow_table(self) -> None:
        size = self._table_size * 2
        table = ffi.new("shm_queue[]", size)
        ffi.memmove(table, self._table, ffi.sizeof("shm_queue") * self._table_size)
        self._free_slots.extend(range(size - 1, self._table_size - 1, -1))
        self._table, self._table_size = table, size

    def _reserve(self, mode: int, rows_capacity: int, nnz_capacity: int) -> int | None:
        """A ring record for a one-shot chunk, or None (the chunk goes inline)."""
        position = self._position
        if self._wait_for_room(
            lambda: lib.shm_reserve(self._base, mode, rows_capacity, nnz_capacity, position)
        ):
            return int(position[0])
        return None

    def _wait_for_room(self, attempt) -> bool:  # type: ignore[no-untyped-def]
        """Full-ring policy: try; reclaim and retry until SHMASK_FULL_WAIT_MS
        has passed; False means the caller falls back to inline."""
        rc = attempt()
        if rc == lib.SHM_OK:
            return True
        if rc != lib.SHM_FULL:
            return False  # larger than the whole ring
        self.stats.full_waits += 1
        deadline = time.monotonic() + self._full_wait_s
        pause = 0.0001
        while True:
            self.reclaim(move_staging=True)
            if attempt() == lib.SHM_OK:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.005)

    def _record_arrays(self, position: int, mode: int, rows_capacity: int,
                       nnz_capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lib.shm_record_layout(mode, rows_capacity, nnz_capacity, self._layout)
        start = int(ffi.cast("char *", lib.shm_record_address(self._base, position))
                    - ffi.cast("char *", self._base))
        layout = self._layout
        n_logprobs = nnz_capacity if mode == MODE_SUPPORT else rows_capacity
        view = self._view
        lengths = view[start + layout.lengths_offset:][:4 * rows_capacity].view(np.int32)
        ids = view[start + layout.ids_offset:][:4 * nnz_capacity].view(np.int32)
        logprobs = view[start + layout.logprobs_offset:][:4 * n_logprobs].view(np.float32)
        return lengths, ids, logprobs

    def _publish_record(self, position: int, mode: int, rows: int, nnz: int) -> ChunkRef:
        rc = lib.shm_publish(self._base, position, rows, nnz, time.monotonic_ns())
        if rc:
            raise_for(rc, f"publish at position {position}")
        # The record's size comes from the producer's own numbers, never from
        # a value read back out of shared memory.
        lib.shm_record_layout(mode, rows, nnz, self._layout)
        self._count(rows, nnz, mode)
        return ChunkRef(KIND_SHM, mode, self.segment_name, self.epoch, position,
                        int(self._layout.record_bytes), rows, nnz, None)

    def _count(self, rows: int, nnz: int, mode: int) -> None:
        self.stats.chunks += 1
        self.stats.rows += rows
        self.stats.payload_bytes += int(payload_bytes(mode, rows, nnz))

    def _inline_ref(self, mode: int, rows: int, nnz: int, payload: bytes) -> ChunkRef:
        self._count(rows, nnz, mode)
        self.stats.inline_chunks += 1
        self.stats.inline_bytes += len(payload)
        if self.config.transport == "shm":
            self._warn_inline()
        return ChunkRef(KIND_INLINE, mode, "", 0, 0, len(payload), rows, nnz,
                        memoryview(payload))

    def _warn_inline(self) -> None:
        # Bounded rate: one line per interval, with the count since the last.
        self._pending_warnings += 1
        now = time.monotonic()
        if now - self._last_warning >= _WARN_INTERVAL_S:
            log.warning("ring full: %d chunk(s) sent inline since the last report "
                        "(raise SHMASK_RING_MB or release chunks sooner)", self._pending_warnings)
            self._last_warning = now
            self._pending_warnings = 0

    # ---- queue buffers (the fast paths are in the native core)
    def _grow_queue(self, slot: int, extra_nnz: int) -> None:
        """Slow path of append_step: the ring had no room for this queue's
        larger buffer right away. Wait for room, else stage privately."""
        capacities = ffi.new("uint64_t[2]")
        lib.shm_queue_grown_capacities(ffi.addressof(self._table[slot]), extra_nnz, capacities,
                                       capacities + 1)
        rows_capacity, nnz_capacity = int(capacities[0]), int(capacities[1])
        self._restage(slot, rows_capacity, nnz_capacity, wait=True)

    def _restage(self, slot: int, rows_capacity: int, nnz_capacity: int, wait: bool) -> None:
        """Give queue `slot` a buffer of these capacities, keeping its rows: in
        the ring if it has room (after the full-ring wait when `wait`), else
        in private memory. A queue already in private memory stays there
        until its next take (its chunk goes inline; the next starts afresh)."""
        entry = self._table[slot]
        staged_privately = not entry.in_ring and entry.rows_capacity
        if self.segment is not None and not staged_privately:
            self._restaging = slot  # reclaim must not move this queue meanwhile
            try:
                attempt = lambda: lib.shm_queue_restage(  # noqa: E731
                    self._base, ffi.addressof(entry), slot, rows_capacity, nnz_capacity)
                placed = self._wait_for_room(attempt) if wait else attempt() == lib.SHM_OK
            finally:
                self._restaging = -1
            if placed:
                self._private.pop(slot, None)
                return
        n_logprobs = nnz_capacity if entry.mode == MODE_SUPPORT else rows_capacity
        arrays = (np.empty(rows_capacity, np.int32), np.empty(nnz_capacity, np.int32),
                  np.empty(n_logprobs, np.float32))
        lib.shm_queue_move(self._base, ffi.addressof(entry),
                           *(ffi.cast(t, a.ctypes.data) for t, a in
                             zip(("int32_t *", "int32_t *", "float *"), arrays, strict=True)),
                           rows_capacity, nnz_capacity)
        self._private[slot] = arrays  # after the copy: the old arrays may go now

    def _move_staging(self, slot: int, position: int) -> bool:
        """Move queue `slot`'s staging buffer (it blocks the ring's tail at
        `position`) to the head if there is room, else to private memory."""
        if slot == self._restaging or self._queue_entry(slot) is None:
            return False
        entry = self._table[slot]
        if not entry.in_ring or entry.position != position:
            return False  # the owner field (shared memory) disagrees with our table
        self.stats.staging_moves += 1
        self._restage(slot, int(entry.rows_capacity), int(entry.nnz_capacity), wait=False)
        return True

    def _take_into_entries(self, slots: np.ndarray,
                           final: bool) -> tuple[np.ndarray, list[bytes]]:
        count = slots.size
        kind = np.zeros(count, np.uint8)
        position = np.zeros(count, np.uint64)
        record_bytes = np.zeros(count, np.uint64)
        rows = np.zeros(count, np.uint32)
        nnz = np.zeros(count, np.uint64)
        mode = np.zeros(count, np.uint8)
        inline_chunks: list[bytes] = []
        inline_offset = 0
        start = 0
        outputs = [ffi.from_buffer(ctype, array) for ctype, array in (
            ("int32_t[]", slots), ("uint8_t[]", kind), ("uint8_t[]", mode),
            ("uint64_t[]", position), ("uint64_t[]", record_bytes), ("uint32_t[]", rows),
            ("uint64_t[]", nnz))]
        now = time.monotonic_ns()
        while start < count:
            done = lib.shm_take_queues(self._base, self._table, self._table_size, outputs[0], count,
                                       start, now, int(final), *outputs[1:])
            if done < 0:
                raise_for(int(done), "take")
            if done == count:
                break
            i = int(done)  # a queue in private memory: its chunk goes inline
            ref = self._take_private(int(slots[i]))
            kind[i], mode[i], rows[i], nnz[i] = KIND_INLINE, ref.mode, ref.rows, ref.nnz
            assert ref.payload is not None
            position[i], record_bytes[i] = inline_offset, len(ref.payload)
            inline_chunks.append(bytes(ref.payload))
            inline_offset += len(ref.payload)
            start = i + 1
        shm = kind == KIND_SHM
        if shm.any():
            self.stats.chunks += int(shm.sum())
            self.stats.rows += int(rows[shm].sum())
            self.stats.payload_bytes += int(payload_bytes(mode[shm], rows[shm].astype(np.uint64),
                                                          nnz[shm]).sum())
        entries = np.zeros(count, dtype=ENTRY_DTYPE)
        entries["kind"], entries["mode"], entries["rows"], entries["nnz"] = kind, mode, rows, nnz
        entries["position"], entries["record_bytes"] = position, record_bytes
        return entries, inline_chunks

    def _take_private(self, slot: int) -> ChunkRef:
        entry = self._table[slot]
        rows, nnz, mode = int(entry.rows), int(entry.nnz), int(entry.mode)
        lengths, ids, logprobs = self._private.pop(slot)
        n_logprobs = nnz if mode == MODE_SUPPORT else rows
        payload = b"".join((lengths[:rows].tobytes(), ids[:nnz].tobytes(),
                            logprobs[:n_logprobs].tobytes()))
        entry.next_rows, entry.next_nnz = rows + rows // 4 + 1, nnz + nnz // 4 + 1
        lib.shm_queue_drop(ffi.NULL, ffi.addressof(entry))
        return self._inline_ref(mode, rows, nnz, payload)

    def _close_queue(self, queue: RowQueue) -> None:
        entry = self._table[queue.slot]
        lib.shm_queue_drop(self._base, ffi.addressof(entry))
        self._private.pop(queue.slot, None)
        entry.mode = 0
        self._queues.pop(queue.slot, None)
        self._free_slots.append(queue.slot)


class RowQueue:
    """One request's rows since its last take (scheduler side)."""

    __slots__ = ("writer", "slot", "mode", "closed")

    def __init__(self, writer: Writer, slot: int, mode: int) -> None:
        self.writer = writer
        self.slot = slot
        self.mode = mode
        self.closed = False

    def append(self, ids: np.ndarray, logprobs: np.ndarray | float) -> None:
        """Append one row (a convenience; engines use Writer.append_step)."""
        ids = _as_array(ids, np.int32, "ids")
        if ids.ndim != 1:
            raise InvalidRowsError(f"a row's ids must be 1-D, got shape {ids.shape}")
        logprobs_array = np.atleast_1d(_as_array(logprobs, np.float32, "logprobs"))
        self.writer.append_step(np.array([self.slot], np.int32), np.array([ids.size], np.int32),
                                ids, logprobs_array)

    def take(self, final: bool = False) -> ChunkRef:
        """Publish the rows appended since the last take, in place."""
        return self.writer.take_batch([self], final)[0]

    @property
    def rows(self) -> int:
        return int(self.writer._table[self.slot].rows)

    def close(self) -> None:
        """Drop unpublished rows and free the slot (the request ended)."""
        if not self.closed:
            self.closed = True
            self.writer._close_queue(self)

    def __repr__(self) -> str:
        return f"RowQueue(slot={self.slot}, rows={self.rows if not self.closed else 'closed'})"


def _as_array(value: object, dtype: type, name: str) -> np.ndarray:
    try:
        array = np.ascontiguousarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidRowsError(f"{name} cannot be read as {np.dtype(dtype).name}: {exc}") from None
    return array


def _slots_array(queues: Sequence[RowQueue] | np.ndarray) -> np.ndarray:
    if isinstance(queues, np.ndarray):
        if queues.dtype.kind not in "iu":
            raise InvalidRowsError(f"slots must be an integer array, got {queues.dtype}")
        return np.ascontiguousarray(queues, dtype=np.int32).ravel()
    return np.fromiter((q.slot for q in queues), dtype=np.int32, count=len(queues))

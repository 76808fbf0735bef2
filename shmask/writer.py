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
        self._max_row = self.config.max_tokens
        self._full_wait_s = self.config.full_wait_ms / 1000.0
        self._lease_ns = int(self.config.lease_s * 1e9)
        self._last_warning = 0.0
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
        self._staging_at: dict[int, int] = {}  # ring position -> slot (staging buffers)
        self._next_size: dict[int, tuple[int, int]] = {}  # slot -> (rows, nnz) hint
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
        return self._publish_record(position, code, rows, nnz, rows, nnz)

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
                self._table, self._table_size, c_slots, batch, c_lengths, c_ids, c_logprobs,
                row_stride, ids.size, logprobs.size, mode, self._max_row, row,
                self._source_cursor, self._bad_row,
            )
            if done == batch:
                return
            if done < 0:
                bad = int(self._bad_row[0])
                raise_for(int(done), f"append_step row {bad} (slot {int(slots[bad])}, "
                                     f"length {int(lengths[bad])})")
            row = int(done)
            self._grow_queue(int(slots[row]), 1, int(lengths[row]))

    def take_batch(self, queues: Sequence[RowQueue], final: bool = False) -> RefBatch:
        """Take every queue (one emission): one RefBatch, entry i for queues[i]."""
        self._check_open()
        entries = np.zeros(len(queues), dtype=ENTRY_DTYPE)
        inline_chunks: list[bytes] = []
        inline_offset = 0
        for i, queue in enumerate(queues):
            ref = self._take(queue, final)
            entry = entries[i]
            entry["kind"], entry["mode"], entry["rows"], entry["nnz"] = (
                ref.kind, ref.mode, ref.rows, ref.nnz)
            if ref.kind == KIND_SHM:
                entry["position"], entry["record_bytes"] = ref.position, ref.record_bytes
            elif ref.kind == KIND_INLINE:
                assert ref.payload is not None
                entry["position"], entry["record_bytes"] = inline_offset, len(ref.payload)
                inline_chunks.append(bytes(ref.payload))
                inline_offset += len(ref.payload)
        segments = [(self.segment_name, self.epoch)] if self.segment else []
        self.reclaim()
        return RefBatch.build(segments, entries, inline_chunks)

    # ------------------------------------------------------------ lifecycle
    def reclaim(self) -> None:
        """Return released (and lease-expired) records to the ring."""
        if self.segment is None:
            return
        while True:
            lib.shm_reclaim(self._base, time.monotonic_ns(), self._lease_ns, self._reclaim_result)
            result = self._reclaim_result
            if result.expired:
                self.stats.expired += int(result.expired)
                log.warning("reclaimed %d chunk(s) not released within SHMASK_LEASE_S=%s",
                            int(result.expired), self.config.lease_s)
            if result.blocked_state != lib.SHM_STATE_STAGING:
                return
            # A queue still filling blocks the tail: move it so reclaim goes on.
            if not self._move_staging(int(result.blocked_position)):
                return

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
        """A ring record for this many rows, or None (the chunk goes inline)."""
        rc = lib.shm_reserve(self._base, mode, rows_capacity, nnz_capacity, self._position)
        if rc == lib.SHM_OK:
            return int(self._position[0])
        if rc != lib.SHM_FULL:
            return None  # larger than the whole ring
        deadline = time.monotonic() + self._full_wait_s
        pause = 0.0001
        self.stats.full_waits += 1
        while True:
            self.reclaim()
            rc = lib.shm_reserve(self._base, mode, rows_capacity, nnz_capacity, self._position)
            if rc == lib.SHM_OK:
                return int(self._position[0])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
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

    def _publish_record(self, position: int, mode: int, rows: int, nnz: int,
                        rows_capacity: int, nnz_capacity: int) -> ChunkRef:
        rc = lib.shm_publish(self._base, position, rows, nnz, time.monotonic_ns())
        if rc:
            raise_for(rc, f"publish at position {position}")
        # The record's size comes from the producer's own capacities, never
        # from a value read back out of shared memory.
        lib.shm_record_layout(mode, rows_capacity, nnz_capacity, self._layout)
        self.stats.chunks += 1
        self.stats.rows += rows
        self.stats.payload_bytes += 4 * (rows + nnz + (nnz if mode == MODE_SUPPORT else rows))
        return ChunkRef(KIND_SHM, mode, self.segment_name, self.epoch, position,
                        int(self._layout.record_bytes), rows, nnz, None)

    def _inline_ref(self, mode: int, rows: int, nnz: int, payload: bytes) -> ChunkRef:
        self.stats.chunks += 1
        self.stats.rows += rows
        self.stats.payload_bytes += len(payload)
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

    # ---- queue buffers
    def _grow_queue(self, slot: int, extra_rows: int, extra_nnz: int) -> None:
        entry = self._table[slot]
        rows_needed = int(entry.rows) + extra_rows
        nnz_needed = int(entry.nnz) + extra_nnz
        hint_rows, hint_nnz = self._next_size.get(slot, (self.config.queue_rows, 0))
        rows_capacity = max(int(entry.rows_capacity) * 2, rows_needed, hint_rows)
        per_row = max(extra_nnz, 1)
        nnz_capacity = max(int(entry.nnz_capacity) * 2, nnz_needed, hint_nnz,
                           per_row * rows_capacity if entry.nnz_capacity == 0 else 0)
        if entry.rows_capacity and rows_needed <= entry.rows_capacity:
            rows_capacity = int(entry.rows_capacity)  # only the ids need room
        if entry.nnz_capacity and nnz_needed <= entry.nnz_capacity:
            nnz_capacity = int(entry.nnz_capacity)
        self._restage(slot, rows_capacity, nnz_capacity)

    def _restage(self, slot: int, rows_capacity: int, nnz_capacity: int,
                 wait: bool = True) -> None:
        """Give queue `slot` a new buffer of these capacities, keeping its rows:
        in the ring if it has room (after reclaim and the full wait when
        `wait`), else in private memory."""
        mode = int(self._table[slot].mode)
        position = None
        if self.segment is not None:
            self._restaging = slot  # reclaim must not move this queue meanwhile
            try:
                if wait:
                    position = self._reserve(mode, rows_capacity, nnz_capacity)
                elif lib.shm_reserve(self._base, mode, rows_capacity, nnz_capacity,
                                     self._position) == lib.SHM_OK:
                    position = int(self._position[0])
            finally:
                self._restaging = -1
        old = ffi.new("shm_queue *", self._table[slot])
        old_private = self._private.pop(slot, None)
        entry = self._table[slot]
        if position is not None:
            lengths, ids, logprobs = self._record_arrays(position, mode, rows_capacity,
                                                         nnz_capacity)
            entry.in_ring, entry.position = 1, position
            self._staging_at[position] = slot
        else:
            n_logprobs = nnz_capacity if mode == MODE_SUPPORT else rows_capacity
            lengths = np.empty(rows_capacity, np.int32)
            ids = np.empty(nnz_capacity, np.int32)
            logprobs = np.empty(n_logprobs, np.float32)
            self._private[slot] = (lengths, ids, logprobs)
            entry.in_ring, entry.position = 0, 0
        entry.lengths = ffi.cast("int32_t *", lengths.ctypes.data)
        entry.ids = ffi.cast("int32_t *", ids.ctypes.data)
        entry.logprobs = ffi.cast("float *", logprobs.ctypes.data)
        entry.rows_capacity, entry.nnz_capacity = rows_capacity, nnz_capacity
        if old.rows_capacity:
            lib.shm_copy_queue(old, entry)
        else:
            entry.rows, entry.nnz = 0, 0
        if old.in_ring and old.rows_capacity:
            self._staging_at.pop(int(old.position), None)
            lib.shm_discard(self._base, old.position)
        del old_private  # the private arrays may go now that the rows are copied

    def _move_staging(self, position: int) -> bool:
        """Move the staging buffer at the ring's tail out of the way: to the
        head if there is room, else to private memory. False if unknown."""
        slot = self._staging_at.get(position)
        if slot is None or slot == self._restaging:
            return False
        entry = self._table[slot]
        self.stats.staging_moves += 1
        self._restage(slot, int(entry.rows_capacity), int(entry.nnz_capacity), wait=False)
        return True

    def _take(self, queue: RowQueue, final: bool) -> ChunkRef:
        if queue.writer is not self or queue.closed:
            raise ShmaskError(f"{queue!r} is closed or belongs to another Writer")
        slot = queue.slot
        entry = self._table[slot]
        rows, nnz, mode = int(entry.rows), int(entry.nnz), int(entry.mode)
        if rows == 0:
            if final:
                self._drop_buffer(slot)
            return ChunkRef(KIND_EMPTY, mode, "", 0, 0, 0, 0, 0, None)
        # Next emission's buffer: this one's size with 25% slack, so steady
        # decoding needs no doubling at all.
        self._next_size[slot] = (rows + rows // 4 + 1, nnz + nnz // 4 + 1)
        if entry.in_ring:
            position = int(entry.position)
            ref = self._publish_record(position, mode, rows, nnz, int(entry.rows_capacity),
                                       int(entry.nnz_capacity))
            self._staging_at.pop(position, None)
        else:
            lengths, ids, logprobs = self._private.pop(slot)
            n_logprobs = nnz if mode == MODE_SUPPORT else rows
            payload = lengths[:rows].tobytes() + ids[:nnz].tobytes() + logprobs[:n_logprobs].tobytes()
            ref = self._inline_ref(mode, rows, nnz, payload)
        entry.rows = entry.nnz = entry.rows_capacity = entry.nnz_capacity = 0
        entry.in_ring = entry.position = 0
        return ref

    def _drop_buffer(self, slot: int) -> None:
        entry = self._table[slot]
        if entry.in_ring and entry.rows_capacity:
            self._staging_at.pop(int(entry.position), None)
            lib.shm_discard(self._base, entry.position)
        self._private.pop(slot, None)
        entry.rows = entry.nnz = entry.rows_capacity = entry.nnz_capacity = 0
        entry.in_ring = entry.position = 0

    def _close_queue(self, queue: RowQueue) -> None:
        self._drop_buffer(queue.slot)
        self._table[queue.slot].mode = 0
        self._next_size.pop(queue.slot, None)
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
        self.writer._check_open()
        return self.writer._take(self, final)

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

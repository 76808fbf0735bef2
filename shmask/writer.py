"""The producer side (a scheduler rank): one ring, many RowQueues.

Rows are staged per request in RowQueue buffers that live in the ring
itself; taking a queue publishes its buffer in place (no copy of the payload
at emission) and returns a ChunkRef. When the ring cannot hold a buffer,
even after reclaiming and waiting up to SHMASK_FULL_WAIT_MS (once per call,
however many queues need room), that queue stages in private memory and its
chunk travels inline in the ref: slower, never wrong, never blocked forever.

The ring's geometry, positions and the queue table live in a C struct
(shm_ring) that only the native core writes; this module decides policy
(when to wait, when to go inline, what to log).
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from . import metrics
from ._native import ffi, lib
from ._native_errors import raise_for
from .config import Config
from .device_port import DeviceAttachment
from .errors import InvalidRowsError, SegmentError, ShmaskError
from .layout import ROW_BITMASK, ROW_FORM_SHIFT, ROW_INVALID, ROW_OK
from .refs import (
    ENTRY_DTYPE,
    ID_RULE,
    KIND_EMPTY,
    KIND_INLINE,
    KIND_SHM,
    MODE_SUPPORT,
    ChunkRef,
    RefBatch,
    mode_code,
    pack_payload,
    payload_bytes,
)
from .segment import Segment, collect_garbage, host_id, process_start_ticks

log = logging.getLogger("shmask")

_WARN_INTERVAL_S = 10.0
_SLOT_MASK = (1 << lib.SHM_HANDLE_SLOT_BITS) - 1  # a handle's low bits: its queue slot
_INT64 = np.dtype(np.int64)


@dataclass
class WriterStats:
    """Counters of one Writer (`Writer.stats`)."""

    chunks: int = 0
    rows: int = 0
    payload_bytes: int = 0
    inline_chunks: int = 0
    inline_bytes: int = 0
    inline_configured: int = 0  # SHMASK_TRANSPORT=inline: every chunk, by choice
    inline_ring_full: int = 0  # no room after the full-ring wait
    inline_oversize: int = 0  # larger than the whole ring
    inline_ring_lost: int = 0  # the segment was truncated by another process
    full_waits: int = 0
    expired: int = 0
    staging_moves: int = 0
    aborted_chunks: int = 0


class _RateLimitedWarning:
    """One log line per interval, with the count since the last line."""

    def __init__(self, message: str, level: int = logging.WARNING) -> None:
        self.message = message
        self.level = level
        self.pending = 0
        self.last = -_WARN_INTERVAL_S

    def add(self, count: int, *args: object) -> bool:
        """Count `count` events; True when this call wrote the line."""
        self.pending += count
        now = time.monotonic()
        if now - self.last < _WARN_INTERVAL_S:
            return False
        log.log(self.level, self.message, self.pending, *args)
        self.last = now
        self.pending = 0
        return True


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _device_quiesced(method: Callable[Concatenate[Writer, _P], _R]
                     ) -> Callable[Concatenate[Writer, _P], _R]:
    """For a method that changes queues on the CPU: while a publisher is
    attached and the GPU owns the queues, the method runs inside its
    quiesced() (the last kernel finished and its diverted rows appended
    first, no kernel stores until the method returns). A closed Writer's
    method runs as it is: it raises or does nothing on its own, and a
    forked child has no GPU of ours to wait for."""

    @functools.wraps(method)
    def call(self: Writer, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        direct = self._direct
        if direct is None or direct.quiet or self.closed:
            return method(self, *args, **kwargs)
        with direct.quiesced():
            return method(self, *args, **kwargs)

    return call


class Writer:
    """Creates one ring segment and publishes chunks into it.

    Not thread-safe: one Writer belongs to one producer thread, in the
    process that built it (a forked child gets ShmaskError: make a new
    Writer there). A Writer collected without close() gives its ring back.
    """

    def __init__(self, config: Config | None = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"Writer takes a shmask.Config (or None: from the environment), "
                            f"got {type(config).__name__}")
        self.config = config or Config.from_env()
        self.stats = WriterStats()
        self._synced = WriterStats()  # what the metrics were last told
        self.segment: Segment | None = None
        self.epoch = secrets.randbits(63)
        # True once closed, or in a forked child (_refuse_in_forked_child):
        # the one check every call makes, so refusing a child costs nothing.
        self.closed = False
        self._pid = os.getpid()
        self._max_tokens = self.config.max_tokens
        self._full_wait_s = self.config.full_wait_ms / 1000.0
        self._lease_ns = int(self.config.lease_s * 1e9)
        self._deadline: float | None = None  # one full-ring wait per public call
        self._growing = -1  # the slot being grown: reclaim must not move it meanwhile
        self._next_fstat = 0.0  # when _check_segment may fstat the segment again
        self._ring_lost = False  # the ring was cut and that was logged
        self._inline_warning = _RateLimitedWarning(
            "%d chunk(s) sent inline instead of through the ring since the last report "
            "(%s; raise SHMASK_RING_MB or release chunks sooner)")
        self._inline_pending: dict[str, int] = {}
        self._expiry_warning = _RateLimitedWarning(
            "reclaimed %d chunk(s) not released within SHMASK_LEASE_S=%s since the last report")
        self._corruption_error = _RateLimitedWarning(
            "%d time(s): a record header in ring %s was overwritten by another process; "
            "reclaim stopped there (chunks go inline)", logging.ERROR)
        # The ring struct (and the queue table it owns) is C memory; freed
        # with the Writer even if close() is never called.
        self._ring = ffi.gc(ffi.new("shm_ring *"), lib.shm_ring_free)
        base, size, capacity = ffi.NULL, 0, 0
        if self.config.transport == "shm":
            collect_garbage(self.config.name_prefix)
            capacity = self.config.ring_capacity_bytes
            self.segment = Segment.create(self.config.name_prefix, capacity)
            base, size = self.segment.base, self.segment.size
            self._view = np.frombuffer(self.segment.buffer, dtype=np.uint8)
        rc = lib.shm_ring_init(self._ring, base, size, capacity, self.epoch, os.getpid(),
                               process_start_ticks(os.getpid()), time.time_ns(),
                               secrets.randbits(15), secrets.randbits(64))
        if rc != lib.SHM_OK:
            if self.segment is not None:
                self.segment.close()
            raise SegmentError(f"ring of {capacity} bytes rejected by the native core ({rc})")
        # Dropped without close(): the ring's private buffers, then its name
        # and mapping go with the Writer (views readers hold stay valid).
        # Not at interpreter exit (atexit unlinks the name then): an exit
        # handler of the host may still use the Writer.
        weakref.finalize(self, _give_back, self._ring, self.segment).atexit = False
        _WRITERS.add(self)
        self._queues: dict[int, RowQueue] = {}
        # The DeviceAttachment (kernels.direct.DirectPublisher) publishing
        # into this ring, if any: the GPU then owns the queues' counts
        # between steps, so every CPU change of a queue runs inside
        # _device_quiesced() (attach_direct, shmask/device_port.py).
        self._direct: DeviceAttachment | None = None
        # The DirectPublisher that kernels.publisher_for gives for this Writer
        # (active or taking the CPU path); an attribute, so the two are
        # collected together.
        self._publisher: Any = None
        self._bad_row = ffi.new("int64_t *")
        self._position = ffi.new("uint64_t *")
        self._given_back = ffi.new("uint64_t *")
        self._reclaim_result = ffi.new("shm_reclaim_result *")
        self._layout = ffi.new("shm_layout *")
        self._any_flags = ffi.new("uint32_t *")
        self._seal = ffi.new("uint64_t *")
        self._take_totals = ffi.new("shm_take_totals *")

    # ------------------------------------------- the device port (DevicePort)
    @property
    def ring_handle(self) -> Any:
        """The native ``shm_ring *`` (the GPU-direct calls take it)."""
        return self._ring

    @property
    def attached(self) -> DeviceAttachment | None:
        return self._direct

    def attach_direct(self, publisher: DeviceAttachment) -> None:
        if self._direct is not None:
            raise ValueError("this Writer already has a DirectPublisher; close that one first")
        self._direct = publisher

    def detach_direct(self, publisher: DeviceAttachment) -> None:
        if self._direct is publisher:
            self._direct = None
            if not self.closed:  # the CPU path sizes buffers from the rows again
                lib.shm_direct_forget_sizes(self._ring)
        if self._publisher is publisher:
            self._publisher = None

    @property
    def default_publisher(self) -> Any:
        return self._publisher

    @default_publisher.setter
    def default_publisher(self, publisher: Any) -> None:
        self._publisher = publisher

    # ------------------------------------------------------------ identity
    @property
    def segment_name(self) -> str:
        return self.segment.name if self.segment else ""

    # ------------------------------------------------------ one-shot publish
    def publish(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                mode: str = "support") -> ChunkRef:
        """Publish one chunk (CSR rows of one request) by copying it in."""
        self._begin_call()
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
        rc = lib.shm_validate_rows(ffi.from_buffer("int32_t[]", lengths), ffi.NULL,
                                   ffi.from_buffer("int32_t[]", ids), rows, nnz, nnz, 0,
                                   self._max_tokens, 1, self._any_flags)
        if rc:
            _raise_if_negative_ids(ids, "publish")
            raise InvalidRowsError(
                f"lengths must be 0..{self._max_tokens} (SHMASK_MAX_TOKENS) and sum to "
                f"len(ids)={nnz}"
            )
        if rows == 0:
            return ChunkRef(KIND_EMPTY, code, "", 0, 0, 0, 0, 0, None)
        # One-shot chunks are CSR: every row an OK ids row, so words == nnz.
        position = self._reserve(code, rows, nnz) if self.segment else None
        if position is None:
            payload = pack_payload(lengths, None, ids, logprobs)
            ref = self._inline_ref(code, rows, nnz, nnz, 0, payload,
                                   self._inline_reason(code, rows, nnz, nnz))
        else:
            try:
                dest_lengths, dest_flags, dest_ids, dest_logprobs = self._record_arrays(
                    position, code, rows, nnz)
                dest_lengths[:] = lengths
                dest_flags[:] = 0
                dest_ids[:] = ids
                dest_logprobs[:] = logprobs
            except BaseException:
                # (KeyboardInterrupt included) a record left STAGING would
                # block reclaim for good.
                lib.shm_discard_record(self._ring, position)
                raise
            try:
                if self.segment is not None and self.segment.truncated:
                    raise SegmentError("truncated during the copy")  # the guard saw a fault
                ref = self._publish_record(position, code, rows, nnz)
            except ShmaskError:
                self._check_segment(force=True)
                if not self._ring.dead:
                    raise
                payload = pack_payload(lengths, None, ids, logprobs)
                ref = self._inline_ref(code, rows, nnz, nnz, 0, payload, "ring_lost")
        if metrics.enabled():
            metrics.sync(self.stats, self._synced, self.ring_usage(), self.segment_name)
        return ref

    # ------------------------------------------------------------ RowQueues
    def open_queue(self, mode: str = "support") -> RowQueue:
        """A queue for one request's rows; close (or abort) it when the
        request ends."""
        self._check_open()
        code = mode_code(mode)
        handle = int(lib.shm_queue_open(self._ring, code, self.config.queue_rows))
        if handle < 0:
            raise_for(handle, "open_queue")
        queue = RowQueue(self, handle, code)
        self._queues[queue.slot] = queue
        return queue

    @_device_quiesced  # the GPU's rows first, then these
    def append_step(self, queues: Sequence[RowQueue] | np.ndarray, lengths: np.ndarray,
                    ids: np.ndarray, logprobs: np.ndarray,
                    selected_logprobs: np.ndarray | None = None, *,
                    status: np.ndarray | None = None, forms: np.ndarray | None = None,
                    vocab: int = 0) -> None:
        """Append one decode step's rows, all or nothing: row i goes to queues[i].

        `queues` is a sequence of RowQueue or an int64 array of their
        `handle`s (the fast path: engines keep a request -> handle table). `ids`
        is [B, W] padded (row i is ids[i, :lengths[i]]) or flat CSR. A
        support-mode row's logprobs sit in `logprobs`, shaped like `ids`. A
        selected-mode row's one value is `selected_logprobs[i]` ([B]); when
        every row of the step is selected-mode, `logprobs` may be that [B]
        array instead. A step may mix modes (then pass both). A queue may
        appear several times in one step (speculative decoding): its rows are
        appended in step order. Every row is checked before any is copied: a
        bad row raises and appends nothing.

        Exact rows of any size (what shmask.kernels produces): `status[i]`
        (0 OK, 1 OVERFLOW, 2 INVALID) travels with row i; a row that is not
        OK has length 0 and no ids, so readers can tell it from an empty
        support. `forms[i]` 1 sends an OK row as a bitmask: its id data is
        ceil(vocab / 32) int32 words (bit j of word w: id 32 w + j) while
        lengths[i] stays its support size, and its support logprobs are its
        L values in ascending id order. Flat `ids` and `logprobs` then
        advance separately (id data per row vs L values per row).
        """
        if self.closed:  # _begin_call, inlined: this runs every decode step
            raise self._closed_error()
        self._deadline = None  # the SIGBUS guard covers the copy: no fstat here
        handles = self._handles(queues)
        lengths = _as_array(lengths, np.int32, "lengths")
        ids = _as_array(ids, np.int32, "ids")
        logprobs = _as_array(logprobs, np.float32, "logprobs")
        batch = handles.size
        if lengths.shape != (batch,):
            raise InvalidRowsError(f"lengths has shape {lengths.shape}; expected ({batch},)")
        if batch == 0:
            return
        if ids.ndim == 2:
            if ids.shape[0] != batch:
                raise InvalidRowsError(f"ids has {ids.shape[0]} rows; expected {batch}")
            row_stride = max(ids.shape[1], 1)  # W == 0: every length must be 0
        elif ids.ndim == 1:
            row_stride = 0
        else:
            raise InvalidRowsError(f"ids must be [B, W] or flat CSR, got shape {ids.shape}")
        c_flags = ffi.NULL if status is None and forms is None else ffi.from_buffer(
            "uint8_t[]", _row_flags(status, forms, batch))
        # With flags, flat id data and support logprobs differ in length (a
        # bitmask row's words vs its L values); the core checks both ranges.
        any_flat = c_flags != ffi.NULL and ids.ndim == 1 and logprobs.ndim == 1
        if selected_logprobs is None:
            selected, selected_is_logprobs = logprobs, 1
            if logprobs.shape not in (ids.shape, (batch,)) and not any_flat:
                raise InvalidRowsError(f"logprobs has shape {logprobs.shape}; expected the shape "
                                       f"of ids {ids.shape} (support) or ({batch},) (selected)")
        else:
            selected, selected_is_logprobs = _as_array(
                selected_logprobs, np.float32, "selected_logprobs"), 0
            if selected.shape != (batch,):
                raise InvalidRowsError(
                    f"selected_logprobs has shape {selected.shape}; expected ({batch},)")
            if logprobs.size and logprobs.shape != ids.shape and not any_flat:
                raise InvalidRowsError(f"logprobs has shape {logprobs.shape}; expected the "
                                       f"shape of ids {ids.shape}")
        if type(vocab) is not int or not 0 <= vocab < 1 << 31:
            vocab = _vocab(vocab)
        c_handles = ffi.from_buffer("int64_t[]", handles)
        c_lengths = ffi.from_buffer("int32_t[]", lengths)
        c_ids = ffi.from_buffer("int32_t[]", ids)
        c_logprobs = ffi.from_buffer("float[]", logprobs)
        c_selected = c_logprobs if selected_is_logprobs else ffi.from_buffer("float[]", selected)
        while True:
            done = lib.shm_append_step(self._ring, c_handles, batch, c_lengths, c_flags, vocab,
                                       c_ids, c_logprobs,
                                       c_selected, row_stride, ids.size, logprobs.size,
                                       selected.size, selected_is_logprobs, self._max_tokens,
                                       self._bad_row)
            if done == batch:
                return
            if done < 0:
                bad = int(self._bad_row[0])
                where = (f"append_step row {bad} (handle {int(handles[bad])}, length "
                         f"{int(lengths[bad])})" if bad >= 0 else "append_step")
                if done == lib.SHM_E_BAD_LENGTHS and bad >= 0:  # a negative id (step undone)
                    _raise_if_negative_ids(_row_ids(ids, lengths, c_flags, vocab, bad), where)
                raise_for(int(done), where)
            self._grow_queue(int(handles[int(done)]) & _SLOT_MASK)

    # Waits for the last step's kernel only: nothing is published before
    # the GPU's writes into these buffers completed.
    @_device_quiesced
    def take_batch(self, queues: Sequence[RowQueue] | np.ndarray,
                   final: bool = False) -> RefBatch:
        """Take every queue (one emission): one RefBatch, entry i for queues[i].

        Ring buffers are published in place and each queue gets its next
        buffer, all in one native call; `final` drops the buffers instead
        (the requests ended)."""
        if self.closed:
            raise self._closed_error()
        if type(final) is not bool and not isinstance(final, np.bool_):
            raise TypeError(f"take_batch: final must be True or False, got {final!r}")
        self._begin_call()
        entries, inline_chunks = self._take_into_entries(self._handles(queues), final)
        segments = [(self.segment_name, self.epoch, host_id())] if self.segment else []
        self.reclaim()
        if metrics.enabled():  # once per emission: nothing per step or per row
            metrics.sync(self.stats, self._synced, self.ring_usage(), self.segment_name)
        return RefBatch._of_own_entries(segments, entries, inline_chunks)

    # ------------------------------------------------------------ lifecycle
    def reclaim(self, move_staging: bool = False) -> None:
        """Return released (and lease-expired) records to the ring. With
        `move_staging`, queue buffers that block the tail are moved out of
        the way (to the head, else to private memory), each at most once."""
        if self.closed:
            raise self._closed_error()
        if self.segment is None:
            return
        if move_staging:
            self._reclaim_moving_staging()
        else:
            self._reclaim(False)

    @_device_quiesced  # relocation moves buffers the GPU may be writing
    def _reclaim_moving_staging(self) -> None:
        self._reclaim(True)

    def _reclaim(self, move_staging: bool) -> None:
        moved: set[int] = set()
        while True:
            lib.shm_reclaim(self._ring, time.monotonic_ns(), self._lease_ns, self._reclaim_result)
            result = self._reclaim_result
            if result.expired:
                self.stats.expired += int(result.expired)
                self._expiry_warning.add(int(result.expired), self.config.lease_s)
            if result.blocked_state == lib.SHM_STATE_CORRUPT:
                self._corruption_error.add(1, self.segment_name)
            if not move_staging or result.blocked_state != lib.SHM_STATE_STAGING:
                return
            slot = int(lib.shm_staging_owner(self._ring, result.blocked_position))
            if slot < 0 or slot in moved or slot == self._growing:
                return
            if lib.shm_queue_relocate(self._ring, slot, 1) != lib.SHM_OK:
                if lib.shm_queue_relocate(self._ring, slot, 0) != lib.SHM_OK:
                    return
            moved.add(slot)
            self.stats.staging_moves += 1

    def close(self) -> None:
        """Close every queue and unlink the segment. Readers that still hold
        views keep their pages; new opens of this segment fail cleanly."""
        if self.closed:
            return
        try:
            if self._direct is not None:
                # Waits for the last kernel, then unregisters the ring; it
                # unregisters even when that raises (rows it could not append),
                # and the Writer closes all the same: the error comes after.
                self._direct.close()
        finally:
            self.closed = True
            for queue in self._queues.values():
                queue.closed = True
            self._queues.clear()
            lib.shm_ring_free(self._ring)  # private buffers; the ring goes with the segment
            if self.segment is not None:
                metrics.forget_ring(self.segment.name)  # its gauges go with the ring
                self.segment.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync_metrics(self) -> None:
        """Hand the stats and the ring gauges to shmask.metrics now (they
        are otherwise handed over once per emission): what an adapter calls
        right after enabling metrics, so the ring shows from the start."""
        if metrics.enabled() and not self.closed:
            metrics.sync(self.stats, self._synced, self.ring_usage(), self.segment_name)

    def ring_usage(self) -> tuple[int, int]:
        """(bytes in use between tail and head, ring capacity)."""
        if self.segment is None:
            return 0, 0
        ring = self._ring
        return int(ring.head - ring.tail), int(ring.capacity)

    # ------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self.closed:
            raise self._closed_error()

    def _closed_error(self) -> ShmaskError:
        if self._pid != os.getpid():
            return ShmaskError(
                f"this Writer belongs to process {self._pid}; process {os.getpid()} is a "
                "forked child of it and cannot use it (its ring and queues are the "
                "parent's): make a new Writer in the child")
        return ShmaskError("Writer is closed")

    def _begin_call(self) -> None:
        """Start of take_batch and publish (append_step inlines the first two
        lines): a fresh full-ring budget, and the truncation check."""
        if self.closed:
            raise self._closed_error()
        self._deadline = None
        self._check_segment()

    def _check_segment(self, force: bool = False) -> None:
        """Notice a segment truncated by another process: at once when a
        SIGBUS marked our mapping or its header's magic reads zero (a file cut
        and grown back to its size faults nowhere: its pages read as zeros),
        else by an fstat of its size at most once a second (it costs
        ~20 us on a 1 GiB tmpfs file, too much for every emission; the SIGBUS
        guard keeps every access safe meanwhile, and rows staged in a cut
        record are never passed on: the core checks their record's header).
        The same tick puts the SIGBUS guard back in front of any handler
        installed after it (faulthandler.enable())."""
        segment = self.segment
        if segment is None or self._ring_lost:
            return
        # The core marks the ring dead itself when rows it moves out of the
        # ring were cut; the log line comes here, once.
        if not self._ring.dead and not segment.truncated:
            now = time.monotonic()
            if now < self._next_fstat and not force:
                return
            self._next_fstat = now + 1.0
            lib.shm_guard_front()
            if segment.file_intact():
                return
        lib.shm_ring_mark_dead(self._ring)
        self._ring_lost = True
        log.error("ring %s was truncated by another process: chunks staged in it are lost "
                  "(their readers get StaleChunkError); every chunk goes inline from now on",
                  segment.name)

    def _handles(self, queues: Sequence[RowQueue] | np.ndarray) -> np.ndarray:
        if isinstance(queues, np.ndarray):
            if queues.dtype is _INT64 and queues.ndim == 1 and queues.flags.c_contiguous:
                return queues  # the engine's own handle array: nothing to convert
            if queues.dtype.kind not in "iu" or queues.ndim != 1:
                raise InvalidRowsError(f"queue handles must be a 1-D integer array, got "
                                       f"{queues.dtype} of shape {queues.shape}")
            return np.ascontiguousarray(queues, dtype=np.int64)
        try:
            return np.fromiter((q.handle for q in queues), dtype=np.int64, count=len(queues))
        except (AttributeError, TypeError) as exc:
            raise InvalidRowsError(f"queues must be RowQueues or an int64 array of their "
                                   f"handles: {exc}") from None

    def _reserve(self, mode: int, rows_capacity: int, nnz_capacity: int) -> int | None:
        """A ring record for a one-shot (CSR) chunk, or None (the chunk goes inline)."""
        position = self._position
        if self._wait_for_room(
            lambda: lib.shm_reserve(self._ring, mode, rows_capacity, nnz_capacity, nnz_capacity,
                                    position)
        ):
            return int(position[0])
        return None

    def _wait_for_room(self, attempt: Callable[[], int]) -> bool:
        """Full-ring policy: try; reclaim and retry until the call's deadline
        (SHMASK_FULL_WAIT_MS after its first wait); False means the caller
        falls back to private memory and inline."""
        rc = attempt()
        if rc == lib.SHM_OK:
            return True
        if rc != lib.SHM_FULL:
            return False  # larger than the whole ring, or no usable ring
        self.stats.full_waits += 1
        if self._deadline is None:
            self._deadline = time.monotonic() + self._full_wait_s
        pause = 0.0001
        while True:
            self.reclaim(move_staging=True)
            if attempt() == lib.SHM_OK:
                return True
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.005)

    def _grow_queue(self, slot: int) -> None:
        """Slow path of append_step: the ring had no room for this queue's
        larger buffer right away. Wait for room, else stage privately."""
        self._growing = slot
        try:
            if self._wait_for_room(lambda: lib.shm_queue_grow(self._ring, slot, 1)):
                return
        finally:
            self._growing = -1
        rc = lib.shm_queue_grow(self._ring, slot, 0)
        if rc:
            raise_for(rc, f"append_step: staging queue slot {slot} in private memory")

    def _record_arrays(self, position: int, mode: int, rows_capacity: int,
                       nnz_capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The arrays of a one-shot (CSR: words == nnz) record."""
        lib.shm_record_layout(mode, rows_capacity, nnz_capacity, nnz_capacity, self._layout)
        start = int(lib.shm_record_offset(self._ring, position))
        layout = self._layout
        n_logprobs = nnz_capacity if mode == MODE_SUPPORT else rows_capacity
        view = self._view
        lengths = view[start + layout.lengths_offset:][:4 * rows_capacity].view(np.int32)
        flags = view[start + layout.flags_offset:][:rows_capacity]
        ids = view[start + layout.ids_offset:][:4 * nnz_capacity].view(np.int32)
        logprobs = view[start + layout.logprobs_offset:][:4 * n_logprobs].view(np.float32)
        return lengths, flags, ids, logprobs

    def _publish_record(self, position: int, mode: int, rows: int, nnz: int) -> ChunkRef:
        rc = lib.shm_publish(self._ring, position, mode, rows, nnz, nnz, 0, time.monotonic_ns(),
                             self._seal)
        if rc:
            raise_for(rc, f"publish at position {position}")
        # The record's size comes from the producer's own numbers, never from
        # a value read back out of shared memory.
        lib.shm_record_layout(mode, rows, nnz, nnz, self._layout)
        self._count(rows, nnz, nnz, mode)
        return ChunkRef(KIND_SHM, mode, self.segment_name, self.epoch, position,
                        int(self._layout.record_bytes), rows, nnz, None, host_id(),
                        seal=int(self._seal[0]))

    def _count(self, rows: int, nnz: int, words: int, mode: int) -> None:
        self.stats.chunks += 1
        self.stats.rows += rows
        self.stats.payload_bytes += int(payload_bytes(mode, rows, words, nnz))

    def _inline_reason(self, mode: int, rows_capacity: int, words_capacity: int,
                       nnz_capacity: int) -> str:
        """Why a chunk of these capacities is not in the ring."""
        if self.segment is None:
            return "configured"
        if self._ring.dead:
            return "ring_lost"
        lib.shm_record_layout(mode, rows_capacity, words_capacity, nnz_capacity, self._layout)
        return "oversize" if self._layout.record_bytes > self._ring.capacity else "ring_full"

    def _inline_ref(self, mode: int, rows: int, nnz: int, words: int, vocab: int,
                    payload: bytes, reason: str) -> ChunkRef:
        self._count(rows, nnz, words, mode)
        self.stats.inline_chunks += 1
        self.stats.inline_bytes += len(payload)
        setattr(self.stats, "inline_" + reason, getattr(self.stats, "inline_" + reason) + 1)
        if reason != "configured":  # chosen inline is not worth a warning
            self._inline_pending[reason] = self._inline_pending.get(reason, 0) + 1
            if self._inline_warning.add(1, ", ".join(
                    f"{n} {r.replace('_', ' ')}" for r, n in sorted(self._inline_pending.items()))):
                self._inline_pending.clear()
        return ChunkRef(KIND_INLINE, mode, "", 0, 0, len(payload), rows, nnz,
                        memoryview(payload), 0, words, vocab)

    def _take_into_entries(self, handles: np.ndarray,
                           final: bool) -> tuple[np.ndarray, list[bytes]]:
        count = handles.size
        # The core writes the batch's entries in place (shm_ref_entry is ENTRY_DTYPE).
        entries = np.zeros(count, dtype=ENTRY_DTYPE)
        inline_chunks: list[bytes] = []
        inline_offset = 0
        start = 0
        c_handles = ffi.from_buffer("int64_t[]", handles)
        c_entries = ffi.from_buffer("shm_ref_entry[]", entries)
        totals = self._take_totals  # the core adds up what it published (stats)
        totals.chunks = totals.rows = totals.payload_bytes = 0
        now = time.monotonic_ns()
        while start < count:
            done = lib.shm_take_queues(self._ring, c_handles, count, start, now, int(final),
                                       c_entries, totals)
            if done < 0:
                raise_for(int(done), "take_batch")
            if done == count:
                break
            i = int(done)  # a queue in private memory: its chunk goes inline
            ref = self._take_private(int(handles[i]) & _SLOT_MASK)
            assert ref.payload is not None
            entries[i] = (KIND_INLINE, ref.mode, 0, ref.rows, inline_offset, len(ref.payload),
                          ref.nnz, ref.words, ref.vocab, 0)
            inline_chunks.append(bytes(ref.payload))
            inline_offset += len(ref.payload)
            start = i + 1
        self.stats.chunks += totals.chunks
        self.stats.rows += totals.rows
        self.stats.payload_bytes += totals.payload_bytes
        return entries, inline_chunks

    def _take_private(self, slot: int) -> ChunkRef:
        entry = self._ring.queues[slot]
        rows, nnz, mode = int(entry.rows), int(entry.nnz), int(entry.mode)
        words, vocab = int(entry.words), int(entry.vocab)
        reason = self._inline_reason(mode, int(entry.rows_capacity), int(entry.words_capacity),
                                     int(entry.nnz_capacity))
        payload = bytearray(int(lib.shm_payload_bytes(mode, rows, words, nnz)))
        rc = lib.shm_queue_pack_private(self._ring, slot, ffi.from_buffer(payload), len(payload))
        if rc:
            raise_for(rc, f"take_batch: packing queue slot {slot}")
        return self._inline_ref(mode, rows, nnz, words, vocab, bytes(payload), reason)

    @_device_quiesced  # no kernel in flight may write a buffer dropped here
    def _close_queue(self, queue: RowQueue, abort: bool) -> int:
        if self.closed:
            if self._pid != os.getpid():
                raise self._closed_error()  # the slot and its chunks are the parent's
            return 0
        self._queues.pop(queue.slot, None)
        if abort:
            rc = lib.shm_queue_abort(self._ring, queue.handle, self._given_back)
            given_back = int(self._given_back[0])
            self.stats.aborted_chunks += given_back
        else:
            rc, given_back = lib.shm_queue_close(self._ring, queue.handle), 0
        if rc:
            raise_for(rc, f"closing {queue!r}")
        return given_back


class RowQueue:
    """One request's rows since its last take (scheduler side)."""

    __slots__ = ("writer", "handle", "slot", "mode", "closed")

    def __init__(self, writer: Writer, handle: int, mode: int) -> None:
        self.writer = writer
        self.handle = handle  # what append_step takes; stops matching once closed
        self.slot = handle & _SLOT_MASK
        self.mode = mode
        self.closed = False

    def append(self, ids: np.ndarray, logprobs: np.ndarray | float) -> None:
        """Append one row (a convenience; engines use Writer.append_step)."""
        ids = _as_array(ids, np.int32, "ids")
        if ids.ndim != 1:
            raise InvalidRowsError(f"a row's ids must be 1-D, got shape {ids.shape}")
        values = np.atleast_1d(_as_array(logprobs, np.float32, "logprobs"))
        handles = np.array([self.handle], np.int64)
        lengths = np.array([ids.size], np.int32)
        if self.mode == MODE_SUPPORT:
            self.writer.append_step(handles, lengths, ids, values)
        else:
            self.writer.append_step(handles, lengths, ids, np.zeros(0, np.float32), values)

    def take(self, final: bool = False) -> ChunkRef:
        """Publish the rows appended since the last take, in place."""
        return self.writer.take_batch([self], final)[0]

    @property
    def rows(self) -> int:
        if self.closed:
            return 0
        if self.writer.closed:  # a forked child's copy (close() closes the queues)
            raise self.writer._closed_error()
        if self.writer._direct is not None:
            self.writer._direct.wait()  # the GPU's counts, once its writes completed
        return int(self.writer._ring.queues[self.slot].rows)

    def close(self) -> None:
        """Drop unpublished rows and free the slot (the request ended)."""
        if not self.closed:
            self.closed = True
            self.writer._close_queue(self, abort=False)

    def abort(self) -> int:
        """The request was aborted: drop unpublished rows, free the slot, and
        give back every chunk it published that no reader has released yet
        (a late reader gets StaleChunkError). Returns how many were given back."""
        if self.closed:
            return 0
        self.closed = True
        return self.writer._close_queue(self, abort=True)

    def __repr__(self) -> str:
        live = not self.closed and not self.writer.closed
        return f"RowQueue(slot={self.slot}, rows={self.rows if live else 'closed'})"


def _give_back(ring: Any, segment: Segment | None) -> None:
    """A Writer's finalizer: what close() frees, for a Writer collected
    without it. The ring's private buffers first (the ring struct points
    into the mapping), then the segment's name, lock and mapping."""
    lib.shm_ring_free(ring)  # idempotent: close() may have run it already
    if segment is not None:
        metrics.forget_ring(segment.name)
        segment.release()


# Every Writer of this process, so a forked child can refuse to use them.
_WRITERS: weakref.WeakSet[Writer] = weakref.WeakSet()


def _refuse_in_forked_child() -> None:
    """After fork(): the parent's Writers are not the child's. Marked closed,
    every call on them raises ShmaskError naming the parent, at no cost to
    the per-step checks (the child's copy of a ring would otherwise publish
    into, and reclaim, the parent's ring)."""
    for writer in list(_WRITERS):
        writer.closed = True


os.register_at_fork(after_in_child=_refuse_in_forked_child)


def _as_array(value: object, dtype: type, name: str) -> np.ndarray:
    """`value` as a contiguous array of `dtype`, refusing casts that would
    change values silently (int64 ids past int32, float ids, bools taken for
    0 and 1)."""
    if isinstance(value, np.ndarray) and value.dtype == dtype:
        return np.ascontiguousarray(value)  # the hot path: nothing to check
    try:
        source = np.asarray(value)
        target = np.dtype(dtype)
        wanted, kinds = ("integers", "iu") if target.kind == "i" else ("numbers", "iuf")
        if source.dtype.kind not in kinds:
            raise InvalidRowsError(f"{name} must be {wanted}, got {source.dtype}")
        if target.kind == "i":
            limits = np.iinfo(target)  # type: ignore[type-var]  # target is an integer dtype here
            if source.size and (source.min() < limits.min or source.max() > limits.max):
                raise InvalidRowsError(
                    f"{name} has values outside {target.name} ({limits.min}..{limits.max})")
        array: np.ndarray = np.ascontiguousarray(source, dtype=dtype)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRowsError):
            raise
        raise InvalidRowsError(f"{name} cannot be read as {np.dtype(dtype).name}: {exc}") from None
    return array


def _row_ids(ids: np.ndarray, lengths: np.ndarray, c_flags: Any, vocab: int,
             row: int) -> np.ndarray:
    """Row `row`'s ids as append_step read them (for an error message)."""
    if ids.ndim == 2:
        return ids[row, :lengths[row]]
    flags = (np.zeros(lengths.size, np.uint8) if c_flags == ffi.NULL
             else np.frombuffer(ffi.buffer(c_flags), np.uint8))
    words = np.where(flags == ROW_OK, lengths,
                     np.where(flags == ROW_BITMASK, (vocab + 31) // 32, 0))
    start = int(words[:row].sum())
    return ids[start:start + int(lengths[row])]


def _raise_if_negative_ids(ids: np.ndarray, where: str) -> None:
    """The message for rows the core refused for a negative id (if that is why)."""
    negative = np.flatnonzero(ids < 0)
    if negative.size:
        raise InvalidRowsError(
            f"{where}: id {int(ids.flat[negative[0]])} (at {int(negative[0])}) is negative: "
            f"{ID_RULE}")


def _vocab(value: object) -> int:
    try:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        vocab = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRowsError(f"vocab must be an integer, got {value!r}") from None
    if not 0 <= vocab < 1 << 31:
        raise InvalidRowsError(f"vocab must be in [0, 2**31), got {vocab}")
    return vocab


def _row_flags(status: object, forms: object, batch: int) -> np.ndarray:
    """Per-row flags byte (shmask/layout.py): the status in the low bits,
    the form above them. Ranges are checked here because packing a bad
    status into bits would turn it into another, valid, flag."""
    flags = np.zeros(batch, np.uint8)
    # status holds codes (0, 1, 2): a bool array is not one; forms says per
    # row whether it is a bitmask, which a bool array says as well as 0 / 1.
    for name, value, limit, shift, kinds in (("status", status, ROW_INVALID, 0, "iu"),
                                             ("forms", forms, 1, ROW_FORM_SHIFT, "iub")):
        if value is None:
            continue
        array = np.asarray(value)
        if array.shape != (batch,) or array.dtype.kind not in kinds:
            raise InvalidRowsError(f"{name} must be an integer array of shape ({batch},), got "
                                   f"{array.dtype} {array.shape}")
        if batch and (array.min() < 0 or array.max() > limit):
            raise InvalidRowsError(f"{name} values must lie in 0..{limit}, got "
                                   f"{int(array.min())}..{int(array.max())}")
        flags |= array.astype(np.uint8) << shift
    return flags

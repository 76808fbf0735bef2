"""The consumer side (a tokenizer process): open refs as numpy views.

Segments are attached lazily, by the name a ref carries, and validated
before use; every field of a ref is bounds-checked by the native core
before a byte of the record is touched. Mappings are guarded against
SIGBUS (see segment.py): a segment truncated under a reader reads as zero
pages, which every check then rejects with StaleChunkError.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from . import layout, metrics
from ._native import ffi, lib
from ._native_errors import raise_for
from .chunk import Chunk
from .config import Config
from .errors import (
    DoubleReleaseError,
    InvalidRefError,
    RemoteChunkError,
    SegmentError,
    ShmaskError,
    StaleChunkError,
)
from .refs import (
    ID_RULE,
    KIND_EMPTY,
    KIND_INLINE,
    KIND_LOST,
    KIND_SHM,
    LOST_RELEASED,
    LOST_STALE,
    MODE_SELECTED,
    MODE_SUPPORT,
    ChunkRef,
    RefBatch,
    payload_bytes,
)
from .segment import Segment, collect_garbage, host_id, is_valid_name, segment_alive

log = logging.getLogger("shmask")


class _Attached:
    """A segment this reader mapped, with the header values it validated once
    (later changes to the shared header cannot widen what it may read)."""

    __slots__ = ("segment", "name", "base", "size", "capacity", "epoch", "view", "memory",
                 "max_rows")

    def __init__(self, segment: Segment, capacity: int, epoch: int) -> None:
        self.segment = segment
        self.name = segment.name
        # Our own reference to the mapping: chunks opened here keep it (and
        # can be checked and released) even after the Reader forgets the
        # segment or is closed.
        self.base = segment.base
        self.size = segment.size
        self.capacity = capacity
        self.epoch = epoch
        self.view = np.frombuffer(segment.buffer, dtype=np.uint8)
        self.view.flags.writeable = False
        # What chunks' arrays are built on (read-only, like `view`).
        self.memory = memoryview(segment.buffer).toreadonly()
        self.max_rows = capacity // 5  # a row takes 5 bytes of lengths and flags

    def error(self, rc: int, context: str) -> None:
        """Raise for a native error code, saying so when the reason is that
        the segment file was truncated under us."""
        if lib.shm_mapping_truncated(self.base):
            raise StaleChunkError(f"{context}: segment {self.name!r} was truncated by "
                                  "another process")
        raise_for(rc, context)


@dataclass
class ReaderStats:
    """Counters of one Reader (`Reader.stats`)."""

    opens: int = 0
    stale: int = 0  # opens that raised StaleChunkError
    invalid: int = 0  # opens that raised another ShmaskError (malformed, released)
    discards: int = 0  # chunks given back unopened


_SYNC_MASK = 255  # metrics are handed over every 256 opens, not per open
# Up to this many rows (320 KiB of geometry copy) a ref's rows size the copy
# at once; beyond, the record is asked first (one more native call).
_ROWS_WITHOUT_PEEK = 65536
# copy_rows sizes its output by the references' own counts before any
# record confirms them: the entries past this many ids (1 GiB) are left to
# the caller's open, so a forged count costs no allocation.
_COPY_MAX_IDS = 1 << 28


class Reader:
    """Opens ChunkRefs. One Reader per process is enough: it may be shared by
    threads (every open gets its own results from the native core; only
    attaching a new segment takes a lock)."""

    def __init__(self, config: Config | None = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"Reader takes a shmask.Config (or None: from the environment), "
                            f"got {type(config).__name__}")
        self.config = config or Config.from_env()
        # Plain int attributes: the cheapest count on the open path (stats
        # builds the ReaderStats view on demand).
        self._opens = self._stale = self._invalid = self._discards = 0
        self._synced = ReaderStats()
        self._host = host_id()  # which /dev/shm this process sees
        self._attached: dict[str, _Attached] = {}
        self._attach_lock = threading.Lock()
        _READERS.add(self)  # its lock is made anew in a forked child
        # Native results per thread: cffi lets go of the GIL inside a call,
        # so threads sharing this Reader must not share an out-struct.
        self._scratch = threading.local()
        if self.config.transport == "shm":
            # Rings of producers that died (SIGKILL leaves them) go now.
            collect_garbage(self.config.name_prefix)

    def open(self, ref: ChunkRef) -> Chunk:
        """The chunk's rows as read-only numpy views; release() when done."""
        try:
            chunk = self._open_shm(ref) if ref.kind == KIND_SHM else self._open_other(ref)
        except StaleChunkError:
            self._stale += 1
            raise
        except ShmaskError:  # InvalidRefError, DoubleReleaseError
            self._invalid += 1
            raise
        except (TypeError, OverflowError, AttributeError, ValueError) as exc:
            # A hand-built ref with fields of the wrong type or range, or no ref.
            self._invalid += 1
            if not isinstance(ref, ChunkRef):
                raise InvalidRefError(
                    f"Reader.open takes a ChunkRef, got {type(ref).__name__}") from None
            raise InvalidRefError(f"malformed reference {ref!r}: {exc}") from None
        self._opens += 1
        if not self._opens & _SYNC_MASK:
            lib.shm_guard_front()  # back in front of a SIGBUS handler installed since
            if metrics.enabled():
                metrics.sync(self.stats, self._synced)
        return chunk

    @property
    def stats(self) -> ReaderStats:
        """Counters of this Reader since it was built."""
        return ReaderStats(self._opens, self._stale, self._invalid, self._discards)

    def sync_metrics(self) -> None:
        """Hand the counters to prometheus_client now (also done every 256
        opens, at every discard and at close)."""
        metrics.sync(self.stats, self._synced)

    def discard(self, ref: ChunkRef) -> None:
        """Give a chunk back without opening it (the request was aborted and
        its rows are not wanted). Inline and empty refs need nothing."""
        if not isinstance(ref, ChunkRef):
            raise InvalidRefError(f"Reader.discard takes a ChunkRef, got {type(ref).__name__}")
        if ref.kind == KIND_SHM:
            self.discard_batch([ref])

    def discard_batch(self, batch: RefBatch | Iterable[ChunkRef]) -> int:
        """Give back every ring chunk of a batch without opening any: one
        native call per segment. Returns how many were given back; chunks
        already released or reclaimed are skipped silently."""
        if not isinstance(batch, RefBatch):
            try:
                batch = RefBatch.from_refs(list(batch))
            except (TypeError, ValueError, OverflowError, AttributeError) as exc:
                if isinstance(exc, InvalidRefError):
                    raise
                raise InvalidRefError(f"discard_batch: malformed reference: {exc}") from None
        entries = batch.entries
        shm = entries["kind"] == KIND_SHM
        given_back = 0
        first_error: ShmaskError | None = None
        for index in np.unique(entries["segment"][shm]):
            name, epoch, host = batch.segments[int(index)]
            if host and host != self._host:
                continue  # another host's ring: its own hop gives it back
            try:
                attached = self._attach(name)
            except StaleChunkError:
                continue  # the producer is gone, and its ring with it
            except ShmaskError as exc:  # a bad segment costs its own chunks only
                first_error = first_error or exc
                continue
            if attached.epoch != epoch:
                continue
            these = shm & (entries["segment"] == index)
            positions = np.ascontiguousarray(entries["position"][these], dtype=np.uint64)
            seals = np.ascontiguousarray(entries["seal"][these], dtype=np.uint64)
            results = np.zeros(positions.size, np.int32)
            lib.shm_release_many(attached.base, attached.size, attached.capacity,
                                 ffi.from_buffer("uint64_t[]", positions),
                                 ffi.from_buffer("uint64_t[]", seals), positions.size,
                                 ffi.from_buffer("int32_t[]", results))
            given_back += int(np.count_nonzero(results == lib.SHM_OK))
        self._discards += given_back
        if metrics.enabled():
            metrics.sync(self.stats, self._synced)
        if first_error is not None:  # after every other segment's chunks went back
            raise first_error
        return given_back

    def copy_rows(self, batch: RefBatch, keep: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For a consumer that copies rows on purpose: each ring entry's
        first ``keep[i]`` rows copied out (bitmask rows decoded to ids) and
        its record released, one native call per segment (shmask_copy.h),
        with Reader.open's checks. Returns ``(ids, starts, row_starts,
        row_lengths, copied)``: entry i's rows' lengths are
        ``row_lengths[row_starts[i]:row_starts[i + 1]]`` and its ids
        ``ids[starts[i]:]`` for their sum; ``copied[i]`` says whether it
        was. An entry not copied was neither read nor released (another
        host's, a bad or late reference, a kept row that is not OK, a keep
        outside 1..rows or past SHM_COPY_MAX_ROWS, which take no room):
        open it as usual, to use it or to raise why not."""
        entries = batch.entries
        count = len(entries)
        keep = np.asarray(keep)
        if keep.shape != (count,):
            raise ValueError(f"keep has shape {keep.shape}; the batch has {count} entries")
        # Sized from the references (untrusted) only within the core's bound.
        keep = np.where((keep >= 1) & (keep <= np.minimum(entries["rows"], lib.SHM_COPY_MAX_ROWS)),
                        keep, 0).astype(np.uint32)
        # The output is sized by the ids the references say they hold (each
        # record confirms its own before a byte is copied), within
        # _COPY_MAX_IDS: entries past it (a forged count) are not copied.
        ring = (entries["kind"] == KIND_SHM) & (keep > 0) & (entries["nnz"] <= _COPY_MAX_IDS)
        running = np.cumsum(np.where(ring, entries["nnz"].astype(np.float64), 0.0))
        ring &= running <= _COPY_MAX_IDS
        keep = np.where(ring, keep, 0).astype(np.uint32)
        first_row = np.zeros(count + 1, np.int64)
        np.cumsum(keep, out=first_row[1:])
        starts = np.zeros(count, np.int64)
        row_lengths = np.zeros(int(first_row[-1]), np.int32)
        copied = np.zeros(count, bool)
        total = int(entries["nnz"][ring].sum())
        out = np.empty(total, np.int32)
        cursor = 0
        for index in np.unique(entries["segment"][ring]):
            name, epoch, host = batch.segments[int(index)]
            if host and host != self._host:
                continue
            try:
                attached = self._attach(name)
            except ShmaskError:
                continue  # the usual open says why
            if attached.epoch != epoch:
                continue
            these = np.flatnonzero(ring & (entries["segment"] == index))
            part_starts = np.zeros(these.size, np.int64)
            results = np.zeros(these.size, np.int32)
            written = lib.shm_copy_rows_many(
                attached.base, attached.size, attached.capacity,
                ffi.from_buffer("shm_ref_entry[]", np.ascontiguousarray(entries[these])),
                ffi.from_buffer("uint32_t[]", np.ascontiguousarray(keep[these])), these.size,
                self.config.max_tokens, ffi.from_buffer("int32_t[]", out[cursor:]),
                total - cursor, ffi.from_buffer("int64_t[]", part_starts),
                ffi.from_buffer("int64_t[]", np.ascontiguousarray(first_row[these])),
                ffi.from_buffer("int32_t[]", row_lengths), row_lengths.size,
                ffi.from_buffer("int32_t[]", results))
            ok = results == lib.SHM_OK
            copied[these[ok]] = True
            starts[these] = part_starts + cursor
            cursor += int(written)
            self._opens += int(ok.sum())
        if metrics.enabled():
            metrics.sync(self.stats, self._synced)
        return out[:cursor], starts, first_row, row_lengths, copied

    def copy_ref_table(self, table: np.ndarray, segment: tuple[str, int, int],
                       keep: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """copy_rows for a step of one-entry references as a frontend
        receives them (one per request): ``table`` is uint8 [count, stride],
        row i reference i's bytes. The caller has checked row 0 as a
        canonical batch of one ring entry whose one segment is ``segment``
        (name, epoch, host). The core takes each row whose leading
        ``stride - 48`` bytes equal row 0's and whose entry is a ring entry
        of that segment with a valid mode, keeping ``keep[i]`` rows (None:
        all its rows), with copy_rows' checks (shm_copy_ref_table,
        native/shmask_copy.h). Returns ``(ids, starts, row_first,
        row_lengths, copied)``: row i's ids are ``ids[starts[i]:starts[i +
        1]]``, its rows' lengths ``row_lengths[row_first[i]:row_first[i +
        1]]``. A row not copied was neither read nor released: open it as
        usual, to use it or to raise why not."""
        if table.dtype != np.uint8 or table.ndim != 2 or not table.flags.c_contiguous:
            raise ValueError(f"the reference table is a C-contiguous uint8 [count, stride] "
                             f"array, got {table.dtype} {table.shape}")
        count, stride = table.shape
        if keep is not None:
            keep = np.ascontiguousarray(keep, np.uint32)
            if keep.shape != (count,):
                raise ValueError(f"keep has shape {keep.shape}; the table has {count} rows")
        copied = np.zeros(count, bool)
        none = (np.zeros(0, np.int32), np.zeros(count + 1, np.int64),
                np.zeros(count + 1, np.int64), np.zeros(0, np.int32), copied)
        name, epoch, host = segment
        if count == 0 or (host and host != self._host):
            return none
        try:
            attached = self._attach(name)
        except ShmaskError:
            return none  # the usual open says why
        if attached.epoch != epoch:
            return none
        table_c = ffi.from_buffer("uint8_t[]", table)
        keep_c = ffi.NULL if keep is None else ffi.from_buffer("uint32_t[]", keep)
        sizes = ffi.new("uint64_t[2]")
        # Sized by the references' own counts (untrusted): one of more than
        # _COPY_MAX_IDS ids is not taken, and within the total's bound one
        # past the room is skipped by the core; each is left to its open.
        lib.shm_ref_table_sizes(table_c, count, stride, keep_c, _COPY_MAX_IDS, sizes, sizes + 1)
        out = np.empty(min(int(sizes[0]), _COPY_MAX_IDS), np.int32)
        row_lengths = np.empty(int(sizes[1]), np.int32)  # <= SHM_COPY_MAX_ROWS a reference
        starts = np.empty(count + 1, np.int64)
        row_first = np.empty(count + 1, np.int64)
        results = np.empty(count, np.int32)
        written = lib.shm_copy_ref_table(
            attached.base, attached.size, attached.capacity, table_c, count, stride, keep_c,
            _COPY_MAX_IDS, self.config.max_tokens, ffi.from_buffer("int32_t[]", out), out.size,
            ffi.from_buffer("int64_t[]", starts), ffi.from_buffer("int64_t[]", row_first),
            ffi.from_buffer("int32_t[]", row_lengths), row_lengths.size,
            ffi.from_buffer("int32_t[]", results))
        np.equal(results, lib.SHM_OK, out=copied)
        self._opens += int(np.count_nonzero(copied))
        lib.shm_guard_front()  # as open does every 256 opens: a step's worth
        if metrics.enabled():
            metrics.sync(self.stats, self._synced)
        return out[:written], starts, row_first, row_lengths, copied

    def _open_other(self, ref: ChunkRef) -> Chunk:
        if not isinstance(ref, ChunkRef):
            raise InvalidRefError(f"Reader.open takes a ChunkRef, got {type(ref).__name__}")
        if ref.kind == KIND_INLINE:
            return _open_inline(ref, self.config.max_tokens)
        if ref.kind == KIND_LOST:
            if ref.position == LOST_STALE:
                raise StaleChunkError(f"{ref!r}: the hop that forwarded this chunk could not read "
                                      "it in time (reclaimed, aborted or truncated)")
            if ref.position == LOST_RELEASED:
                raise DoubleReleaseError(f"{ref!r}: chunk was released already: the hop that "
                                         "forwarded it had copied and given it back before (the "
                                         "same batch pulled or forwarded twice)")
            raise InvalidRefError(f"{ref!r}: the hop that forwarded this chunk found its "
                                  "reference malformed")
        if ref.kind == KIND_EMPTY:
            if type(ref.rows) is not int or type(ref.nnz) is not int or ref.rows or ref.nnz:
                raise InvalidRefError(f"empty reference with rows={ref.rows!r} nnz={ref.nnz!r}")
            return Chunk.empty(ref.mode if ref.mode in (MODE_SELECTED, MODE_SUPPORT)
                               else MODE_SUPPORT)
        raise InvalidRefError(f"reference kind {ref.kind} is invalid: accepted 0, 1, 2, 3")

    def open_batch(self, batch: RefBatch) -> Iterator[Chunk]:
        """Open every ref of a batch, in order. If one fails to open (the
        error goes to the caller), or the caller stops early (closes the
        generator), the chunks not yet opened are given back to the ring."""
        opened = 0
        try:
            for ref in batch:
                opened += 1  # one that fails to open holds nothing to give back
                yield self.open(ref)
        finally:
            if opened < len(batch):
                self.discard_batch(batch.select(np.arange(opened, len(batch))))

    def close(self) -> None:
        """Forget every segment (views handed out stay valid until dropped)."""
        if metrics.enabled():
            metrics.sync(self.stats, self._synced)
        for attached in self._attached.values():
            attached.segment.close()
        self._attached.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _open_shm(self, ref: ChunkRef) -> Chunk:
        if ref.host and ref.host != self._host:
            raise RemoteChunkError(
                f"{ref!r} lives in the shared memory of another host (or of a container with "
                "its own /dev/shm): the hop that forwards it here must send it inline "
                "(RefBatch.for_host(<this reader's shmask.host_id()>, reader) or "
                "RefBatch.to_inline(reader)), or run the producer with SHMASK_TRANSPORT=inline")
        attached = self._attach(ref.segment)
        if ref.epoch != attached.epoch:
            if type(ref.epoch) is not int:
                raise InvalidRefError(f"reference epoch {ref.epoch!r} is not an integer")
            raise StaleChunkError(
                f"ref epoch {ref.epoch} does not match segment {ref.segment!r} "
                f"(epoch {attached.epoch}): the segment was recreated"
            )
        rows, nnz, words = ref.rows, ref.nnz, ref.words
        if not 0 <= rows <= attached.max_rows:
            # Checked before sizing the geometry copy by it (a record of
            # `rows` rows holds 5 bytes a row of lengths and flags).
            raise InvalidRefError(f"{ref!r}: {rows} rows cannot fit a ring of "
                                  f"{attached.capacity} bytes")
        if rows > _ROWS_WITHOUT_PEEK:
            # A large copy is sized by the record's own rows, not the ref's
            # alone: a forged ref must not make every open allocate a ring's
            # worth of memory before it is turned down.
            rc = lib.shm_record_has_rows(attached.base, attached.size, attached.capacity,
                                         ref.position, ref.seal, rows)
            if rc:
                attached.error(rc, f"open {ref!r}")
        # The rows' geometry is copied out of the record by the native core
        # and validated there: lengths (int32) then flags (uint8), private to
        # this chunk.
        copied = bytearray(5 * rows)
        try:
            view = self._scratch.view
        except AttributeError:
            view = self._scratch.view = ffi.new("shm_view *")
        # One native call checks the ref against the record (its seal
        # included), then the rows (flags, lengths, bitmasks, totals), then
        # the record again (reclaimed meanwhile: stale).
        rc = lib.shm_open_record(attached.base, attached.size, attached.capacity, ref.position,
                                 ref.seal, ref.record_bytes, rows, words, nnz, ref.vocab,
                                 ref.mode, self.config.max_tokens, ffi.from_buffer(copied),
                                 view)
        record = _ShmRecord(attached, ref.position, ref.seal)
        if rc:
            if rc == lib.SHM_E_BAD_LENGTHS:
                record.check()  # reclaimed or truncated meanwhile: say that instead
            attached.error(rc, f"open {ref!r}")
        memory = attached.memory  # read-only: so are ids and logprobs
        geometry = bytes(copied)  # immutable: the chunk's arrays are read-only
        lengths = np.frombuffer(geometry, np.int32, rows)
        ids = np.frombuffer(memory, np.int32, words, view.ids_offset)
        logprobs = np.frombuffer(memory, np.float32, nnz if ref.mode == MODE_SUPPORT else rows,
                                 view.logprobs_offset)
        if not view.any_flags:  # OK ids rows only: the chunk needs no flags
            return Chunk(ref.mode, lengths, ids, logprobs, record)
        flags = np.frombuffer(geometry, np.uint8, rows, 4 * rows)
        return Chunk(ref.mode, lengths, ids, logprobs, record, flags=flags, vocab=ref.vocab)

    def _attach(self, name: str) -> _Attached:
        attached = self._attached.get(name)
        if attached is not None:
            return attached
        with self._attach_lock:  # threads attaching one segment map it once
            return self._attach_locked(name)

    def _attach_locked(self, name: str) -> _Attached:
        attached = self._attached.get(name)
        if attached is not None:
            return attached
        if not is_valid_name(name):
            raise InvalidRefError(f"{name!r} is not a shmask segment name")
        try:
            segment = Segment.attach(name)
        except SegmentError as exc:
            raise StaleChunkError(f"cannot read chunk: {exc}") from exc
        info = ffi.new("shm_info *")
        rc = lib.shm_read_info(segment.base, segment.size, info)
        if rc != lib.SHM_OK:
            truncated = segment.truncated or rc == lib.SHM_E_TRUNCATED
            segment.close()
            if truncated:
                raise StaleChunkError(f"segment {name!r} was truncated by another process")
            raise InvalidRefError(f"segment {name!r} has no valid shmask header")
        self._forget_dead_segments()
        attached = _Attached(segment, int(info.capacity), int(info.epoch))
        self._attached[name] = attached
        return attached

    def _forget_dead_segments(self) -> None:
        # A new producer appeared: unmap the segments of producers that died,
        # so a long-lived tokenizer does not pin their memory forever.
        for name, attached in list(self._attached.items()):
            if not segment_alive(name):
                attached.segment.close()
                del self._attached[name]


class _ShmRecord:
    """What a Chunk needs to re-check and release its ring record."""

    __slots__ = ("attached", "position", "seal")

    def __init__(self, attached: _Attached, position: int, seal: int) -> None:
        self.attached = attached
        self.position = position
        self.seal = seal

    def check(self) -> None:
        attached = self.attached
        # A truncated segment reads as zero pages, which fail this check too.
        if lib.shm_check_record(attached.base, attached.capacity, self.position, self.seal):
            attached.error(lib.SHM_E_STALE, f"chunk at {attached.name}@{self.position}")

    def release(self) -> None:
        attached = self.attached
        rc = lib.shm_release(attached.base, attached.size, attached.capacity, self.position,
                             self.seal)
        if rc:
            attached.error(rc, f"release {attached.name}@{self.position}")


def _check_rows(lengths: np.ndarray, flags: np.ndarray, ids: np.ndarray, nnz: int, vocab: int,
                max_tokens: int) -> bool:
    """Validates a chunk's rows (native core); whether some row is not an OK
    ids row (the chunk then carries its flags)."""
    any_flags = ffi.new("uint32_t *")  # per call: a Reader may be shared by threads
    rc = lib.shm_validate_rows(ffi.from_buffer("int32_t[]", lengths),
                               ffi.from_buffer("uint8_t[]", flags),
                               ffi.from_buffer("int32_t[]", ids), lengths.size, ids.size, nnz,
                               vocab, max_tokens, 1, any_flags)
    if rc:
        _raise_if_negative_id(lengths, flags, ids, vocab, "chunk rows")
        raise_for(rc, "chunk rows")
    return bool(any_flags[0])


def _raise_if_negative_id(lengths: np.ndarray, flags: np.ndarray, ids: np.ndarray, vocab: int,
                          context: str) -> None:
    """The error for rows the core refused, when a negative id in an ids
    row is why (the error path only: rows that passed were checked natively).
    Ids are non-negative int32 wherever rows enter; a chunk holding one is
    corrupt (written past the producer's checks), never shown."""
    words = np.where(flags == layout.ROW_OK, lengths, np.where(flags == layout.ROW_BITMASK,
                                                   (vocab + 31) // 32, 0)).astype(np.int64)
    ends = np.cumsum(words)
    if words.size == 0 or ends[-1] > ids.size or np.any(lengths < 0):
        return  # the lengths themselves are wrong: the core's message says so
    for row in np.flatnonzero((flags == layout.ROW_OK) & (lengths > 0)).tolist():
        values = ids[ends[row] - words[row]:ends[row]]
        negative = np.flatnonzero(values < 0)
        if negative.size:
            raise InvalidRefError(
                f"{context}: row {row} holds id {int(values[negative[0]])}, which is negative: "
                f"{ID_RULE}, so the chunk is corrupt")


def _open_inline(ref: ChunkRef, max_tokens: int) -> Chunk:
    payload = ref.payload
    rows, nnz, words, vocab = ref.rows, ref.nnz, ref.words, ref.vocab
    if type(ref.mode) is not int or ref.mode not in (MODE_SELECTED, MODE_SUPPORT):
        raise InvalidRefError(f"inline reference mode {ref.mode!r} is invalid: accepted 1, 2")
    if not all(type(v) is int and v >= 0 for v in (rows, nnz, words, vocab)) or vocab >= 1 << 31:
        raise InvalidRefError(f"inline {ref!r}: rows, nnz, words and vocab must be "
                              "non-negative integers")
    size = int(payload_bytes(ref.mode, rows, words, nnz))
    if payload is None or len(payload) != size:
        raise InvalidRefError(f"inline {ref!r} carries {0 if payload is None else len(payload)} "
                              f"bytes; its rows, nnz and words need {size}")
    data = np.frombuffer(payload, dtype=np.uint8)
    flags_at, ids_at = 4 * rows, 4 * rows + -(-rows // 4) * 4
    logprobs_at = ids_at + 4 * words
    lengths = data[:flags_at].view(np.int32)
    flags = data[flags_at:flags_at + rows]
    ids = data[ids_at:logprobs_at].view(np.int32)
    logprobs = data[logprobs_at:].view(np.float32)
    plain = not _check_rows(lengths, flags, ids, nnz, vocab, max_tokens)
    return Chunk(ref.mode, lengths, ids, logprobs, None, flags=None if plain else flags,
                 vocab=vocab)


# Every Reader of the process: a child forked while a thread of the parent
# held a Reader's attach lock (held across Segment.attach: shm_open, fstat,
# mmap) would block on it forever; the child gets new locks instead.
_READERS: weakref.WeakSet[Reader] = weakref.WeakSet()


def _renew_locks_in_child() -> None:
    for reader in list(_READERS):
        reader._attach_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_locks_in_child)

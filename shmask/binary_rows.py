"""Binary rows: a request's sampling masks as little-endian arrays, base64
inside the response's JSON, for clients that can take them (opt-in per
request; the JSON lists stay the default). The schema is in
docs/architecture.md, "Binary rows"; in short, one JSON object::

    {"format": "base64", "version": 1, "mode": "support" | "selected",
     "start": S, "rows": R, "nnz": N,
     "lengths": b64(int32 LE [R]),
     "status": b64(uint8 [R]),          (only when some row is not OK)
     "ids": b64(int32 LE [N]),
     "logprobs": b64(float32 LE [N] in support mode, [R] in selected mode)}

Server side: `encode_meta_info(chunk, start)` (one chunk's rows as SGLang's
two meta_info fields, the whole JSON object written by the compiled core in
one pass, its base64 encoded on SHMASK_JSON_THREADS threads),
`encode_meta_info_many(chunks, starts)` (an emission in one call; with
`into=EmissionBuffer()` into memory reused from one emission to the next
while no document of it is alive),
`encode_chunk(chunk)` (the binary-rows object alone, as an orjson.Fragment
to embed) or `SamplingMaskBase64` (a request's rows accumulated across
emissions, like the SGLang adapter's SamplingMaskJSON: `extend(chunk)` per
emission, `fields(start)` per response). Client side: `loads(body)` is
orjson.loads with every binary-rows object of the document decoded (found
by a native scan of the body, its big strings decoded in parallel straight
into numpy arrays, never made Python strings); `decode_rows(obj)` decodes
one object already parsed. Both give CSR numpy arrays (or torch tensors)
with no Python object per row and check everything they read: the client's
input is untrusted too.

The compiled core is optional: without it (a client that installed the
package without building it) the same functions run on numpy, orjson and
pybase64 (the `binary` extra; 2x faster encoding and 7x faster decoding than
binascii here) or binascii, giving the same bytes and the same rows.
"""

from __future__ import annotations

import binascii
import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from .config import check_threads
from .errors import ShmaskError
from .refs import ID_RULE

if TYPE_CHECKING:
    from .chunk import Chunk

_pybase64: Any
try:
    _pybase64 = importlib.import_module("pybase64")
except ImportError:  # the stdlib codec: same bytes, slower
    _pybase64 = None

FORMAT = "base64"
VERSION = 1
MODES = ("selected", "support")
# SGLang's meta_info keys (as shmask.adapters.sglang names them; the adapter
# is not imported here: it needs msgspec, a client does not).
MASK_FIELD = "output_token_sampling_mask"
LENGTH_FIELD = "output_token_sampling_mask_length"
_STATUS_MAX = 2  # OK 0, OVERFLOW 1, INVALID 2 (shmask.chunk.ROW_*)
_LITTLE = sys.byteorder == "little"
_FIELDS = (("lengths", "<i4"), ("status", "u1"), ("ids", "<i4"), ("logprobs", "<f4"))
_ALIGN = 64  # offset of each decoded array in their buffer; of each EmissionBuffer document
_native_core: Any = None  # (ffi, lib) of the compiled core, False without it


def _native() -> Any:
    """(ffi, lib) of the compiled core, or None: imported on first use, so
    that a client without it still imports this module. The core writes
    and reads little-endian bytes as they lie in memory: a big-endian host
    takes the numpy path."""
    global _native_core
    if _native_core is None:
        try:
            module = importlib.import_module("shmask._native")
        except ImportError:
            _native_core = False
        else:
            _native_core = (module.ffi, module.lib) if _LITTLE else False
            if _native_core:
                # the response writer's module applies SHMASK_JSON_SIMD (the
                # base64 encoder's AVX-512 switch too) when first imported
                importlib.import_module("shmask.response_json")
    return _native_core or None


def _threads(threads: int | None) -> int:
    if threads is not None:
        return threads
    global _json_threads
    if _json_threads is None:
        from .response_json import json_threads  # the core is there: this imports it
        _json_threads = json_threads
    return _json_threads()


_json_threads: Any = None  # response_json.json_threads, imported on first use


class BinaryRowsError(ShmaskError, ValueError):
    """A binary-rows object is malformed: the message names the field."""


# ------------------------------------------------------------------ codec
def _b64encode(data: Any) -> bytes:
    if _pybase64 is not None:
        return _pybase64.b64encode(data)
    return binascii.b2a_base64(data, newline=False)


def _b64decode(text: str | bytes, writable: bool) -> bytes | bytearray:
    """Strict decoding (no skipped characters), raising binascii.Error."""
    if _pybase64 is not None:
        if writable:
            return _pybase64.b64decode_as_bytearray(text, validate=True)
        return _pybase64.b64decode(text, validate=True)
    if sys.version_info >= (3, 11):
        out = binascii.a2b_base64(text, strict_mode=True)
    else:
        import base64
        out = base64.b64decode(text, validate=True)
    return bytearray(out) if writable else out


def _le_bytes(array: np.ndarray, dtype: str) -> memoryview:
    """The array's values as contiguous little-endian bytes (a view when
    they already are)."""
    return np.ascontiguousarray(array, dtype=dtype).data.cast("B")


# ------------------------------------------------------------ server side
def _object(support: bool, start: int, rows: int, nnz: int, lengths: list[Any],
            status: list[Any] | None, ids: list[Any], logprobs: list[Any]) -> bytes:
    """The object's JSON bytes from its encoded fields (each a list of
    bytes-like base64 pieces), in one join: one copy of the encoded data."""
    parts: list[Any] = [
        b'{"format":"%s","version":%d,"mode":"%s","start":%d,"rows":%d,"nnz":%d,"lengths":"'
        % (FORMAT.encode(), VERSION, b"support" if support else b"selected", start, rows, nnz),
        *lengths]
    if status is not None:
        parts += [b'","status":"', *status]
    parts += [b'","ids":"', *ids, b'","logprobs":"', *logprobs, b'"}']
    return b"".join(parts)


def _selected_values(logprobs: np.ndarray, status: np.ndarray | None) -> np.ndarray:
    # A dropped row has no logprob: NaN, whatever the producer left there.
    if status is None or not status.any():
        return logprobs
    out = np.array(logprobs, dtype="<f4")
    out[status != 0] = np.nan
    return out


def encode_meta_info(chunk: Chunk, start: int = 0, threads: int | None = None, *,
                     length: int | None = None) -> bytes:
    """SGLang's two meta_info fields for one chunk's rows, as one JSON
    object: {"output_token_sampling_mask": <the binary-rows object>,
    "output_token_sampling_mask_length": length} (`length` defaults to
    start + chunk.rows, the request's rows through this chunk). The same
    bytes as orjson.dumps of encode_chunk's Fragment and the length, but
    written by the compiled core in one pass into a bytes object of the
    exact size, the base64 on up to `threads` threads (default
    SHMASK_JSON_THREADS) straight from the chunk's views; without the core,
    that orjson.dumps. Raises StaleChunkError if the record was reclaimed
    before or while it was read."""
    check_threads(threads)
    _check_start(start, length)
    total = start + chunk.rows if length is None else length
    if _native() is not None:
        return _encode_native(chunk, start, threads, True, total)
    _check_start(start, total)
    return orjson.dumps({MASK_FIELD: orjson.Fragment(encode_chunk(chunk, start)),
                         LENGTH_FIELD: total})


def encode_chunk(chunk: Chunk, start: int = 0, threads: int | None = None) -> bytes:
    """One chunk's rows as the binary-rows object (JSON bytes; embed it
    with orjson.Fragment). `start` is recorded as the first row's index in
    the request. Bitmask rows are decoded; a dropped row (status not OK) has
    length 0 and its status. Written by the compiled core as
    encode_meta_info does (numpy and the base64 codec without it). Raises
    StaleChunkError if the record was reclaimed before or while it was
    read."""
    check_threads(threads)
    _check_start(start, 0)
    if _native() is not None:
        return _encode_native(chunk, start, threads, False, 0)
    ids, _ = chunk._csr_arrays()  # checked below, once the views were read
    _check_ids(ids)
    status = chunk.status if chunk.flags is not None else None
    logprobs = chunk.logprobs if chunk.support_mode else _selected_values(chunk.logprobs, status)
    out = _object(chunk.support_mode, start, chunk.rows, int(ids.size),
                  [_b64encode(_le_bytes(chunk.lengths, "<i4"))],
                  None if status is None else [_b64encode(_le_bytes(status, "u1"))],
                  [_b64encode(_le_bytes(ids, "<i4"))], [_b64encode(_le_bytes(logprobs, "<f4"))])
    chunk.check()  # the views were read: only good if the record is still ours
    return out


class EmissionBuffer:
    """Memory that encode_meta_info_many(..., into=buffer) writes an
    emission's documents into, kept for the next emission: a server that
    sends each emission's documents and drops them writes every emission
    into pages already mapped, where a bytes object per document is new
    memory each time (glibc gives an emission's 136 MB back when its
    documents are freed, and faulting them in again cost half the writer's
    time on the H200 host).

    The block is reused only when nothing made from the emission before is
    alive. Its documents are read-only memoryviews of a read-only numpy
    array over the block (a document's `.obj`); while that array, any
    document, or any view, slice, array or buffer made from one exists, the
    block has an export and refuses to be resized, which is what `_claim`
    tries. A block someone still reads is never written again: the next
    emission gets a new block, and the old one is freed with its last
    reader. The price: one document still held keeps its whole emission's
    block (136 MB at 256 x 50 x 1000) alive. Threads may share a buffer (a
    call that finds the block in use takes a new one)."""

    __slots__ = ("_block", "_lock", "blocks_made")

    def __init__(self) -> None:
        self._block: bytearray | None = None
        self._lock = threading.Lock()
        self.blocks_made = 0  # new blocks allocated so far (reuse is the rest)

    def _claim(self, size: int) -> tuple[bytearray, np.ndarray, int]:
        """(block, owner, first): a block that nothing else refers to, with
        `size` bytes from offset `first` (a 64-byte boundary, so that two
        threads' documents share no cache line), and the read-only array
        over it that the documents will be views of. Finding the block free
        and taking the array's export are one step under the lock."""
        with self._lock:
            block = self._block
            if block is None or len(block) < size + _ALIGN + 1 or not _unexported(block):
                block = bytearray(size + _ALIGN + 1)  # zero-filled: only documents are written
                self.blocks_made += 1
                self._block = block  # an old block lives on with its readers, if any
            owner = np.frombuffer(block, dtype=np.uint8)
            owner.flags.writeable = False
        return block, owner, -owner.ctypes.data % _ALIGN


def _unexported(block: bytearray) -> bool:
    """Whether no buffer export of `block` is alive: a bytearray refuses to
    be resized while one is (BufferError). It holds one byte past any
    document; taking it off and putting it back reallocates nothing."""
    try:
        del block[-1]
    except BufferError:
        return False
    block.append(0)
    return True


def encode_meta_info_many(chunks: Sequence[Chunk], starts: Sequence[int] | None = None,
                          threads: int | None = None, *,
                          lengths: Sequence[int | None] | None = None,
                          return_exceptions: bool = False,
                          into: EmissionBuffer | None = None) -> list[Any]:
    """[encode_meta_info(chunk, start, length=length) for each chunk]: an
    emission's responses in one native call, the GIL released once, each of
    up to `threads` (SHMASK_JSON_THREADS) threads taking whole documents in
    turn (no split and join per document). With `return_exceptions` a chunk
    that fails (StaleChunkError, a bad start...) has its exception in its
    place and costs no other chunk its result; without, the first failure is
    raised once every chunk is done. With `into` (an EmissionBuffer) each
    document is a read-only memoryview of the buffer's block instead of a
    bytes object (the same bytes; the compiled core only)."""
    count = len(chunks)
    starts = [0] * count if starts is None else list(starts)
    lengths = [None] * count if lengths is None else list(lengths)
    if len(starts) != count or len(lengths) != count:
        raise BinaryRowsError(f"binary rows: {count} chunks but {len(starts)} starts and "
                              f"{len(lengths)} lengths")
    check_threads(threads)
    results: list[Any] = [None] * count
    if into is not None and not isinstance(into, EmissionBuffer):
        raise TypeError(f"into must be an EmissionBuffer, got {type(into).__name__}")
    if into is not None and _native() is None:
        raise BinaryRowsError("binary rows: into= needs shmask's compiled core")
    if _native() is None:
        for i, (chunk, start, length) in enumerate(zip(chunks, starts, lengths, strict=True)):
            try:
                results[i] = encode_meta_info(chunk, start, length=length)
            except Exception as exc:  # kept in its place
                results[i] = exc
    else:
        ffi, lib = _native()
        prepared: list[tuple[int, _Prepared]] = []
        for i, (chunk, start, length) in enumerate(zip(chunks, starts, lengths, strict=True)):
            try:
                _check_start(start, length)
                total = start + chunk.rows if length is None else length
                prepared.append((i, _Prepared(chunk, start, True, total, into is None)))
            except Exception as exc:  # kept in its place
                results[i] = exc
        block = owner = None
        if into is not None:  # the documents side by side, each at a 64-byte boundary
            places = np.cumsum([0] + [-(-p.size // _ALIGN) * _ALIGN for _, p in prepared],
                               dtype=np.int64)
            block, owner, first = into._claim(int(places[-1]))
            places += first
        with (ffi.from_buffer(block) if block is not None else contextlib.nullcontext()) as base:
            jobs = ffi.new("shm_b64_rows_job[]", len(prepared))
            for k, (job, (_, p)) in enumerate(zip(jobs, prepared, strict=True)):
                if base is not None:
                    p.place(base + int(places[k]))
                (job.meta_info, job.support, job.start, job.rows, job.nnz, job.length,
                 job.lengths, job.status, job.ids, job.logprobs, job.out,
                 job.capacity) = p.arguments
            lib.shm_b64_rows_many(jobs, len(prepared), _threads(threads))
        view = None if owner is None else owner.data  # a memoryview whose .obj is the owner
        for k, (job, (i, p)) in enumerate(zip(jobs, prepared, strict=True)):
            try:
                written = p.finish(job.written)
                results[i] = (written if view is None
                              else view[int(places[k]):int(places[k]) + p.size])
            except Exception as exc:  # kept in its place
                results[i] = exc
        del view, owner  # the documents hold the block's export, not this function
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None and not return_exceptions:
        raise failed
    return results


def _check_start(start: object, length: object) -> None:
    """start and length (None: not given) are non-negative ints, never
    floats or bools (the object would carry them as they are)."""
    for name, value in (("start", start), ("length", length)):
        if value is None and name == "length":
            continue
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
            raise BinaryRowsError(f"binary rows: {name} must be a non-negative int, got "
                                  f"{value!r}")


def _check_ids(ids: np.ndarray) -> None:
    """Ids are non-negative int32 wherever rows enter (the decoder refuses
    others): rows handed over in-process are held to it too."""
    negative = np.flatnonzero(ids < 0)
    if negative.size:
        raise BinaryRowsError(f"binary rows: id {int(ids[negative[0]])} (at {int(negative[0])}) "
                              f"is negative: {ID_RULE}")


class _Prepared:
    """One chunk's arguments for the native writer (shm_b64_rows without
    its thread count), its result bytes, and the arrays they point into."""

    __slots__ = ("chunk", "arguments", "out", "keep", "size")

    def __init__(self, chunk: Chunk, start: int, meta_info: bool, length: int,
                 allocate: bool = True) -> None:
        from .response_json import new_bytes  # needs the core, as this path does

        ffi, lib = _native()
        _check_start(start, length)
        ids, _ = chunk._csr_arrays()  # checked in finish, once the views were read
        status = chunk.status if chunk.flags is not None else None
        logprobs = (chunk.logprobs if chunk.support_mode
                    else _selected_values(chunk.logprobs, status))
        rows, nnz, support = chunk.rows, int(ids.size), chunk.support_mode
        lengths = np.ascontiguousarray(chunk.lengths, "<i4")
        ids = np.ascontiguousarray(ids, "<i4")
        logprobs = np.ascontiguousarray(logprobs, "<f4")
        if (lengths.size != rows or logprobs.size != (nnz if support else rows)
                or status is not None and status.size != rows):
            raise BinaryRowsError(f"binary rows: a chunk of {rows} rows with {nnz} ids has "
                                  f"{lengths.size} lengths and {logprobs.size} logprobs")
        size = lib.shm_b64_rows_size(meta_info, support, start, rows, nnz, status is not None,
                                     length)
        if size == 0:
            raise BinaryRowsError(f"binary rows: {rows} rows of {nnz} ids are too many to write")
        # The result is written in place, every byte of it: a bytes object
        # that no one else holds yet, not zero-filled first
        # (response_json.new_bytes); its pages are first touched by the
        # threads that write them, so their faults run in parallel. Or, with
        # `allocate` false, wherever place() puts it (an EmissionBuffer).
        self.chunk, self.size = chunk, size
        self.out = new_bytes(size) if allocate else None
        status = None if status is None else np.ascontiguousarray(status, "u1")
        self.keep = (lengths, status, ids, logprobs)
        self.arguments = (meta_info, support, start, rows, nnz, length, ffi.from_buffer(lengths),
                          ffi.NULL if status is None else ffi.from_buffer(status),
                          ffi.from_buffer(ids), ffi.from_buffer(logprobs),
                          ffi.NULL if self.out is None else ffi.from_buffer(self.out), size)

    def place(self, out: Any) -> None:
        """Writes the document at `out` (a char pointer to self.size bytes)."""
        self.arguments = (*self.arguments[:-2], out, self.size)

    def finish(self, written: int) -> Any:
        """The bytes, once the writer returned `written`: checked, and only
        good if the chunk's record is still ours (StaleChunkError)."""
        if written != self.size:
            self.chunk.check()  # reclaimed under the writer: that is why
            _check_ids(self.keep[2])  # the writer refuses negative ids
            raise BinaryRowsError(f"binary rows: the writer failed with code {written}")
        self.chunk.check()  # the views were read: only good if the record is still ours
        return self.out


def _encode_native(chunk: Chunk, start: int, threads: int | None, meta_info: bool,
                   length: int) -> bytes:
    prepared = _Prepared(chunk, start, meta_info, length)
    _, lib = _native()
    return prepared.finish(lib.shm_b64_rows(*prepared.arguments, _threads(threads)))


class _Column:
    """One field's values, accumulated as little-endian bytes, with the
    base64 of its whole 3-byte groups cached: base64 of a concatenation is
    the base64 of a prefix of 3k bytes followed by that of the rest, so a
    cumulative response encodes only what arrived since the last one."""

    __slots__ = ("raw", "encoded", "done")

    def __init__(self) -> None:
        self.raw = bytearray()
        self.encoded: list[bytes] = []  # base64 pieces of raw[:done], joined into each response
        self.done = 0  # a multiple of 3

    def b64(self, begin: int) -> list[Any]:
        """Base64 of raw[begin:], as pieces to join."""
        with memoryview(self.raw) as view:
            if begin:  # an incremental response: only its rows, not cached
                return [_b64encode(view[begin:])]
            whole = len(self.raw) - len(self.raw) % 3
            if whole > self.done:
                self.encoded.append(_b64encode(view[self.done:whole]))
                self.done = whole
            return [*self.encoded, _b64encode(view[whole:])]


class SamplingMaskBase64:
    """A request's accumulated sampling masks as binary rows (the binary
    counterpart of shmask.adapters.sglang.SamplingMaskJSON). `extend(chunk)`
    per emission copies the rows out (the caller releases the chunk at
    once); `fields(start)` per response gives the meta_info fields."""

    __slots__ = ("support", "_lengths", "_status", "_ids", "_logprobs", "_rows", "_dropped")

    def __init__(self, support_logprobs: bool) -> None:
        if not isinstance(support_logprobs, bool | np.bool_):
            raise TypeError(f"SamplingMaskBase64: support_logprobs must be True or False, got "
                            f"{support_logprobs!r}")
        self.support = bool(support_logprobs)
        self._lengths, self._status = _Column(), _Column()
        self._ids, self._logprobs = _Column(), _Column()
        self._rows = 0
        self._dropped = False  # some row so far is not OK

    def extend(self, chunk: Chunk) -> None:
        if chunk.support_mode != self.support:
            raise BinaryRowsError(
                f"a {chunk.mode_name}-mode chunk cannot join a request whose rows are "
                f"{'support' if self.support else 'selected'}-mode")
        if not chunk.rows:
            return
        ids, _ = chunk._csr_arrays()  # checked below, once copied
        _check_ids(ids)
        status = chunk.status
        logprobs = chunk.logprobs if self.support else _selected_values(chunk.logprobs, status)
        columns = (self._lengths, self._status, self._ids, self._logprobs)
        sizes = [len(column.raw) for column in columns]
        for column, values, dtype in zip(columns, (chunk.lengths, status, ids, logprobs),
                                         ("<i4", "u1", "<i4", "<f4"), strict=True):
            column.raw += _le_bytes(values, dtype)
        try:
            chunk.check()  # the views were copied: only good if the record is still ours
        except Exception:
            for column, size in zip(columns, sizes, strict=True):
                del column.raw[size:]  # rows read after a reclaim never join the request
            raise
        self._rows += chunk.rows
        self._dropped = self._dropped or chunk.flags is not None and bool(status.any())

    def __len__(self) -> int:
        return self._rows

    def to_bytes(self, start: int = 0) -> bytes:
        """The object for rows [start:] (`start`, an int, clamped to [0,
        rows] as a slice's start is), as JSON bytes."""
        if not isinstance(start, int | np.integer) or isinstance(start, bool):
            raise BinaryRowsError(f"binary rows: start must be an int, got {start!r}")
        start = min(max(start, 0), self._rows)
        lengths = np.frombuffer(self._lengths.raw, "<i4")
        nnz_before = int(lengths[:start].sum(dtype=np.int64))
        nnz = int(lengths.sum(dtype=np.int64)) - nnz_before
        status = None
        if self._dropped and np.frombuffer(self._status.raw, np.uint8)[start:].any():
            status = self._status.b64(start)
        values_begin = nnz_before if self.support else start
        return _object(self.support, start, self._rows - start, nnz, self._lengths.b64(4 * start),
                       status, self._ids.b64(4 * nnz_before),
                       self._logprobs.b64(4 * values_begin))

    def fields(self, start: int = 0) -> dict[str, Any]:
        """The meta_info fields for rows [start:]: the object under
        output_token_sampling_mask (an orjson.Fragment; it carries the
        logprobs, so output_token_sampling_logprobs is left out) and
        output_token_sampling_mask_length, the request's total rows (as in
        the JSON form)."""
        return {MASK_FIELD: orjson.Fragment(self.to_bytes(start)), LENGTH_FIELD: self._rows}


# ------------------------------------------------------------ client side
@dataclass(frozen=True)
class BinaryRows:
    """Decoded rows in CSR form. Row i's ids are
    `ids[offsets[i]:offsets[i + 1]]` (ascending); its logprobs the same
    slice of `logprobs` (support mode) or `logprobs[i]` (selected mode).
    `status[i]` 0 is OK; 1 (OVERFLOW) or 2 (INVALID) marks a dropped row:
    length 0, no ids, and in selected mode a NaN logprob; never the same as
    an empty row. `start` is the first row's index in the request."""

    mode: str
    start: int
    lengths: Any  # int32 [rows]
    offsets: Any  # int64 [rows + 1]
    ids: Any  # int32 [nnz]
    logprobs: Any  # float32 [nnz] (support) or [rows] (selected)
    status: Any  # uint8 [rows]

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"binary rows: {name} must be True or False, got {value!r}")


def _count(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise BinaryRowsError(f"binary rows: {name!r} must be a non-negative integer, "
                              f"got {value!r}")
    return value


def _header(obj: dict[str, Any]) -> tuple[str, int, int, int]:
    """(mode, start, rows, nnz) of a parsed object, checked."""
    if obj.get("format") != FORMAT:
        raise BinaryRowsError(f"binary rows: 'format' must be {FORMAT!r}, got "
                              f"{obj.get('format')!r}")
    version = obj.get("version")
    if type(version) is not int or version != VERSION:  # not 1.0, not true
        raise BinaryRowsError(f"binary rows: 'version' {obj.get('version')!r} is not supported "
                              f"(this decoder reads version {VERSION})")
    mode = obj.get("mode")
    if mode not in MODES:
        raise BinaryRowsError(f"binary rows: 'mode' must be one of {MODES}, got {mode!r}")
    return mode, _count(obj, "start"), _count(obj, "rows"), _count(obj, "nnz")


def _counts(mode: str, rows: int, nnz: int) -> dict[str, int]:
    """Each field's number of values."""
    return {"lengths": rows, "status": rows, "ids": nnz,
            "logprobs": nnz if mode == "support" else rows}


def _check_chars(name: str, chars: int, count: int, itemsize: int) -> int:
    """The field's decoded size; its base64 length checked against it
    before decoding, so that a forged count cannot size an allocation."""
    size = count * itemsize
    if chars != 4 * -(-size // 3):
        raise BinaryRowsError(
            f"binary rows: {name!r} has {chars} base64 characters; {count} values of "
            f"{itemsize} bytes take {4 * -(-size // 3)}")
    return size


def _field(obj: dict[str, Any], name: str, count: int, dtype: str, writable: bool,
           required: bool = True) -> np.ndarray | None:
    """Field `name`: `count` values of `dtype` (little-endian), checked
    before and after decoding."""
    text = obj.get(name)
    if text is None and not required:
        return None
    if not isinstance(text, str | bytes):
        raise BinaryRowsError(f"binary rows: {name!r} must be a base64 string, got "
                              f"{type(text).__name__}")
    itemsize = np.dtype(dtype).itemsize
    size = _check_chars(name, len(text), count, itemsize)
    try:
        data = _b64decode(text, writable)
    except (binascii.Error, ValueError) as exc:
        raise BinaryRowsError(f"binary rows: {name!r} is not valid base64: {exc}") from None
    if len(data) != size or len(data) % itemsize:
        raise BinaryRowsError(f"binary rows: {name!r} decodes to {len(data)} bytes, not "
                              f"{count} values of {itemsize} bytes")
    array = np.frombuffer(data, dtype)
    if not _LITTLE and itemsize > 1:
        array = array.astype(np.dtype(dtype).newbyteorder("="))  # a big-endian host
    return array


def _rows(mode: str, start: int, nnz: int, arrays: dict[str, Any], torch: bool,
          negative: tuple[bool | None, bool | None] = (None, None)) -> BinaryRows:
    """The decoded fields checked against each other, as BinaryRows.
    `negative` (from the native decoder) says whether 'lengths' and 'ids'
    hold a negative value; None: numpy looks."""
    lengths, status, ids, logprobs = (arrays["lengths"], arrays.get("status"), arrays["ids"],
                                      arrays["logprobs"])
    rows = lengths.shape[0]
    if rows and (int(lengths.min()) < 0 if negative[0] is None else negative[0]):
        raise BinaryRowsError(f"binary rows: 'lengths' has a negative length at row "
                              f"{int(np.argmin(lengths))}")
    offsets = np.empty(rows + 1, np.int64)
    offsets[0] = 0
    np.add.accumulate(lengths, out=offsets[1:], dtype=np.int64)  # np.cumsum, less overhead
    if offsets.item(-1) != nnz:
        raise BinaryRowsError(f"binary rows: 'lengths' sum to {offsets.item(-1)}, "
                              f"'nnz' is {nnz}")
    if status is None:
        status = np.zeros(rows, np.uint8)
    elif rows:
        if int(status.max()) > _STATUS_MAX:
            raise BinaryRowsError(f"binary rows: 'status' has an unknown value "
                                  f"{int(status.max())} (0 OK, 1 OVERFLOW, 2 INVALID)")
        bad = np.flatnonzero((status != 0) & (lengths != 0))
        if bad.size:
            raise BinaryRowsError(f"binary rows: row {int(bad[0])} is dropped ('status') "
                                  f"but has length {int(lengths[bad[0]])}")
    if nnz and (int(ids.min()) < 0 if negative[1] is None else negative[1]):
        raise BinaryRowsError(f"binary rows: 'ids' has a negative id at {int(np.argmin(ids))}")
    if torch:
        import torch as _torch
        return BinaryRows(mode, start, *(_torch.from_numpy(a)
                                         for a in (lengths, offsets, ids, logprobs, status)))
    return BinaryRows(mode, start, lengths, offsets, ids, logprobs, status)


def decode_rows(obj: dict[str, Any] | str | bytes, *, torch: bool = False) -> BinaryRows:
    """The binary-rows object (as parsed from JSON, or its JSON text, or a
    meta_info dict holding it under output_token_sampling_mask) as CSR
    arrays: numpy arrays (the decoded ones read-only, views of the decoded
    bytes), or torch tensors sharing writable buffers (`torch=True`; torch
    is imported only then): pybase64 decodes into them directly, the stdlib
    codec's bytes are copied once. (`loads` decodes a whole response body,
    faster: it never makes the base64 Python strings.)
    Raises BinaryRowsError naming the field for anything malformed."""
    _check_flag("torch", torch)
    if isinstance(obj, str | bytes):
        try:
            obj = orjson.loads(obj)
        except orjson.JSONDecodeError as exc:
            raise BinaryRowsError(f"binary rows: not JSON: {exc}") from None
    if isinstance(obj, dict) and MASK_FIELD in obj:
        obj = obj[MASK_FIELD]
    if not isinstance(obj, dict):
        raise BinaryRowsError(f"binary rows: expected a JSON object, got {type(obj).__name__}")
    return _decode_object(obj, torch)


def _decode_object(obj: dict[str, Any], torch: bool) -> BinaryRows:
    mode, start, rows, nnz = _header(obj)
    counts = _counts(mode, rows, nnz)
    arrays = {name: _field(obj, name, counts[name], dtype, torch, required=name != "status")
              for name, dtype in _FIELDS}
    return _rows(mode, start, nnz, arrays, torch)


# ------------------------------------------------------- client: loads
_DTYPES = tuple((name, dtype, np.dtype(dtype)) for name, dtype in _FIELDS)


def _is_rows(value: Any) -> bool:
    """A binary-rows object: "format": "base64" and "version": 1 (an int)."""
    return (type(value) is dict and value.get("format") == FORMAT
            and type(value.get("version")) is int and value["version"] == VERSION)


def _find_rows(tree: Any) -> list[tuple[Any, Any, dict[str, Any]]]:
    """Every binary-rows object of a parsed document: (container, key,
    object), container None for the document itself."""
    if _is_rows(tree):
        return [(None, None, tree)]
    found = []
    stack = [tree] if type(tree) in (dict, list) else []
    while stack:
        node = stack.pop()
        for key, value in (node.items() if type(node) is dict else enumerate(node)):
            if type(value) is dict:
                if _is_rows(value):
                    found.append((node, key, value))
                else:
                    stack.append(value)
            elif type(value) is list:
                stack.append(value)
    return found


def _placed(tree: Any, found: list[tuple[Any, Any, dict[str, Any]]], rows: list[BinaryRows]) -> Any:
    """`tree` with each found object replaced by its rows."""
    for (container, key, _), decoded in zip(found, rows, strict=True):
        if container is None:
            return decoded
        container[key] = decoded
    return tree


def _convert(tree: Any, torch: bool) -> Any:
    """`tree` with every binary-rows object in it (itself included) decoded
    as decode_rows does: loads' reference path."""
    found = _find_rows(tree)
    return _placed(tree, found, [_decode_object(obj, torch) for _, _, obj in found])


class _Fallback(Exception):
    """The native path cannot vouch for what it read: the reference path
    (orjson.loads + decode_rows) decides."""


def _loads_native(data: bytes | bytearray | memoryview, torch: bool, ffi: Any, lib: Any) -> Any:
    """loads with the compiled core, or _Fallback (or any ValueError) where
    the reference path must decide: a body that is not JSON, a binary-rows
    string that is not plain base64 (escapes, a character outside the
    alphabet, a length its counts do not give), an object the scan and the
    parser see differently, a malformed object. Well-formed bodies never
    fall back."""
    text = ffi.from_buffer(data)
    error_at = ffi.new("uint64_t *")
    capacity = 4
    while True:
        found = ffi.new("int64_t[]", 8 * capacity)
        count = lib.shm_b64_scan(text, len(data), found, capacity, error_at)
        if count <= capacity:
            break
        capacity = count  # more objects than room: once more, with room for all
    if count <= 0:  # none, or not JSON
        raise _Fallback
    spans = ffi.unpack(found, 8 * count)  # field k: spans[2k], spans[2k + 1]
    present = sorted((spans[2 * k], spans[2 * k + 1], k) for k in range(4 * count)
                     if spans[2 * k] >= 0)
    # Each found string replaced by a placeholder (a random nonce: no string
    # of the body can be taken for one): what is left for orjson is a few
    # hundred bytes per object.
    prefix = f"shmask-binary-rows:{os.urandom(8).hex()}:"
    marks: dict[str, int] = {}
    pieces: list[Any] = []
    view = memoryview(data)
    done = 0
    for begin, end, k in present:
        mark = f"{prefix}{k}"
        marks[mark] = k
        pieces += [view[done:begin], mark.encode()]
        done = end
    pieces.append(view[done:])
    tree = orjson.loads(b"".join(pieces))
    objects = _find_rows(tree)
    # Every found string's field, decoded natively into one buffer: the
    # object's arrays and negatives, name, dtype, count, offset in `out`;
    # `plan` the decoder's spans.
    plans = []
    native: list[tuple[dict[str, Any], dict[str, bool], str, np.dtype, int, int]] = []
    plan: list[int] = []
    out_size = 0
    for _, _, obj in objects:
        mode, start, rows, nnz = _header(obj)
        counts = (rows, rows, nnz, nnz if mode == "support" else rows)
        arrays: dict[str, Any] = {}
        negatives: dict[str, bool] = {}  # 'lengths', 'ids': negative values, as decoded natively
        for (name, dtype, numpy_dtype), count in zip(_DTYPES, counts, strict=True):
            value = obj.get(name)
            k = marks.get(value, -1) if type(value) is str else -1
            if k < 0:  # a value the scan did not take (not a string, say)
                arrays[name] = _field(obj, name, count, dtype, torch, required=name != "status")
                continue
            begin, end = spans[2 * k], spans[2 * k + 1]
            size = count * numpy_dtype.itemsize
            if end - begin != 4 * -(-size // 3):
                raise _Fallback  # escapes, or the wrong length: the reference path says
            native.append((arrays, negatives, name, numpy_dtype, count, out_size))
            plan += [begin, end - begin, out_size, size]
            out_size += -(-size // _ALIGN) * _ALIGN
        plans.append((mode, start, nnz, arrays, negatives))
    if len(native) != len(present):  # a found string the parser puts elsewhere
        raise _Fallback
    out = np.empty(max(out_size, 1), np.uint8)
    results = ffi.new("int64_t[]", 2 * len(native))
    code = lib.shm_b64_decode(text, len(data), ffi.new("uint64_t[]", plan), len(native),
                              ffi.from_buffer("uint8_t[]", out), out.size, results, _threads(None))
    if code != 0:
        raise BinaryRowsError(f"binary rows: the decoder failed with code {code}")
    checked = ffi.unpack(results, 2 * len(native))  # per field: first bad character, negative
    if any(bad >= 0 for bad in checked[::2]):  # not plain base64: no span can be trusted
        raise _Fallback
    for (arrays, negatives, name, numpy_dtype, count, offset), negative in zip(
            native, checked[1::2], strict=True):
        arrays[name] = np.frombuffer(out, numpy_dtype, count, offset)
        negatives[name] = negative != 0
    return _placed(tree, objects, [
        _rows(mode, start, nnz, arrays, torch, (negatives.get("lengths"), negatives.get("ids")))
        for mode, start, nnz, arrays, negatives in plans])


def loads(body: bytes | bytearray | memoryview | str, *, torch: bool = False) -> Any:
    """orjson.loads(body), with every binary-rows object in the document
    (an object whose "format" is "base64" and "version" 1) decoded as
    decode_rows does: BinaryRows in its place, numpy arrays or (`torch`)
    tensors, every field checked (BinaryRowsError names it). Malformed JSON
    raises orjson.JSONDecodeError, as orjson.loads does.

    With the compiled core, the base64 never becomes Python strings: a
    native scan of the body (a JSON tokenizer: strings, escapes, nesting;
    the big strings jumped over where the object's counts give their
    length) finds the objects, their big strings are decoded and checked in
    parallel (SHMASK_JSON_THREADS threads) straight into numpy arrays (one
    buffer per body), and orjson parses only the rest. Anything the native
    path cannot vouch for (bad input of any kind, JSON escapes inside the
    base64) is left to orjson.loads and decode_rows, which is also the
    path without the core: both give the same rows and the same errors
    (a str holding a lone surrogate, which no UTF-8 body can, or a body of
    another type: orjson.JSONDecodeError, as from orjson.loads)."""
    _check_flag("torch", torch)
    native = _native()
    if native is not None and isinstance(body, str):
        try:
            body = body.encode()
        except UnicodeEncodeError:  # a lone surrogate: orjson.loads says so
            native = None
    if native is not None and isinstance(body, bytes | bytearray | memoryview):
        data = body
        if isinstance(data, memoryview):
            data = data.cast("B") if data.contiguous else data.tobytes()
        try:
            return _loads_native(data, torch, *native)
        except (_Fallback, ValueError):
            body = data
    return _convert(orjson.loads(body), torch)

"""The native response writer (native/response_json.c): a chunk's three
response fields as JSON, byte for byte what orjson writes for the Python
lists (`Chunk.to_lists()`), without a Python object per value.

Floats are float32 values widened to double and written in the shortest
form that reads back as the same double, exactly as orjson writes a Python
float (NaN and infinities as null). The C call releases the GIL and splits
the rows across up to SHMASK_JSON_THREADS threads: the calling thread and
workers of a pool the C core starts once per process (not per call), each
writing its own span of each array into this thread's scratch buffer; the
spans are joined in the one copy that makes the returned bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

from ._native import ffi, lib
from .config import Config, check_threads
from .documents import map_documents
from .errors import InvalidRowsError, ShmaskError
from .refs import ID_RULE

_threads: int | None = None
_KEEP_BYTES = 32 << 20  # scratch kept per thread between calls (larger ones are freed)
_scratch = threading.local()


def _setting(name: str) -> Config:
    """A Config of the defaults and this one SHMASK_* variable, validated
    (a process-wide setting of the writer, not one of a Reader's Config)."""
    return Config.from_env({name: os.environ[name]} if name in os.environ else {})


def json_threads() -> int:
    """SHMASK_JSON_THREADS, read (and validated) once per process."""
    global _threads
    if _threads is None:
        _threads = _setting("SHMASK_JSON_THREADS").json_threads
    return _threads


def response_arrays(support: bool, lengths: np.ndarray, flags: np.ndarray | None,
                    ids: np.ndarray, logprobs: np.ndarray,
                    threads: int | None = None) -> tuple[bytes, bytes, bytes]:
    """(ids per row, logprobs per row or per token, lengths) as JSON arrays.

    `ids` holds the rows' ids back to back (decoded: sum of lengths),
    `logprobs` as many values (support mode) or one per row (selected). A
    row whose status (flags & ROW_STATUS_MASK, shmask.layout) is not OK is null in all three and must
    have length 0. Ids are non-negative int32 (0 <= id < 2**31), as
    everywhere rows enter: a negative one raises InvalidRowsError. `threads`
    (default SHMASK_JSON_THREADS): at most this many threads share the
    rows; small chunks use fewer."""
    _check_support(support)
    check_threads(threads)
    out, fields = _write_rows(support, lengths, flags, ids, logprobs, threads, _scratch_buffer)
    # Each array is its parts' spans, joined in the one copy out of the scratch.
    view = memoryview(out)
    joined = [b"".join([view[start:start + length] for start, length in spans])
              for spans in fields]
    return joined[0], joined[1], joined[2]


Spans = list[tuple[int, int]]


def _write_rows(support: bool, lengths: np.ndarray, flags: np.ndarray | None, ids: np.ndarray,
                logprobs: np.ndarray, threads: int | None,
                buffer_for: Callable[[int], bytearray]) -> tuple[bytearray, list[Spans]]:
    """The three arrays written into a buffer from `buffer_for(bound)`: the
    buffer and, per field, its (offset, length) spans in order."""
    lengths = _contiguous(lengths, np.int32)
    ids = _contiguous(ids, np.int32)
    logprobs = _contiguous(logprobs, np.float32)
    rows = lengths.size
    bound = lib.shm_json_rows_bound(int(support), rows, ids.size)
    if bound == 0:
        raise ShmaskError(f"response JSON: {rows} rows of {ids.size} ids are too many to write")
    out = buffer_for(bound)
    spans = ffi.new("uint64_t[]", 6 * lib.SHM_JSON_MAX_THREADS)
    parts = ffi.new("int *")
    flags_ptr = ffi.NULL if flags is None else ffi.from_buffer("uint8_t[]",
                                                               _contiguous(flags, np.uint8))
    code = lib.shm_json_rows(int(support), ffi.from_buffer("int32_t[]", lengths), flags_ptr, rows,
                             ffi.from_buffer("int32_t[]", ids), ids.size,
                             ffi.from_buffer("float[]", logprobs), logprobs.size,
                             json_threads() if threads is None else threads,
                             ffi.from_buffer(out), len(out), spans, parts)
    if code == lib.SHM_JSON_E_ROWS:
        negative = np.flatnonzero(ids < 0)
        if negative.size:  # the writer refuses them (ids are non-negative int32)
            raise InvalidRowsError(
                f"response JSON: id {int(ids[negative[0]])} (at {int(negative[0])}) is "
                f"negative: {ID_RULE}")
        raise ShmaskError(
            f"response JSON: {rows} rows whose lengths (sum {int(lengths.sum())}) or statuses "
            f"disagree with {ids.size} ids and {logprobs.size} logprobs "
            f"({'support' if support else 'selected'} mode)")
    if code != 0:
        raise ShmaskError(f"response JSON: the writer failed with code {code}")
    count, stride = parts[0], lib.SHM_JSON_MAX_THREADS
    return out, [[(spans[2 * (field * stride + i)], spans[2 * (field * stride + i) + 1])
                  for i in range(count)] for field in range(3)]


# ----------------------------------------------------------- whole documents

class RowsJSON:
    """A chunk's rows, to be written as JSON arrays where a document given
    to `dumps` holds `.ids`, `.logprobs` or `.lengths` (each the array
    Chunk.json_arrays would return). Nothing is written before `dumps`: the
    rows go from the ring straight into the document's bytes, with one copy
    of the written text (no bytes object per array, no orjson pass over
    them). `check` (if given) is called after writing: a chunk whose record
    was reclaimed meanwhile raises StaleChunkError there."""

    __slots__ = ("support", "lengths", "flags", "ids_values", "logprobs_values", "check",
                 "ids", "logprobs", "lengths_field")

    def __init__(self, support: bool, lengths: np.ndarray, flags: np.ndarray | None,
                 ids: np.ndarray, logprobs: np.ndarray,
                 check: Callable[[], None] | None = None) -> None:
        _check_support(support)
        self.support, self.lengths, self.flags = bool(support), lengths, flags
        self.ids_values, self.logprobs_values, self.check = ids, logprobs, check
        self.ids, self.logprobs, self.lengths_field = (_RowsField(self, f) for f in range(3))


class _RowsField:
    """One of a RowsJSON's three arrays, as placed in a document."""

    __slots__ = ("rows", "field")

    def __init__(self, rows: RowsJSON, field: int) -> None:
        self.rows, self.field = rows, field


class RawJSON:
    """JSON text given as pieces (bytes or memoryviews), placed in a
    document by `dumps` as their concatenation, copied once, into it."""

    __slots__ = ("pieces",)

    def __init__(self, *pieces: bytes | memoryview) -> None:
        self.pieces = pieces


# orjson never writes a NUL byte (strings escape control characters), so a
# NUL in its output marks where a hole was.
_HOLE = b"\x00"
_HOLE_FRAGMENT = orjson.Fragment(_HOLE)


def dumps(obj: Any, *, option: int | None = None, default: Callable[[Any], Any] | None = None,
          threads: int | None = None) -> bytes:
    """orjson.dumps(obj), where RowsJSON fields and RawJSON values are
    written natively: orjson writes the document around them (small), every
    RowsJSON is written once by the native writer, and the pieces are
    gathered into the one result in a single copy, shared by up to
    `threads` (SHMASK_JSON_THREADS) threads. Byte for byte what orjson
    writes for the same document with the rows as Python lists."""
    check_threads(threads)
    holes: list[_RowsField | RawJSON] = []

    def place(value: Any) -> Any:
        if isinstance(value, _RowsField | RawJSON):
            holes.append(value)
            return _HOLE_FRAGMENT
        if default is not None:
            return default(value)
        raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")

    skeleton = (orjson.dumps(obj, default=place) if option is None
                else orjson.dumps(obj, default=place, option=option))
    around = skeleton.split(_HOLE)
    if len(around) != len(holes) + 1:
        raise ShmaskError("response JSON: a NUL byte in the document outside shmask's "
                          "placeholders (an orjson.Fragment holding one?)")
    threads = json_threads() if threads is None else threads
    written: dict[int, tuple[bytearray, list[Spans]]] = {}  # per RowsJSON, by id
    sources: list[RowsJSON] = []  # each RowsJSON once, to check after the copy
    pieces: list[Any] = [around[0]]
    for hole, after in zip(holes, around[1:], strict=True):
        if isinstance(hole, RawJSON):
            pieces.extend(hole.pieces)
        else:
            rows = hole.rows
            if id(rows) not in written:
                # The first RowsJSON uses this thread's scratch, any other a buffer of its own.
                try:
                    written[id(rows)] = _write_rows(
                        rows.support, rows.lengths, rows.flags, rows.ids_values,
                        rows.logprobs_values, threads, _scratch_buffer if not written else bytearray)
                except Exception:
                    if rows.check is not None:
                        rows.check()  # a late read is StaleChunkError, whatever failed
                    raise
                sources.append(rows)
            out, fields = written[id(rows)]
            view = memoryview(out)
            pieces.extend(view[start:start + length] for start, length in fields[hole.field])
        pieces.append(after)
    document = _gather(pieces, threads)
    for rows in sources:
        if rows.check is not None:
            rows.check()
    return document


def dumps_many(objs: Sequence[Any], *, option: int | None = None,
               default: Callable[[Any], Any] | None = None, threads: int | None = None,
               return_exceptions: bool = False) -> list[Any]:
    """[dumps(obj) for obj in objs], the documents written in parallel on up
    to `threads` (SHMASK_JSON_THREADS) threads: an emission's responses at
    once, as a tokenizer gets them. With at least as many documents as
    threads each document is written whole by one thread (no split and
    join per document, no thread idle while the next one's small Python
    part runs: every document's native part releases the GIL); fewer
    documents share the threads. Results in the order of `objs`.

    A document that fails costs only its own result: with
    `return_exceptions` its exception takes its place in the list (what a
    server needs: one request's error, the others' responses); without,
    the first failure is raised once every document is done."""
    check_threads(threads)
    return map_documents(
        lambda obj, each: dumps(obj, option=option, default=default, threads=each), objs,
        json_threads() if threads is None else threads, return_exceptions)


def new_bytes(size: int) -> bytes:
    """A new bytes object of `size` bytes whose contents the caller writes
    in full before anyone else sees it (what C code does with
    PyBytes_FromStringAndSize(NULL, n)): not zero-filled first. bytes(n)
    is calloc'd, which zero-fills memory the allocator reuses: a second
    pass over every byte of every response."""
    return _uninitialized_bytes(None, size) if _uninitialized_bytes else bytes(size)


def _uninitialized_bytes_function() -> Any:
    try:
        import ctypes

        function = ctypes.pythonapi.PyBytes_FromStringAndSize
    except (ImportError, AttributeError):  # not CPython: zero-filled bytes(n)
        return None
    function.restype = ctypes.py_object
    function.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    return function


_uninitialized_bytes = _uninitialized_bytes_function()


def _gather(pieces: list[Any], threads: int) -> bytes:
    """The pieces' concatenation as a new bytes object, copied natively."""
    keep = [ffi.from_buffer(piece) for piece in pieces]
    lengths = [len(piece) for piece in keep]
    total = sum(lengths)
    # Every byte is written by the gather (the pieces add up to `total`),
    # on the pool's threads: they take the page faults of fresh memory too.
    document = new_bytes(total)
    code = lib.shm_json_gather(ffi.from_buffer(document), total, keep, lengths, len(keep),
                               threads)
    if code != 0:
        raise ShmaskError(f"response JSON: the gather failed with code {code}")
    return document


def _scratch_buffer(size: int) -> bytearray:
    """A buffer of at least `size` bytes for this thread: reused across
    calls (a fresh one would be zero-filled and page-faulted every time),
    unless it would be large; the result is copied out before reuse."""
    buffer: bytearray | None = getattr(_scratch, "buffer", None)
    if buffer is not None and len(buffer) >= size:
        return buffer
    buffer = bytearray(size)
    if size <= _KEEP_BYTES:
        _scratch.buffer = buffer
    return buffer


def _apply_simd_setting() -> None:
    """SHMASK_JSON_SIMD=off turns the AVX-512 paths off for the process."""
    if not _setting("SHMASK_JSON_SIMD").json_simd:
        lib.shm_set_avx512(0)


def avx512(enable: bool | None = None) -> bool:
    """Whether the response writers use AVX-512 (the CPU decides at first
    use; SHMASK_JSON_SIMD=off turns it off): floats and ids converted eight
    at a time, base64 encoded 48 bytes at a time. `enable` True or False sets
    it for the process (True only where the CPU has AVX-512), None leaves it.
    Returns the setting now. Every path writes the same bytes either way;
    this is for the tests that check both and for measuring."""
    if enable is not None and type(enable) is not bool:
        raise TypeError(f"avx512: enable must be True, False or None, got {enable!r}")
    if enable is not None:
        lib.shm_set_avx512(int(enable))
    return bool(lib.shm_set_avx512(-1))


def float_json(values: np.ndarray) -> bytes:
    """A JSON array of float32 values widened to double, as orjson writes
    the Python floats (used to check the formatting value by value)."""
    values = _contiguous(values, np.float32)
    capacity = 2 + values.size * (lib.SHM_JSON_FLOAT_BYTES + 1) + lib.SHM_JSON_ROOM
    out = bytearray(capacity)
    written = lib.shm_json_floats(ffi.from_buffer("float[]", values), values.size,
                                  ffi.from_buffer(out), capacity)
    if written < 0:
        raise ShmaskError(f"response JSON: the writer failed with code {written}")
    del out[written:]
    return bytes(out)


def _check_support(support: object) -> None:
    """Support mode or not: a bool (numpy's too), never a number or a string
    taken by its truth."""
    if not isinstance(support, bool | np.bool_):
        raise TypeError(f"support must be True (support mode) or False (selected), "
                        f"got {support!r}")


def _contiguous(array: np.ndarray, dtype: type) -> np.ndarray:
    """`array` as a C-contiguous array of `dtype`: the C writer reads raw
    memory, so nothing is converted (and nothing of another shape flattened)."""
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
        got = (f"{array.dtype} of shape {array.shape}" if isinstance(array, np.ndarray)
               else type(array).__name__)
        raise InvalidRowsError(f"response JSON: expected a 1-D numpy array of "
                               f"{np.dtype(dtype).name}, got {got}")
    return np.ascontiguousarray(array)


_apply_simd_setting()

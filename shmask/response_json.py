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

import numpy as np

from ._native import ffi, lib
from .config import Config
from .errors import ShmaskError

_threads: int | None = None
_KEEP_BYTES = 32 << 20  # scratch kept per thread between calls (larger ones are freed)
_scratch = threading.local()


def json_threads() -> int:
    """SHMASK_JSON_THREADS, read (and validated) once per process."""
    global _threads
    if _threads is None:
        name = "SHMASK_JSON_THREADS"
        environ = {name: os.environ[name]} if name in os.environ else {}
        _threads = Config.from_env(environ).json_threads
    return _threads


def response_arrays(support: bool, lengths: np.ndarray, flags: np.ndarray | None,
                    ids: np.ndarray, logprobs: np.ndarray,
                    threads: int | None = None) -> tuple[bytes, bytes, bytes]:
    """(ids per row, logprobs per row or per token, lengths) as JSON arrays.

    `ids` holds the rows' ids back to back (decoded: sum of lengths),
    `logprobs` as many values (support mode) or one per row (selected). A
    row whose status (flags & 3) is not OK is null in all three and must
    have length 0. `threads` (default SHMASK_JSON_THREADS): at most this
    many threads share the rows; small chunks use fewer."""
    lengths = _contiguous(lengths, np.int32)
    ids = _contiguous(ids, np.int32)
    logprobs = _contiguous(logprobs, np.float32)
    rows = lengths.size
    bound = lib.shm_json_rows_bound(int(support), rows, ids.size)
    if bound == 0:
        raise ShmaskError(f"response JSON: {rows} rows of {ids.size} ids are too many to write")
    out = _scratch_buffer(bound)
    spans = ffi.new("uint64_t[]", 6 * lib.SHM_JSON_MAX_THREADS)
    parts = ffi.new("int *")
    flags_ptr = ffi.NULL if flags is None else ffi.from_buffer("uint8_t[]",
                                                               _contiguous(flags, np.uint8))
    code = lib.shm_json_rows(int(support), ffi.from_buffer("int32_t[]", lengths), flags_ptr, rows,
                             ffi.from_buffer("int32_t[]", ids), ids.size,
                             ffi.from_buffer("float[]", logprobs), logprobs.size,
                             json_threads() if threads is None else threads,
                             ffi.from_buffer(out), bound, spans, parts)
    if code == lib.SHM_JSON_E_ROWS:
        raise ShmaskError(
            f"response JSON: {rows} rows whose lengths (sum {int(lengths.sum())}) or statuses "
            f"disagree with {ids.size} ids and {logprobs.size} logprobs "
            f"({'support' if support else 'selected'} mode)")
    if code != 0:
        raise ShmaskError(f"response JSON: the writer failed with code {code}")
    # Each array is its parts' spans, joined in the one copy out of the scratch.
    view, count, stride = memoryview(out), parts[0], lib.SHM_JSON_MAX_THREADS
    if count == 1:
        return (bytes(view[spans[0]:spans[0] + spans[1]]),
                bytes(view[spans[2 * stride]:spans[2 * stride] + spans[2 * stride + 1]]),
                bytes(view[spans[4 * stride]:spans[4 * stride] + spans[4 * stride + 1]]))
    fields = []
    for field in range(3):
        pairs = [(spans[2 * (field * stride + i)], spans[2 * (field * stride + i) + 1])
                 for i in range(count)]
        fields.append(b"".join([view[start:start + length] for start, length in pairs]))
    return fields[0], fields[1], fields[2]


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


def _contiguous(array: np.ndarray, dtype: type) -> np.ndarray:
    """`array` as a C-contiguous array of `dtype`: the C writer reads raw memory."""
    if array.dtype != dtype:
        raise ShmaskError(f"response JSON: expected {np.dtype(dtype).name} values, "
                          f"got {array.dtype}")
    return np.ascontiguousarray(array)

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

Server side: `encode_chunk(chunk)` (one chunk's rows) or `SamplingMaskBase64`
(a request's rows accumulated across emissions, like the SGLang adapter's
SamplingMaskJSON: `extend(chunk)` per emission, `fields(start)` per
response, the object as an orjson.Fragment). Client side: `decode_rows(obj)`
gives CSR numpy arrays (or torch tensors) with no Python object per row, and
checks everything it reads: the client's input is untrusted too.

This module needs numpy only (and orjson for the Fragment): a client decodes
without the compiled core. pybase64 (the `binary` extra) is used when it is
installed: 2x faster encoding and 7x faster decoding than binascii here, the
same bytes.
"""

from __future__ import annotations

import binascii
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from .errors import ShmaskError

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


def encode_chunk(chunk: Chunk, start: int = 0) -> bytes:
    """One chunk's rows as the binary-rows object (JSON bytes; embed it
    with orjson.Fragment). `start` is recorded as the first row's index in
    the request. Bitmask rows are decoded; a dropped row (status not OK) has
    length 0 and its status. Raises StaleChunkError if the record was
    reclaimed before or while it was read."""
    ids, _ = chunk._csr_arrays()  # checked below, once the views were read
    status = chunk.status if chunk.flags is not None else None
    logprobs = chunk.logprobs if chunk.support_mode else _selected_values(chunk.logprobs, status)
    out = _object(chunk.support_mode, start, chunk.rows, int(ids.size),
                  [_b64encode(_le_bytes(chunk.lengths, "<i4"))],
                  None if status is None else [_b64encode(_le_bytes(status, "u1"))],
                  [_b64encode(_le_bytes(ids, "<i4"))], [_b64encode(_le_bytes(logprobs, "<f4"))])
    chunk.check()  # the views were read: only good if the record is still ours
    return out


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
        """The object for rows [start:] (`start` clamped to [0, rows]), as
        JSON bytes."""
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


def _count(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise BinaryRowsError(f"binary rows: {name!r} must be a non-negative integer, "
                              f"got {value!r}")
    return value


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
    size = count * itemsize
    # Checked before decoding: a forged count cannot size an allocation.
    if len(text) != 4 * -(-size // 3):
        raise BinaryRowsError(
            f"binary rows: {name!r} has {len(text)} base64 characters; {count} values of "
            f"{itemsize} bytes take {4 * -(-size // 3)}")
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


def decode_rows(obj: dict[str, Any] | str | bytes, *, torch: bool = False) -> BinaryRows:
    """The binary-rows object (as parsed from JSON, or its JSON text, or a
    meta_info dict holding it under output_token_sampling_mask) as CSR
    arrays: numpy arrays (the decoded ones read-only, views of the decoded
    bytes), or torch tensors sharing writable buffers (`torch=True`; torch
    is imported only then): pybase64 decodes into them directly, the stdlib
    codec's bytes are copied once.
    Raises BinaryRowsError naming the field for anything malformed."""
    if isinstance(obj, str | bytes):
        try:
            obj = orjson.loads(obj)
        except orjson.JSONDecodeError as exc:
            raise BinaryRowsError(f"binary rows: not JSON: {exc}") from None
    if isinstance(obj, dict) and MASK_FIELD in obj:
        obj = obj[MASK_FIELD]
    if not isinstance(obj, dict):
        raise BinaryRowsError(f"binary rows: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise BinaryRowsError(f"binary rows: 'format' must be {FORMAT!r}, got "
                              f"{obj.get('format')!r}")
    if obj.get("version") != VERSION:
        raise BinaryRowsError(f"binary rows: 'version' {obj.get('version')!r} is not supported "
                              f"(this decoder reads version {VERSION})")
    mode = obj.get("mode")
    if mode not in MODES:
        raise BinaryRowsError(f"binary rows: 'mode' must be one of {MODES}, got {mode!r}")
    start, rows, nnz = _count(obj, "start"), _count(obj, "rows"), _count(obj, "nnz")
    lengths = _field(obj, "lengths", rows, "<i4", torch)
    status = _field(obj, "status", rows, "u1", torch, required=False)
    ids = _field(obj, "ids", nnz, "<i4", torch)
    logprobs = _field(obj, "logprobs", nnz if mode == "support" else rows, "<f4", torch)
    assert lengths is not None and ids is not None and logprobs is not None
    if rows and int(lengths.min()) < 0:
        raise BinaryRowsError(f"binary rows: 'lengths' has a negative length at row "
                              f"{int(np.argmin(lengths))}")
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] != nnz:
        raise BinaryRowsError(f"binary rows: 'lengths' sum to {int(offsets[-1])}, "
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
    if nnz and int(ids.min()) < 0:
        raise BinaryRowsError(f"binary rows: 'ids' has a negative id at {int(np.argmin(ids))}")
    arrays: tuple[Any, ...] = (lengths, offsets, ids, logprobs, status)
    if torch:
        import torch as _torch
        arrays = tuple(_torch.from_numpy(a) for a in arrays)
    return BinaryRows(mode, start, *arrays)

"""A chunk as the consumer sees it: CSR rows as read-only numpy views, and
the response fields built straight from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import orjson

from ._native import ffi, lib
from .errors import DoubleReleaseError, ShmaskError
from .refs import MODE_NAMES, MODE_SUPPORT

DEFAULT_FIELDS = ("mask_ids", "mask_logprobs", "mask_lengths")
_NEST_BELOW = 128  # mean entries per row under which to_json splits flat arrays


class _Record(Protocol):
    def check(self) -> None: ...
    def release(self) -> None: ...


class Chunk:
    """Consecutive rows of one request.

    `lengths[i]` entries of `ids` (and of `logprobs` in support mode) belong
    to row i; in selected mode `logprobs[i]` is row i's one value. The views
    point into shared memory: they are valid until release() (or until the
    lease runs out; `check()` and `to_lists()` detect that).
    """

    __slots__ = ("mode", "lengths", "ids", "logprobs", "_record", "_released", "_offsets",
                 "_owner")

    def __init__(self, mode: int, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                 record: _Record | None, owner: Chunk | None = None) -> None:
        self.mode = mode
        self.lengths = lengths
        self.ids = ids
        self.logprobs = logprobs
        self._record = record
        self._released = False
        self._offsets: np.ndarray | None = None
        self._owner = owner

    @classmethod
    def empty(cls, mode: int) -> Chunk:
        return cls(mode, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32),
                   None)

    # ------------------------------------------------------------ shape
    @property
    def rows(self) -> int:
        return self.lengths.size

    @property
    def nnz(self) -> int:
        return self.ids.size

    @property
    def mode_name(self) -> str:
        return MODE_NAMES[self.mode]

    @property
    def support_mode(self) -> bool:
        return self.mode == MODE_SUPPORT

    @property
    def offsets(self) -> np.ndarray:
        """Row starts in `ids`: int64[rows + 1], offsets[0] == 0."""
        if self._offsets is None:
            offsets = np.zeros(self.rows + 1, np.int64)
            np.cumsum(self.lengths, out=offsets[1:])
            self._offsets = offsets
        return self._offsets

    def __len__(self) -> int:
        return self.rows

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray | float]:
        """(ids, logprobs) of one row; logprobs is a float in selected mode."""
        if not -self.rows <= index < self.rows:
            raise IndexError(f"row {index} out of range for a chunk of {self.rows} rows")
        index %= self.rows
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        if self.support_mode:
            return self.ids[start:stop], self.logprobs[start:stop]
        return self.ids[start:stop], float(self.logprobs[index])

    def slice(self, start: int, stop: int | None = None) -> Chunk:
        """Rows [start, stop) as a chunk sharing this one's memory (for
        per-token streaming). Releasing stays the parent's job."""
        begin, end, _ = slice(start, stop).indices(self.rows)
        end = max(begin, end)
        lo, hi = int(self.offsets[begin]), int(self.offsets[end])
        logprobs = self.logprobs[lo:hi] if self.support_mode else self.logprobs[begin:end]
        return Chunk(self.mode, self.lengths[begin:end], self.ids[lo:hi], logprobs, None,
                     owner=self._owner or self)

    # -------------------------------------------------------- responses
    def to_lists(self) -> tuple[list[list[int]], list[list[float]] | list[float]]:
        """(ids per row, logprobs per row or per token) as Python lists.

        Values equal `int()` / `float()` of the producer's int32 / float32
        values exactly. Raises StaleChunkError if the record was reclaimed
        while the lists were built."""
        bounds = self.offsets.tolist()
        flat_ids = self.ids.tolist()
        ids = [flat_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        flat_logprobs = self.logprobs.tolist()
        if self.support_mode:
            logprobs: list[Any] = [flat_logprobs[a:b]
                                   for a, b in zip(bounds, bounds[1:], strict=False)]
        else:
            logprobs = flat_logprobs
        self.check()
        return ids, logprobs

    def to_json(self, fields: Sequence[str] = DEFAULT_FIELDS) -> bytes:
        """The three response fields (ids per row, logprobs per row or per
        token, lengths) as one JSON object.

        orjson writes each flat array in one call and the native core splits
        it into rows, so no Python object is made per row or per value.
        Floats are widened to float64 first so that parsing the JSON gives
        exactly `float()` of the float32 values, as json.dumps of to_lists()
        would."""
        try:
            out = self._json(fields)
        except ShmaskError:
            self.check()  # rows overwritten under us: say so (StaleChunkError)
            raise
        self.check()
        return out

    def _json(self, fields: Sequence[str]) -> bytes:
        ids_field, logprobs_field, lengths_field = (orjson.dumps(str(f)) for f in fields)
        numpy = orjson.OPT_SERIALIZE_NUMPY
        logprobs64 = self.logprobs.astype(np.float64)
        if self.nnz < _NEST_BELOW * max(self.rows, 1):
            # Short rows: one orjson call per field, split into rows natively
            # (per-row views would cost more than the numbers themselves).
            ids = _nest(_dumps(self.ids), self.lengths)
            logprobs = _dumps(logprobs64)
            if self.support_mode:
                logprobs = _nest(logprobs, self.lengths)
        else:
            # Long rows: orjson writes one array per row view (measured faster
            # than one flat array at 1000+ entries per row).
            bounds = self.offsets.tolist()
            spans = list(zip(bounds, bounds[1:], strict=False))
            ids = orjson.dumps([self.ids[a:b] for a, b in spans], option=numpy)
            logprobs = orjson.dumps([logprobs64[a:b] for a, b in spans] if self.support_mode
                                    else logprobs64, option=numpy)
        lengths = _dumps(self.lengths)
        return b"".join((b"{", ids_field, b":", ids, b",", logprobs_field, b":", logprobs, b",",
                         lengths_field, b":", lengths, b"}"))

    # ---------------------------------------------------------- lifetime
    def check(self) -> None:
        """Raise StaleChunkError if the record was reclaimed under us."""
        owner = self._owner or self
        if owner._record is not None:
            owner._record.check()

    def release(self) -> None:
        """Give the record back to the producer. A second call raises."""
        if self._owner is not None:
            raise ShmaskError("release the chunk this slice was taken from, not the slice")
        if self._released:
            raise DoubleReleaseError("chunk was released already")
        self._released = True
        if self._record is not None:
            self._record.release()

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> Chunk:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._released and self._owner is None:
            self.release()

    def __repr__(self) -> str:
        return f"Chunk({self.mode_name}, rows={self.rows}, nnz={self.nnz})"


def _dumps(array: np.ndarray) -> bytes:
    # orjson refuses the zero strides numpy gives some empty arrays
    return orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY) if array.size else b"[]"


def _nest(flat_json: bytes, lengths: np.ndarray) -> bytes:
    """'[a,b,c]' -> '[[a,b],[c]]' split by row lengths (native core)."""
    out = bytearray(len(flat_json) + 3 * lengths.size)  # each row adds "[", "]" and ","
    written = lib.shm_json_nest(flat_json, len(flat_json), ffi.from_buffer("int32_t[]", lengths),
                                lengths.size, ffi.from_buffer(out), len(out))
    if written < 0:
        raise ShmaskError("response JSON: row lengths do not match the number of values")
    del out[written:]
    return bytes(out)

"""A chunk as the consumer sees it: CSR rows as read-only numpy views, and
the response fields built straight from them. Rows sent as bitmasks are
decoded here, so a consumer sees ascending ids whatever form a row took;
rows the producer marked OVERFLOW or INVALID are never shown as empty."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ._native import ffi, lib
from .config import check_threads
from .errors import DoubleReleaseError, InvalidRefError, RowDroppedError, ShmaskError

# A row's flags byte (shmask/layout.py; ROW_* stay importable from here).
from .layout import ROW_BITMASK, ROW_INVALID, ROW_OK, ROW_OVERFLOW
from .layout import ROW_STATUS_MASK as ROW_STATUS_BITS
from .refs import ID_RULE, MODE_NAMES, MODE_SUPPORT, is_index
from .response_json import RowsJSON, dumps, response_arrays

DEFAULT_FIELDS = ("mask_ids", "mask_logprobs", "mask_lengths")

STATUS_NAMES = {ROW_OK: "OK", ROW_OVERFLOW: "OVERFLOW", ROW_INVALID: "INVALID"}
_STATUS_WHY = {ROW_OVERFLOW: "its support was larger than the producer's cap",
               ROW_INVALID: "the sampler found the row invalid"}


class _Record(Protocol):
    def check(self) -> None: ...
    def release(self) -> None: ...


class Chunk:
    """Consecutive rows of one request.

    `lengths[i]` is row i's support size L: L ids (and, in support mode, L
    entries of `logprobs`, in ascending id order) belong to it; in selected
    mode `logprobs[i]` is row i's one value. `flags` (None: every row is OK
    and in ids form) gives each row's status and form: an ids-form row's L
    ascending ids sit in `ids` at `word_offsets[i]`, a bitmask-form row's
    ceil(vocab / 32) words there instead, and a row whose status is not OK
    (OVERFLOW, INVALID) has L = 0 and nothing in `ids`. `csr()`, `row()`,
    `to_lists()` and `to_json()` decode bitmask rows, so a consumer sees
    ascending ids either way; a non-OK row raises RowDroppedError from
    `row()` and is None / null in the lists and JSON, never an empty row.

    `ids` and `logprobs` are views of shared memory: valid until release()
    (or until the lease runs out; `check()` and every accessor that reads
    rows detect that, and raise StaleChunkError). `lengths` and `flags` are
    the chunk's own copies, made and validated at open, so which entries
    belong to which row never changes, whatever is written into the record
    afterwards.
    """

    __slots__ = ("mode", "lengths", "ids", "logprobs", "flags", "vocab", "_record", "_released",
                 "_offsets", "_word_offsets", "_csr", "_owner")

    def __init__(self, mode: int, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                 record: _Record | None, owner: Chunk | None = None, *,
                 flags: np.ndarray | None = None, vocab: int = 0) -> None:
        self.mode = mode
        self.lengths = lengths
        self.ids = ids
        self.logprobs = logprobs
        # All-zero flags say what None says; None keeps every plain fast path.
        self.flags = flags if flags is not None and flags.any() else None
        self.vocab = vocab
        self._record = record
        self._released = False
        self._offsets: np.ndarray | None = None
        self._word_offsets: np.ndarray | None = None
        self._csr: tuple[np.ndarray, np.ndarray] | None = None
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
        """Support ids in the chunk (the sum of lengths), in either form."""
        return self.ids.size if self.flags is None else int(self.offsets[-1])

    @property
    def mode_name(self) -> str:
        return MODE_NAMES[self.mode]

    @property
    def support_mode(self) -> bool:
        return self.mode == MODE_SUPPORT

    @property
    def status(self) -> np.ndarray:
        """Each row's status, uint8[rows]: ROW_OK, ROW_OVERFLOW or ROW_INVALID."""
        if self.flags is None:
            return np.zeros(self.rows, np.uint8)
        return self.flags & ROW_STATUS_BITS

    @property
    def offsets(self) -> np.ndarray:
        """Row starts among the support ids (and support-mode logprobs):
        int64[rows + 1], offsets[0] == 0, the cumulative sum of lengths."""
        if self._offsets is None:
            offsets = np.zeros(self.rows + 1, np.int64)
            np.cumsum(self.lengths, out=offsets[1:])
            self._offsets = offsets
        return self._offsets

    @property
    def word_offsets(self) -> np.ndarray:
        """Row starts in `ids` as sent: int64[rows + 1]. Equal to `offsets`
        unless some row is a bitmask (ceil(vocab / 32) words) or not OK (none)."""
        if self.flags is None:
            return self.offsets
        if self._word_offsets is None:
            words = np.where(self._bitmask_rows(), self._bitmask_words(), self.lengths)
            offsets = np.zeros(self.rows + 1, np.int64)
            np.cumsum(words, out=offsets[1:])
            self._word_offsets = offsets
        return self._word_offsets

    def _bitmask_rows(self) -> np.ndarray:
        # Only an OK row carries a bitmask; the reader's core refuses others.
        assert self.flags is not None
        return self.flags == ROW_BITMASK

    def _bitmask_words(self) -> int:
        return (self.vocab + 31) // 32

    def __len__(self) -> int:
        return self.rows

    def _bounds(self, what: str, start: object, stop: object) -> tuple[int, int]:
        """[start, stop) as a slice gives it, from ints (or None) only: a
        slice takes True for 1, and a float raises a TypeError naming nothing."""
        for name, value in (("start", start), ("stop", stop)):
            if not is_index(value) and value is not None:
                raise TypeError(f"{what}: {name} must be an int or None, got {value!r} "
                                f"({type(value).__name__})")
        begin, end, _ = slice(start, stop).indices(self.rows)
        return begin, end

    def check_rows(self, start: int = 0, stop: int | None = None) -> None:
        """Raise RowDroppedError for the first row in [start, stop) whose
        status is not OK (its ids were never sent). start and stop are ints
        (or None) as in a slice."""
        begin, end = self._bounds("check_rows", start, stop)
        if self.flags is None:
            return
        dropped = np.flatnonzero(self.flags[begin:end] & ROW_STATUS_BITS)
        if dropped.size:
            index = begin + int(dropped[0])
            status = int(self.flags[index] & ROW_STATUS_BITS)
            name = STATUS_NAMES.get(status, str(status))
            raise RowDroppedError(
                f"row {index} of {self!r} has status {name} ({status}): "
                f"{_STATUS_WHY.get(status, 'unknown status')}, so its ids were not sent",
                index, status)

    # ----------------------------------------------------------- decode
    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, offsets): every row's support as ascending int32 ids, back
        to back, bitmask rows decoded, and int64[rows + 1] row starts (the
        same as `offsets`; a non-OK row is empty here: see `status`).

        Without bitmask rows these are the chunk's own views (no copy);
        otherwise the ids are a private copy, made once per chunk. Raises
        StaleChunkError once the record was reclaimed (views of it would show
        whatever the ring holds there now)."""
        out = self._csr_arrays()
        self.check()  # views, or a copy, are only good if the record was not reclaimed
        return out

    def _csr_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """csr() without its closing check: for the accessors that check
        once, after they have read every row."""
        if self._csr is None:
            if self.flags is None or not self._bitmask_rows().any():
                self._csr = (self.ids, self.offsets)
            else:
                try:
                    ids = self._decode()
                except Exception:
                    self.check()  # rows overwritten under us: say so (StaleChunkError)
                    raise
                self._csr = (ids, self.offsets)
        return self._csr

    def _decode(self) -> np.ndarray:
        """Every row's ids, bitmask rows decoded, in one native pass."""
        return _decode_rows(self.lengths, self.flags, self.ids, self.vocab, self.nnz)

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray | float]:
        """(ids, logprobs) of one row; logprobs is a float in selected mode.
        An ids-form row gives views; a bitmask row its decoded ids (a copy).
        Raises RowDroppedError for a row whose status is not OK, and
        StaleChunkError once the record was reclaimed."""
        if not is_index(index):
            raise TypeError(f"row index must be an int, got {index!r} ({type(index).__name__})")
        if not -self.rows <= index < self.rows:
            raise IndexError(f"row {index} out of range for a chunk of {self.rows} rows")
        try:
            out = self._row(index)
        except Exception:
            self.check()  # a late read is StaleChunkError, whatever failed
            raise
        self.check()
        return out

    def _row(self, index: int) -> tuple[np.ndarray, np.ndarray | float]:
        index %= self.rows
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        ids = self.ids[start:stop]
        if self.flags is not None:
            self.check_rows(index, index + 1)
            if self.flags[index] == ROW_BITMASK:
                begin, end = self.word_offsets[index:index + 2].tolist()
                ids = _decode_rows(self.lengths[index:index + 1], self.flags[index:index + 1],
                                   self.ids[begin:end], self.vocab, stop - start)
            else:
                begin = int(self.word_offsets[index])
                ids = self.ids[begin:begin + stop - start]
        if self.support_mode:
            return ids, self.logprobs[start:stop]
        return ids, float(self.logprobs[index])

    def slice(self, start: int, stop: int | None = None) -> Chunk:
        """Rows [start, stop) as a chunk sharing this one's memory (for
        per-token streaming). start and stop are ints (or None) taken as in
        a slice: negative ones count from the end, and both are
        clamped to the rows. Releasing stays the parent's job."""
        begin, end = self._bounds("slice", start, stop)
        end = max(begin, end)
        lo, hi = int(self.offsets[begin]), int(self.offsets[end])
        logprobs = self.logprobs[lo:hi] if self.support_mode else self.logprobs[begin:end]
        if self.flags is None:
            return Chunk(self.mode, self.lengths[begin:end], self.ids[lo:hi], logprobs, None,
                         owner=self._owner or self)
        words = self.word_offsets
        return Chunk(self.mode, self.lengths[begin:end], self.ids[words[begin]:words[end]],
                     logprobs, None, owner=self._owner or self, flags=self.flags[begin:end],
                     vocab=self.vocab)

    # -------------------------------------------------------- responses
    def to_lists(self) -> tuple[list[list[int] | None], list[Any]]:
        """(ids per row, logprobs per row or per token) as Python lists.

        Values equal `int()` / `float()` of the producer's int32 / float32
        values exactly; bitmask rows come as their ascending ids. A row whose
        status is not OK is None in both lists (in place of its ids list, and
        of its logprobs list (support mode) or logprob (selected mode)).
        Raises StaleChunkError if the record was reclaimed before or while
        the lists were built."""
        try:
            ids, logprobs = self._lists()
        except Exception:
            self.check()  # a late read is StaleChunkError, whatever failed
            raise
        self.check()
        return ids, logprobs

    def _lists(self) -> tuple[list[list[int] | None], list[Any]]:
        flat_ids, offsets = self._csr_arrays()
        if flat_ids.size and int(flat_ids.min()) < 0:  # open reads no ids: the response does
            at = int(np.argmax(flat_ids < 0))
            row = int(np.searchsorted(offsets, at, side="right")) - 1
            raise InvalidRefError(f"row {row} of {self!r} holds id {int(flat_ids[at])}, which is "
                                  f"negative: {ID_RULE}, so the chunk is corrupt (rewritten "
                                  "after it was published)")
        bounds = offsets.tolist()
        all_ids = flat_ids.tolist()
        ids: list[Any] = [all_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        flat_logprobs = self.logprobs.tolist()
        if self.support_mode:
            logprobs: list[Any] = [flat_logprobs[a:b]
                                   for a, b in zip(bounds, bounds[1:], strict=False)]
        else:
            logprobs = flat_logprobs
        if self.flags is not None:
            for dropped in np.flatnonzero(self.flags & ROW_STATUS_BITS).tolist():
                ids[dropped] = logprobs[dropped] = None
        return ids, logprobs

    def to_json(self, fields: Sequence[str] = DEFAULT_FIELDS, threads: int | None = None) -> bytes:
        """The three response fields (ids per row, logprobs per row or per
        token, lengths) as one JSON object.

        Written by the native response writer (shmask.response_json), byte
        for byte what orjson writes for to_lists()'s lists, with no Python
        object per row or per value; the GIL is released meanwhile and up to
        `threads` (default SHMASK_JSON_THREADS) threads share the rows. A
        row whose status is not OK is null in all three fields (ids,
        logprobs, length), as in to_lists; bitmask rows are decoded."""
        names = list(fields)
        if len(names) != 3 or len(set(names)) != 3 or not all(isinstance(f, str) for f in names):
            raise ValueError(f"to_json needs three distinct field names (str), got {names!r}")
        check_threads(threads)
        ids_field, logprobs_field, lengths_field = names
        rows = self.json_rows()
        return dumps({ids_field: rows.ids, logprobs_field: rows.logprobs,
                      lengths_field: rows.lengths_field}, threads=threads)

    def json_rows(self) -> RowsJSON:
        """The rows as a RowsJSON: its `.ids`, `.logprobs` and `.lengths_field`
        placed anywhere in a document given to shmask.response_json.dumps are
        written there natively (the arrays json_arrays returns), in the one
        copy that makes the document's bytes. The chunk must stay open until
        dumps returns; a record reclaimed meanwhile raises StaleChunkError."""
        try:
            flat_ids = self.ids if self.flags is None else self._csr_arrays()[0]
        except Exception:
            self.check()  # a late read is StaleChunkError, whatever failed
            raise
        return RowsJSON(self.support_mode, self.lengths, self.flags, flat_ids, self.logprobs,
                        check=self.check)

    def json_arrays(self, threads: int | None = None) -> tuple[bytes, bytes, bytes]:
        """The three arrays to_json writes (ids per row, logprobs, lengths),
        each as JSON bytes: equal to orjson.dumps of to_lists()'s lists (and
        of the lengths, null where a row is not OK). Floats are the float32
        values widened to double, in the shortest form that reads back as
        that double (NaN and infinities as null), as orjson writes them."""
        check_threads(threads)
        try:
            out = self._json(threads)
        except Exception:
            self.check()  # a late read is StaleChunkError, whatever failed
            raise
        self.check()
        return out

    def _json(self, threads: int | None) -> tuple[bytes, bytes, bytes]:
        # Bitmask rows need decoding (csr); otherwise the views go as they are.
        flat_ids = self.ids if self.flags is None else self._csr_arrays()[0]
        return response_arrays(self.support_mode, self.lengths, self.flags, flat_ids,
                               self.logprobs, threads)

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


def _decode_rows(lengths: np.ndarray, flags: np.ndarray | None, ids: np.ndarray, vocab: int,
                 total: int) -> np.ndarray:
    """Rows' ids back to back, bitmask rows decoded (native core). Rows live
    in shared memory: rows rewritten since they were validated raise
    ShmaskError here (the caller's check() then says if they were reclaimed)."""
    out = np.empty(total, np.int32)
    written = lib.shm_decode_rows(ffi.from_buffer("int32_t[]", lengths),
                                  ffi.NULL if flags is None else ffi.from_buffer("uint8_t[]", flags),
                                  ffi.from_buffer("int32_t[]", ids), lengths.size, ids.size, vocab,
                                  ffi.from_buffer("int32_t[]", out, require_writable=True), total)
    if written != total:
        raise ShmaskError("chunk rows changed after they were checked: a bitmask disagrees "
                          "with its row's length")
    return out

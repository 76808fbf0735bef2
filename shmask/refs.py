"""References: what crosses zmq instead of the rows.

A RefBatch is one bytes object for a whole emission (one entry per request),
so pickling it, msgpacking it or sending it as a zmq frame costs O(1) Python
objects however many requests it holds. Wire format (little-endian):

    offset 0   4s   magic b"SMRB"
           4   u16  version (4)
           6   u16  n_segments
           8   u32  n_entries
          12   u32  inline_bytes
          16   segment table: n_segments x (u64 epoch, u64 host, u8 name_len, name)
               padded with zeros to a multiple of 8
               entries: n_entries x ENTRY_DTYPE (48 bytes)
               inline area: inline_bytes (packed chunks of entries of kind INLINE)

An inline chunk is `lengths int32[rows] | flags uint8[rows], zero-padded to
a multiple of 4 | ids int32[words] | logprobs float32[nnz or rows]`, packed
(the record arrays of native/shmask_layout.h: `words` counts the rows' id
data, which differs from `nnz` when a row travels as a bitmask or is
dropped with its status). Everything here is parsed as untrusted input:
a malformed batch raises InvalidRefError, never reads out of bounds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import DoubleReleaseError, InvalidRefError, ShmaskError, StaleChunkError
from .layout import REF_KIND_EMPTY, REF_KIND_INLINE, REF_KIND_LOST, REF_KIND_RING

MAGIC = b"SMRB"
# 2: each segment says which host (boot + /dev/shm mount) holds it;
# 3: entries carry words and vocab (row flags and bitmask rows);
# 4: entries carry the record's seal (a ref opens only the record it was
#    issued for), and kind LOST (a chunk a forwarding hop could not read)
VERSION = 5  # 5: lost reason 3 (released); an older reader refuses the batch by its version
_HEADER = struct.Struct("<4sHHII")
_SEGMENT = struct.Struct("<QQB")
MAX_NAME_BYTES = 64
MSGPACK_EXT_CODE = 83  # msgspec/msgpack extension type carrying RefBatch bytes

# An entry's kind (shmask/layout.py, SHM_REF_KIND_* in native/shmask_queue.h).
KIND_EMPTY = REF_KIND_EMPTY  # a request that produced no rows since its last take
KIND_SHM = REF_KIND_RING
KIND_INLINE = REF_KIND_INLINE
# A chunk that a forwarding hop (RefBatch.to_inline / for_host) could not
# read: no rows, only why; opening it raises that error (`position` holds
# LOST_STALE, LOST_INVALID or LOST_RELEASED), so one bad chunk costs one request.
KIND_LOST = REF_KIND_LOST
LOST_STALE = 1  # StaleChunkError: reclaimed, aborted or truncated before the hop read it
LOST_INVALID = 2  # InvalidRefError: the hop found the reference malformed
# DoubleReleaseError, as a local open of a released record: the chunk had
# been copied and given back already (the same batch forwarded or pulled twice).
LOST_RELEASED = 3
LOST_REASONS = (LOST_STALE, LOST_INVALID, LOST_RELEASED)
MODE_SELECTED = 1
MODE_SUPPORT = 2
# The one rule for ids, wherever rows enter (Writer.publish / append_step,
# a reader's checks, the response encoders): no vocabulary bounds an ids row
# (a bitmask row's vocab is only its width), and every decoder refuses less.
ID_RULE = "ids are non-negative int32 (0 <= id < 2**31)"
MODES = {"selected": MODE_SELECTED, "support": MODE_SUPPORT}
MODE_NAMES = {v: k for k, v in MODES.items()}

ENTRY_DTYPE = np.dtype(
    [
        ("kind", "<u1"),
        ("mode", "<u1"),
        ("segment", "<u2"),
        ("rows", "<u4"),
        ("position", "<u8"),  # ring position (shm) or offset in the inline area
        ("record_bytes", "<u8"),  # record size (shm) or payload size (inline)
        ("nnz", "<u8"),  # support ids (sum of row lengths)
        ("words", "<u4"),  # int32 words of id data (== nnz unless a row is a bitmask or dropped)
        ("vocab", "<u4"),  # V of the chunk's bitmask rows (0: none)
        ("seal", "<u8"),  # shm: the record's seal (native/shmask_layout.h); else 0
    ]
)
assert ENTRY_DTYPE.itemsize == 48


def mode_code(mode: str | int) -> int:
    """A mode's code from its name ('selected', 'support') or its code (1,
    2; an int, not True or 1.0, which compare equal to 1)."""
    if isinstance(mode, str) and mode in MODES:
        return MODES[mode]
    if type(mode) is int and mode in MODE_NAMES:
        return mode
    raise InvalidRefError(f"mode {mode!r} is invalid: accepted 'selected' or 'support'")


def is_index(value: object) -> bool:
    """Whether `value` is an integer index or count: a Python or numpy int,
    never a bool (numpy and Python both take True for 1) or a float."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def payload_bytes(mode, rows, words, nnz):  # type: ignore[no-untyped-def]
    """Bytes of a chunk's row arrays (lengths, flags padded to 4, id data,
    logprobs): the size of an inline payload; the native core's
    shm_payload_bytes, arguments in its order (tests/test_constants.py holds
    them equal), element-wise on numpy arrays too."""
    return 4 * rows + (rows + 3) // 4 * 4 + 4 * words + 4 * np.where(mode == MODE_SUPPORT, nnz,
                                                                     rows)


def pack_payload(lengths: np.ndarray, flags: np.ndarray | None, ids: np.ndarray,
                 logprobs: np.ndarray) -> bytes:
    """An inline payload from row arrays (flags None: every row an OK ids row)."""
    flag_bytes = np.zeros(-(-lengths.size // 4) * 4, np.uint8)
    if flags is not None:
        flag_bytes[:lengths.size] = flags
    return b"".join((lengths.tobytes(), flag_bytes.tobytes(), ids.tobytes(), logprobs.tobytes()))


class ChunkRef:
    """A reference to one chunk (consecutive rows of one request)."""

    __slots__ = ("kind", "mode", "segment", "epoch", "position", "record_bytes", "rows", "nnz",
                 "payload", "host", "words", "vocab", "seal")

    def __init__(self, kind: int, mode: int, segment: str, epoch: int, position: int,
                 record_bytes: int, rows: int, nnz: int, payload: memoryview | None,
                 host: int = 0, words: int | None = None, vocab: int = 0,
                 seal: int = 0) -> None:
        self.kind = kind
        self.mode = mode
        self.segment = segment
        self.epoch = epoch
        self.position = position
        self.record_bytes = record_bytes
        self.rows = rows
        self.nnz = nnz
        self.payload = payload
        self.host = host  # shmask.host_id() of the ring's host; 0: unknown (assumed local)
        # int32 words of the rows' id data; nnz when every row is an OK ids row
        self.words = nnz if words is None else words
        self.vocab = vocab  # V of the bitmask rows (0: none)
        self.seal = seal  # the ring record's seal: the only record this ref opens

    @property
    def inline(self) -> bool:
        return self.kind == KIND_INLINE

    @property
    def mode_name(self) -> str:
        # A hand-built ref may hold anything here; its repr must not raise.
        return MODE_NAMES.get(self.mode, "?") if type(self.mode) is int else "?"

    def to_bytes(self) -> bytes:
        return RefBatch.from_refs([self]).to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> ChunkRef:
        batch = RefBatch.from_bytes(data)
        if len(batch) != 1:
            raise InvalidRefError(f"expected one reference, got a batch of {len(batch)}")
        return batch[0]

    def __reduce__(self) -> tuple[Any, ...]:
        return (ChunkRef.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        where = ("inline" if self.inline else "lost" if self.kind == KIND_LOST
                 else f"{self.segment}@{self.position}")
        return f"ChunkRef({self.mode_name}, rows={self.rows}, nnz={self.nnz}, {where})"


class RefBatch:
    """One emission's references, in one bytes object; `batch[i]` is request i."""

    __slots__ = ("_data", "_segments", "_entries", "_inline")

    def __init__(self, data: bytes, segments: list[tuple[str, int, int]], entries: np.ndarray,
                 inline: memoryview) -> None:
        self._data = data
        self._segments = segments
        self._entries = entries
        self._inline = inline

    # ------------------------------------------------------------ building
    @classmethod
    def build(cls, segments: Sequence[tuple[str, int] | tuple[str, int, int]], entries: np.ndarray,
              inline_chunks: Sequence[bytes | memoryview] = ()) -> RefBatch:
        """Pack entries (ENTRY_DTYPE; inline entries' `position` is the offset
        into the concatenation of `inline_chunks`). A segment is (name,
        epoch) or (name, epoch, host); host 0 means unknown."""
        return cls.from_bytes(_pack(segments, entries, inline_chunks))

    @classmethod
    def _of_own_entries(cls, segments: list[tuple[str, int, int]], entries: np.ndarray,
                        inline_chunks: Sequence[bytes]) -> RefBatch:
        """build() for entries this process's native core has just written
        (Writer.take_batch), without parsing its own bytes back: the same
        bytes, a few numpy calls fewer per step. Whoever receives them
        checks them (from_bytes, Reader)."""
        data = _pack(segments, entries, inline_chunks)
        inline_bytes = sum(len(c) for c in inline_chunks)
        entries_end = len(data) - inline_bytes
        view = np.frombuffer(data, dtype=ENTRY_DTYPE, count=len(entries),
                             offset=entries_end - len(entries) * ENTRY_DTYPE.itemsize)
        return cls(data, segments, view, memoryview(data)[entries_end:])

    @classmethod
    def from_refs(cls, refs: Sequence[ChunkRef]) -> RefBatch:
        segments: dict[tuple[str, int, int], int] = {}
        entries = np.zeros(len(refs), dtype=ENTRY_DTYPE)
        chunks: list[memoryview] = []
        offset = 0
        for i, ref in enumerate(refs):
            entry = entries[i]
            entry["kind"], entry["mode"] = ref.kind, ref.mode
            entry["rows"], entry["nnz"] = ref.rows, ref.nnz
            entry["words"], entry["vocab"] = ref.words, ref.vocab
            if ref.kind == KIND_SHM:
                key = (ref.segment, ref.epoch, ref.host)
                entry["segment"] = segments.setdefault(key, len(segments))
                entry["position"], entry["record_bytes"] = ref.position, ref.record_bytes
                entry["seal"] = ref.seal
            elif ref.kind == KIND_LOST:
                entry["position"] = ref.position
            elif ref.kind == KIND_INLINE:
                assert ref.payload is not None
                entry["position"], entry["record_bytes"] = offset, len(ref.payload)
                chunks.append(ref.payload)
                offset += len(ref.payload)
        return cls.build(list(segments), entries, chunks)

    # ------------------------------------------------------------- parsing
    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RefBatch:
        if not isinstance(data, bytes | bytearray | memoryview):
            # bytes(5) would be five zero bytes, bytes([1, 2]) two bytes
            raise TypeError(f"a reference batch is bytes (or a bytearray or memoryview), got "
                            f"{type(data).__name__}")
        data = bytes(data) if not isinstance(data, bytes) else data
        if len(data) < _HEADER.size:
            raise InvalidRefError(f"reference batch of {len(data)} bytes is shorter than its header")
        magic, version, n_segments, n_entries, inline_bytes = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise InvalidRefError(f"not a shmask reference batch (magic {magic!r})")
        if version != VERSION:
            raise InvalidRefError(f"reference batch version {version} is not supported ({VERSION})")
        offset = _HEADER.size
        segments = []
        for _ in range(n_segments):
            if offset + _SEGMENT.size > len(data):
                raise InvalidRefError("reference batch truncated in its segment table")
            epoch, host, name_len = _SEGMENT.unpack_from(data, offset)
            offset += _SEGMENT.size
            if name_len > MAX_NAME_BYTES or offset + name_len > len(data):
                raise InvalidRefError(f"segment name of {name_len} bytes is invalid")
            try:
                name = data[offset:offset + name_len].decode("ascii")
            except UnicodeDecodeError:
                raise InvalidRefError("segment name is not ASCII") from None
            segments.append((name, epoch, host))
            offset += name_len
        offset += -offset % 8
        entries_end = offset + n_entries * ENTRY_DTYPE.itemsize
        if entries_end + inline_bytes != len(data):
            raise InvalidRefError(
                f"reference batch is {len(data)} bytes, its header says {entries_end + inline_bytes}"
            )
        entries = np.frombuffer(data, dtype=ENTRY_DTYPE, count=n_entries, offset=offset)
        if n_entries:
            _check_entries(entries, n_segments, inline_bytes)
        return cls(data, segments, entries, memoryview(data)[entries_end:])

    def to_bytes(self) -> bytes:
        return self._data

    # ------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> ChunkRef:
        """Request `index`'s reference: an int in [-len, len), as in a list
        (select() takes several)."""
        count = len(self._entries)
        if not is_index(index):
            raise TypeError(f"RefBatch index must be an int, got {index!r} "
                            f"({type(index).__name__}); select() takes several")
        if not -count <= index < count:
            raise IndexError(f"RefBatch index {index} is outside [-{count}, {count})")
        return self._ref(*self._entries[index].tolist())

    def __iter__(self) -> Iterator[ChunkRef]:
        # One tolist() for the whole batch: plain ints, no numpy scalars per field.
        for fields in self._entries.tolist():
            yield self._ref(*fields)

    def _ref(self, kind: int, mode: int, segment_index: int, rows: int, position: int,
             record_bytes: int, nnz: int, words: int, vocab: int, seal: int) -> ChunkRef:
        segment, epoch, host, payload = "", 0, 0, None
        if kind == KIND_SHM:
            segment, epoch, host = self._segments[segment_index]
        elif kind == KIND_INLINE:
            payload = self._inline[position:position + record_bytes]
        return ChunkRef(kind, mode, segment, epoch, position, record_bytes, rows, nnz, payload, host,
                        words, vocab, seal)

    @property
    def entries(self) -> np.ndarray:
        """The entries as a read-only structured array (vectorised routing)."""
        return self._entries

    @property
    def segments(self) -> list[tuple[str, int, int]]:
        """(segment name, epoch, host) per segment index of the entries."""
        return self._segments

    def one_entry_prefix(self) -> bytes:
        """What precedes the entry in a batch of one of this batch's ring
        entries (`select([i]).to_bytes()` less its last 48 bytes: the header
        and this segment table): a ring entry's 48 bytes appended make that
        batch, without a RefBatch built per request."""
        table_end = len(self._data) - len(self._inline) - self._entries.nbytes
        return (_HEADER.pack(MAGIC, VERSION, len(self._segments), 1, 0)
                + self._data[_HEADER.size:table_end])

    def one_entry_batches(self) -> np.ndarray:
        """Each entry as its own one-entry batch, a row each (uint8
        [len, prefix + 48]): one_entry_prefix() then the entry. A ring or
        empty entry's row is its whole batch; an inline entry's lacks its
        payload (split() and the vLLM adapter put those in whole)."""
        prefix = np.frombuffer(self.one_entry_prefix(), np.uint8)
        count, width = len(self._entries), ENTRY_DTYPE.itemsize
        out = np.empty((count, prefix.size + width), np.uint8)
        out[:, :prefix.size] = prefix
        out[:, prefix.size:] = np.ascontiguousarray(self._entries).view(np.uint8).reshape(
            count, width)
        return out

    @property
    def hosts(self) -> set[int]:
        """The hosts (shmask.host_id()) whose rings this batch points into."""
        shm = self._entries["kind"] == KIND_SHM
        return {self._segments[int(i)][2] for i in np.unique(self._entries["segment"][shm])}

    def split(self) -> list[bytes]:
        """Each entry as its own one-entry batch (what `self[i].to_bytes()`
        gives), built with a few numpy copies instead of one batch per entry:
        for engines that carry one reference per request."""
        out = self.one_entry_batches()
        size = out.shape[1]
        blob = out.tobytes()
        refs = [blob[i * size:(i + 1) * size] for i in range(len(out))]
        for i in np.flatnonzero(self._entries["kind"] == KIND_INLINE).tolist():
            refs[i] = self[i].to_bytes()  # an inline entry carries its payload
        return refs

    def to_inline(self, reader: Any) -> RefBatch:
        """This batch with every ring chunk copied into the batch itself and
        given back to the ring: for a consumer that cannot see this host's
        /dev/shm (another host, a container with its own). `reader` is the
        forwarding hop's shmask.Reader.

        Entry by entry: a chunk the hop cannot read (reclaimed, aborted,
        malformed) becomes a LOST entry whose open raises that error for its
        request alone; the others are forwarded, each released exactly once."""
        _check_reader(reader)
        return self._inline_where(reader, lambda host: True)

    def for_host(self, host: int, reader: Any) -> RefBatch:
        """This batch as a consumer on `host` (its shmask.host_id()) can read
        it: unchanged when every ring lives there, else with the chunks of
        other hosts' rings carried inline (see to_inline)."""
        if not is_index(host):
            raise TypeError(f"for_host: host must be a host id (an int from shmask.host_id()), "
                            f"got {host!r}")
        if not 0 <= host < 1 << 64:
            raise ValueError(f"for_host: host {host} is outside 0 to 2**64 - 1")
        _check_reader(reader)
        if all(ring_host == host for ring_host in self.hosts):
            return self
        return self._inline_where(reader, lambda ring_host: ring_host != host)

    def _inline_where(self, reader: Any, inline_host: Any) -> RefBatch:
        payloads: dict[int, bytes] = {}
        lost: dict[int, int] = {}
        for i, ref in enumerate(self):
            if ref.kind == KIND_SHM and inline_host(ref.host):
                try:
                    payloads[i] = _copy_out(reader, ref)
                except ShmaskError as exc:
                    lost[i] = lost_reason(exc)
        return self.with_inline(payloads, lost)

    def with_inline(self, payloads: Mapping[int, bytes | memoryview],
                    lost: Mapping[int, int]) -> RefBatch:
        """This batch with ring entry i carried inline as payloads[i] (an
        inline payload: pack_payload's layout) and entry j LOST for reason
        lost[j] (LOST_REASONS); the other entries as they are.
        What a hop that copied some chunks out (to_inline, a remote pull)
        sends on."""
        if not payloads and not lost:
            return self
        entries = self._entries.copy()
        chunks: list[bytes | memoryview] = []
        offset = 0
        payload: bytes | memoryview
        for i, ref in enumerate(self):
            if i in lost:
                entries[i] = (KIND_LOST, ref.mode, 0, 0, lost[i], 0, 0, 0, 0, 0)
                continue
            if i in payloads:
                payload = payloads[i]
                entries[i]["kind"], entries[i]["segment"], entries[i]["seal"] = KIND_INLINE, 0, 0
            elif ref.kind == KIND_INLINE:
                assert ref.payload is not None
                payload = ref.payload
            else:
                continue
            entries[i]["position"], entries[i]["record_bytes"] = offset, len(payload)
            chunks.append(payload)
            offset += len(payload)
        return RefBatch.build(self._segments, entries, chunks)

    @property
    def nbytes(self) -> int:
        return len(self._data)

    def select(self, indices: Sequence[int] | Sequence[bool] | np.ndarray) -> RefBatch:
        """A batch of some of the requests (multi-tokenizer routing), given
        either as
          - integer indices (Python ints, or a 1-D numpy integer array), in
            [-len, len) as for a list: those requests, in that order
            (repeats allowed);
          - a boolean mask of exactly len(self) values (a 1-D numpy bool
            array, or a list of bools): the requests where it is True, in
            batch order: `batch.select(owner == k)`.
        Anything else raises instead of being cast: floats, bools among
        ints (True is not request 1), a mask of another length, arrays that
        are not 1-D (TypeError, ValueError; IndexError for an index out of
        range)."""
        index = _selection(indices, len(self))
        entries = self._entries[index].copy()
        inline = np.flatnonzero(entries["kind"] == KIND_INLINE)
        chunks = []
        offset = 0
        for i in inline:  # inline chunks are the rare full-ring fallback
            start, size = int(entries[i]["position"]), int(entries[i]["record_bytes"])
            chunks.append(self._inline[start:start + size])
            entries[i]["position"] = offset
            offset += size
        return RefBatch.build(self._segments, entries, chunks)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RefBatch.from_bytes, (self._data,))

    def __repr__(self) -> str:
        return f"RefBatch({len(self)} refs, {self.nbytes} bytes)"


def _selection(indices: object, count: int) -> np.ndarray:
    """select()'s argument as int64 indices into a batch of `count`."""
    if isinstance(indices, np.ndarray):
        array = indices
        kind = "bool" if array.dtype == np.bool_ else "int" if array.dtype.kind in "iu" else None
    elif isinstance(indices, Sequence) and not isinstance(indices, str | bytes):
        # Element by element: numpy would turn [True, 2] into [1, 2].
        if all(isinstance(v, bool | np.bool_) for v in indices) and len(indices):
            kind = "bool"
        elif all(is_index(v) for v in indices):
            kind = "int"
        else:
            bad = next(v for v in indices if not is_index(v))
            raise TypeError(f"select: {bad!r} ({type(bad).__name__}) is not an index: give ints "
                            f"(or a numpy integer array) or a boolean mask of {count} bools, "
                            "not a mix")
        array = np.array(indices, dtype=bool if kind == "bool" else np.int64)
    else:
        raise TypeError(f"select takes a sequence of int indices or a boolean mask, got "
                        f"{type(indices).__name__}")
    if kind is None:
        raise TypeError(f"select: an index array must hold integers (or be a boolean mask), "
                        f"got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"select: indices must be 1-D, got shape {array.shape}")
    if kind == "bool":
        if array.size != count:
            raise ValueError(f"select: a boolean mask needs one value per request ({count}), "
                             f"got {array.size}")
        return np.flatnonzero(array)
    if array.size:
        low, high = array.min(), array.max()
        if low < -count or high >= count:
            bad = low if low < -count else high
            raise IndexError(f"select: index {int(bad)} is outside [-{count}, {count})")
    return array.astype(np.int64, copy=False)


def _check_reader(reader: Any) -> None:
    """The forwarding hop's shmask.Reader (duck-typed: refs.py imports no core)."""
    if not callable(getattr(reader, "open", None)):
        raise TypeError(f"reader must be a shmask.Reader, got {type(reader).__name__}")


def lost_reason(exc: ShmaskError) -> int:
    """The LOST reason of a chunk a hop could not copy (to_inline here, a
    remote pull): what its consumer's open raises (Reader.open, KIND_LOST)."""
    if isinstance(exc, StaleChunkError):
        return LOST_STALE
    if isinstance(exc, DoubleReleaseError):
        return LOST_RELEASED
    return LOST_INVALID


def _copy_out(reader: Any, ref: ChunkRef) -> bytes:
    """A ring chunk's rows as an inline payload, given back to the ring."""
    chunk = reader.open(ref)
    try:
        payload = pack_payload(chunk.lengths, chunk.flags, chunk.ids, chunk.logprobs)
        chunk.check()  # copied before any reclaim, or raises StaleChunkError
    finally:
        try:
            chunk.release()
        except ShmaskError:
            pass  # reclaimed after the check passed: the copy is good, the record is gone
    return payload


def _pack(segments: Sequence[tuple[str, int] | tuple[str, int, int]], entries: np.ndarray,
          inline_chunks: Sequence[bytes | memoryview]) -> bytes:
    """A batch's bytes: header, segment table (padded to 8), entries, inline
    payloads (RefBatch.build)."""
    table = bytearray()
    for segment in segments:
        name, epoch, host = (*segment, 0)[:3]
        encoded = name.encode()
        table += _SEGMENT.pack(epoch, host, len(encoded)) + encoded
    table += b"\0" * (-(_HEADER.size + len(table)) % 8)
    inline_bytes = sum(len(c) for c in inline_chunks)
    if inline_bytes >= 1 << 32:
        raise InvalidRefError(f"inline payload of {inline_bytes} bytes exceeds 4 GiB")
    return b"".join((
        _HEADER.pack(MAGIC, VERSION, len(segments), len(entries), inline_bytes),
        bytes(table),
        np.ascontiguousarray(entries, dtype=ENTRY_DTYPE).tobytes(),
        *inline_chunks,
    ))


def _check_entries(entries: np.ndarray, n_segments: int, inline_bytes: int) -> None:
    kind = entries["kind"]
    shm = kind == KIND_SHM
    if shm.all():
        # The usual emission: every entry a ring chunk (a few vectorised
        # checks; the ring record itself is checked at open).
        mode = entries["mode"]
        if np.any((mode != MODE_SELECTED) & (mode != MODE_SUPPORT)):
            raise InvalidRefError("reference mode is invalid: accepted 1 (selected), 2 (support)")
        if np.any(entries["segment"] >= n_segments):
            raise InvalidRefError(f"reference names segment index >= {n_segments}")
        return
    if np.any(kind > KIND_LOST):
        raise InvalidRefError(f"reference kind {int(kind.max())} is invalid: accepted 0, 1, 2, 3")
    live = (kind == KIND_SHM) | (kind == KIND_INLINE)
    if np.any(~live & ((entries["rows"] != 0) | (entries["nnz"] != 0) | (entries["words"] != 0)
                       | (entries["vocab"] != 0) | (entries["seal"] != 0))):
        raise InvalidRefError("an empty or lost reference must have rows == nnz == words == "
                              "vocab == seal == 0")
    lost = kind == KIND_LOST
    if np.any(lost & ~np.isin(entries["position"], LOST_REASONS)):
        raise InvalidRefError(f"a lost reference's reason must be {LOST_STALE} (stale), "
                              f"{LOST_INVALID} (invalid) or {LOST_RELEASED} (released)")
    mode = entries["mode"]
    if np.any((live | lost) & (mode != MODE_SELECTED) & (mode != MODE_SUPPORT)):
        raise InvalidRefError("reference mode is invalid: accepted 1 (selected), 2 (support)")
    if np.any(shm & (entries["segment"] >= n_segments)):
        raise InvalidRefError(f"reference names segment index >= {n_segments}")
    inline = kind == KIND_INLINE
    if np.any(inline):
        start = entries["position"][inline]
        size = entries["record_bytes"][inline]
        rows = entries["rows"][inline].astype(np.uint64)
        nnz = entries["nnz"][inline]
        words = entries["words"][inline].astype(np.uint64)
        if np.any(nnz > (1 << 40)) or np.any(size > inline_bytes) or np.any(
            start > inline_bytes - size
        ):
            raise InvalidRefError("inline reference points outside its batch")
        if np.any(size != payload_bytes(mode[inline], rows, words, nnz)):
            raise InvalidRefError("inline reference size disagrees with its rows, nnz and words")


# ------------------------------------------------------------- msgpack

def msgpack_enc_hook(obj: Any) -> Any:
    """msgspec.msgpack enc_hook: RefBatch/ChunkRef travel as one ext object."""
    import msgspec

    if isinstance(obj, RefBatch):
        return msgspec.msgpack.Ext(MSGPACK_EXT_CODE, obj.to_bytes())
    if isinstance(obj, ChunkRef):
        return msgspec.msgpack.Ext(MSGPACK_EXT_CODE, obj.to_bytes())
    raise NotImplementedError(f"cannot msgpack {type(obj).__name__}")


def msgpack_ext_hook(code: int, data: memoryview) -> Any:
    """msgspec.msgpack ext_hook: the inverse of msgpack_enc_hook (a RefBatch)."""
    if type(code) is not int or code != MSGPACK_EXT_CODE:
        raise InvalidRefError(f"unknown msgpack extension code {code!r}: accepted {MSGPACK_EXT_CODE}")
    return RefBatch.from_bytes(data)

"""Rings read from another host through NIXL.

A consumer on another host cannot map the producer's /dev/shm. Instead of a
forwarding hop on the producer's host copying every chunk into the batch
(RefBatch.to_inline), the producer exports its ring segments to NIXL once
and a hop on the consumer's host pulls the records a batch names with
one-sided READs, turning them into inline entries:

    # producer host                          # consumer host (a forwarding hop)
    export = RemoteExport(writer, port=p)    puller = RemotePuller(port=q, timeout_s=2)
    descriptor = export.descriptor(my_ip)    batch = puller.pull(RemoteBatch.from_bytes(data))
    data = RemoteBatch(refs, descriptor)     # an ordinary RefBatch, its pulled entries inline
           .to_bytes()

The puller READs each record into the same offset of a private, sparse
mirror of the segment (zeros until a READ lands), then the segment header
(its tail) after the records, and opens each record there with the native
core's own checks (shm_open_record: tag, seal, state, sizes, rows), exactly
as a local reader would; the header read after the records is the seqlock
re-check: a record reclaimed before the READ ended shows a tail past it and
is stale. Copied records are given back to the producer by one NIXL
notification per segment (positions and seals), on which the export calls
the native shm_release_many: no Python writes to shared memory. The puller
remembers what it gave back, so pulling a record again fails that entry
(LOST_RELEASED: DoubleReleaseError, as a local open of a released record)
without a READ, even before its release has landed.

NIXL never fails a READ on a link that was pulled (UCX over TCP waits on the
kernel's retransmissions, tests/test_netns_nixl.py), so every pull has its
own deadline: entries it could not read in time become LOST (stale) and the
others go through. NIXL cannot cancel a READ, so one given up is kept with
its destination until it ends (RemotePuller._late), and its agent is left
alone meanwhile. Everything a RemoteBatch carries is untrusted input.

NIXL is imported only when an export or a puller is made:
`pip install 'shmask[nixl]'` (nixl-cu12; 1.5.1 is the version tested). UCX picks its transports from the
environment (UCX_TLS, UCX_NET_DEVICES).
"""

from __future__ import annotations

import heapq
import ipaddress
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ._native import ffi, lib
from ._native_errors import raise_for
from .config import Config
from .errors import InvalidRefError, ShmaskError, StaleChunkError
from .refs import (
    KIND_SHM,
    LOST_INVALID,
    LOST_RELEASED,
    LOST_STALE,
    MODE_SUPPORT,
    RefBatch,
    lost_reason,
    pack_payload,
)
from .segment import Segment, is_valid_name

log = logging.getLogger("shmask")

NIXL_HINT = "pip install 'shmask[nixl]' (nixl-cu12; 1.5.1 is the version tested)"

# RemoteBatch (little-endian):
#   offset 0  4s  magic b"SMRR"
#          4  u16 version (1)
#          6  u16 reserved (0)
#          8  u32 descriptor_bytes
#         12  descriptor: UTF-8 JSON (RemoteExport.descriptor)
#             the RefBatch bytes (refs.py), to the end
REMOTE_MAGIC = b"SMRR"
REMOTE_VERSION = 1
_REMOTE_HEADER = struct.Struct("<4sHHI")
MAX_DESCRIPTOR_BYTES = 64 << 10
MAX_SEGMENTS = 256
MAX_AGENT_NAME = 128
# A segment's size as a descriptor may state it: the mirror is that big
# (virtual memory: np.zeros maps untouched pages lazily).
MAX_SEGMENT_BYTES = 1 << 40
_HEADER_BYTES = int(lib.SHM_HEADER_BYTES)
_MIN_SEGMENT_BYTES = _HEADER_BYTES + int(lib.SHM_MIN_CAPACITY)
_ALIGN = int(lib.SHM_RECORD_ALIGN)
# What the seqlock re-check reads again after the records: the header fields
# (native/shmask_layout.h: they end at byte 256).
_HEADER_FIELDS_BYTES = 256

# A release notification (little-endian): magic b"SMRL", u32 segment index
# in the descriptor, u64 epoch, then (u64 position, u64 seal) pairs.
RELEASE_MAGIC = b"SMRL"
_RELEASE_HEADER = struct.Struct("<4sIQ")
MAX_RELEASES_PER_NOTIF = 4096
# NIXL's progress thread (on by default) spins a core even idle (RESULTS.md:
# 91-97% of a core over an idle second). Off: the export's notification
# poll and the puller's state checks drive UCX's progress themselves.
PROGRESS_THREAD = False


def _nixl() -> Any:
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise ImportError(f"shmask.remote needs NIXL: {NIXL_HINT} ({exc})") from exc
    return _api


def _ucx_agent(api: Any, name: str, port: int) -> Any:
    """A NIXL agent with the UCX backend, its metadata listener on `port`,
    without NIXL's progress thread (PROGRESS_THREAD): an export's or a
    puller's."""
    agent = api.nixl_agent(name, api.nixl_agent_config(
        enable_prog_thread=PROGRESS_THREAD, enable_listen_thread=True, listen_port=port,
        backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise ShmaskError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    return agent


def _address(base: Any) -> int:
    return int(ffi.cast("uintptr_t", base))


# ------------------------------------------------------------- descriptor

@dataclass(frozen=True)
class RemoteSegment:
    """One exported ring segment: where it lies in the producer's memory."""
    name: str
    epoch: int
    address: int
    size: int


@dataclass(frozen=True)
class RemoteDescriptor:
    """Which NIXL agent exports which segments (RemoteExport.descriptor)."""
    agent: str
    ip: str
    port: int
    segments: tuple[RemoteSegment, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"agent": self.agent, "ip": self.ip, "port": self.port,
                "segments": [{"name": s.name, "epoch": s.epoch, "address": s.address,
                              "size": s.size} for s in self.segments]}

    @classmethod
    def from_dict(cls, value: object) -> RemoteDescriptor:
        """Validates every field (untrusted): InvalidRefError otherwise."""
        if not isinstance(value, dict):
            raise InvalidRefError(f"remote descriptor must be an object, got "
                                  f"{type(value).__name__}")
        agent, ip, port = value.get("agent"), value.get("ip"), value.get("port")
        if (not isinstance(agent, str) or not 0 < len(agent) <= MAX_AGENT_NAME
                or not agent.isascii() or not agent.isprintable()):
            raise InvalidRefError(f"remote descriptor: agent name {agent!r} is invalid "
                                  f"(1 to {MAX_AGENT_NAME} printable ASCII characters)")
        if not isinstance(ip, str):
            raise InvalidRefError(f"remote descriptor: ip {ip!r} is not a string")
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise InvalidRefError(f"remote descriptor: ip {ip!r} is not an IP address") from None
        if type(port) is not int or not 0 < port < 1 << 16:
            raise InvalidRefError(f"remote descriptor: port {port!r} is not 1 to 65535")
        raw = value.get("segments")
        if not isinstance(raw, list) or len(raw) > MAX_SEGMENTS:
            raise InvalidRefError(f"remote descriptor: segments must be a list of at most "
                                  f"{MAX_SEGMENTS}")
        segments = []
        names = set()
        for i, seg in enumerate(raw):
            if not isinstance(seg, dict):
                raise InvalidRefError(f"remote descriptor: segment {i} is not an object")
            name, epoch = seg.get("name"), seg.get("epoch")
            address, size = seg.get("address"), seg.get("size")
            if not isinstance(name, str) or not is_valid_name(name) or name in names:
                raise InvalidRefError(f"remote descriptor: segment {i} name {name!r} is not a "
                                      "shmask segment name (or repeats one)")
            if type(epoch) is not int or not 0 <= epoch < 1 << 64:
                raise InvalidRefError(f"remote descriptor: segment {name!r} epoch {epoch!r} is "
                                      "not a u64")
            if type(size) is not int or not _MIN_SEGMENT_BYTES <= size <= MAX_SEGMENT_BYTES:
                raise InvalidRefError(f"remote descriptor: segment {name!r} size {size!r} is "
                                      f"outside {_MIN_SEGMENT_BYTES} to {MAX_SEGMENT_BYTES}")
            if type(address) is not int or not 0 < address or address + size > 1 << 64:
                raise InvalidRefError(f"remote descriptor: segment {name!r} address "
                                      f"{address!r} is invalid")
            names.add(name)
            segments.append(RemoteSegment(name, epoch, address, size))
        return cls(agent, ip, port, tuple(segments))


def parse_descriptor(data: bytes) -> RemoteDescriptor:
    """A descriptor's JSON (untrusted): InvalidRefError unless well formed."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidRefError(f"remote batch descriptor is not JSON: {exc}") from None
    return RemoteDescriptor.from_dict(raw)


def remote_prefix(descriptor: RemoteDescriptor | dict[str, Any]) -> bytes:
    """A RemoteBatch's bytes up to its RefBatch: the same for every batch of
    one export, so a producer that sends many makes it once."""
    if not isinstance(descriptor, RemoteDescriptor):
        descriptor = RemoteDescriptor.from_dict(descriptor)
    desc = orjson.dumps(descriptor.to_dict())
    if len(desc) > MAX_DESCRIPTOR_BYTES:
        raise InvalidRefError(f"remote descriptor of {len(desc)} bytes exceeds "
                              f"{MAX_DESCRIPTOR_BYTES}")
    return _REMOTE_HEADER.pack(REMOTE_MAGIC, REMOTE_VERSION, 0, len(desc)) + desc


class RemoteBatch:
    """A RefBatch plus the descriptor of the rings it points into: what a
    forwarding hop sends to a host that pulls the rows (RemotePuller)."""

    __slots__ = ("batch", "descriptor")

    def __init__(self, batch: RefBatch, descriptor: RemoteDescriptor | dict[str, Any]) -> None:
        if not isinstance(batch, RefBatch):
            raise TypeError(f"RemoteBatch takes a RefBatch, got {type(batch).__name__}")
        self.batch = batch
        self.descriptor = (descriptor if isinstance(descriptor, RemoteDescriptor)
                           else RemoteDescriptor.from_dict(descriptor))

    def to_bytes(self) -> bytes:
        return remote_prefix(self.descriptor) + self.batch.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RemoteBatch:
        desc, batch = cls.parts(data)
        return cls(RefBatch.from_bytes(batch), parse_descriptor(desc))

    @staticmethod
    def parts(data: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
        """(descriptor JSON, RefBatch bytes) of a remote batch, its header
        checked, neither part parsed: a consumer of many batches from one
        export parses the descriptor once (parse_descriptor)."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"a remote batch is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _REMOTE_HEADER.size:
            raise InvalidRefError(f"remote batch of {len(data)} bytes is shorter than its header")
        magic, version, reserved, desc_bytes = _REMOTE_HEADER.unpack_from(data)
        if magic != REMOTE_MAGIC:
            raise InvalidRefError(f"not a shmask remote batch (magic {magic!r})")
        if version != REMOTE_VERSION or reserved:
            raise InvalidRefError(f"remote batch version {version} is not supported "
                                  f"({REMOTE_VERSION})")
        end = _REMOTE_HEADER.size + desc_bytes
        if desc_bytes > MAX_DESCRIPTOR_BYTES or end > len(data):
            raise InvalidRefError(f"remote batch descriptor of {desc_bytes} bytes does not fit "
                                  f"its {len(data)} bytes (at most {MAX_DESCRIPTOR_BYTES})")
        return data[_REMOTE_HEADER.size:end], data[end:]

    def __repr__(self) -> str:
        return (f"RemoteBatch({len(self.batch)} refs, agent {self.descriptor.agent!r} at "
                f"{self.descriptor.ip}:{self.descriptor.port})")


def _release_messages(segment_index: int, epoch: int,
                      pairs: Sequence[tuple[int, int]]) -> list[bytes]:
    messages = []
    for start in range(0, len(pairs), MAX_RELEASES_PER_NOTIF):
        part = np.array(pairs[start:start + MAX_RELEASES_PER_NOTIF], dtype="<u8").reshape(-1)
        messages.append(_RELEASE_HEADER.pack(RELEASE_MAGIC, segment_index, epoch)
                        + part.tobytes())
    return messages


# ---------------------------------------------------------------- producer

@dataclass
class ExportStats:
    notifs: int = 0  # release notifications received
    releases: int = 0  # records released on a peer's word
    release_errors: int = 0  # positions the core refused (stale, released already, forged)
    bad_notifs: int = 0  # notifications that were not well-formed release messages
    handle_errors: int = 0  # notifications whose handling raised (logged once per kind)


class _Exported:
    __slots__ = ("segment", "base", "size", "capacity", "epoch", "registered")

    def __init__(self, segment: Segment, capacity: int, epoch: int, registered: Any) -> None:
        self.segment = segment
        self.base = segment.base  # our own reference: the mapping stays while we use it
        self.size = segment.size
        self.capacity = capacity
        self.epoch = epoch
        self.registered = registered


class RemoteExport:
    """Exports a producer's ring segment(s) to NIXL: one agent (UCX, its
    listen thread on `port`) with each segment's whole mapping registered,
    and a thread that releases the records peers say they copied.

    `source` is a shmask.Writer, a Segment, or a sequence of them; its
    order is the segments' order in the descriptor."""

    def __init__(self, source: Any, *, name: str | None = None, port: int,
                 poll_s: float = 0.002) -> None:
        api = _nixl()
        segments = _segments_of(source)
        self.name = name or f"shmask-export-{os.getpid()}-{secrets.token_hex(4)}"
        self.port = port
        self.stats = ExportStats()
        self._poll_s = poll_s
        info = ffi.new("shm_info *")
        self._agent = _ucx_agent(api, self.name, port)
        self._exported: list[_Exported] = []
        try:
            for segment in segments:
                rc = lib.shm_read_info(segment.base, segment.size, info)
                if rc:
                    raise_for(rc, f"export {segment.name}")
                registered = self._agent.register_memory(
                    [(_address(segment.base), segment.size, 0, "")], "DRAM")
                self._exported.append(_Exported(segment, int(info.capacity), int(info.epoch),
                                                registered))
        except BaseException:
            self._deregister()
            raise
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shmask-export-{self.name}",
                                        daemon=True)
        self._thread.start()

    def descriptor(self, ip: str) -> dict[str, Any]:
        """What a puller needs to read these segments: this agent's name and
        listen address (`ip`: this host's address the pullers reach) and
        each segment's name, epoch, address and size."""
        return RemoteDescriptor(self.name, ip, self.port, tuple(
            RemoteSegment(e.segment.name, e.epoch, _address(e.base), e.size)
            for e in self._exported)).to_dict()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:  # the agent is being torn down
                log.exception("shmask.remote: get_new_notifs failed")
                continue
            for messages in notifs.values():
                for message in messages:
                    try:
                        self._handle(message)
                    except Exception as exc:  # a peer's message must not end the thread
                        self.stats.handle_errors += 1
                        kind = type(exc).__name__
                        if kind not in self._logged:
                            self._logged.add(kind)
                            log.exception("shmask.remote: a release notification failed")

    def _handle(self, message: bytes) -> None:
        self.stats.notifs += 1
        body = len(message) - _RELEASE_HEADER.size
        if body < 0 or body % 16 or body // 16 > MAX_RELEASES_PER_NOTIF:
            self.stats.bad_notifs += 1
            return
        magic, index, epoch = _RELEASE_HEADER.unpack_from(message)
        if magic != RELEASE_MAGIC or index >= len(self._exported):
            self.stats.bad_notifs += 1
            return
        exported = self._exported[index]
        if epoch != exported.epoch:
            self.stats.bad_notifs += 1
            return
        pairs = np.frombuffer(message, dtype="<u8", offset=_RELEASE_HEADER.size).reshape(-1, 2)
        positions = np.ascontiguousarray(pairs[:, 0], dtype=np.uint64)
        seals = np.ascontiguousarray(pairs[:, 1], dtype=np.uint64)
        results = np.zeros(positions.size, np.int32)
        lib.shm_release_many(exported.base, exported.size, exported.capacity,
                             ffi.from_buffer("uint64_t[]", positions),
                             ffi.from_buffer("uint64_t[]", seals), positions.size,
                             ffi.from_buffer("int32_t[]", results))
        ok = int(np.count_nonzero(results == lib.SHM_OK))
        self.stats.releases += ok
        self.stats.release_errors += positions.size - ok

    def close(self) -> None:
        """Stop the release thread. The segments stay mapped and registered
        for as long as this object (and so its agent) lives: NIXL 1.5.1 has
        no way to stop an agent serving READs of registered memory (nor
        does deregistering stop a peer's READ), and a READ of a ring
        unmapped under the agent crashes this process. A peer pulling after
        close() still reads the records as they are (released or not: its
        own checks decide) or times out; the memory goes when the export
        is collected (its agent first: the attribute made first)."""
        if getattr(self, "_stop", None) is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()

    def _deregister(self) -> None:
        for exported in self._exported:
            try:
                self._agent.deregister_memory(exported.registered)
            except Exception:
                log.exception("shmask.remote: deregister_memory failed")
        self._exported = []

    def __enter__(self) -> RemoteExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _segments_of(source: Any) -> list[Segment]:
    items = list(source) if isinstance(source, list | tuple) else [source]
    segments = []
    for item in items:
        segment = getattr(item, "segment", item) if not isinstance(item, Segment) else item
        if not isinstance(segment, Segment) or segment.closed:
            raise TypeError(f"RemoteExport takes Writers (transport 'shm', open) or Segments, "
                            f"got {type(item).__name__}")
        segments.append(segment)
    if not segments:
        raise ValueError("RemoteExport: no segment to export")
    return segments


# ------------------------------------------------------------------ reader

@dataclass
class PullStats:
    pulls: int = 0
    pulled: int = 0  # entries turned inline
    lost_stale: int = 0
    lost_invalid: int = 0
    lost_released: int = 0  # entries copied and given back before (a batch pulled twice)
    read_errors: int = 0  # READs that failed or ran past the deadline
    quarantined: int = 0  # READs given up while still in flight (kept until they end)
    dropped_bytes: int = 0  # mirror pages given back after their records were copied
    mirrors_dropped: int = 0  # mirrors of the producers least recently pulled from (MAX_MIRRORS)
    notify_errors: int = 0  # release notifications that could not be sent
    last_error: str = ""  # the last READ or metadata failure, for people


class _PullTimeout(Exception):
    pass


# READs that ran past their deadline (or failed in flight) and may still
# land: NIXL 1.5.1 cannot cancel one (release_xfer_handle, remove_remote_agent
# and deregister_memory leave it running), so its handle, its destination
# buffer and that buffer's registration are kept here until the READ says
# DONE or ERR. Freeing the buffer earlier lets the late bytes land on freed
# memory (a crash) or on a new buffer at the same address (stale rows
# after their check).
MAX_QUARANTINE = 64

# Records a mirror remembers having copied and given back (_Mirror.given).
# The memory only has to last until the release lands: from then on the
# producer's own record says the same (RELEASED: DoubleReleaseError at the
# mirror's check, then below the tail: stale), so a mirror forgets what lies
# below the tail each pull reads, and past this many, its lowest positions
# (the oldest, whose releases landed long ago). The ring itself would allow
# capacity / 128 live records (millions in the default 1 GiB ring); this is
# about 2 MiB of Python objects per mirror at most, and hundreds of pulls'
# worth of records in flight.
MAX_GIVEN = 1 << 14

# Mirrors a puller keeps (one per producer segment it pulls from). A producer
# restarted under a new agent name (the default) brings a new mirror, and the
# old one would otherwise stay for the puller's life (its address space and
# NIXL registration; its pages are given back after each pull): past this
# many, the one least recently pulled from goes. A large deployment's head
# node pulls from one segment per remote scheduler (64 at 8 nodes of TP 8).
MAX_MIRRORS = 256


@dataclass
class _Late:
    agent: str
    handle: Any  # nixl_xfer_handle: never released (nor collected) before it ends
    buffer: Any  # the destination (a _Mirror or the scratch array): never freed before
    registered: Any  # its registration: never deregistered before


class _Mirror:
    """A private copy of a remote segment's header and ring, each byte at its
    own offset; sized by the ring's own header (read first into a scratch
    page), never by the descriptor alone. Anonymous memory: untouched pages
    cost nothing, and the pages a pull wrote are given back once its records
    are copied out (`drop`), so a consumer's memory does not grow to the
    producer's ring size as pulls walk around it."""

    __slots__ = ("memory", "array", "base", "size", "capacity", "registered", "remote",
                 "given", "_given_order")

    def __init__(self, header: np.ndarray, capacity: int, registered_by: Any) -> None:
        self.size = _HEADER_BYTES + capacity
        self.memory = mmap.mmap(-1, self.size)  # zero pages until written
        self.array = np.frombuffer(self.memory, np.uint8)
        self.array[:_HEADER_BYTES] = header
        self.base = ffi.from_buffer(self.array)
        self.capacity = capacity
        self.remote = (0, 0)  # the (address, size) its descriptor gave
        self.registered = registered_by.register_memory(
            [(self.array.ctypes.data, self.size, 0, "")], "DRAM")
        # position -> seal of the records copied out and given back (the
        # claim a local reader's release makes, kept on this side: two pulls
        # of one batch must not both copy it); positions in a min-heap to
        # forget the lowest first. A position never recurs in one epoch
        # (the head only grows); the seal keeps a forged ref from passing
        # for one of them. A mirror dropped (_forget) forgets them: from
        # then on the producer's record alone tells (RELEASED once the
        # release has landed).
        self.given: dict[int, int] = {}
        self._given_order: list[int] = []

    def give(self, position: int, seal: int) -> None:
        """Remember a record copied out and given back (MAX_GIVEN at most)."""
        if position not in self.given:
            heapq.heappush(self._given_order, position)
        self.given[position] = seal
        while len(self._given_order) > MAX_GIVEN:
            del self.given[heapq.heappop(self._given_order)]

    def forget_below(self, tail: int) -> None:
        """Forget the records below the producer's tail: reclaimed, so a pull
        of one fails as stale without being remembered."""
        order = self._given_order
        while order and order[0] < tail:
            del self.given[heapq.heappop(order)]

    def drop(self, ranges: Sequence[tuple[int, int]]) -> int:
        """Give back the pages under these (offset, size) ranges, whole pages
        around them (the bytes there were copied out or belong to no pull
        now: a later pull READs again what it opens); the header's pages
        stay. Returns the bytes given back."""
        page = mmap.PAGESIZE
        floor = -(-_HEADER_BYTES // page) * page
        dropped = 0
        for start, end in _merged(ranges):
            start = max(floor, start // page * page)
            end = min(self.size, -(-end // page) * page)
            if end > start:
                self.memory.madvise(mmap.MADV_DONTNEED, start, end - start)
                dropped += end - start
        return dropped


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, size) ranges as sorted, merged [start, end) runs."""
    runs: list[tuple[int, int]] = []
    for start, size in sorted(ranges):
        end = start + size
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


class RemotePuller:
    """Pulls the ring records of RemoteBatches through NIXL (one agent, UCX,
    its listen thread on `port`); `pull` gives an ordinary RefBatch whose
    pulled entries are inline. Not for several threads at once (a lock
    serialises pulls)."""

    def __init__(self, *, name: str | None = None, port: int, timeout_s: float = 5.0,
                 config: Config | None = None) -> None:
        api = _nixl()
        self.name = name or f"shmask-pull-{os.getpid()}-{secrets.token_hex(4)}"
        self.timeout_s = float(timeout_s)
        self.stats = PullStats()
        self._max_tokens = (config or Config.from_env()).max_tokens
        self._refused: tuple[type[BaseException], ...] = tuple(
            error for error in (getattr(api.nixlBind, "nixlNotFoundError", None),
                                getattr(api.nixlBind, "nixlInvalidParamError", None))
            if isinstance(error, type))
        self._agent = _ucx_agent(api, self.name, port)
        self._peers: dict[str, tuple[str, int]] = {}  # agent -> (ip, port) with metadata
        # One mirror per (agent, segment name, epoch): a descriptor naming it at
        # another address or size is forged (LOST_INVALID), and cannot make
        # the puller allocate and register mirrors without end.
        self._mirrors: dict[tuple[str, str, int], _Mirror] = {}
        self._lock = threading.Lock()
        self._view = ffi.new("shm_view *")
        self._info = ffi.new("shm_info *")
        self._scratch = np.zeros(_HEADER_BYTES, np.uint8)  # a header, before its mirror
        self._scratch_registered: Any = None
        self._late: list[_Late] = []

    def pull(self, remote: RemoteBatch | bytes) -> RefBatch:
        """The batch with the ring entries of the descriptor's segments
        copied in (inline), each copied record given back to its producer.
        An entry that could not be read in time, or was found malformed,
        becomes LOST (its request alone fails); entries of segments the
        descriptor does not name, and entries of other kinds, pass as
        they are."""
        if not isinstance(remote, RemoteBatch):
            remote = RemoteBatch.from_bytes(remote)
        with self._lock:
            return self._pull(remote)

    def _pull(self, remote: RemoteBatch) -> RefBatch:
        self.stats.pulls += 1
        batch, desc = remote.batch, remote.descriptor
        entries = batch.entries.copy()
        by_name = {s.name: i for i, s in enumerate(desc.segments)}
        groups: dict[int, list[int]] = {}
        lost: dict[int, int] = {}
        payloads: dict[int, bytes] = {}
        shm = np.flatnonzero(entries["kind"] == KIND_SHM).tolist()
        for i in shm:
            name, epoch, _host = batch.segments[int(entries[i]["segment"])]
            index = by_name.get(name)
            if index is None:
                continue  # not exported here: the consumer says RemoteChunkError
            if desc.segments[index].epoch != epoch:
                lost[i] = LOST_STALE  # the segment was recreated
                continue
            groups.setdefault(index, []).append(i)
        # Two entries naming one record: one of them is not its request's
        # (forged or corrupt), and which one cannot be told: neither is read.
        for index, members in list(groups.items()):
            positions = entries["position"][members]
            unique, counts = np.unique(positions, return_counts=True)
            if unique.size < positions.size:
                twice = set(unique[counts > 1].tolist())
                lost.update((i, LOST_INVALID) for i in members
                            if int(entries[i]["position"]) in twice)
                groups[index] = [i for i in members if i not in lost]
                if not groups[index]:
                    del groups[index]
        self._poll_late()
        if groups and (len(self._late) >= MAX_QUARANTINE
                       or any(late.agent == desc.agent for late in self._late)):
            # A READ from this agent may still land: read nothing more from it
            # (nor from anyone, past the bound) until they all end.
            self.stats.last_error = (f"_PullTimeout: {len(self._late)} earlier READ(s) still in "
                                     f"flight (from {desc.agent} or past {MAX_QUARANTINE})")
            for members in groups.values():
                lost.update((i, LOST_STALE) for i in members)
            groups = {}
        if groups:
            deadline = time.monotonic() + self.timeout_s
            try:
                fresh = self._connect(desc, deadline)
            except Exception as exc:
                log.warning("shmask.remote: no metadata from %s at %s:%d: %s", desc.agent,
                            desc.ip, desc.port, exc)
                self.stats.read_errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
                for members in groups.values():
                    lost.update((i, LOST_STALE) for i in members)
                groups = {}
            for index, members in groups.items():
                if desc.agent not in self._peers:
                    # Forgotten by an earlier segment's failure: not tried again here.
                    lost.update((i, LOST_STALE) for i in members)
                    continue
                copied = self._pull_segment(desc, index, batch, entries, members, payloads,
                                            lost, deadline)
                if copied is None and not fresh:
                    # Refused by metadata cached before this pull: the producer may
                    # have restarted under the same name and address. Fetch it again,
                    # once, before calling the entries invalid.
                    fresh = True
                    self._forget(desc.agent)
                    try:
                        self._connect(desc, deadline)
                    except Exception as exc:
                        self.stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
                        lost.update((i, LOST_STALE) for i in members)
                        continue
                    for i in members:
                        lost.pop(i, None)
                    copied = self._pull_segment(desc, index, batch, entries, members, payloads,
                                                lost, deadline)
                if copied:
                    self._notify(desc, index, copied)
        return _rebuild(batch, payloads, lost, self.stats)

    # ------------------------------------------------------------ internals
    def _connect(self, desc: RemoteDescriptor, deadline: float) -> bool:
        """Metadata of the descriptor's agent; True when fetched now."""
        if self._peers.get(desc.agent) == (desc.ip, desc.port):
            return False
        self._forget(desc.agent)
        # Asked again every quarter second: a removal just made (a restarted
        # peer, forgotten) is applied by NIXL's listener thread and may
        # discard the answer to a fetch sent before it.
        asked = 0.0
        while not self._agent.check_remote_metadata(desc.agent):
            now = time.monotonic()
            if now > deadline:
                raise _PullTimeout(f"no metadata within {self.timeout_s} s")
            if now - asked > 0.25:
                self._agent.fetch_remote_metadata(desc.agent, desc.ip, desc.port)
                asked = now
            time.sleep(0.002)
        self._peers[desc.agent] = (desc.ip, desc.port)
        return True

    def _forget(self, agent: str) -> None:
        """After a failed or late READ: drop the peer (the next pull fetches
        its metadata again) and its mirrors (none has a READ in flight: a
        late READ's mirror is in self._late, not there)."""
        self._peers.pop(agent, None)
        if not any(late.agent == agent for late in self._late):
            # (Kept while a READ from it is in flight; _poll_late forgets it
            # again when the last one ends.)
            try:
                self._agent.remove_remote_agent(agent)
            except Exception:
                pass
        for key in [k for k in self._mirrors if k[0] == agent]:
            mirror = self._mirrors.pop(key)
            try:
                self._agent.deregister_memory(mirror.registered)
            except Exception:
                pass

    def _mirror(self, desc: RemoteDescriptor, segment: RemoteSegment,
                deadline: float) -> _Mirror:
        key = (desc.agent, segment.name, segment.epoch)
        mirror = self._mirrors.pop(key, None)
        if mirror is not None:
            self._mirrors[key] = mirror   # the most recently pulled from: last
        if mirror is not None and mirror.remote != (segment.address, segment.size):
            raise InvalidRefError(f"remote segment {segment.name}: address or size differs "
                                  "from the first descriptor's")
        if mirror is None:
            if self._scratch_registered is None:
                self._scratch_registered = self._agent.register_memory(
                    [(self._scratch.ctypes.data, _HEADER_BYTES, 0, "")], "DRAM")
            self._scratch[:] = 0
            self._read_into(desc, None, segment, [(0, _HEADER_BYTES)], deadline)
            info = self._info
            rc = lib.shm_read_info(ffi.from_buffer(self._scratch), segment.size, info)
            if rc:
                raise_for(rc, f"remote segment {segment.name}")
            if int(info.epoch) != segment.epoch:
                raise StaleChunkError(f"remote segment {segment.name}: epoch {int(info.epoch)}, "
                                      f"the descriptor says {segment.epoch}")
            mirror = _Mirror(self._scratch, int(info.capacity), self._agent)
            mirror.remote = (segment.address, segment.size)
            self._mirrors[key] = mirror
            while len(self._mirrors) > MAX_MIRRORS:
                # The least recently pulled from (a dict keeps its order):
                # none has a READ in flight (those are in self._late), and
                # a pull copies one segment's records out before the next
                # segment's mirror is made. What it remembered of the records
                # it gave back goes with it (_Mirror.given).
                oldest = self._mirrors.pop(next(iter(self._mirrors)))
                self.stats.mirrors_dropped += 1
                try:
                    self._agent.deregister_memory(oldest.registered)
                except Exception:
                    pass
        return mirror

    def _read(self, desc: RemoteDescriptor, mirror: _Mirror, segment: RemoteSegment,
              ranges: Sequence[tuple[int, int]], deadline: float) -> None:
        """READ [offset, offset + size) of the remote segment into the same
        range of the mirror, for every range, by `deadline`; raises
        otherwise (a refused descriptor, a disconnect, a timeout)."""
        self._read_into(desc, mirror, segment, ranges, deadline)

    def _read_into(self, desc: RemoteDescriptor, mirror: _Mirror | None,
                   segment: RemoteSegment, ranges: Sequence[tuple[int, int]],
                   deadline: float) -> None:
        """READ into `mirror`, or into the scratch header when None."""
        local_base = (self._scratch if mirror is None else mirror.array).ctypes.data
        local = self._agent.get_xfer_descs(
            [(local_base + offset, size, 0) for offset, size in ranges], "DRAM")
        remote = self._agent.get_xfer_descs(
            [(segment.address + offset, size, 0) for offset, size in ranges], "DRAM")
        handle = self._agent.initialize_xfer("READ", local, remote, desc.agent)
        state = "PROC"
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise _PullTimeout(f"READ of {len(ranges)} range(s) from {desc.agent} not "
                                       f"done within {self.timeout_s} s")
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise ShmaskError(f"READ from {desc.agent} ended in state {state}")
        finally:
            if state in ("DONE", "ERR"):
                self._release(handle)
            else:  # given up (or failed) in flight: it may still land
                self._quarantine(desc.agent, handle, mirror)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass  # the first error is the one to report

    def _quarantine(self, agent: str, handle: Any, mirror: _Mirror | None) -> None:
        """Keep a READ still in flight, its destination and its registration
        until it ends (_poll_late); never reuse that destination."""
        self.stats.quarantined += 1
        if mirror is None:
            late = _Late(agent, handle, self._scratch, self._scratch_registered)
            self._scratch = np.zeros(_HEADER_BYTES, np.uint8)  # registered afresh when needed
            self._scratch_registered = None
        else:
            late = _Late(agent, handle, mirror, mirror.registered)
            for key in [k for k, m in self._mirrors.items() if m is mirror]:
                del self._mirrors[key]
        self._late.append(late)

    def _poll_late(self) -> None:
        """Free the quarantined READs that have ended; forget an agent whose
        last one ended (the next pull fetches its metadata afresh)."""
        if not self._late:
            return
        pending = []
        for late in self._late:
            try:
                state = self._agent.check_xfer_state(late.handle)
            except Exception:
                state = "PROC"  # unknown: keeping the buffer is the safe side
            if state not in ("DONE", "ERR"):
                pending.append(late)
                continue
            self._release(late.handle)
            if late.registered is not None:
                try:
                    self._agent.deregister_memory(late.registered)
                except Exception:
                    pass
        ended = {late.agent for late in self._late} - {late.agent for late in pending}
        self._late = pending
        for agent in ended:
            self._forget(agent)

    def _header(self, mirror: _Mirror, segment: RemoteSegment) -> None:
        """Validate the mirror's header (as read last) against what it said
        first: a sound header of the same ring."""
        rc = lib.shm_read_info(mirror.base, mirror.size, self._info)
        if rc:
            raise_for(rc, f"remote segment {segment.name}")
        if int(self._info.epoch) != segment.epoch:
            raise StaleChunkError(f"remote segment {segment.name}: epoch "
                                  f"{int(self._info.epoch)}, the descriptor says {segment.epoch}")
        if int(self._info.capacity) != mirror.capacity:
            raise InvalidRefError(f"remote segment {segment.name}: capacity changed")

    def _pull_segment(self, desc: RemoteDescriptor, index: int, batch: RefBatch,
                      entries: np.ndarray, members: list[int], payloads: dict[int, bytes],
                      lost: dict[int, int], deadline: float) -> list[tuple[int, int]] | None:
        """The (position, seal) of each record copied; None when NIXL refused
        the READ before issuing it (its entries are then LOST_INVALID)."""
        segment = desc.segments[index]
        try:
            mirror = self._mirror(desc, segment, deadline)
        except Exception as exc:
            return self._segment_failed(desc, segment, members, lost, exc)
        capacity = mirror.capacity
        wanted: dict[int, tuple[int, int]] = {}
        for i in members:
            position, record_bytes = int(entries[i]["position"]), int(entries[i]["record_bytes"])
            offset = position & (capacity - 1)
            if (position % _ALIGN or record_bytes < _ALIGN or record_bytes % _ALIGN
                    or record_bytes > capacity - offset
                    or int(entries[i]["rows"]) > capacity // 5):
                lost[i] = LOST_INVALID  # would not fit the ring: never READ
                continue
            if mirror.given.get(position) == int(entries[i]["seal"]):
                # Copied and given back by an earlier pull: its rows went to
                # that pull's consumer, and its release may not have landed
                # yet (a second would be refused). Never READ.
                lost[i] = LOST_RELEASED
                continue
            wanted[i] = (_HEADER_BYTES + offset, record_bytes)
        if not wanted:
            return []
        try:
            # The records, then the header: a record reclaimed (and maybe
            # rewritten) before its READ ended shows in the tail read after.
            self._read(desc, mirror, segment, sorted(set(wanted.values())), deadline)
            self._read(desc, mirror, segment, [(0, _HEADER_FIELDS_BYTES)], deadline)
            self._header(mirror, segment)
        except Exception as exc:
            return self._segment_failed(desc, segment, list(wanted), lost, exc)
        mirror.forget_below(int(self._info.tail))  # the tail _header just read
        copied = []
        for i in wanted:
            ref = batch[i]
            try:
                payloads[i] = self._copy(mirror, segment, ref)
            except ShmaskError as exc:  # stale, released already or malformed: open says which
                lost[i] = lost_reason(exc)
                continue
            copied.append((ref.position, ref.seal))
            mirror.give(ref.position, ref.seal)
        self.stats.dropped_bytes += mirror.drop(list(wanted.values()))
        return copied

    def _segment_failed(self, desc: RemoteDescriptor, segment: RemoteSegment,
                        members: list[int], lost: dict[int, int],
                        exc: BaseException) -> list[tuple[int, int]] | None:
        log.warning("shmask.remote: cannot READ %s from %s: %s", segment.name, desc.agent, exc)
        self.stats.read_errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
        # NIXL refuses, before issuing it, a READ of memory the peer did not
        # register (a forged address or size): the descriptor is malformed.
        refused = isinstance(exc, self._refused)
        reason = LOST_INVALID if refused or isinstance(exc, InvalidRefError) else LOST_STALE
        lost.update((i, reason) for i in members)
        if not refused and not isinstance(exc, ShmaskError):
            self._forget(desc.agent)  # a disconnect or a late READ: connect afresh next time
        return None if refused else []

    def _copy(self, mirror: _Mirror, segment: RemoteSegment, ref: Any) -> bytes:
        rows, words, nnz = ref.rows, ref.words, ref.nnz
        geometry = bytearray(5 * rows)
        view = self._view
        rc = lib.shm_open_record(mirror.base, mirror.size, mirror.capacity, ref.position,
                                 ref.seal, ref.record_bytes, rows, words, nnz, ref.vocab, ref.mode,
                                 self._max_tokens, ffi.from_buffer(geometry), view)
        if rc:
            raise_for(rc, f"pull {segment.name}@{ref.position}")
        lengths = np.frombuffer(geometry, np.int32, rows)
        flags = np.frombuffer(geometry, np.uint8, rows, 4 * rows)
        ids = np.frombuffer(mirror.array, np.int32, words, view.ids_offset)
        logprobs = np.frombuffer(mirror.array, np.float32,
                                 nnz if ref.mode == MODE_SUPPORT else rows, view.logprobs_offset)
        return pack_payload(lengths, flags if view.any_flags else None, ids, logprobs)

    def _notify(self, desc: RemoteDescriptor, index: int, copied: list[tuple[int, int]]) -> None:
        segment = desc.segments[index]
        for message in _release_messages(index, segment.epoch, copied):
            try:
                self._agent.send_notif(desc.agent, message)
            except Exception as exc:  # the producer's lease reclaims them instead
                self.stats.notify_errors += 1
                log.warning("shmask.remote: cannot tell %s to release %d record(s): %s",
                            desc.agent, len(copied), exc)

    def close(self) -> None:
        """Forget every peer and mirror. READs still in flight keep their
        buffers (self._late) for as long as this object lives."""
        with self._lock:
            self._poll_late()
            for agent in list(self._peers):
                self._forget(agent)
            for mirror in self._mirrors.values():
                try:
                    self._agent.deregister_memory(mirror.registered)
                except Exception:
                    pass
            self._mirrors.clear()
            if self._scratch_registered is not None:
                try:
                    self._agent.deregister_memory(self._scratch_registered)
                except Exception:
                    pass
                self._scratch_registered = None

    def __enter__(self) -> RemotePuller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rebuild(batch: RefBatch, payloads: dict[int, bytes], lost: dict[int, int],
             stats: PullStats) -> RefBatch:
    """The batch with `payloads` inline and `lost` entries LOST, counted."""
    stats.pulled += len(payloads.keys() - lost.keys())
    stats.lost_stale += sum(reason == LOST_STALE for reason in lost.values())
    stats.lost_invalid += sum(reason == LOST_INVALID for reason in lost.values())
    stats.lost_released += sum(reason == LOST_RELEASED for reason in lost.values())
    return batch.with_inline(payloads, lost)

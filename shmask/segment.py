"""POSIX shared-memory segments: create, attach, unlink, and clean up after
producers that died.

A segment is one producer's ring (layout in native/shmask_layout.h). Names
are `/<prefix>-<uid>-<pid>-<16 random hex>`: unguessable, and the pid lets
the janitor find segments whose producer is gone. posix_ipc is used rather
than multiprocessing.shared_memory so that no process registers segments
with Python's resource tracker (which would unlink them under a reader).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import posix_ipc

from ._native import ffi, lib
from .errors import SegmentError

log = logging.getLogger("shmask")

SHM_DIR = "/dev/shm"
# Map every page up front: otherwise the first touch of each 4 KiB page on
# the hot path (a decode step's copy, a tokenizer's read) takes a page fault.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_NAME_PATTERN = re.compile(r"^/[A-Za-z0-9_]{1,32}-[0-9]{1,10}-[0-9]{1,10}-[0-9a-f]{16}$")


def is_valid_name(name: str) -> bool:
    """True when `name` has the shape of a shmask segment name."""
    return isinstance(name, str) and bool(_NAME_PATTERN.match(name))


def new_name(prefix: str) -> str:
    return f"/{prefix}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"


def process_start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (0 when unknown); with
    the pid it names a process even after pids wrap around."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # Field 22; the command name (field 2) may hold spaces, so split after ')'.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def producer_alive(pid: int, start_ticks: int) -> bool:
    if pid <= 0:
        return False
    ticks = process_start_ticks(pid)
    return ticks != 0 and (start_ticks == 0 or ticks == start_ticks)


class Segment:
    """A mapped segment. The producer creates it; readers attach by name."""

    def __init__(self, name: str, mapping: mmap.mmap, owner_pid: int | None) -> None:
        self.name = name
        self.mapping = mapping
        self.size = len(mapping)
        # The address the C core works on; held while the mapping lives.
        self._pointer = ffi.from_buffer(mapping)
        self.base = ffi.cast("void *", self._pointer)
        self.owner_pid = owner_pid
        self.closed = False

    @classmethod
    def create(cls, prefix: str, capacity: int, epoch: int) -> Segment:
        name = new_name(prefix)
        size = int(lib.SHM_HEADER_BYTES) + capacity
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.Error as exc:
            raise SegmentError(f"cannot create shared memory {name!r}: {exc}") from exc
        try:
            try:
                # Allocate every page now: a /dev/shm that is too small fails
                # here, with a message, instead of SIGBUS on a later write.
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as exc:
                free = _shm_free_bytes()
                raise SegmentError(
                    f"cannot allocate {size / 2**20:.0f} MiB for ring {name!r} in {SHM_DIR} "
                    f"({free / 2**20:.0f} MiB free): {exc.strerror}; lower SHMASK_RING_MB "
                    "or enlarge /dev/shm (docker: --shm-size)"
                ) from exc
            mapping = mmap.mmap(shm.fd, size, flags=_MAP_FLAGS)
        except BaseException:
            _unlink_quietly(name)
            raise
        finally:
            shm.close_fd()
        segment = cls(name, mapping, owner_pid=os.getpid())
        rc = lib.shm_init(
            segment.base, size, capacity, epoch, os.getpid(),
            process_start_ticks(os.getpid()), time.time_ns(),
        )
        if rc != lib.SHM_OK:
            segment.close()
            raise SegmentError(f"ring capacity {capacity} rejected by the native core ({rc})")
        _LIVE.add(segment)
        return segment

    @classmethod
    def attach(cls, name: str) -> Segment:
        if not is_valid_name(name):
            raise SegmentError(f"{name!r} is not a shmask segment name")
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise SegmentError(f"segment {name!r} does not exist (producer gone?)") from exc
        except posix_ipc.Error as exc:
            raise SegmentError(f"cannot open segment {name!r}: {exc}") from exc
        try:
            if shm.size < int(lib.SHM_HEADER_BYTES) + int(lib.SHM_MIN_CAPACITY):
                raise SegmentError(f"segment {name!r} is too small ({shm.size} bytes)")
            mapping = mmap.mmap(shm.fd, shm.size, flags=_MAP_FLAGS)
        finally:
            shm.close_fd()
        return cls(name, mapping, owner_pid=None)

    def close(self) -> None:
        """Unmap; the producer also unlinks. Views handed out keep the pages
        mapped until they are gone, so closing never invalidates them."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        if self.owner_pid == os.getpid():
            _unlink_quietly(self.name)
        try:
            ffi.release(self._pointer)
            self.mapping.close()
        except BufferError:
            pass  # numpy views still export the mapping; it unmaps with them.

    def unlink_only(self) -> None:
        """Remove the name (used at exit and on SIGTERM: no unmapping there)."""
        if self.owner_pid == os.getpid() and not self.closed:
            _unlink_quietly(self.name)


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------- lifecycle

class _LiveSegments:
    """The producer's own segments, unlinked at exit and on SIGTERM."""

    def __init__(self) -> None:
        self._segments: set[Segment] = set()
        self._lock = threading.Lock()
        self._hooked = False

    def add(self, segment: Segment) -> None:
        with self._lock:
            self._segments.add(segment)
            if not self._hooked:
                self._hooked = True
                atexit.register(self.unlink_all)
                _chain_sigterm(self.unlink_all)

    def discard(self, segment: Segment) -> None:
        with self._lock:
            self._segments.discard(segment)

    def unlink_all(self) -> None:
        with self._lock:
            segments = list(self._segments)
        for segment in segments:
            segment.unlink_only()


_LIVE = _LiveSegments()


def _chain_sigterm(cleanup) -> None:  # type: ignore[no-untyped-def]
    """Unlink on SIGTERM, then do what the process would have done anyway:
    call the handler that was installed, or die of the signal."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return

    def on_sigterm(signum, frame):  # type: ignore[no-untyped-def]
        cleanup()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


# ---------------------------------------------------------------- janitor

@dataclass(frozen=True)
class SegmentInfo:
    name: str
    size: int
    producer_pid: int
    alive: bool
    capacity: int
    head: int
    tail: int
    published: int
    released: int
    expired: int


def list_segments(prefix: str | None = None) -> Iterator[SegmentInfo]:
    """Segments of this user in /dev/shm (optionally of one prefix)."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    uid = os.getuid()
    for entry in sorted(entries):
        name = "/" + entry
        if not is_valid_name(name) or entry.split("-")[1] != str(uid):
            continue
        if prefix is not None and not entry.startswith(prefix + "-"):
            continue
        info = _inspect(name)
        if info is not None:
            yield info


def _inspect(name: str) -> SegmentInfo | None:
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.Error:
        return None
    try:
        size = shm.size
        if size < int(lib.SHM_HEADER_BYTES):
            return SegmentInfo(name, size, 0, False, 0, 0, 0, 0, 0, 0)
        mapping = mmap.mmap(shm.fd, int(lib.SHM_HEADER_BYTES), prot=mmap.PROT_READ)
    finally:
        shm.close_fd()
    try:
        pointer = ffi.from_buffer(mapping)
        try:
            info = ffi.new("shm_info *")
            if lib.shm_read_info(pointer, size, info) != lib.SHM_OK:
                return SegmentInfo(name, size, 0, False, 0, 0, 0, 0, 0, 0)
            pid = int(info.producer_pid)
            return SegmentInfo(
                name, size, pid, producer_alive(pid, int(info.producer_start)),
                int(info.capacity), int(info.head), int(info.tail),
                int(info.published), int(info.released), int(info.expired),
            )
        finally:
            ffi.release(pointer)
    finally:
        mapping.close()


def collect_garbage(prefix: str | None = None, min_age_s: float = 5.0) -> list[str]:
    """Unlink segments whose producer is gone. Segments with no valid header
    are removed only once older than `min_age_s` (they may be being made)."""
    removed = []
    now = time.time()
    for info in list_segments(prefix):
        if info.alive:
            continue
        if info.producer_pid == 0:
            try:
                age = now - os.stat(os.path.join(SHM_DIR, info.name[1:])).st_mtime
            except OSError:
                continue
            if age < min_age_s:
                continue
        _unlink_quietly(info.name)
        removed.append(info.name)
        log.info("removed segment %s of dead producer %d", info.name, info.producer_pid)
    return removed

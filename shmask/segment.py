"""POSIX shared-memory segments: create, attach, unlink, and clean up after
producers that died.

A segment is one producer's ring (layout in native/shmask_layout.h), named
`/<prefix>-<uid>-<pid>-<16 random hex>`: unguessable; the uid and pid are
only for people reading `ls` (the janitor trusts neither).

Liveness: the producer holds an exclusive flock(2) on the segment file from
the moment it creates it until it closes or dies (the kernel drops the lock
with the last descriptor, SIGKILL included). A segment whose lock can be
taken has no producer, whatever its header says or which PID namespace its
producer ran in; the janitor unlinks only while holding that lock, and a
producer checks after locking that its name still points at its file, so a
janitor racing a creation removes nothing the producer then uses.

Mappings are made by the native core (`shm_map`), which guards them against
SIGBUS: a segment file truncated by another process turns into zero pages
and a StaleChunkError instead of killing the process.

When the name goes: at Writer.close(), when a Writer is collected without
close() (its finalizer), at interpreter exit, and when the process dies of
SIGTERM's default action (a handler in the native core, set from whichever
thread builds the first Writer: see native/shmask_exit.h). A host that
handles SIGTERM itself (a server that drains) keeps its rings while it
drains; they go at its exit or close. SIGKILL, os._exit() or a host handler
that re-raises SIGTERM with the default action leave the name to the
janitor below (the lifetime lock went with the process).

posix_ipc opens the objects (never multiprocessing.shared_memory, whose
resource tracker would unlink segments under a reader).
"""

from __future__ import annotations

import atexit
import errno
import faulthandler
import fcntl
import functools
import hashlib
import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import posix_ipc

from ._native import ffi, lib
from .errors import SegmentError

if TYPE_CHECKING:
    from ._native import CData

log = logging.getLogger("shmask")

SHM_DIR = "/dev/shm"
_NAME_PATTERN = re.compile(r"^/[A-Za-z0-9_]{1,32}-[0-9]{1,10}-[0-9]{1,10}-[0-9a-f]{16}$")
_CREATE_ATTEMPTS = 8


def is_valid_name(name: str) -> bool:
    """True when `name` has the shape of a shmask segment name."""
    return isinstance(name, str) and bool(_NAME_PATTERN.match(name))


def new_name(prefix: str) -> str:
    return f"/{prefix}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"


_host_id: tuple[int, int] | None = None  # (pid, id): recomputed after a fork


def host_id() -> int:
    """Which /dev/shm this process sees: a 63-bit hash of the boot id, of
    the /dev/shm mount's device and of where /dev/shm lies within that
    filesystem (a container whose /dev/shm is a bind mount of a directory
    of the host's tmpfs sees other files on the same device). Two processes
    with the same host id can read each other's rings; refs carry the
    producer's, so a reader elsewhere (another host, a container with a
    private /dev/shm) is told so instead of failing to find the ring."""
    global _host_id
    pid = os.getpid()
    if _host_id is None or _host_id[0] != pid:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                boot = f.read().strip()
        except OSError:
            boot = b"unknown-boot"
        try:
            device = os.stat(SHM_DIR).st_dev
        except OSError:
            device = 0
        where = shm_dir_within_filesystem(device)
        digest = hashlib.blake2b(boot + b"/" + str(device).encode() + b"/" + where,
                                 digest_size=8).digest()
        _host_id = (pid, (int.from_bytes(digest, "little") >> 1) or 1)
    return _host_id[1]


def _unescape_mountinfo(field: bytes) -> bytes:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)


def shm_dir_within_filesystem(device: int, mountinfo: str = "/proc/self/mountinfo") -> bytes:
    """The path of /dev/shm inside its filesystem: the root of the mount that
    holds it (/proc/self/mountinfo, field 4) joined with the rest of the path
    below that mount point. b"/" for a tmpfs mounted at /dev/shm, b"/sub" for
    a bind mount of the tmpfs's directory sub; b"" when it cannot be told.
    Processes in other mount namespaces that share the mount agree on it."""
    try:
        target = os.path.realpath(SHM_DIR).encode()
        with open(mountinfo, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return b""
    wanted = f"{os.major(device)}:{os.minor(device)}".encode()
    best: tuple[int, bytes] | None = None
    for line in lines:
        fields = line.split(b" ")
        if len(fields) < 5 or fields[2] != wanted:
            continue
        root, point = _unescape_mountinfo(fields[3]), _unescape_mountinfo(fields[4])
        if target == point:
            rest = b""
        elif target.startswith(point.rstrip(b"/") + b"/"):
            rest = target[len(point.rstrip(b"/")):]
        else:
            continue
        # The deepest mount point wins; of equals, the last (mounted on top).
        if best is None or len(point) >= best[0]:
            best = (len(point), root.rstrip(b"/") + rest if rest else root)
    return best[1] if best is not None else b""


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def process_start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (0 when unknown); kept in
    the header for `shmask ls`, not used to judge liveness."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return 0
    # Field 22; the command name (field 2) may hold spaces, so split after ')'.
    return int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])


def _map(fd: int, size: int, name: str) -> CData:
    """A guarded shared mapping of the whole segment (cdata that unmaps
    itself when the last view of it is gone)."""
    error = ffi.new("int *")
    address = lib.shm_map(fd, size, 1, error)
    if address == ffi.NULL:
        raise SegmentError(f"cannot map segment {name!r}: {os.strerror(error[0])}")
    return ffi.gc(ffi.cast("char *", address), lib.shm_unmap, size=size)


def _map_separately(lock_fd: int, size: int, name: str) -> CData:
    """Map the segment through a second open file description. A mapping
    keeps its description alive, and a flock belongs to a description: were
    the lock's own one mapped, a forked child (which inherits mappings) would
    hold the producer's lock for as long as it lives."""
    fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) != (os.fstat(lock_fd).st_ino,
                                                         os.fstat(lock_fd).st_dev):
            raise SegmentError(f"segment {name!r} was replaced while it was being created")
        return _map(fd, size, name)
    finally:
        os.close(fd)


class Segment:
    """A mapped segment. The producer creates it; readers attach by name."""

    def __init__(self, name: str, base: CData, size: int, owner_fd: int | None) -> None:
        self.name = name
        self.size = size
        # The C core's address of the mapping; the mapping lives as long as
        # this cdata or any buffer made from it (numpy views included).
        self.base = base
        self.buffer = ffi.buffer(base, size)
        self.owner_pid = os.getpid() if owner_fd is not None else None
        # The producer's descriptor: it carries the lifetime lock.
        self._owner_fd = owner_fd
        # The producer's entry in the native core's SIGTERM table (-1: none).
        self._exit_slot = -1
        if owner_fd is not None:
            self._exit_slot = int(lib.shm_exit_register(_path(name).encode()))
            if self._exit_slot < 0:  # the table grows: only out of memory
                raise SegmentError(f"cannot register ring {name!r} for removal at SIGTERM: "
                                   "out of memory")
        self.closed = False

    @classmethod
    def create(cls, prefix: str, capacity: int) -> Segment:
        """A new segment, locked and allocated; the caller initialises it."""
        size = int(lib.SHM_HEADER_BYTES) + capacity
        for _ in range(_CREATE_ATTEMPTS):
            name = new_name(prefix)
            # Until the registry holds the segment, a child forked meanwhile
            # (by another thread) finds the lock's descriptor in _CREATING
            # and closes its copy (_LiveSegments.forget_in_child); no fork
            # happens between the open and that (_OPENING).
            with _OPENING:
                try:
                    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
                except posix_ipc.ExistentialError:
                    continue  # the random name exists already: draw again
                except posix_ipc.Error as exc:
                    raise SegmentError(f"cannot create shared memory {name!r}: {exc}") from exc
                fd = shm.fd
                _CREATING.add(fd)
            try:
                # Lock first, then check the name still points at our file: a
                # janitor that took the lock before us may have unlinked it.
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not _same_file(fd, name):
                    _CREATING.discard(fd)  # before the number can be reused
                    os.close(fd)
                    continue
                _allocate(fd, size, name)
                base = _map_separately(fd, size, name)
                segment = cls(name, base, size, owner_fd=fd)
            except BaseException:
                _unlink_quietly(name)  # first: a child forked before the close holds a dead name
                _CREATING.discard(fd)
                os.close(fd)
                raise
            _LIVE.add(segment)
            _CREATING.discard(fd)
            return segment
        raise SegmentError(f"could not create a segment with prefix {prefix!r} in "
                           f"{_CREATE_ATTEMPTS} attempts")

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
            info = os.fstat(shm.fd)
            if info.st_uid != os.geteuid():
                raise SegmentError(f"segment {name!r} belongs to uid {info.st_uid}, not to us")
            if info.st_size < int(lib.SHM_HEADER_BYTES) + int(lib.SHM_MIN_CAPACITY):
                raise SegmentError(f"segment {name!r} is too small ({info.st_size} bytes)")
            base = _map(shm.fd, info.st_size, name)
        finally:
            shm.close_fd()
        return cls(name, base, info.st_size, owner_fd=None)

    @property
    def truncated(self) -> bool:
        """True once the file was seen cut under us: a SIGBUS marked the
        mapping, or the header's magic reads zero (cut and grown back, or
        declared lost by its producer)."""
        return not self.closed and bool(lib.shm_mapping_truncated(self.base))

    def file_intact(self) -> bool:
        """The producer's check (one fstat) that its file still has its size.
        The mtime is no witness: on tmpfs a write fault through the mapping
        on a page that was reclaimed moves it too. A cut grown back to size
        is caught by the header's magic (`truncated`) and by each staged
        record's own header."""
        if self._owner_fd is None:
            return True
        try:
            info = os.fstat(self._owner_fd)
        except OSError:
            return False
        return info.st_size >= self.size

    def close(self) -> None:
        """Drop our reference to the mapping; the producer also unlinks and
        lets go of the lock. Views handed out keep the pages mapped until
        they are gone, so closing never invalidates them."""
        if self.closed:
            return
        self.release()
        _LIVE.discard(self)

    def release(self) -> None:
        """close() without the registry's lock, for a finalizer: the
        collector may run one at any allocation, even on a thread that holds
        that lock (the registry drops closed segments itself)."""
        if self.closed:
            return
        self.closed = True
        lib.shm_exit_unregister(self._exit_slot)  # a no-op in a forked child
        if self._owner_fd is not None:
            if self.owner_pid == os.getpid():
                _unlink_quietly(self.name)
            # Forgotten before it is closed: a child forked in between must
            # not close the number (forget_in_child), which another thread
            # may have reused by then; its copy of the lock is harmless, the
            # name is gone.
            owner_fd, self._owner_fd = self._owner_fd, None
            os.close(owner_fd)
        self.buffer = None  # type: ignore[assignment]
        self.base = None  # type: ignore[assignment]

    def unlink_only(self) -> None:
        """Remove the name (used at exit: no unmapping there)."""
        if self.owner_pid == os.getpid() and not self.closed:
            _unlink_quietly(self.name)


def _allocate(fd: int, size: int, name: str) -> None:
    try:
        # Allocate every page now: a /dev/shm that is too small fails here,
        # with a message, instead of SIGBUS on a later write.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = _shm_free_bytes()
        raise SegmentError(
            f"cannot allocate {size / 2**20:.0f} MiB for ring {name!r} in {SHM_DIR} "
            f"({free / 2**20:.0f} MiB free): {exc.strerror}; lower SHMASK_RING_MB "
            "or enlarge /dev/shm (docker: --shm-size)"
        ) from exc


def _same_file(fd: int, name: str) -> bool:
    try:
        by_name = os.stat(_path(name), follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (by_name.st_dev, by_name.st_ino) == (mine.st_dev, mine.st_ino)


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.Error:
        pass


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------- lifecycle

class _LiveSegments:
    """The producer's own segments, unlinked at exit (SIGTERM: the native
    core's table, filled by Segment itself)."""

    def __init__(self) -> None:
        self._segments: set[Segment] = set()
        # A snapshot read without taking the lock: exit handlers and at-fork
        # hooks may run while another thread, or this one, holds it.
        self._snapshot: tuple[Segment, ...] = ()
        self._lock = threading.Lock()
        self._atexit = False

    def add(self, segment: Segment) -> None:
        # At every new ring, not once: a host may have put SIGTERM's default
        # action back since. The native core sets it from any thread, and
        # only over the default action (a host's handler stays in charge).
        lib.shm_exit_hook_sigterm()
        with self._lock:
            self._segments = {s for s in self._segments if _holds_lock_fd(s)}
            self._segments.add(segment)
            self._snapshot = tuple(self._segments)
            if not self._atexit:
                self._atexit = True
                atexit.register(self.unlink_all)

    def discard(self, segment: Segment) -> None:
        with self._lock:
            self._segments = {s for s in self._segments if s is not segment and _holds_lock_fd(s)}
            self._snapshot = tuple(self._segments)

    def unlink_all(self) -> None:
        for segment in self._snapshot:
            segment.unlink_only()

    def forget_in_child(self) -> None:
        """After fork: the child is not the producer. Closing its copy of
        the descriptor leaves the lock with the parent alone, so a SIGKILLed
        producer's ring becomes collectable even while a forked child lives.
        Segments that other threads of the parent were creating at the fork
        are not in the registry yet: their descriptors are in _CREATING."""
        owner_fds = set(_CREATING)
        for segment in self._snapshot:
            if segment._owner_fd is not None:
                owner_fds.add(segment._owner_fd)
                segment._owner_fd = None
        for fd in owner_fds:  # each once: a segment may be in both
            try:
                os.close(fd)
            except OSError:
                pass
        _CREATING.clear()
        self._segments.clear()
        self._snapshot = ()
        self._lock = threading.Lock()  # the parent's may have been held at the fork


def _holds_lock_fd(segment: Segment) -> bool:
    """Whether the registry must keep a segment: until release() has let go
    of its lock descriptor, not merely marked it closed (released by a
    finalizer or another thread, it is still open, its name not yet
    unlinked: a child forked then must find it to close its copy)."""
    return segment._owner_fd is not None


# Lock descriptors of segments being created, not yet in _LIVE (set.add and
# discard are atomic). _OPENING is held from the open of a new segment until
# its descriptor is in _CREATING (posix_ipc lets other threads run, a fork
# included, before the opening thread gets the descriptor back), and while
# collect_garbage holds another ring's descriptor; a fork waits for it, so
# no child is made in between and none inherits a lock it does not own.
_CREATING: set[int] = set()
_OPENING = threading.Lock()
_LIVE = _LiveSegments()
os.register_at_fork(before=_OPENING.acquire, after_in_parent=_OPENING.release,
                    after_in_child=_OPENING.release)
os.register_at_fork(after_in_child=_LIVE.forget_in_child)


# ------------------------------------------------------------ SIGBUS guard

def _keep_guard_in_front(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (faulthandler.enable or disable), then the SIGBUS guard back
    in front: enable() puts faulthandler's handler before it, and disable()
    of a faulthandler enabled before shmask restores what was there before
    faulthandler, removing the guard. faulthandler's handler stays chained
    behind the guard for every fault outside shmask's mappings."""
    @functools.wraps(function)
    def keeping_guard(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        finally:
            lib.shm_guard_front()
    keeping_guard.__dict__["shmask_guard"] = True
    return keeping_guard


def _guard_faulthandler() -> None:
    """Wrap faulthandler.enable and disable (once). A handler installed by
    other means (native code) is in front of the guard until shmask's next
    mapping, take, publish or 256th open puts it back; meanwhile a fault in a
    shmask mapping that such a handler re-raises is still the guard's."""
    for name in ("enable", "disable"):
        function = getattr(faulthandler, name)
        if not getattr(function, "shmask_guard", False):
            setattr(faulthandler, name, _keep_guard_in_front(function))


_guard_faulthandler()


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


def _open_own(name: str) -> int | None:
    """A read-only descriptor of segment file `name` if it is a regular file
    that this user owns (by its owner, never by the uid in its name), else
    None. Nothing about another user's file can make this raise."""
    try:
        fd = os.open(_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def _lock_held(fd: int) -> bool:
    """True when some process (a producer) holds the segment's lifetime lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        return True  # cannot tell: treat as alive, never remove on a doubt
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def segment_alive(name: str) -> bool:
    """True while the producer of segment `name` holds its lifetime lock."""
    fd = _open_own(name)
    if fd is None:
        return False
    try:
        return _lock_held(fd)
    finally:
        os.close(fd)


def _own_segment_names(prefix: str | None) -> Iterator[str]:
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    for entry in sorted(entries):
        name = "/" + entry
        if not is_valid_name(name):
            continue
        if prefix is not None and not entry.startswith(prefix + "-"):
            continue
        yield name


def list_segments(prefix: str | None = None) -> Iterator[SegmentInfo]:
    """This user's segments in /dev/shm (optionally of one prefix)."""
    for name in _own_segment_names(prefix):
        fd = _open_own(name)
        if fd is None:
            continue
        try:
            yield _inspect(name, fd)
        finally:
            os.close(fd)


def _inspect(name: str, fd: int) -> SegmentInfo:
    alive = _lock_held(fd)
    size = os.fstat(fd).st_size
    header = int(lib.SHM_HEADER_BYTES)
    if size < header:
        return SegmentInfo(name, size, 0, alive, 0, 0, 0, 0, 0, 0)
    # pread, not mmap: a file truncated meanwhile gives a short read, not SIGBUS.
    page = os.pread(fd, header, 0)
    if len(page) < header:
        return SegmentInfo(name, size, 0, alive, 0, 0, 0, 0, 0, 0)
    info = ffi.new("shm_info *")
    if lib.shm_read_info(ffi.from_buffer(page), size, info) != lib.SHM_OK:
        return SegmentInfo(name, size, 0, alive, 0, 0, 0, 0, 0, 0)
    return SegmentInfo(name, size, int(info.producer_pid), alive, int(info.capacity),
                       int(info.head), int(info.tail), int(info.published), int(info.released),
                       int(info.expired))


def collect_garbage(prefix: str | None = None) -> list[str]:
    """Unlink this user's segments whose producer is gone: those whose
    lifetime lock we can take. The unlink happens while we hold the lock, so
    a producer still creating its segment (it locks, then checks its name)
    never keeps using a file we removed."""
    removed = []
    for name in _own_segment_names(prefix):
        # No fork while we hold a descriptor, locked or not (_OPENING: the
        # fork handlers wait for it): a child made meanwhile would inherit
        # the lock of a ring that is not its own, and keep it while it lives.
        with _OPENING:
            fd = _open_own(name)
            if fd is None:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # held: its producer is alive (or is being checked)
                # The name may have been replaced since we opened it.
                if _same_file(fd, name):
                    _unlink_quietly(name)
                    removed.append(name)
                    log.info("removed segment %s: its producer is gone", name)
            finally:
                os.close(fd)  # drops our lock
    return removed

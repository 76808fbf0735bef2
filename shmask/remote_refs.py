"""References that leave their producer's host inside an engine's own messages.

An engine adapter whose producer sends to a consumer on another host (SGLang:
the schedulers of ``--node-rank`` 1 and above send their outputs to the
detokenizer and tokenizer on node 0) cannot send plain ring references: the
consumer cannot map the producer's /dev/shm (the Reader would say
RemoteChunkError). ``SHMASK_REMOTE`` says how the rows go instead:

- ``off`` (the default): the producer's chunks ride inline in their
  references (the adapter gives such requests an inline Writer): the rows'
  bytes on the engine's sockets, nothing else to install or open;
- ``nixl``: the producer's ring is exported to NIXL once (``Leaving``) and
  each reference that leaves is a one-entry ``RemoteBatch``: the export's
  descriptor (a few hundred bytes, the same for every reference, made
  once), then the plain reference. The consumer pulls the rows of all the
  remote references of one message with one ``RemotePuller.pull`` per
  producer (``pull``), each becoming an inline reference that any Reader
  opens; the pull gives the records back to the producer (one NIXL
  notification per segment).

Each reference stays self-contained (an engine may split a message by
request: SGLang's multi-tokenizer router does). A reference that cannot be
pulled becomes LOST (its request alone fails when opened: StaleChunkError,
or DoubleReleaseError for a record this puller already pulled and gave back);
one that is malformed is left as it is and fails when opened, saying why.
Everything here from a reference is untrusted (remote.py checks it).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .config import Config
from .errors import InvalidRefError, RemoteChunkError, ShmaskError
from .refs import KIND_SHM, ChunkRef, RefBatch

log = logging.getLogger("shmask")

_MAGIC = b"SMRR"  # remote.REMOTE_MAGIC, without importing NIXL's side here
_DESCRIPTORS_KEPT = 64  # parsed descriptors cached by their bytes


def is_remote(ref: bytes | bytearray | memoryview) -> bool:
    """Whether a reference's bytes are a RemoteBatch (to pull) rather than
    a plain reference batch."""
    return bytes(ref[:4]) == _MAGIC


def route_ip(head: str | None) -> str:
    """This host's address on the route to `head` (``host`` or
    ``host:port``; SGLang's --dist-init-addr names node 0): what a consumer
    there reaches this host at. A UDP connect sends nothing; it asks the
    kernel's routing table. Without a head (or one that does not resolve):
    the address the host name resolves to."""
    if head:
        host = head
        if host.startswith("["):  # [v6]:port
            host = host[1:].split("]", 1)[0]
        elif host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        try:
            family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, kind) as probe:
                probe.connect(address)
                return str(probe.getsockname()[0])
        except OSError as exc:
            log.warning("shmask: no route to %r (%s); advertising the host name's address "
                        "(set SHMASK_REMOTE_IP)", head, exc)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port() -> int:
    """A TCP port free now (the kernel's pick), for an agent's listener. Another
    process could take it before the agent binds it: set SHMASK_REMOTE_PORT
    where that matters."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


# ---------------------------------------------------------------- producer
_own_agents: set[str] = set()  # exports made by this process (see unwrap_own)


class Leaving:
    """A producer's ring exported to NIXL (SHMASK_REMOTE_EXPORT: by a sidecar
    process, or in this one), and its references wrapped for a
    consumer on another host. ``head``: where the consumers are (for
    SHMASK_REMOTE_IP's default). Raises ImportError without NIXL, or what
    NIXL raises when the agent cannot start: the caller falls back to
    inline rows."""

    def __init__(self, writer: Any, config: Config | None = None, head: str | None = None) -> None:
        from .remote import RemoteExport, remote_prefix

        config = config or Config.from_env()
        port = config.remote_port or free_port()
        ip = config.remote_ip or route_ip(head)
        self.writer = writer
        self.export: Any
        if config.remote_export == "process":
            # READs over TCP are copied by the exporting process: a sidecar's,
            # not the engine's (remote_sidecar.py).
            from .remote_sidecar import Sidecar

            self.export = Sidecar(writer, ip=ip, port=port)
        else:
            self.export = RemoteExport(writer, port=port)
        _own_agents.add(self.export.name)
        self.prefix = remote_prefix(self.export.descriptor(ip))
        log.info("shmask: ring %s exported to NIXL as %s at %s:%d (%s)", writer.segment_name,
                 self.export.name, ip, port, "sidecar process"
                 if config.remote_export == "process" else "in this process")

    def refs(self, batch: RefBatch) -> list[bytes]:
        """Each entry as its own reference (RefBatch.split), the ring's
        entries wrapped with the descriptor; inline ones (a full ring's) stay
        as they are."""
        refs = batch.split()
        prefix = self.prefix
        for i in np.flatnonzero(batch.entries["kind"] == KIND_SHM).tolist():
            refs[i] = prefix + refs[i]
        return refs

    def close(self) -> None:
        _own_agents.discard(self.export.name)
        self.export.close()


def rows_ride_inline(config: Config, head: str, outputs: str) -> bool:
    """For a producer whose consumers are on another host (``head``, "" when
    unknown): True, logged, when its rows are to ride inline in their
    references (SHMASK_REMOTE=off); False when its ring is to be exported
    (`export_or_none`). ``outputs`` names the producer in the log."""
    if config.remote != "off":
        return False
    log.info("shmask: %s go to another host (%s): sampling-mask rows travel inline in their "
             "references (SHMASK_REMOTE=nixl reads them from this host's ring instead)",
             outputs, head or "?")
    return True


def export_or_none(writer: Any, config: Config, head: str) -> Leaving | None:
    """``writer``'s ring exported to NIXL for consumers at ``head``, or None
    with a warning when NIXL is missing or its agent fails: the caller then
    closes the ring and writes inline (nothing is lost, more bytes travel)."""
    try:
        return Leaving(writer, config, head=head or None)
    except Exception as exc:  # noqa: BLE001 - NIXL missing or its agent failed: inline
        log.warning("shmask: SHMASK_REMOTE=nixl, but ring %s cannot be exported to NIXL "
                    "(%s: %s); sampling-mask rows travel inline in their references instead "
                    "(pip install 'shmask[nixl]')", writer.segment_name, type(exc).__name__, exc)
        return None


# ---------------------------------------------------------------- consumer
_descriptors: OrderedDict[bytes, Any] = OrderedDict()
_puller_lock = threading.Lock()
_puller: dict[str, Any] = {"puller": None, "failed": None}  # failed: (when, message)
RETRY_S = 1.0


def _descriptor(data: bytes) -> Any:
    from .remote import parse_descriptor

    desc = _descriptors.get(data)
    if desc is None:
        desc = _descriptors[data] = parse_descriptor(data)
        while len(_descriptors) > _DESCRIPTORS_KEPT:
            _descriptors.popitem(last=False)
    return desc


def plain(ref: bytes) -> tuple[bytes, bytes]:
    """(descriptor JSON, the plain one-entry reference) of a remote reference;
    InvalidRefError when it is not one."""
    from .remote import RemoteBatch

    return RemoteBatch.parts(ref)


def unwrap_own(ref: bytes) -> bytes | None:
    """The plain reference when a remote reference was exported by this very
    process (a producer reading back its own chunk), else None."""
    desc, inner = plain(ref)
    return inner if _descriptor(desc).agent in _own_agents else None


def default_puller() -> Any:
    """This process's RemotePuller, made on first use from SHMASK_REMOTE_PORT
    (0: a free port) and SHMASK_REMOTE_TIMEOUT_S. RemoteChunkError when NIXL
    is not installed here or its agent cannot start (UCX finds no usable
    device, the port is taken); a failed start is tried again after
    RETRY_S, not at every reference of the message that found it."""
    with _puller_lock:
        puller = _puller["puller"]
        if puller is not None:
            return puller
        failed = _puller["failed"]
        if failed is not None and time.monotonic() - failed[0] < RETRY_S:
            raise RemoteChunkError(failed[1])
        from .remote import NIXL_HINT, RemotePuller

        config = Config.from_env()
        try:
            puller = RemotePuller(port=config.remote_port or free_port(),
                                  timeout_s=config.remote_timeout_s, config=config)
        except ImportError as exc:
            message = (f"rows of another host's ring are read through NIXL, which is not "
                       f"installed here ({NIXL_HINT}; or run the producers with "
                       f"SHMASK_REMOTE=off: rows inline): {exc}")
        except Exception as exc:  # noqa: BLE001 - NIXL's own errors: said, then retried
            message = (f"this process's NIXL agent cannot start ({type(exc).__name__}: "
                       f"{exc}); check UCX_TLS / UCX_NET_DEVICES and SHMASK_REMOTE_PORT")
        else:
            _puller["puller"], _puller["failed"] = puller, None
            return puller
        _puller["failed"] = (time.monotonic(), message)
        log.warning("shmask: %s", message)
        raise RemoteChunkError(message)


def pull(refs: Sequence[bytes], puller: Any = None) -> list[bytes | None]:
    """The remote references among `refs` pulled: for each, the plain
    reference its rows now ride in (inline; LOST where they could not be
    read in time: its request alone fails), or None where the item is not a
    remote reference or is malformed (opening it says why). One pull per
    producer (descriptor) for the whole sequence."""
    out: list[bytes | None] = [None] * len(refs)
    groups: dict[bytes, list[tuple[int, ChunkRef]]] = {}
    for i, ref in enumerate(refs):
        if not isinstance(ref, bytes) or not is_remote(ref):
            continue
        try:
            desc, inner = plain(ref)
            if _descriptor(desc).agent in _own_agents:
                out[i] = inner
                continue
            ref_of = ChunkRef.from_bytes(inner)
            groups.setdefault(desc, []).append((i, ref_of))
        except (InvalidRefError, TypeError):
            continue  # opened alone, it says what is wrong with it
    if not groups:
        return out
    from .remote import RemoteBatch

    puller = puller or default_puller()
    for desc, members in groups.items():
        batch = RefBatch.from_refs([ref for _, ref in members])
        pulled = puller.pull(RemoteBatch(batch, _descriptor(desc)))
        for (i, _), part in zip(members, pulled.split(), strict=True):
            out[i] = part
    return out


def pull_one(ref: bytes) -> bytes:
    """One remote reference pulled (or unwrapped, when this process exported
    it): the plain reference to open. InvalidRefError when malformed,
    RemoteChunkError when NIXL is not installed here."""
    own = unwrap_own(ref)  # InvalidRefError for a malformed one
    if own is not None:
        return own
    ChunkRef.from_bytes(plain(ref)[1])  # its own errors before any READ
    pulled = pull([ref])[0]
    if pulled is None:  # pragma: no cover - pull() takes every well-formed one
        raise ShmaskError("remote reference not pulled")
    return pulled

"""A producer's ring exported to NIXL from a process of its own (issue 37).

UCX over TCP has no one-sided READ: the exporting process copies every byte
a puller reads into the socket. Inside an engine's scheduler that costs the
scheduler 8-9x the CPU of the single-host ring per emission
(benchmarks/RESULTS.md, "Past one machine"). The ring is POSIX shared
memory, so a sidecar process of the same uid maps the same segment, registers
its own mapping with its own NIXL agent (RemoteExport) and serves the READs;
the pullers' releases are applied on its mapping by the C core
(shm_release_many: atomics in the shared header and records, valid from any
process that maps the ring). The descriptor the references carry is the
sidecar's: its agent, its port, the segments' addresses in its memory.

    sidecar = Sidecar(writer, ip=ip, port=port)   # in the producer
    sidecar.descriptor()                           # -> RemoteBatch's descriptor
    sidecar.close()                                # stdin closed: it exits

The child (``python -m shmask.remote_sidecar --port P --parent PID NAME...``)
prints its descriptor as one JSON line once its agent is up, answers each
"stats" line on stdin with its ExportStats as one JSON line, and exits when
its stdin reaches EOF (the producer closed it, or died: the kernel closes a
dead process's pipes) or when its parent changes (the producer died while a
process it forked still holds the pipe), or on SIGTERM (default action).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from .errors import ShmaskError

log = logging.getLogger("shmask")

# How long a sidecar may take to import NIXL and start its agent.
START_TIMEOUT_S = 60.0
# How long close() waits for it to exit before SIGKILL.
STOP_TIMEOUT_S = 5.0
# How often the child checks that its parent is still the producer. Not
# PR_SET_PDEATHSIG: the kernel sends it when the *thread* that started the
# child exits, and an engine may make its ring on a thread that ends
# while the producer goes on (the rows would be lost with no error).
PARENT_POLL_S = 0.5


class Sidecar:
    """The producer's side: starts the child for `writer`'s segment (a
    Writer has one, made once: Writer.__init__), waits for its descriptor;
    same interface as RemoteExport for Leaving (name, port, descriptor,
    stats, close). ShmaskError (with the child's exit status; its stderr is
    the producer's) or ImportError when it cannot start."""

    def __init__(self, writer: Any, *, ip: str, port: int) -> None:
        from .remote import NIXL_HINT

        if importlib.util.find_spec("nixl_cu12") is None:
            raise ImportError(f"shmask.remote needs NIXL: {NIXL_HINT}")
        segment = getattr(writer, "segment", None)
        if segment is None or segment.closed:
            raise TypeError("Sidecar exports a Writer's open ring (transport 'shm')")
        self.port = port
        self._asking = threading.Lock()  # one stats request and its reply at a time
        # Its own session: signals meant for the producer's process group (a
        # terminal's ^C, a test's killpg) leave it to exit on its own terms.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmask.remote_sidecar", "--port", str(port), "--ip", ip,
             "--parent", str(os.getpid()), segment.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        try:
            self._descriptor = json.loads(self._line(START_TIMEOUT_S, "its descriptor"))
        except BaseException:
            self.close()
            raise
        self.name: str = self._descriptor["agent"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def descriptor(self, ip: str | None = None) -> dict[str, Any]:
        """The sidecar's descriptor (its agent, `ip` and port, the segments
        as it maps them). `ip`: the address it was started with when None."""
        return self._descriptor if ip is None else {**self._descriptor, "ip": ip}

    @property
    def stats(self) -> Any:
        """The sidecar's ExportStats now (asked over its stdin)."""
        from .remote import ExportStats

        assert self.proc.stdin is not None
        with self._asking:
            self.proc.stdin.write(b"stats\n")
            self.proc.stdin.flush()
            return ExportStats(**json.loads(self._line(STOP_TIMEOUT_S, "its stats")))

    def _line(self, timeout: float, what: str) -> bytes:
        """One line of the child's stdout within `timeout` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ShmaskError(f"NIXL export sidecar (pid {self.proc.pid}) did not send "
                                  f"{what} within {timeout} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise ShmaskError(f"NIXL export sidecar (pid {self.proc.pid}) exited with "
                                  f"status {self.proc.wait()} before sending {what} (its "
                                  "messages are on this process's stderr)")
            data += chunk
        return data

    def close(self) -> None:
        """Close its stdin (it exits), wait STOP_TIMEOUT_S, then SIGKILL.
        Pullers still reading get their entries LOST within their timeout."""
        if self.proc.returncode is not None:
            return
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("shmask: NIXL export sidecar %d did not exit in %s s: killed",
                        self.proc.pid, STOP_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmask.remote_sidecar",
                                     description="Export shmask ring segments to NIXL.")
    parser.add_argument("--port", type=int, required=True, help="the NIXL agent's port")
    parser.add_argument("--ip", required=True, help="the address pullers reach this host at")
    parser.add_argument("--parent", type=int, required=True, help="exit when this pid is gone")
    parser.add_argument("segments", nargs="+", help="segment names (/shmask...)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="shmask sidecar %(process)d: %(levelname)s %(message)s")
    # The replies go on a descriptor of their own, and fd 1 becomes stderr:
    # NIXL and UCX print to stdout, which must carry nothing but our lines.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    if os.getppid() != args.parent:   # the producer died before we got here
        return 1

    from .remote import RemoteExport
    from .segment import Segment

    segments = [Segment.attach(name) for name in args.segments]
    export = RemoteExport(segments, port=args.port)
    out.write(json.dumps(export.descriptor(args.ip)).encode() + b"\n")
    out.flush()
    pending = b""
    try:
        while os.getppid() == args.parent:
            if not select.select([0], [], [], PARENT_POLL_S)[0]:
                continue
            data = os.read(0, 4096)
            if not data:   # EOF: the producer closed it or died
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line == b"stats":
                    out.write(json.dumps(vars(export.stats)).encode() + b"\n")
                    out.flush()
    finally:
        export.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

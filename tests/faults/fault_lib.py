"""What both sides of a fault case share: the seeded row encoding, the
producer workload, process measurements and small process helpers.

Every row's ids encode the request it belongs to and its sequence number in
that request, so a reader that is handed the rows of another request, or of
another step of the same request, is caught by value, not only by length.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHILD = HERE / "fault_child.py"
SHM_DIR = "/dev/shm"
MODE_SELECTED, MODE_SUPPORT = 1, 2
MAX_LEN = 255  # ids keep the entry index in 8 bits


# ------------------------------------------------------------ row encoding

def row_lengths(seed: int, request, seqs, max_len: int = MAX_LEN) -> np.ndarray:
    """Seeded length of each row (0..max_len); int64 arithmetic, no overflow.
    `request` and `seqs` broadcast (one request, or one per row)."""
    seqs = np.asarray(seqs, np.int64)
    request = np.asarray(request, np.int64)
    mixed = (seqs * 2654435761 + request * 40503 + seed * 97 + 12345) >> 7
    return (mixed % (max_len + 1)).astype(np.int32)


def row_bases(request, seqs) -> np.ndarray:
    """Id of entry 0 of each row: request (11 bits) | sequence (12 bits) | entry (8 bits)."""
    return ((np.asarray(request, np.int64) % 2048) << 20) | ((np.asarray(seqs, np.int64) % 4096) << 8)


def encode_rows(seed: int, request: int, mode: int, first_seq: int, rows: int,
                max_len: int = MAX_LEN) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR rows (lengths, ids, logprobs) of rows first_seq.. of a request."""
    seqs = np.arange(first_seq, first_seq + rows, dtype=np.int64)
    lengths = row_lengths(seed, request, seqs, max_len)
    ids = csr_ids(row_bases(request, seqs), lengths)
    return lengths, ids, logprobs_for(mode, ids, row_bases(request, seqs))


def csr_ids(bases: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    total = int(lengths.sum())
    starts = np.zeros(lengths.size, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    return (np.repeat(bases, lengths) + within).astype(np.int32)


def logprobs_for(mode: int, ids: np.ndarray, bases: np.ndarray) -> np.ndarray:
    source = ids if mode == MODE_SUPPORT else bases
    return (-(np.asarray(source, np.int64) % 1_000_003) / 1024.0).astype(np.float32)


def check_rows(lengths, ids, logprobs, expected) -> str:
    """'' when the rows equal `expected` bit for bit; else what differs, and
    whether the ids belong to another request/step ('other rows')."""
    want_lengths, want_ids, want_logprobs = expected
    lengths, ids, logprobs = (np.asarray(a) for a in (lengths, ids, logprobs))
    if (lengths.shape == want_lengths.shape and np.array_equal(lengths, want_lengths)
            and ids.shape == want_ids.shape and np.array_equal(ids, want_ids)
            and logprobs.shape == want_logprobs.shape
            and np.array_equal(logprobs.view(np.uint32), want_logprobs.view(np.uint32))):
        return ""
    if ids.size and want_ids.size and ids.size == want_ids.size:
        got_owner = set(np.unique(ids.astype(np.int64) >> 8).tolist())
        want_owner = set(np.unique(want_ids.astype(np.int64) >> 8).tolist())
        if got_owner != want_owner:
            return "other rows (ids of another request or step)"
    return f"different rows (lengths {lengths[:4].tolist()} vs {want_lengths[:4].tolist()})"


# ------------------------------------------------------------ the producer side

class Workload:
    """Requests on one Writer, each with a RowQueue; every step appends one
    seeded row to a random subset of them; `take` publishes one emission and
    says, per entry, (request, mode, first_seq, rows) so readers can verify."""

    def __init__(self, writer, seed: int, requests: int, max_len: int = MAX_LEN,
                 selected_share: float = 0.25, churn: float = 0.0) -> None:
        self.writer = writer
        self.seed = seed
        self.max_len = max_len
        self.rng = np.random.default_rng(seed)
        self.selected_share = selected_share
        self.churn = churn
        self.next_request = 0
        self.requests: list[list] = []  # [queue, request, mode, seq, first_untaken]
        for _ in range(requests):
            self._open()

    def _open(self) -> None:
        mode = MODE_SELECTED if self.rng.random() < self.selected_share else MODE_SUPPORT
        queue = self.writer.open_queue("selected" if mode == MODE_SELECTED else "support")
        self.requests.append([queue, self.next_request, mode, 0, 0])
        self.next_request += 1

    def step(self, skip: float = 0.2, timings: list[float] | None = None) -> None:
        """One decode step; one append_step call per mode (rows of one mode).
        With `timings`, each append_step call's duration is appended to it."""
        for mode in (MODE_SUPPORT, MODE_SELECTED):
            chosen = [r for r in self.requests if r[2] == mode and self.rng.random() >= skip]
            if not chosen:
                continue
            requests = np.array([r[1] for r in chosen], np.int64)
            seqs = np.array([r[3] for r in chosen], np.int64)
            lengths = row_lengths(self.seed, requests, seqs, self.max_len)
            bases = row_bases(requests, seqs)
            ids = csr_ids(bases, lengths)
            logprobs = logprobs_for(mode, ids, bases)
            # RowQueue objects, not raw slots/handles: the stable public form
            started = time.monotonic()
            self.writer.append_step([r[0] for r in chosen], lengths, ids, logprobs)
            if timings is not None:
                timings.append(time.monotonic() - started)
            for r in chosen:
                r[3] += 1

    def take(self):
        """(RefBatch, meta int64[n, 4]) for every open request; then, with
        probability `churn` each, requests end and new ones start."""
        queues = [r[0] for r in self.requests]
        batch = self.writer.take_batch(queues)
        meta = np.array([[r[1], r[2], r[4], r[3] - r[4]] for r in self.requests], np.int64)
        for r in self.requests:
            r[4] = r[3]
        if self.churn:
            ending = [r for r in self.requests if self.rng.random() < self.churn]
            for r in ending:
                r[0].close()
                self.requests.remove(r)
                self._open()
        return batch, meta

    def close(self) -> None:
        for r in self.requests:
            r[0].close()
        self.requests.clear()


def expected_for(seed: int, meta_row, max_len: int = MAX_LEN):
    request, mode, first_seq, rows = (int(v) for v in meta_row)
    return encode_rows(seed, request, mode, first_seq, rows, max_len)


# ------------------------------------------------------------ measurements

def memory_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and RssAnon (private memory: the ring's shared pages excluded)."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                values[key] = int(rest.split()[0])
    return values


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def segments_of(prefix: str) -> list[str]:
    """Names ('/...') in /dev/shm of exactly this prefix."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted("/" + e for e in entries if e.startswith(prefix + "-"))


def sweep(prefix: str) -> list[str]:
    """Unlink whatever the case left under its own prefix; returns the names."""
    left = segments_of(prefix)
    for name in left:
        try:
            os.unlink(shm_path(name))
        except OSError:
            pass
    return left


# ------------------------------------------------------------ child processes

def child_env(prefix: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMASK_")}
    if prefix is not None:
        env["SHMASK_NAME_PREFIX"] = prefix
    env.update(extra)
    return env


class Child:
    """A python child running fault_child.py <role>, spoken to by lines.

    stdout is read with os.read into our own buffer, so a select() timeout
    never misses a line already buffered by a file object."""

    def __init__(self, role: str, *args: str, prefix: str | None = None,
                 env: dict[str, str] | None = None, argv_prefix: list[str] | None = None,
                 preexec_fn=None) -> None:  # type: ignore[no-untyped-def]
        command = [*(argv_prefix or []), sys.executable, str(CHILD), role, *map(str, args)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env if env is not None else child_env(prefix), cwd=str(REPO),
            preexec_fn=preexec_fn, start_new_session=True,  # kill() takes its whole group
        )
        self.pid = self.proc.pid
        self._buffer = b""
        self._eof = False
        self._stderr: str | None = None

    def readline(self, timeout: float) -> str | None:
        """The next stdout line, or None at EOF or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = max(0.0, deadline - time.monotonic())
            if self._eof:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready and remaining <= 0:
                return None
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    self._eof = True
                self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace")

    def expect(self, head: str, timeout: float) -> str:
        """Skip lines until one starts with `head`; raise with stderr if none comes."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.readline(max(0.0, deadline - time.monotonic()))
            if line is None:
                self.wait(1)
                raise RuntimeError(f"child {self.pid} gave no {head!r} line "
                                   f"({describe_rc(self.proc.poll())}): {self.stderr_tail()}")
            if line.startswith(head):
                return line[len(head):].strip()

    def send(self, line: str) -> bool:
        """Write a line; False when the child is gone (its status tells why)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return False
        return True

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self, limit: int = 3000) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(running)"
        if self._stderr is None:
            self._stderr = self.proc.stderr.read().decode(errors="replace")
        return self._stderr[-limit:]

    def kill(self) -> None:
        """SIGKILL the child's process group: the child and anything it
        started (an `unshare -f` prefix's python, a child's own children)."""
        kill_group(self.pid)
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        self.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream:
                    stream.close()
            except OSError:
                pass

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def kill_group(pid: int) -> None:
    """SIGKILL process group `pid` (a child started with start_new_session),
    stopped members included; nothing if it is gone."""
    for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must be able to die
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return


def run_script(code: str, env: dict[str, str], timeout: float,
               argv_prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run python -c code (bounded) in its own process group, killed whole
    when it runs past `timeout` or the caller is interrupted; a timeout is
    returned as rc 124."""
    command = [*(argv_prefix or []), sys.executable, "-c", code]
    proc = subprocess.Popen(command, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(command, 124, out, err)
    finally:
        kill_group(proc.pid)
        proc.wait()


def describe_rc(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    return f"exit {rc}"

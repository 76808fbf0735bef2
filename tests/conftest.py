"""Shared fixtures, and what keeps one test's mess out of the next one.

Every test gets a segment-name prefix of its own (`prefix`). After each test:
  - processes it started that still run are killed, each with its whole
    process group (a test that timed out, under pytest-timeout's signal
    method, never got to its own clean-up), and named in a warning;
  - segments left under its prefix are removed and reported against it,
    not against the tests after it: a segment of a live process (a Writer
    left open) fails the test at teardown; one whose creator is dead (a
    child the test killed, or crashed on purpose: what shmask's own
    garbage collection reclaims at the next Writer) is named in a warning.
Segments under the session prefix itself (module fixtures and child
processes started with SESSION_PREFIX) are checked the same way when their
module ends."""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

# Kernels run under Triton's interpreter on machines without a GPU; set it
# before anything imports triton. SHMASK_TEST_GPU=1 runs them on CUDA.
if os.environ.get("SHMASK_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

import shmask

SESSION_PREFIX = "shmtest" + secrets.token_hex(3)

# The tests that take longest on a 2-core machine (interpreter runs at large
# sizes, benchmark smoke runs): marked `long`, so `make test` leaves them to
# `make test-long` (CI runs both). One node id a line, as pytest names it.
# (A copy of this file run elsewhere, as test_conftest_isolation does, has
# no list beside it: nothing is long there; test_conftest_isolation checks
# that the real list names real tests.)
_LONG_LIST = Path(__file__).parent / "long_tests.txt"
LONG_TESTS = frozenset(line.strip() for line in
                       (_LONG_LIST.read_text().splitlines() if _LONG_LIST.is_file() else ())
                       if line.strip() and not line.startswith("#"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: minutes on a 2-core machine; run by make test-long")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in LONG_TESTS:
            item.add_marker(pytest.mark.long)
_TEST_NUMBERS = itertools.count(1)
# multiprocessing's helpers start at first use and serve the whole session.
_SESSION_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def leftover_segments(prefix: str = SESSION_PREFIX) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(prefix))


def creator_alive(entry: str) -> bool:
    """Whether the process that created segment `entry` (named
    <prefix>-<uid>-<pid>-<random>) still runs; True when the name says no pid."""
    try:
        pid = int(entry.split("-")[-2])
    except (IndexError, ValueError):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix`; returns their names."""
    left = leftover_segments(prefix)
    for entry in left:
        try:
            os.unlink(os.path.join("/dev/shm", entry))
        except OSError:
            pass
    return left


# ------------------------------------------------------------ processes

def _processes() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (ppid, process group, state, start time) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0].decode(), fields[19].decode())
    return table


def descendants() -> dict[int, tuple[int, str]]:
    """pid -> (process group, start time) of this process's live descendants,
    multiprocessing's session-wide helpers left out. The start time tells a
    process from a later one that got the same pid."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        _, group, state, started = table[pid]
        if state in "ZX":
            continue  # exited, waiting to be reaped: nothing left to kill
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if any(helper in f.read() for helper in _SESSION_HELPERS):
                    continue
        except OSError:
            continue
        found[pid] = (group, started)
    return found


def children_of(pid: int) -> dict[str, list[int]]:
    """script name -> the pids of the children of `pid` running examples/<script>."""
    found: dict[str, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if ppid == pid and len(argv) > 1 and argv[1].endswith(b".py"):
            found.setdefault(Path(argv[1].decode()).name, []).append(int(entry))
    return found


def running(pid: int) -> bool:
    """Whether `pid` runs (not exited, nor a zombie that its reaper has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def kill_new_processes(before: dict[int, tuple[int, str]]) -> list[int]:
    """Kill every descendant not in `before`, with its process group when it
    has one of its own (never ours). Repeated, since a dying parent's
    children can be forking still. Returns the pids killed."""
    killed: list[int] = []
    own_group = os.getpgrp()
    for _ in range(5):
        new = {pid: info for pid, info in descendants().items()
               if pid not in before or before[pid][1] != info[1]}
        if not new:
            break
        for pid, (group, _) in new.items():
            for send, target in ((os.killpg, group), (os.kill, pid)):
                if send is os.killpg and group == own_group:
                    continue
                try:
                    send(target, signal.SIGCONT)  # a stopped process must be able to die
                    send(target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            killed.append(pid)
        time.sleep(0.05)
    return killed


# ------------------------------------------------------------ fixtures

def report_segments(prefix: str, nodeid: str, who: str) -> None:
    """Remove the segments under `prefix`: fail for those of live processes,
    warn for those of dead ones."""
    live = [entry for entry in leftover_segments(prefix) if creator_alive(entry)]
    dead = [entry for entry in remove_segments(prefix) if entry not in live]
    if dead:
        warnings.warn(pytest.PytestWarning(
            f"{nodeid} left segments of dead processes behind (now removed): {dead}"),
            stacklevel=1)
    if live:
        pytest.fail(f"{who} left shared-memory segments behind (now removed): {live}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _no_leftovers(request: pytest.FixtureRequest):
    """Yields this test's segment prefix; afterwards kills what the test left
    running and fails the test (only it) if it left segments behind."""
    own = f"{SESSION_PREFIX}t{next(_TEST_NUMBERS):05d}"  # fixed width: no prefix of another
    before = descendants()
    yield own
    killed = kill_new_processes(before)
    if killed:
        warnings.warn(pytest.PytestWarning(
            f"{request.node.nodeid} left processes running; killed with their groups: {killed}"),
            stacklevel=1)
    report_segments(own, request.node.nodeid, "the test")


@pytest.fixture(autouse=True)
def _no_kernel_plans_from_other_tests() -> None:
    """Each test starts with no replayable launches (kernels/launch_plan.py):
    a GPU test then runs Triton's path for its first two calls of a shape,
    whatever ran before it. Only where the kernels are already imported."""
    for name in ("shmask.kernels.capture", "shmask.kernels.compact"):
        module = sys.modules.get(name)
        if module is not None:
            module._PLANS.clear()


@pytest.fixture(autouse=True, scope="module")
def _no_session_segments_left(request: pytest.FixtureRequest):
    """Segments of the session prefix itself, made in this module (module
    fixtures and child processes given SESSION_PREFIX): removed at the
    module's end, and reported against its last test."""
    yield
    report_segments(SESSION_PREFIX, request.node.nodeid, f"tests in {request.node.nodeid}")


@pytest.fixture
def prefix(_no_leftovers: str) -> str:
    return _no_leftovers


@pytest.fixture
def config(prefix: str) -> shmask.Config:
    """A small ring, so tests exercise wrap-around and the full policy."""
    return shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=20, lease_s=60)


@pytest.fixture
def writer(config: shmask.Config):
    w = shmask.Writer(config)
    yield w
    w.close()


@pytest.fixture
def reader(config: shmask.Config):
    r = shmask.Reader(config)
    yield r
    r.close()


def random_chunk(rng: np.random.Generator, rows: int, max_len: int, mode: str = "support",
                 vocab: int = 151_936):
    """CSR rows with ascending distinct ids, like a sampler's support."""
    lengths = rng.integers(0, max_len + 1, rows).astype(np.int32)
    ids = np.concatenate(
        [np.sort(rng.choice(vocab, n, replace=False)) for n in lengths]
        or [np.zeros(0)]
    ).astype(np.int32)
    n_logprobs = ids.size if mode == "support" else rows
    logprobs = (np.log(rng.random(n_logprobs) + 1e-9)).astype(np.float32)
    return lengths, ids, logprobs


def assert_chunk_equal(chunk: shmask.Chunk, lengths, ids, logprobs) -> None:
    np.testing.assert_array_equal(chunk.lengths, lengths)
    np.testing.assert_array_equal(chunk.ids, ids)
    assert chunk.logprobs.dtype == np.float32
    np.testing.assert_array_equal(chunk.logprobs.view(np.uint32), np.asarray(logprobs).view(np.uint32))


def run_child(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a child in its own process group and return what it printed; on
    a timeout (or the test interrupted) the whole group is killed."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture(name="run_child")
def run_child_fixture() -> Callable[..., subprocess.CompletedProcess]:
    """``run_child`` for test modules that cannot import this conftest by
    name (tests/compat has a conftest of its own)."""
    return run_child


def forked_answer(child: Callable[[], bytes], timeout: float = 60) -> bytes:
    """Fork; the child runs `child()` in its own process group and sends
    back what it returns (at most 64 bytes; the repr of what it raised if
    it raised). On a timeout the test fails
    and the whole group is killed: a call that hangs in a forked child (a
    thread pool carried over from the parent) cannot outlive the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own process group, one answer back
        try:
            os.setpgid(0, 0)
            answer = child()
        except BaseException as exc:  # noqa: BLE001 - sent back: the parent's assert shows it
            answer = repr(exc)[:64].encode()
        finally:
            try:
                os.write(write_end, answer)
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first
    except OSError:
        pass  # the child did it already (or exited)
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline, "the forked child's call never finished"
            time.sleep(0.01)
        pid = 0
        return os.read(read_end, 64)
    finally:
        os.close(read_end)
        if pid:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


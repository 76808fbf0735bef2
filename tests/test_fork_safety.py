"""Fork safety of the ring's life cycle (issue 33, item 3): a child forked
while another thread maps or unmaps a ring (a Writer made, closed or
dropped, a ring attached by a Reader) must be able to make its own Writer,
publish, read its rows back and exit. Before the fix the native core's
guard lock, held across mmap(MAP_POPULATE) and copied locked into the
child, blocked about a third of such children forever in their first
Writer(); and most children of a parent that was creating a ring kept that
ring's lifetime lock (so a SIGKILLed parent's ring was not collectable
while they lived).

A driver process (its own process group, killed whole on a timeout) runs
threads that make, close and drop Writers, attach rings with a Reader and
keep both thread pools busy, and forks from its main thread at seeded
random moments; each child gets a bounded time, and one that does not exit
within it is a hang (the driver kills it). tests/faults/cases_fork.py runs
the same driver at the `make faults` size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

FORKS_SHORT, FORKS_FULL = 40, 1000  # `make test`; `make faults` (SHMASK_FAULTS_FULL=1)
FORKS = FORKS_FULL if os.environ.get("SHMASK_FAULTS_FULL") == "1" else FORKS_SHORT
CHILD_TIMEOUT_S = 15.0  # a child makes one 1 MiB ring: well under 1 s even on a busy machine
MAX_HANGS = 3  # each hang costs CHILD_TIMEOUT_S: stop counting once the verdict is clear

# argv: prefix forks seed child_timeout_s max_hangs parents_reader (0 or 1).
# Prints one JSON line.
DRIVER = textwrap.dedent("""
    import contextlib, faulthandler, json, os, random, signal, sys, threading, time
    import numpy as np
    import shmask
    from shmask.documents import map_documents
    from shmask.response_json import response_arrays
    from shmask.segment import collect_garbage

    prefix, forks, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    child_timeout_s, max_hangs = float(sys.argv[4]), int(sys.argv[5])
    parents_reader = sys.argv[6] == "1"
    config = shmask.Config(ring_mb=1, name_prefix=prefix)
    rows = (np.array([2, 1], np.int32), np.array([3, 4, 5], np.int32),
            np.array([-1.0, -2.0, -3.0], np.float32))
    # Import and build once before any thread runs: a fork while another
    # thread is inside a first import hangs any Python child (CPython keeps
    # that module's import lock held in the child), shmask or not.
    shmask.Writer(config).close()
    shmask.Reader(config).close()

    stop = threading.Event()
    made = {"churn": 0, "attach": 0, "pools": 0}
    errors = []

    def churn():  # Writers made and closed, or dropped (the finalizer unmaps)
        while not stop.is_set():
            writer = shmask.Writer(config)
            if made["churn"] % 2:
                writer.close()
            del writer
            made["churn"] += 1

    # The attach thread's Reader maps each new ring (and unmaps those of
    # closed ones); with `parents_reader` the children read with it too.
    shared_reader = shmask.Reader(config)

    def attach():
        while not stop.is_set():
            with shmask.Writer(config) as writer:
                with shared_reader.open(writer.publish(*rows)) as chunk:
                    chunk.to_lists()
            made["attach"] += 1

    # The native thread pool and the documents' pool, busy at the forks too
    # (both claim fork safety: a child must have working pools of its own).
    # 20,040 entries and rows: 4 parts of the native pool's 4,096-entry minimum.
    json_rows = (np.full(40, 500, np.int32), np.arange(20_000, dtype=np.int32),
                 np.linspace(-9, 0, 20_000, dtype=np.float32))
    json_expected = response_arrays(True, json_rows[0], None, *json_rows[1:], threads=1)

    def pools_ok():
        return (response_arrays(True, json_rows[0], None, *json_rows[1:], threads=4)
                == json_expected
                and map_documents(lambda item, each: item * 2, list(range(6)), 3)
                == list(range(0, 12, 2)))

    def pools():
        while not stop.is_set():
            if not pools_ok():
                raise AssertionError("a pool gave another result")
            made["pools"] += 1

    def guarded(work):
        def run():
            try:
                work()
            except BaseException as exc:  # reported: a thread that died proves nothing
                errors.append(repr(exc))
        return run

    threads = [threading.Thread(target=guarded(w), daemon=True) for w in (churn, churn, attach, pools)]
    for thread in threads:
        thread.start()

    def parent_locks_held():
        # Descriptors carrying the lifetime lock (an flock on their open file
        # description) of a ring whose name still exists: a child must not
        # hold its parent's, or a SIGKILLed parent's ring could not be
        # collected while the child lives. Looked at first thing, so that a
        # name is still there (the parent's threads close rings soon after).
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                with open(f"/proc/self/fdinfo/{fd}") as info:
                    locked = "FLOCK" in info.read()
            except OSError:
                continue  # the listing's own descriptor
            held += (locked and target.startswith("/dev/shm/" + prefix)
                     and not target.endswith(" (deleted)"))
        return held

    def child():
        # A child that hangs says where (stderr), then the driver kills it.
        faulthandler.dump_traceback_later(child_timeout_s / 2)
        try:
            inherited = parent_locks_held()
            reader = (contextlib.nullcontext(shared_reader) if parents_reader
                      else shmask.Reader(config))
            with shmask.Writer(config) as writer, reader as reader:
                with reader.open(writer.publish(*rows)) as chunk:
                    ok = chunk.to_lists() == ([[3, 4], [5]], [[-1.0, -2.0], [-3.0]])
            ok = ok and pools_ok()
            os._exit(3 if not ok else 5 if inherited else 0)
        except BaseException as exc:
            print(f"child {os.getpid()}: {exc!r}", file=sys.stderr, flush=True)
            os._exit(4)

    rng = random.Random(seed)
    done = hangs = failures = locks_held = 0
    started = time.monotonic()
    for done in range(1, forks + 1):
        time.sleep(rng.uniform(0, 0.004))  # a random point of the threads' loops
        pid = os.fork()
        if pid == 0:
            child()
        deadline = time.monotonic() + child_timeout_s
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        if status[0] == 0:  # hung: it has no children of its own
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            hangs += 1
            print(f"fork {done}: child {pid} hung", file=sys.stderr, flush=True)
        elif os.waitstatus_to_exitcode(status[1]) == 5:
            locks_held += 1
        elif status[1] != 0:
            failures += 1
            print(f"fork {done}: child {pid} status {status[1]}", file=sys.stderr, flush=True)
        if hangs >= max_hangs:
            break
    seconds = time.monotonic() - started
    stop.set()
    for thread in threads:
        thread.join(60)
    collect_garbage(prefix)  # the rings of killed children
    print(json.dumps({"forks": done, "hangs": hangs, "failures": failures, "locks_held": locks_held,
                      "seconds": round(seconds, 1), "made": made, "thread_errors": errors,
                      "threads_stuck": sum(t.is_alive() for t in threads)}), flush=True)
    os._exit(0)  # no exit handlers: a stuck thread must not hold the driver
""")


def fork_at_random_points(prefix: str, forks: int, seed: int = 0,
                          child_timeout_s: float = CHILD_TIMEOUT_S,
                          max_hangs: int = MAX_HANGS, parents_reader: bool = False) -> dict:
    """Run the driver; returns its report (forks made, hangs, failures, ...)
    plus `stderr` (the tail of what it and its children printed). With
    `parents_reader` each child reads with the Reader of the parent's
    attaching thread instead of a new one."""
    wall_s = forks * 0.5 + (max_hangs + 1) * child_timeout_s + 120
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, prefix, str(forks), str(seed), str(child_timeout_s),
         str(max_hangs), "1" if parents_reader else "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=wall_s)
    except subprocess.TimeoutExpired:
        out, err = "", f"the driver did not finish within {wall_s:.0f} s"
    finally:
        try:  # the driver's group: itself if it hangs, and any child it left
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"forks": 0, "hangs": None, "stderr": err[-4000:], "rc": proc.returncode}
    report = json.loads(lines[-1])
    report["stderr"] = err[-4000:]
    return report


@pytest.mark.timeout(FORKS * 0.5 + (MAX_HANGS + 1) * CHILD_TIMEOUT_S + 180)
def test_fork_at_random_points_of_the_ring_life_cycle(prefix):
    """Children forked while threads make, close, drop and attach rings all
    make their own Writer, publish, read back and exit: 0 hangs."""
    report = fork_at_random_points(prefix, FORKS, seed=33)
    assert report["hangs"] == 0, report
    assert report["forks"] == FORKS, report
    assert report["failures"] == 0, report
    assert report["locks_held"] == 0, report  # a parent's ring lock inherited at the fork
    assert not report["thread_errors"] and not report["threads_stuck"], report
    assert min(report["made"].values()) > 0, report  # every thread went round its loop


@pytest.mark.timeout(FORKS * 0.5 + 2 * CHILD_TIMEOUT_S + 180)
def test_a_forked_child_reads_with_its_parents_reader(prefix):
    """Readers work on in a forked child (docs/architecture.md): children
    that read with the Reader a thread of the parent attaches rings with."""
    report = fork_at_random_points(prefix, FORKS, seed=34, max_hangs=1, parents_reader=True)
    assert report["hangs"] == 0, report
    assert report["forks"] == FORKS and report["failures"] == 0, report

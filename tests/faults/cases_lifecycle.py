"""Fault cases of the producer's lifecycle (issue 17): a producer that
drains on SIGTERM, and one that dies of it.

Run as a script, this module is also the children of its cases:
`python cases_lifecycle.py <role> ...`, spoken to by lines like
fault_child.py's roles.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fault_cases import Result, case
from fault_child import batch_hex, parse_batch, say, wait_for
from fault_child import result as say_result
from fault_lib import (
    REPO,
    Child,
    Workload,
    check_rows,
    child_env,
    describe_rc,
    expected_for,
    shm_path,
)

import shmask

SCRIPT = Path(__file__).resolve()
MAX_LEN = 32
# handler installed before the Writer, after it; no handler (the default
# action), and no handler with the Writer built on a worker thread
DRAINING, DYING = ("before", "after"), ("default", "thread")


class _Role(Child):
    """A child running one of this module's roles (fault_child.py's Child
    runs that file's)."""

    def __init__(self, role: str, *args: object, prefix: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), role, *map(str, args)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(prefix, **env),
            cwd=str(REPO), start_new_session=True)
        self.pid = self.proc.pid
        self._buffer = b""
        self._eof = False
        self._stderr = None


# ==================================================================== case

@case("SIGTERM drain")
def sigterm_drain(result: Result, prefix: str, full: bool) -> None:
    seed = 23
    requests, pre, post = (32, 50, 200) if full else (8, 6, 12)
    env = {"SHMASK_RING_MB": "16" if full else "4"}
    figures: dict[str, dict] = {}
    for order in DRAINING:
        figures[order] = _drain(result, prefix, seed, order, requests, pre, post, env)
    for order in DYING:
        figures[order] = _die(result, prefix, seed, order, requests, env)
    after = sum(f.get("rows_after_sigterm_read", 0) for f in figures.values())
    published = sum(f.get("rows_after_sigterm", 0) for f in figures.values())
    lost = sum(f.get("rows_lost", 0) for f in figures.values())
    unlinked = sum(f.get("unlinked_on_sigterm", False) for f in figures.values())
    result.metrics.update(figures, rows_after_sigterm=after, rows_lost=lost)
    result.happened = (
        "producers whose SIGTERM handler drains (installed before, then after, the Writer) "
        "kept publishing after the signal; a consumer started after it read every row; each "
        "ring went at the producer's exit. Producers with SIGTERM's default action (Writer on "
        "the main thread, then on a worker thread) died of it with the ring unlinked")
    result.figure = (f"{after}/{published} rows published after SIGTERM read exactly, "
                     f"{lost} lost; default action: {unlinked}/{len(DYING)} rings unlinked")


def _drain(result: Result, prefix: str, seed: int, order: str, requests: int, pre: int,
           post: int, env: dict[str, str]) -> dict:
    """A draining producer: SIGTERM, more batches, a consumer that starts
    only then, and the ring gone at exit."""
    figures: dict = {}
    lines = Path(os.environ.get("TMPDIR", "/tmp")) / f"shmask-drain-{prefix}-{order}.txt"
    with _Role("drain_producer", seed, order, requests, pre, post, lines, prefix=prefix,
               **env) as producer:
        name = producer.expect("segment", 30)
        producer.expect("ready", 30)
        os.kill(producer.pid, signal.SIGTERM)
        signalled = producer.expect("written", 120)
        result.check(signalled == "1", f"{order}: the producer's handler saw {signalled} SIGTERM")
        result.check(producer.proc.poll() is None,
                     f"{order}: the draining producer died ({describe_rc(producer.proc.poll())})")
        result.check(os.path.exists(shm_path(name)),
                     f"{order}: SIGTERM unlinked the ring of a producer that drains")
        with _Role("drain_consumer", seed, lines, prefix=prefix) as consumer:
            report = json.loads(consumer.expect("result", 120))
            rc = consumer.wait(30)
            result.check(rc == 0, f"{order}: consumer {describe_rc(rc)}: {consumer.stderr_tail()}")
        for when in ("before", "after"):
            read, total = report[f"rows_{when}_ok"], report[f"rows_{when}"]
            result.check(read == total, f"{order}: {total - read} of {total} rows published "
                                        f"{when} SIGTERM were not read exactly")
        result.check(not report["errors"], f"{order}: consumer errors {report['errors']}")
        result.check(report["other_rows"] == 0,
                     f"{order}: {report['other_rows']} chunks had another request's rows")
        producer.send("exit")
        rc = producer.wait(30)
        result.check(rc == 0, f"{order}: the producer's exit: {describe_rc(rc)}: "
                              f"{producer.stderr_tail()}")
        gone = not os.path.exists(shm_path(name))
        result.check(gone, f"{order}: the ring outlived its producer's exit")
    lines.unlink(missing_ok=True)
    figures.update(report, ring_gone_at_exit=gone,
                   rows_after_sigterm=report["rows_after"],
                   rows_after_sigterm_read=report["rows_after_ok"],
                   rows_lost=report["rows_before"] + report["rows_after"]
                   - report["rows_before_ok"] - report["rows_after_ok"])
    return figures


def _die(result: Result, prefix: str, seed: int, order: str, requests: int,
         env: dict[str, str]) -> dict:
    """SIGTERM's default action: the producer dies of it, its ring unlinked."""
    with _Role("drain_producer", seed, order, requests, 3, 0, "-", prefix=prefix,
               **env) as producer:
        name = producer.expect("segment", 30)
        producer.expect("ready", 30)
        os.kill(producer.pid, signal.SIGTERM)
        rc = producer.wait(30)
        result.check(rc == -signal.SIGTERM, f"{order}: SIGTERM ended the producer with "
                                            f"{describe_rc(rc)}: {producer.stderr_tail()}")
        unlinked = not os.path.exists(shm_path(name))
        result.check(unlinked, f"{order}: a producer that died of SIGTERM left its ring")
    return {"rc": rc, "unlinked_on_sigterm": unlinked}


# ================================================================ children

def drain_producer(seed: str, order: str, requests: str, pre: str, post: str,
                   lines_path: str) -> None:
    """Publishes `pre` batches, says ready; then either dies of SIGTERM
    (`default`, `thread`) or, its handler having run, publishes `post`
    batches more, writes every batch to `lines_path` and waits for exit."""
    draining: list[int] = []

    def on_sigterm(signum, frame):  # type: ignore[no-untyped-def]
        draining.append(signum)  # a server that drains: note it, go on

    if order == "before":
        signal.signal(signal.SIGTERM, on_sigterm)
    config = shmask.Config.from_env()
    if order == "thread":
        made: list[shmask.Writer] = []
        worker = threading.Thread(target=lambda: made.append(shmask.Writer(config)))
        worker.start()
        worker.join()
        writer = made[0]
    else:
        writer = shmask.Writer(config)
    if order == "after":
        signal.signal(signal.SIGTERM, on_sigterm)
    work = Workload(writer, int(seed), int(requests), max_len=MAX_LEN)
    batches = []
    for _ in range(int(pre)):
        work.step()
        batches.append("before " + batch_hex(*work.take()))
    say("segment", writer.segment_name)
    say("ready")
    if order in DYING:
        time.sleep(60)  # SIGTERM's default action ends the process here
        return
    deadline = time.monotonic() + 60
    while not draining and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(int(post)):  # the drain: the ring must still be there for these
        work.step()
        batches.append("after " + batch_hex(*work.take()))
    Path(lines_path).write_text("\n".join(batches) + "\n")
    say("written", len(draining))
    wait_for("exit")
    # A normal exit: atexit unlinks the ring.


def drain_consumer(seed: str, lines_path: str) -> None:
    """Started after the producer's SIGTERM: opens every batch's refs."""
    reader = shmask.Reader()
    report = {"rows_before": 0, "rows_after": 0, "rows_before_ok": 0, "rows_after_ok": 0,
              "chunks": 0, "other_rows": 0, "errors": {}}
    for line in Path(lines_path).read_text().splitlines():
        when, text = line.split(" ", 1)
        batch, meta = parse_batch(text)
        for ref, row in zip(batch, meta, strict=True):
            rows = int(row[3])
            report[f"rows_{when}"] += rows
            report["chunks"] += 1
            try:
                with reader.open(ref) as chunk:
                    problem = check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                         expected_for(int(seed), row, MAX_LEN))
            except shmask.ShmaskError as exc:
                name = type(exc).__name__
                report["errors"][name] = report["errors"].get(name, 0) + 1
                continue
            if problem.startswith("other rows"):
                report["other_rows"] += 1
            elif not problem:
                report[f"rows_{when}_ok"] += rows
    reader.close()
    say_result(report)


if __name__ == "__main__":
    {"drain_producer": drain_producer, "drain_consumer": drain_consumer}[sys.argv[1]](
        *sys.argv[2:])

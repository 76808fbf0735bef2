"""The fault matrix of issue 7, as functions both tests/faults/test_faults.py
and benchmarks/reliability.py call.

Each case runs real processes on real /dev/shm (zmq where a pipeline is
needed), is bounded in time, cleans up after itself (children killed,
segments of its own prefix unlinked) and returns a Result: what happened,
one figure for the Reliability table, the raw metrics, and `problems`: each
way the run departed from the specification (an empty list is a pass).
`full=True` is the `make faults` size; `full=False` the `make test` one.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from fault_lib import (
    HERE,
    MODE_SELECTED,
    MODE_SUPPORT,
    Child,
    Workload,
    check_rows,
    child_env,
    describe_rc,
    encode_rows,
    expected_for,
    run_script,
    shm_path,
    sweep,
)

import shmask

NOBODY = 65534


@dataclass
class Result:
    case: str
    happened: str = ""
    figure: str = ""
    problems: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0

    def check(self, condition: bool, problem: str) -> bool:
        """Record `problem` unless `condition` holds; returns the condition."""
        if not condition:
            self.problems.append(problem)
        return condition

    def report(self) -> str:
        lines = [f"{self.case}: {self.happened}", f"  figure: {self.figure}",
                 f"  seconds: {self.seconds:.1f}"]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        return "\n".join(lines)


CASES: dict[str, Callable[[str, bool], Result]] = {}


def case(name: str):  # type: ignore[no-untyped-def]
    """Register a case; give it its own sub-prefix, time it, turn an
    exception into a problem, and sweep the sub-prefix afterwards."""
    def register(function):  # type: ignore[no-untyped-def]
        def run(prefix: str, full: bool = False) -> Result:
            result = Result(name)
            own = f"{prefix}{secrets.token_hex(2)}"
            started = time.monotonic()
            try:
                function(result, own, full)
            except Exception:  # noqa: BLE001 - a case that breaks is a finding
                result.problems.append("case raised: " + traceback.format_exc(limit=6))
            finally:
                result.seconds = time.monotonic() - started
                left = sweep(own)
                if left:
                    result.metrics["swept_after_case"] = left
            return result
        run.__name__ = function.__name__
        CASES[name] = run
        return run
    return register


# The cases' ipc sockets live in one directory of this run, removed when the
# process that made it ends: a child killed mid-case (the point of most
# cases) leaves its bound socket's file behind, which would otherwise stay
# in /tmp. It is made at the first endpoint asked for, not at import: a
# case's child script imports this module too (cases_lifecycle.py runs as
# one) and, killed, left an empty directory of its own each time. Children
# started after it find it through the environment.
_SOCKETS_VARIABLE = "FAULT_CASES_SOCKETS"


def _sockets() -> str:
    made = os.environ.get(_SOCKETS_VARIABLE)
    if made and os.path.isdir(made):
        return made
    made = tempfile.mkdtemp(prefix="shmask-faults-")
    os.environ[_SOCKETS_VARIABLE] = made
    owner = os.getpid()  # (a forked child inherits the exit hook: only the owner removes)
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(made, True))
    return made


def _endpoint() -> str:
    return f"ipc://{_sockets()}/{secrets.token_hex(6)}.sock"


def _gc_cli(prefix: str) -> subprocess.CompletedProcess:
    return run_script("import sys; from shmask.cli import main; sys.exit(main(sys.argv[1:]))"
                      .replace("sys.argv[1:]", f"['gc', '--prefix', {prefix!r}]"),
                      child_env(prefix), timeout=60)


def _start_in_child(what: str, prefix: str) -> subprocess.CompletedProcess:
    """`shmask.Reader()` or `shmask.Writer()` started (and closed) in a fresh process."""
    return run_script(f"import shmask; shmask.{what}().close()",
                      child_env(prefix, SHMASK_RING_MB="1"), timeout=60)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _opened_rows_ok(reader, ref, row, seed: int, max_len: int) -> str:
    """'' if the ref opens to its seeded rows (and releases), else what went wrong."""
    with reader.open(ref) as chunk:
        return check_rows(chunk.lengths, chunk.ids, chunk.logprobs, expected_for(seed, row, max_len))


# ==================================================================== cases

@case("SIGKILL producer mid-stream")
def producer_sigkill(result: Result, prefix: str, full: bool) -> None:
    import zmq

    seed = 11
    config = shmask.Config(ring_mb=4, name_prefix=prefix)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 20_000)
    endpoint = _endpoint()
    pull.bind(endpoint)
    producer = Child("producer_stream", seed, endpoint, 16, env=child_env(prefix, SHMASK_RING_MB="4"))
    reader = shmask.Reader(config)
    held, pending = [], []
    try:
        name = producer.expect("segment", 30)
        hold_batches, pend_batches = (40, 40) if full else (8, 8)
        for index in range(hold_batches + pend_batches):
            meta_bytes, data = pull.recv_multipart()
            meta = np.frombuffer(meta_bytes, np.int64).reshape(-1, 4)
            for ref, row in zip(shmask.RefBatch.from_bytes(data), meta, strict=True):
                if ref.kind != 1:
                    continue
                if index < hold_batches:
                    chunk = reader.open(ref)
                    want = expected_for(seed, row, 64)
                    result.check(not check_rows(chunk.lengths, chunk.ids, chunk.logprobs, want),
                                 "a chunk read before the kill had wrong rows")
                    held.append((chunk, want))
                else:
                    pending.append((ref, row))
        # the producer is still streaming: kill it between two of its sends
        os.kill(producer.pid, signal.SIGKILL)
        rc = producer.wait(10)
        result.check(rc == -signal.SIGKILL, f"producer: {describe_rc(rc)}")
        left_after_kill = os.path.exists(shm_path(name))
        intact = sum(not check_rows(c.lengths, c.ids, c.logprobs, w) for c, w in held)
        result.check(intact == len(held), f"{len(held) - intact} held views changed after the kill")
        lists_ok = 0
        for chunk, _ in held[: min(len(held), 200)]:
            try:
                chunk.to_lists()
                lists_ok += 1
            except shmask.ShmaskError:
                pass
        # A new Reader start in another process is to remove the dead ring.
        started = _start_in_child("Reader", prefix)
        result.check(started.returncode == 0, f"Reader() start failed: {started.stderr[-400:]}")
        removed_by_reader = not os.path.exists(shm_path(name))
        result.check(removed_by_reader, "a new Reader start left the SIGKILLed producer's ring")
        gc = _gc_cli(prefix)
        result.check(gc.returncode == 0, f"gc failed: {gc.stderr[-400:]}")
        removed = not os.path.exists(shm_path(name))
        result.check(removed, "gc left the SIGKILLed producer's ring")
        # New opens: a fresh Reader must get a shmask error (the ring is gone);
        # the Reader that still maps it may give the true rows, never others.
        fresh = shmask.Reader(config)
        fresh_errors, fresh_bad = {}, []
        attached_true = attached_errors = 0
        for ref, row in pending:
            try:
                fresh.open(ref).release()
                fresh_bad.append("opened")
            except shmask.ShmaskError as exc:
                fresh_errors[type(exc).__name__] = fresh_errors.get(type(exc).__name__, 0) + 1
            except Exception as exc:  # noqa: BLE001
                fresh_bad.append(f"{type(exc).__name__}: {exc}")
            try:
                problem = _opened_rows_ok(reader, ref, row, seed, 64)
                result.check(not problem, f"the attached reader read {problem}")
                attached_true += not problem
            except shmask.ShmaskError:
                attached_errors += 1
            except Exception as exc:  # noqa: BLE001
                result.problems.append(f"attached reader: {type(exc).__name__}: {exc}")
        if removed:
            result.check(not fresh_bad, f"new opens of the removed ring: {fresh_bad[:3]}")
        releases = {}
        for chunk, _ in held:
            try:
                chunk.release()
                key = "ok"
            except shmask.ShmaskError as exc:
                key = type(exc).__name__
            except Exception as exc:  # noqa: BLE001
                key = f"non-shmask {type(exc).__name__}"
                result.problems.append(f"release after the producer died: {key}")
            releases[key] = releases.get(key, 0) + 1
        fresh.close()
        result.metrics.update(held=len(held), intact=intact, to_lists_ok=lists_ok,
                              pending=len(pending), fresh_open_errors=fresh_errors,
                              attached_true=attached_true, attached_errors=attached_errors,
                              ring_left_after_kill=left_after_kill,
                              removed_by_reader_start=removed_by_reader, removed_by_gc=removed,
                              releases=releases)
        result.happened = (f"held views intact; new opens -> {fresh_errors or fresh_bad}; ring "
                           + ("removed by the next Reader start" if removed_by_reader else
                              "removed by gc" if removed else "NOT removed"))
        result.figure = (f"{intact}/{len(held)} held chunks intact, {len(pending)} new opens: "
                         f"{sum(fresh_errors.values())} shmask errors")
    finally:
        producer.kill()
        reader.close()
        pull.close(linger=0)
        context.term()


@case("SIGKILL consumer holding chunks")
def consumer_sigkill(result: Result, prefix: str, full: bool) -> None:
    import zmq

    seed, lease = 12, 1.0
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=50, lease_s=lease)
    writer = shmask.Writer(config)
    work = Workload(writer, seed, 32, max_len=64)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1000)
    endpoint = _endpoint()
    push.bind(endpoint)
    consumer = Child("consumer_hold", endpoint, seed, 200, prefix=prefix)
    reader = shmask.Reader(config)
    stalls = {"append_step": [], "take_batch": []}

    def emit(send: bool):  # type: ignore[no-untyped-def]
        for _ in range(2):
            work.step(timings=stalls["append_step"])  # each append_step call on its own
        t0 = time.monotonic()
        batch, meta = work.take()
        stalls["take_batch"].append(time.monotonic() - t0)
        if send:
            try:
                push.send_multipart([meta.tobytes(), batch.to_bytes()], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        return batch, meta

    try:
        # 1: the consumer opens chunks and never releases; the ring fills up
        deadline = time.monotonic() + 30
        held = None
        while time.monotonic() < deadline and (held is None or writer.stats.inline_chunks == 0):
            emit(send=True)
            if held is None:
                line = consumer.readline(0)
                if line and line.startswith("held"):
                    held = [int(v) for v in line.split()[1:]]
        result.check(held is not None, f"the consumer held nothing: {consumer.stderr_tail()}")
        result.check(writer.stats.inline_chunks > 0, "the ring never filled up")
        result.check(held is None or held[1] == 0, "the consumer read wrong rows")
        # 2: SIGKILL it; the producer goes on with a live reader of its own
        os.kill(consumer.pid, signal.SIGKILL)
        result.check(consumer.wait(10) == -signal.SIGKILL, "the consumer did not die of SIGKILL")
        killed_at = time.monotonic()
        mismatches = produced = 0
        inline_after_lease = 0
        while time.monotonic() < killed_at + lease * 2 + (3 if full else 1):
            batch, meta = emit(send=False)
            for ref, row in zip(batch, meta, strict=True):
                if ref.kind == 0:
                    continue
                produced += 1
                if ref.kind == 2 and time.monotonic() > killed_at + lease + 0.5:
                    inline_after_lease += 1
                mismatches += bool(_opened_rows_ok(reader, ref, row, seed, 64))
        writer.reclaim()
        used, capacity = writer.ring_usage()
        # issue 7, defect 5: one call waits about one SHMASK_FULL_WAIT_MS in
        # total, then goes inline (plus slack for a loaded 2-core machine)
        bound = 1.5 * config.full_wait_ms / 1000 + 0.025
        worst = {k: max(v) for k, v in stalls.items()}
        p99 = {k: float(np.percentile(v, 99)) for k, v in stalls.items()}
        result.check(mismatches == 0, f"{mismatches} chunks read after the kill had wrong rows")
        result.check(writer.stats.expired > 0, "lease reclaim expired nothing")
        result.check(inline_after_lease == 0,
                     f"{inline_after_lease} chunks still went inline after the lease ran out")
        for call, seconds in worst.items():
            result.check(seconds <= bound, f"{call} stalled {seconds * 1000:.0f} ms "
                         f"(SHMASK_FULL_WAIT_MS={config.full_wait_ms:.0f}; bound {bound * 1000:.0f} ms)")
        result.metrics.update(held_by_consumer=held, expired=writer.stats.expired,
                              full_waits=writer.stats.full_waits, chunks_after_kill=produced,
                              inline_total=writer.stats.inline_chunks,
                              inline_after_lease=inline_after_lease, ring_used_end=used,
                              ring_capacity=capacity, max_stall_ms={k: round(v * 1000, 1) for k, v in
                                                                    worst.items()},
                              p99_stall_ms={k: round(v * 1000, 1) for k, v in p99.items()})
        result.happened = (f"producer went on ({produced} chunks after the kill, {mismatches} "
                           f"mismatches); lease reclaim expired {writer.stats.expired} records")
        result.figure = (f"max stall append_step {worst['append_step'] * 1000:.0f} ms, take_batch "
                         f"{worst['take_batch'] * 1000:.0f} ms (FULL_WAIT {config.full_wait_ms:.0f} "
                         f"ms); ring {used >> 10} KiB used after reclaim")
    finally:
        consumer.kill()
        reader.close()
        work.close()
        writer.close()
        push.close(linger=0)
        context.term()


@case("SIGSTOP consumer past its lease")
def consumer_sigstop(result: Result, prefix: str, full: bool) -> None:
    seed, lease = 13, 0.5
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=5, lease_s=lease)
    writer = shmask.Writer(config)
    work = Workload(writer, seed, 24)
    reader = shmask.Reader(config)
    from fault_child import batch_hex

    consumer = Child("consumer_stop", seed, prefix=prefix)
    try:
        for _ in range(4):
            work.step(skip=0.0)
        first = work.take()
        for _ in range(4):
            work.step(skip=0.0)
        late = work.take()
        consumer.send("refs " + batch_hex(*first))
        consumer.send("refs " + batch_hex(*late))
        held = int(consumer.expect("held", 30))
        os.kill(consumer.pid, signal.SIGSTOP)
        time.sleep(lease + 0.2)
        # overwrite the whole ring several times while the consumer sleeps
        written = 0
        rounds = 0
        while written < (8 if full else 3) * config.ring_capacity_bytes:
            for _ in range(4):
                work.step(skip=0.0)
            batch, meta = work.take()
            rounds += 1
            for ref in batch:
                if ref.kind != 0:
                    written += ref.record_bytes if ref.kind == 1 else 0
                    with reader.open(ref):
                        pass
            result.check(rounds < 5000, "the ring never wrapped")
            if rounds >= 5000:
                break
        os.kill(consumer.pid, signal.SIGCONT)
        consumer.send("go")
        report = json.loads(consumer.expect("result", 60))
        rc = consumer.wait(30)
        late_count = sum(1 for r in late[0] if r.kind == 1)
        result.check(rc == 0, f"consumer: {describe_rc(rc)} {consumer.stderr_tail()}")
        result.check(report["other_rows"] == 0, f"{report['other_rows']} reads returned other rows")
        result.check(not report["other_errors"], f"non-stale errors: {report['other_errors'][:3]}")
        result.check(report["stale"] == held, f"{report['stale']}/{held} held chunks raised "
                     "StaleChunkError")
        result.check(report["late_stale"] == late_count,
                     f"{report['late_stale']}/{late_count} late opens raised StaleChunkError")
        result.metrics.update(report=report, held=held, late=late_count, expired=writer.stats.expired,
                              bytes_overwritten=written)
        result.happened = (f"after SIGCONT: {report['stale']} held + {report['late_stale']} late "
                           f"chunks -> StaleChunkError, {report['other_rows']} other rows")
        result.figure = (f"{held + late_count} stale chunks, {report['stale'] + report['late_stale']}"
                         f" StaleChunkError, {report['other_rows']} other rows")
    finally:
        consumer.kill()
        reader.close()
        work.close()
        writer.close()


@case("soak")
def soak(result: Result, prefix: str, full: bool) -> None:
    seed, consumers, hold_max = 14, 3, 32
    target = 1_000_000 if full else 20_000
    endpoints = [_endpoint() for _ in range(consumers)]
    env = child_env(prefix, SHMASK_RING_MB="4", SHMASK_FULL_WAIT_MS="20")
    readers = []
    producer = None
    try:
        for index, endpoint in enumerate(endpoints):
            # the consumers bind; the producer connects to each
            readers.append(Child("soak_consumer", endpoint, seed, index, hold_max, env=env))
        for child in readers:
            child.expect("ready", 30)
        producer = Child("soak_producer", seed, target, *endpoints, env=env)
        producer.expect("segment", 30)
        budget = 1500 if full else 120
        report = json.loads(producer.expect("result", budget))
        stats = [json.loads(child.expect("result", 120)) for child in readers]
        producer.send("exit")
        rcs = [producer.wait(30)] + [child.wait(30) for child in readers]
        result.check(all(rc == 0 for rc in rcs), f"exit statuses {[describe_rc(r) for r in rcs]}")
        received = sum(s["chunks"] for s in stats)
        mismatches = sum(s["mismatches"] for s in stats)
        stale = sum(s["stale"] for s in stats)
        result.check(received == report["chunks"],
                     f"consumers verified {received} chunks, the producer sent {report['chunks']}")
        result.check(received >= target, f"only {received} chunks")
        result.check(mismatches == 0, f"{mismatches} mismatches: "
                     f"{[e for s in stats for e in s['errors']][:3]}")
        result.check(stale == 0, f"{stale} chunks stale within the lease")
        rss = [("producer", report)] + [(f"consumer{i}", s) for i, s in enumerate(stats)]
        growth_limit = 16 * 1024
        for who, s in rss:
            grown = s["rss_end"]["RssAnon"] - s["rss_start"]["RssAnon"]
            result.check(grown <= growth_limit, f"{who} private memory grew {grown >> 10} MiB")
        rss_text = ", ".join(f"{who} {s['rss_start']['VmRSS'] >> 10}->{s['rss_end']['VmRSS'] >> 10}"
                             f" MiB (anon {s['rss_start']['RssAnon'] >> 10}->"
                             f"{s['rss_end']['RssAnon'] >> 10})" for who, s in rss)
        result.metrics.update(producer=report, consumers=stats, rss=rss_text)
        result.happened = (f"{received:,} chunks over {report['emissions']:,} emissions to "
                           f"{consumers} consumers in {report['seconds']:.0f} s, random sizes and "
                           f"release order; {report['inline_chunks']} went inline")
        result.figure = f"{received:,} chunks, {mismatches} mismatches, RSS {rss_text}"
    finally:
        for child in ([producer] if producer else []) + readers:
            child.kill()


@case("forged refs")
def forged_refs(result: Result, prefix: str, full: bool) -> None:
    seed = 15
    total = 100_000 if full else 5_000
    hang_s = 15.0
    counts: dict[str, int] = {}
    crashes, hangs, examples = [], [], {}
    index = 0
    env = child_env(prefix)
    started = time.monotonic()
    while index < total:
        child = _forge_child(seed, index, total, env)
        last = index - 1
        try:
            while True:
                line = child.readline(hang_s)
                if line is None:
                    rc = child.wait(2)
                    if rc is None:
                        hangs.append(last + 1)
                    elif rc != 0 or last + 1 < total:
                        crashes.append((last + 1, describe_rc(rc), child.stderr_tail(300)))
                    index = last + 2
                    break
                if line == "done":
                    index = total
                    rc = child.wait(30)  # let it close (and unlink) its rings
                    result.check(rc == 0, f"the forging process ended with {describe_rc(rc)}")
                    break
                number, code = line.split(" ", 1)
                last = int(number)
                counts[code] = counts.get(code, 0) + 1
                examples.setdefault(code, last)
        finally:
            child.kill()
    cases = sum(counts.values()) + len(crashes) + len(hangs)
    bad = {c: n for c, n in counts.items() if c[0] in "OXW"}
    result.check(not crashes, f"{len(crashes)} crashes, first: {crashes[:2]}")
    result.check(not hangs, f"{len(hangs)} hangs (cases {hangs[:5]})")
    result.check(not bad, f"violations {bad} (first case of each: "
                 f"{ {c: examples[c] for c in bad} })")
    result.check(cases >= total, f"only {cases} cases ran")
    errors = sum(n for c, n in counts.items() if c.startswith("E"))
    other_rows = counts.get("O", 0)
    non_shmask = sum(n for c, n in counts.items() if c[0] in "XW")
    result.metrics.update(counts=counts, crashes=crashes[:10], hangs=hangs[:10],
                          examples=examples, seconds=time.monotonic() - started)
    result.happened = (f"{cases:,} seeded forgeries: {errors:,} shmask errors, "
                       f"{counts.get('T', 0):,} harmless (true rows), {counts.get('I', 0)} inline "
                       f"payloads altered in the message")
    result.figure = (f"{cases:,} cases, {len(crashes)} crashes, {len(hangs)} hangs, "
                     f"{non_shmask} non-shmask/wrong-type errors, {other_rows} other rows")


def _forge_child(seed: int, start: int, end: int, env: dict[str, str]) -> Child:
    child = Child.__new__(Child)
    child.proc = subprocess.Popen([sys.executable, str(HERE / "fault_forge.py"), str(seed),
                                   str(start), str(end)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                  cwd=str(HERE.parents[1]))
    child.pid = child.proc.pid
    child._buffer, child._eof, child._stderr = b"", False, None
    return child


def _truncate(name: str, size: int, producer_pid: int) -> str:
    """Truncate the segment file; through the producer's mapping when the
    name is no longer in /dev/shm (a memfd); 'refused: ...' when the kernel
    says no (a sealed memfd), which is the best outcome."""
    path = shm_path(name)
    try:
        if not os.path.exists(path):
            with open(f"/proc/{producer_pid}/maps") as f:
                spans = [ln.split()[0] for ln in f if name.lstrip("/") in ln]
            if not spans:
                return "refused: segment not found by name nor in the producer's maps"
            path = f"/proc/{producer_pid}/map_files/{spans[0]}"
        os.truncate(path, size)
        return "truncated"
    except OSError as exc:
        return f"refused: {exc.strerror}"


@case("truncated segment")
def truncated_segment(result: Result, prefix: str, full: bool) -> None:
    ring = 4096 + (1 << 20)
    sizes = [0, 100, 4096, ring // 2, ring - 4096] if full else [0, ring // 2]
    deaths, non_shmask, outcomes = 0, [], {}
    for size in sizes:
        env = child_env(prefix)
        writer = Child("trunc_writer", 1.5, env=env)
        reader = Child("trunc_reader", 7, env=env)
        try:
            name = writer.expect("segment", 30)
            reader.send("refs " + writer.expect("refs", 30))
            reader.send("refs " + writer.expect("refs", 30))
            result.check(reader.expect("held", 30) == "ok", "rows read before truncation differ")
            writer.send("go")  # the producer is now writing in a loop
            time.sleep(0.3)
            done = _truncate(name, size, writer.pid)
            reader.send("go")
            reports = {}
            for who, child in (("reader", reader), ("producer", writer)):
                try:
                    reports[who] = json.loads(child.expect("result", 30))
                except RuntimeError:
                    reports[who] = None
            writer.send("exit")
            for who, child in (("reader", reader), ("producer", writer)):
                rc = child.wait(20)
                if rc is None or rc < 0:
                    deaths += 1
                    result.problems.append(f"size {size}: {who} {describe_rc(rc)}")
            for who, report in reports.items():
                if report is None:
                    continue
                for call, got in report.items():
                    for outcome in (got if isinstance(got, dict) else {got: 1}):
                        outcomes[outcome.split(":")[0] + ":" + outcome.split(":")[-1][:40]
                                 if outcome.startswith("other") else outcome] = 1
                        if outcome.startswith("other"):
                            non_shmask.append(f"size {size} {who} {call}: {outcome}")
            result.metrics[f"size {size}"] = {"truncation": done, **reports}
        finally:
            writer.kill()
            reader.kill()
    result.check(not non_shmask, f"{len(non_shmask)} non-shmask errors: {non_shmask[:4]}")
    result.happened = (f"truncated to {sizes} while a reader held a chunk and the producer wrote; "
                       f"outcomes {sorted(outcomes)}")
    result.figure = (f"{len(sizes)} sizes x 2 processes: {deaths} died (SIGBUS or other), "
                     f"{len(non_shmask)} non-shmask errors")


@case("another uid")
def another_uid(result: Result, prefix: str, full: bool) -> None:
    if os.getuid() != 0:
        result.problems.append("needs root to act as another uid")
        return
    config = shmask.Config(ring_mb=1, name_prefix=prefix)
    writer = shmask.Writer(config)
    reader = shmask.Reader(config)
    lengths, ids, logprobs = encode_rows(16, 1, MODE_SUPPORT, 0, 5, 64)
    ref = writer.publish(lengths, ids, logprobs)
    dead = _dead_pid()
    # root plants a headerless, old, world-readable file whose name claims
    # nobody's uid: nobody may read it and judge it dead, but cannot unlink it
    claims_nobody = f"/{prefix}-{NOBODY}-{dead}-{'cd' * 8}"
    fd = os.open(shm_path(claims_nobody), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)  # whatever the umask
    os.close(fd)
    os.utime(shm_path(claims_nobody), (time.time() - 3600,) * 2)
    planted_by_nobody = None
    try:
        spec = {"ref": ref.to_bytes().hex(), "name": writer.segment_name, "prefix": prefix,
                "dead_pid": dead}
        with Child("as_nobody", json.dumps(spec), prefix=prefix) as child:
            report = json.loads(child.expect("result", 60))
            rc = child.wait(20)
        result.check(rc == 0, f"the nobody process: {describe_rc(rc)}")
        planted_by_nobody = report.get("planted")
        result.check(report["uid"] == NOBODY, "the child did not run as nobody")
        result.check(report["open"].startswith("shmask:"), f"nobody's open gave {report['open']}")
        result.check(report["attach"].startswith("shmask:"),
                     f"nobody's attach gave {report['attach']}")
        result.check(not report["list_segments_sees_it"], "nobody's list_segments lists root's ring")
        result.check(not report["cli_ls_shows_it"], "nobody's `shmask ls` shows root's ring")
        for call in ("cli_ls", "cli_gc", "cli_gc_prefix", "collect_garbage", "own_writer"):
            result.check(report[call] == "ok", f"nobody's {call} gave {report[call]}")
        result.check(report["lock"] == "cannot open", f"nobody's lock attempt: {report['lock']}")
        # root's ring is untouched and still works
        result.check(os.path.exists(shm_path(writer.segment_name)), "root's ring was removed")
        with reader.open(writer.publish(lengths, ids, logprobs)) as chunk:
            result.check(not check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                        (lengths, ids, logprobs)), "root's ring gave wrong rows")
        with reader.open(ref) as chunk:
            result.check(not check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                        (lengths, ids, logprobs)), "root's first chunk changed")
        # root's janitor, with a nobody-owned file that claims uid 0
        gc = _gc_cli(prefix)
        result.check(gc.returncode == 0, f"root's gc failed: {gc.stderr[-300:]}")
        try:
            shmask.Writer(config).close()
            root_writer = "ok"
        except Exception as exc:  # noqa: BLE001
            root_writer = f"{type(exc).__name__}: {exc}"
        result.check(root_writer == "ok", f"root's Writer() raised {root_writer}")
        kept = bool(planted_by_nobody) and os.path.exists(shm_path(planted_by_nobody))
        result.check(kept, "root's gc/Writer deleted a file owned by nobody (its name claims uid 0)")
        result.metrics.update(report=report, root_gc=gc.stdout[-300:], root_writer=root_writer)
        refused = sum(report[k].startswith("shmask:") for k in ("open", "attach"))
        result.happened = (f"nobody: open/attach -> {report['open']}, {report['attach']}; ls/gc "
                           f"hid and kept root's ring; own Writer -> {report['own_writer']}; "
                           f"planted file {'kept' if kept else 'DELETED'} by root's gc")
        result.figure = (f"{refused}/2 reads refused, lock: {report['lock']}, "
                         f"{len(result.problems)} violations")
    finally:
        for name in (claims_nobody, planted_by_nobody):
            if name:
                try:
                    os.unlink(shm_path(name))
                except OSError:
                    pass
        reader.close()
        writer.close()


@case("/dev/shm too small")
def shm_too_small(result: Result, prefix: str, full: bool) -> None:
    mount = 'mount -t tmpfs -o size=8M tmpfs /dev/shm && exec "$0" "$@"'
    with Child("small_shm", prefix=prefix, argv_prefix=["unshare", "-m", "sh", "-c", mount]) as child:
        report = json.loads(child.expect("result", 60))
        rc = child.wait(20)
    result.check(rc == 0, f"child: {describe_rc(rc)}")
    result.check(report["df_mib"] == 8, f"/dev/shm in the child is {report['df_mib']} MiB")
    for label in ("Config(ring_mb=16)", "SHMASK_RING_MB=32 Writer()", "second"):
        got = report[label]
        result.check(got["error"] == "SegmentError", f"{label}: {got['error']}")
        result.check(got.get("names_variable", False), f"{label}: message does not name "
                     f"SHMASK_RING_MB: {got.get('message')}")
        result.check(not got.get("left_in_tmpfs"), f"{label}: left {got.get('left_in_tmpfs')}")
    result.check(report["fitting_ring_rows_ok"], "a ring that fits gave wrong rows")
    result.check(not report["left_at_end"], f"left in the tmpfs: {report['left_at_end']}")
    result.metrics["report"] = report
    result.happened = ("8 MiB tmpfs: 16 and 32 MiB rings and a second 4 MiB ring -> "
                       + report["Config(ring_mb=16)"].get("message", "?")[:90])
    result.figure = (f"3 oversize rings: {sum(report[k]['error'] == 'SegmentError' for k in ('Config(ring_mb=16)', 'SHMASK_RING_MB=32 Writer()', 'second'))}"  # noqa: E501
                     f" SegmentError naming SHMASK_RING_MB, child {describe_rc(rc)}")


BAD_VALUES = {
    # An empty value means unset (the default), so none is listed here.
    "SHMASK_TRANSPORT": ["tcp", "shm!", "shm,inline"],
    "SHMASK_RING_MB": ["0", "-1", "abc", "1.5", "1048577"],
    "SHMASK_NAME_PREFIX": ["a.b", "a-b", "../x", "x" * 33, "sh m"],
    "SHMASK_FULL_WAIT_MS": ["-1", "nan", "inf", "abc", "60001"],
    "SHMASK_LEASE_S": ["0", "-5", "nan", "inf", "abc", "86401"],
    "SHMASK_MAX_TOKENS": ["0", "-1", "1e9", "abc", "4194305"],
    "SHMASK_QUEUE_ROWS": ["0", "-1", "abc", "1048576"],
    "SHMASK_LOG_LEVEL": ["LOUD", "verbose", "5"],
}


@case("bad SHMASK_* values")
def bad_config(result: Result, prefix: str, full: bool) -> None:
    cases = [(variable, value) for variable, values in BAD_VALUES.items() for value in values]
    with Child("bad_config", json.dumps(cases),
               env=child_env(prefix, SHMASK_RING_MB="1")) as child:
        report = json.loads(child.expect("result", 60))["rows"]
        rc = child.wait(20)
    result.check(rc == 0, f"child: {describe_rc(rc)}")
    good = 0
    for row in report:
        label = f"{row['variable']}={row['value']!r}"
        ok = True
        for cls in ("Writer", "Reader"):
            ok &= result.check(row[cls] == "ConfigError", f"{label}: {cls}() -> {row[cls]}")
            if row[cls] == "ConfigError":
                ok &= result.check(row[cls + "_names_variable"],
                                   f"{label}: message does not name it: {row[cls + '_message']}")
        ok &= result.check(not row["segments_created"], f"{label}: created {row['segments_created']}")
        good += ok
    result.metrics["rows"] = report
    result.happened = f"{len(report)} bad values over {len(BAD_VALUES)} variables, Writer() and Reader()"
    result.figure = f"{good}/{len(report)} -> ConfigError naming the variable at start"


@case("fork on both sides")
def fork_both_sides(result: Result, prefix: str, full: bool) -> None:
    from fault_child import batch_hex, parse_batch

    seed = 17
    config = shmask.Config(ring_mb=1, name_prefix=prefix)
    reader = shmask.Reader(config)
    # --- a producer that forks
    producer = Child("fork_producer", seed, env=child_env(prefix, SHMASK_RING_MB="1"))
    longchild = None
    try:
        name = producer.expect("segment", 30)
        batches = [parse_batch(producer.expect("refs", 30)), parse_batch(producer.expect("refs", 30))]
        forks = json.loads(producer.expect("forks", 30))
        longchild = int(producer.expect("longchild", 30))
        result.check(forks["ring_exists_after_children"],
                     f"a forked child removed the parent's ring ({forks['exits']})")
        expected_status = {"sigterm": signal.SIGTERM}
        for how, status in forks["exits"].items():
            result.check(status == expected_status.get(how, 0),
                         f"forked child '{how}' ended with status {status}")
        bad = sum(bool(_opened_rows_ok(reader, ref, row, seed, 32))
                  for batch, meta in batches for ref, row in zip(batch, meta, strict=True)
                  if ref.kind == 1)
        result.check(bad == 0, f"{bad} chunks of the forking producer had wrong rows")
        # the producer dies; its long-lived forked child must not keep the ring
        os.kill(producer.pid, signal.SIGKILL)
        producer.wait(10)
        gc = _gc_cli(prefix)
        removed = not os.path.exists(shm_path(name))
        result.check(gc.returncode == 0 and removed,
                     "gc kept the ring of a SIGKILLed producer while its forked child lived")
        result.metrics.update(forks=forks, removed_while_fork_child_lives=removed)
    finally:
        producer.kill()
        if longchild:
            try:
                os.kill(longchild, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # --- a reader that forks after attaching
    writer = shmask.Writer(config)
    work = Workload(writer, seed, 4, max_len=32, selected_share=0.0)
    try:
        for _ in range(3):
            work.step(skip=0.0)
        with Child("fork_reader", seed, prefix=prefix) as child:
            child.send("refs " + batch_hex(*work.take()))
            report = json.loads(child.expect("result", 60))
            rc = child.wait(20)
        result.check(rc == 0, f"forking reader: {describe_rc(rc)}")
        for key in ("parent_held_before", "parent_held_after", "parent_release", "parent_open_after"):
            result.check(report[key] == "ok", f"reader parent {key}: {report[key]}")
        result.check(report["child_status"] == 0, f"reader's child status {report['child_status']}")
        for key in ("held_in_child", "open_in_child", "fresh_reader_in_child"):
            result.check(report["child"].get(key) == "ok",
                         f"reader's forked child {key}: {report['child'].get(key, report['child'])}")
        result.check(os.path.exists(shm_path(writer.segment_name)), "the reader's fork removed the ring")
        lengths, ids, logprobs = encode_rows(seed, 99, MODE_SELECTED, 0, 3, 32)
        with reader.open(writer.publish(lengths, ids, logprobs, "selected")) as chunk:
            result.check(not check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                        (lengths, ids, logprobs)), "the ring broke after the fork")
        result.metrics["reader"] = report
    finally:
        work.close()
        writer.close()
        reader.close()
    result.happened = ("producer forked 5 children (exit, close, SIGTERM, own Writer, _exit): "
                       f"ring {'kept' if forks['ring_exists_after_children'] else 'LOST'}; reader "
                       "forked after attaching: both sides read and released")
    result.figure = f"{len(result.problems)} violations over 5 producer forks + 1 reader fork"


@case("producer in another PID namespace")
def pid_namespace(result: Result, prefix: str, full: bool) -> None:
    env = child_env(prefix, SHMASK_RING_MB="1")
    producer = Child("writer_sleep", env=env, argv_prefix=["unshare", "-p", "-f", "--mount-proc"])
    config = shmask.Config(ring_mb=1, name_prefix=prefix)
    inner = None
    try:
        name, inner_pid = producer.expect("segment", 30).split()
        with open(f"/proc/{producer.pid}/task/{producer.pid}/children") as f:
            inner = int(f.read().split()[0])
        survived = {}
        gc = _gc_cli(prefix)
        survived["python -m shmask gc"] = os.path.exists(shm_path(name))
        shmask.Writer(config).close()
        survived["new Writer()"] = os.path.exists(shm_path(name))
        started = _start_in_child("Reader", prefix)
        survived["new Reader()"] = os.path.exists(shm_path(name))
        for what, kept in survived.items():
            result.check(kept, f"{what} removed the live ring of a producer in another PID "
                         f"namespace (pid {inner_pid} there)")
        result.check(gc.returncode == 0 and started.returncode == 0, "gc or Reader() failed")
        os.kill(inner, signal.SIGKILL)
        producer.wait(10)
        gc = _gc_cli(prefix)
        removed = not os.path.exists(shm_path(name))
        result.check(removed, "gc kept the ring after the namespaced producer died")
        result.metrics.update(survived=survived, removed_after_death=removed, inner_pid=inner_pid)
        result.happened = (f"live (pid {inner_pid} in its namespace): "
                           + ", ".join(f"{k} {'kept' if v else 'REMOVED'}" for k, v in survived.items())
                           + f"; after SIGKILL gc {'removed' if removed else 'KEPT'} it")
        result.figure = (f"{sum(survived.values())}/3 janitors kept the live ring, "
                         f"removed after death: {removed}")
    finally:
        if inner:
            try:
                os.kill(inner, signal.SIGKILL)
            except ProcessLookupError:
                pass
        producer.kill()


@case("ring being created (lifetime lock)")
def ring_being_created(result: Result, prefix: str, full: bool) -> None:
    uid = os.getuid()
    hold = 30
    kept, removed_after = {}, {}
    variants = ["empty file", "zeroed header", "dead producer's header"]
    for variant in variants:
        holder = victim = None
        try:
            if variant == "dead producer's header":
                victim = Child("writer_sleep", env=child_env(prefix, SHMASK_RING_MB="1"))
                name = victim.expect("segment", 30).split()[0]
                victim.proc.kill()
                victim.wait(10)
                holder = Child("hold_lock", shm_path(name), "open", hold, prefix=prefix)
            else:
                template = shm_path(f"/{prefix}-{uid}-{{pid}}-{secrets.token_hex(8)}")
                holder = Child("hold_lock", template, "create" if variant == "empty file" else "sized",
                               hold, prefix=prefix)
            path = holder.expect("locked", 30)
            old = time.time() - 3600  # older than any age heuristic
            os.utime(path, (old, old))
            _gc_cli(prefix)
            shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)).close()
            _start_in_child("Reader", prefix)
            kept[variant] = os.path.exists(path)
            result.check(kept[variant], f"{variant}: a segment whose lock is held was removed")
            holder.proc.kill()
            holder.wait(10)
            _gc_cli(prefix)
            removed_after[variant] = not os.path.exists(path)
        finally:
            for child in (holder, victim):
                if child:
                    child.kill()
    result.check(removed_after.get("dead producer's header", False),
                 "gc kept a dead producer's ring once nobody held its lock")
    result.metrics.update(kept_while_locked=kept, removed_after_unlock=removed_after)
    result.happened = ("lock held (flock + POSIX), mtime 1 h old: "
                       + ", ".join(f"{k} {'kept' if v else 'REMOVED'}" for k, v in kept.items())
                       + "; after the holder died: "
                       + ", ".join(f"{k} {'removed' if v else 'kept'}" for k, v in removed_after.items()))
    result.figure = f"{sum(kept.values())}/{len(variants)} locked segments survived gc, Writer() and Reader()"


def run_all(prefix: str, full: bool, names: list[str] | None = None) -> list[Result]:
    return [CASES[name](prefix, full) for name in (names or list(CASES))]


def markdown_table(results: list[Result]) -> str:
    lines = ["| case | what happened | figure | verdict |", "|---|---|---|---|"]
    for r in results:
        verdict = "pass" if not r.problems else "FAIL: " + "; ".join(p.splitlines()[0][:140]
                                                                     for p in r.problems[:3])
        cells = [r.case, r.happened, f"{r.figure} ({r.seconds:.0f} s)", verdict]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


# Cases of later issues live in their own modules; importing them registers
# them here (they import `case` and `Result` from this module, defined above).
import cases_adapters  # noqa: E402,F401
import cases_api  # noqa: E402,F401
import cases_fork  # noqa: E402,F401
import cases_guard  # noqa: E402,F401
import cases_integrate  # noqa: E402,F401
import cases_lifecycle  # noqa: E402,F401
import cases_remote  # noqa: E402,F401
import cases_server  # noqa: E402,F401
import cases_trust  # noqa: E402,F401

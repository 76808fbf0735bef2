"""Regression tests for the lifecycle items of issue 17: a producer that
drains on SIGTERM (8), metrics that fail (12), a forked child holding the
parent's Writer (13), a Writer dropped without close() or built on a worker
thread (15). Real processes, real /dev/shm, real prometheus_client."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import assert_chunk_equal, random_chunk

import shmask
from shmask.segment import _LIVE, collect_garbage


def _path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def _spawn(code: str, prefix: str, **env: str) -> subprocess.Popen:
    script = "import os, sys, time, signal, numpy as np, shmask\n" + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SHMASK_NAME_PREFIX=prefix, **env),
                            start_new_session=True)


def _line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"child gave no line (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
    return line.strip()


def _end(proc: subprocess.Popen, prefix: str) -> None:
    """Kill what is left of the child's group, and its rings (a failed test's)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()
    collect_garbage(prefix)


# A producer whose host drains on SIGTERM: its handler only sets a flag; the
# main loop then publishes a last batch and waits to be told to exit.
_DRAINING_PRODUCER = """
    draining = []
    def on_sigterm(signum, frame):
        draining.append(signum)
    if {before}:
        signal.signal(signal.SIGTERM, on_sigterm)
    writer = shmask.Writer(shmask.Config.from_env(ring_mb=1))
    if not {before}:
        signal.signal(signal.SIGTERM, on_sigterm)
    queue = writer.open_queue("support")
    def publish(first):
        ids = np.arange(first, first + 6, dtype=np.int32)
        queue.append(ids[:3], -ids[:3].astype(np.float32))
        queue.append(ids[3:], -ids[3:].astype(np.float32))
        return queue.take().to_bytes().hex()
    print(writer.segment_name, publish(100), flush=True)
    deadline = time.monotonic() + 30
    while not draining and time.monotonic() < deadline:
        time.sleep(0.01)
    print(publish(200), flush=True)       # published while draining
    sys.stdin.readline()                  # "exit"
"""


@pytest.mark.parametrize("installed", ["before", "after"])
def test_sigterm_drain_keeps_the_ring_until_exit(prefix, config, installed):
    """A host handler that drains: the ring stays while the process goes on
    (rows published before and after SIGTERM are read by a Reader that
    attaches after the signal, and by one that attached before and met
    another producer since), and goes when the process exits."""
    proc = _spawn(_DRAINING_PRODUCER.format(before=installed == "before"), prefix)
    attached = shmask.Reader(config)
    try:
        name, before_hex = _line(proc).split()
        before = shmask.ChunkRef.from_bytes(bytes.fromhex(before_hex))
        attached.open(before).release()  # attached to the producer's ring now
        assert os.path.exists(_path(name))
        proc.send_signal(signal.SIGTERM)
        during = shmask.ChunkRef.from_bytes(bytes.fromhex(_line(proc)))
        assert proc.poll() is None, "the draining producer died of SIGTERM"
        assert os.path.exists(_path(name)), "SIGTERM unlinked the ring of a draining producer"
        with shmask.Writer(config) as other:  # the attached reader meets another producer
            attached.open(other.publish(np.array([1], np.int32), np.array([9], np.int32),
                                        np.zeros(1, np.float32))).release()
        with shmask.Reader(config) as late:  # attaches after the signal
            assert late.open(during).to_lists()[0] == [[200, 201, 202], [203, 204, 205]]
        with attached.open(during) as chunk:
            assert chunk.to_lists() == ([[200, 201, 202], [203, 204, 205]],
                                        [[-200.0, -201.0, -202.0], [-203.0, -204.0, -205.0]])
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
        assert not os.path.exists(_path(name)), "the ring outlived its producer's exit"
    finally:
        attached.close()
        _end(proc, prefix)


def test_sigterm_cleans_up_a_writer_built_on_a_worker_thread(prefix):
    """The only Writer was built on a worker thread: SIGTERM's default
    action still unlinks its ring, and the process still dies of it."""
    proc = _spawn("""
        import threading
        made = []
        worker = threading.Thread(target=lambda: made.append(
            shmask.Writer(shmask.Config.from_env(ring_mb=1))))
        worker.start(); worker.join()
        print(made[0].segment_name, flush=True)
        time.sleep(60)
    """, prefix)
    try:
        name = _line(proc)
        assert os.path.exists(_path(name))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert not os.path.exists(_path(name)), "SIGTERM left a worker thread's ring behind"
    finally:
        _end(proc, prefix)


MANY_RINGS = 300  # past the native table's first chunk of 256 slots (issue 33, item 6)


def test_sigterm_unlinks_every_ring_of_a_process_with_more_than_256(prefix):
    """300 live Writers (the table that SIGTERM's handler reads had 256
    fixed slots: 44 rings were left), some past the 256th closed before the
    signal (their slots must be freed, not a live ring's): none is left."""
    needed = MANY_RINGS * (4096 + (1 << 20)) + (64 << 20)  # ring_mb=1, and some room to spare
    shm = os.statvfs("/dev/shm")
    if shm.f_bavail * shm.f_frsize < needed:
        pytest.skip(f"/dev/shm has {shm.f_bavail * shm.f_frsize >> 20} MiB free; "
                    f"the test needs {needed >> 20} MiB")
    proc = _spawn(f"""
        config = shmask.Config.from_env(ring_mb=1)
        writers = [shmask.Writer(config) for _ in range({MANY_RINGS})]
        for writer in writers[260:280]:
            writer.close()
        print("made", flush=True)
        time.sleep(60)
    """, prefix)
    try:
        _line(proc)  # every ring made
        made = [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]
        assert len(made) == MANY_RINGS - 20
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        left = [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]
        assert not left, f"SIGTERM left {len(left)} of {len(made)} rings behind"
    finally:
        _end(proc, prefix)


def test_sigterm_ignored_or_handled_leaves_the_handler_alone(prefix):
    """A process that ignores SIGTERM keeps ignoring it (and its ring); the
    native hook never replaces an action the host chose."""
    proc = _spawn("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        writer = shmask.Writer(shmask.Config.from_env(ring_mb=1))
        print(writer.segment_name, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive", flush=True)
        sys.stdin.readline()
    """, prefix)
    try:
        name, ignored = _line(proc).split()
        assert ignored == "True"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert _line(proc) == "alive"
        assert os.path.exists(_path(name))
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(_path(name))
    finally:
        _end(proc, prefix)


def test_dropped_writer_gives_its_ring_back(config, reader):
    """Writers dropped without close() (one with open queues: a reference
    cycle) give their rings back once collected; a chunk a reader holds
    stays readable."""
    rng = np.random.default_rng(15)
    want = random_chunk(rng, 3, 20)
    names, held = [], None
    for i in range(4):
        writer = shmask.Writer(config)
        names.append(writer.segment_name)
        if i == 0:
            held = reader.open(writer.publish(*want))
        if i == 1:
            queues = [writer.open_queue("support") for _ in range(2)]
            writer.append_step(queues, np.array([1, 1], np.int32), np.array([3, 4], np.int32),
                               np.zeros(2, np.float32))
            del queues
        del writer
    gc.collect()
    left = [n for n in names if os.path.exists(_path(n))]
    assert not left, f"{len(left)} of 4 dropped Writers kept their rings"
    assert not [s for s in _LIVE._snapshot if s.name in names and not s.closed]
    assert_chunk_equal(held, *want)
    assert held.to_lists()[0] == [row.tolist() for row in np.split(want[1], np.cumsum(want[0])[:-1])]
    held.release()


_FORKING_PRODUCER = """
    import json
    writer = shmask.Writer(shmask.Config.from_env(ring_mb=1))
    queue = writer.open_queue("support")
    queue.append(np.array([1, 2], np.int32), np.array([-1.0, -2.0], np.float32))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        report = {}
        calls = {
            "append_step": lambda: writer.append_step([queue], np.array([1], np.int32),
                                                      np.array([7], np.int32),
                                                      np.zeros(1, np.float32)),
            "take_batch": lambda: writer.take_batch([queue]),
            "publish": lambda: writer.publish(np.array([1], np.int32), np.array([7], np.int32),
                                              np.zeros(1, np.float32)),
            "open_queue": lambda: writer.open_queue("support"),
            "reclaim": lambda: writer.reclaim(),
            "queue.append": lambda: queue.append(np.array([7], np.int32), np.zeros(1, np.float32)),
            "queue.take": lambda: queue.take(),
            "queue.rows": lambda: queue.rows,
            "queue.abort": lambda: queue.abort(),
        }
        for what, call in calls.items():
            try:
                call()
                report[what] = "worked"
            except shmask.ShmaskError as exc:
                report[what] = str(exc)
        writer.close()  # dropping the child's copy is fine
        with shmask.Writer(shmask.Config.from_env(ring_mb=1)) as own:
            report["own_writer"] = own.publish(np.array([1], np.int32), np.array([5], np.int32),
                                               np.zeros(1, np.float32)).to_bytes().hex()
            with shmask.Reader() as reader:
                report["own_rows"] = reader.open(
                    shmask.ChunkRef.from_bytes(bytes.fromhex(report["own_writer"]))).to_lists()[0]
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    report = json.loads(os.read(read, 1 << 20))
    queue.append(np.array([3], np.int32), np.array([-3.0], np.float32))
    report["status"] = status
    report["parent_pid"] = os.getpid()
    report["child_pid"] = pid
    report["parent_ref"] = queue.take().to_bytes().hex()
    print(json.dumps(report), flush=True)
    sys.stdin.readline()
"""


def test_forked_child_refuses_the_parents_writer(prefix, config):
    proc = _spawn(_FORKING_PRODUCER, prefix)
    try:
        report = json.loads(_line(proc))
        assert report["status"] == 0
        parent, child = report["parent_pid"], report["child_pid"]
        for what in ("append_step", "take_batch", "publish", "open_queue", "reclaim",
                     "queue.append", "queue.take", "queue.rows", "queue.abort"):
            message = report[what]
            assert message != "worked", f"{what} worked in a forked child"
            assert f"belongs to process {parent}" in message and str(child) in message, message
            assert "forked child" in message and "new Writer" in message, message
        assert report["own_rows"] == [[5]]
        with shmask.Reader(config) as reader:  # the parent's rows are its own, untouched
            ref = shmask.ChunkRef.from_bytes(bytes.fromhex(report["parent_ref"]))
            with reader.open(ref) as chunk:
                assert chunk.to_lists() == ([[1, 2], [3]], [[-1.0, -2.0], [-3.0]])
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    finally:
        _end(proc, prefix)


# ------------------------------------------------------------------ metrics

prometheus_client = pytest.importorskip("prometheus_client")


def test_metrics_never_fail_a_data_call(prefix, tmp_path):
    """prometheus_client in multiprocess mode, its directory removed, then a
    worker forked (its first increment opens a new file and fails): every
    data call still returns its refs and rows; the failure is logged once."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    proc = _spawn(f"""
        import json, logging, shutil
        import shmask.metrics
        logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
        shmask.metrics.enable()
        shutil.rmtree({str(directory)!r})
        pid = os.fork()
        if pid == 0:
            report = {{}}
            try:
                config = shmask.Config.from_env(ring_mb=1)
                with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
                    queues = [writer.open_queue("selected") for _ in range(2)]
                    for step in range(3):
                        writer.append_step(queues, np.array([1, 1], np.int32),
                                           np.array([step, 10 + step], np.int32),
                                           np.array([-1.0, -2.0], np.float32))
                        batch = writer.take_batch(queues)
                        report.setdefault("taken", []).append(len(batch))
                    report["rows"] = reader.open(batch[1]).to_lists()[0]
                    ref = writer.publish(np.array([1], np.int32), np.array([4], np.int32),
                                         np.zeros(1, np.float32))
                    for _ in range(300):  # past the every-256th-open sync
                        reader.open(ref).to_lists()
                    reader.open(ref).release()
                    report["discarded"] = reader.discard_batch(batch)
            except Exception as exc:  # noqa: BLE001
                report["error"] = f"{{type(exc).__name__}}: {{exc}}"
            print(json.dumps(report), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    """, prefix, PROMETHEUS_MULTIPROC_DIR=str(directory))
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        _end(proc, prefix)
    assert proc.returncode == 0, err[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert "error" not in report, report["error"]
    assert report["taken"] == [2, 2, 2]
    assert report["rows"] == [[12]]
    assert report["discarded"] == 2  # batch 1 opened, not released; batch 0 unopened
    assert err.count("shmask metrics:") == 1, err[-2000:]


def test_metrics_enable_after_disable_works(config):
    from shmask import metrics

    registry = prometheus_client.CollectorRegistry()
    try:
        metrics.enable(registry)
        metrics.disable()
        metrics.enable(registry)
        with shmask.Writer(config) as writer:
            writer.publish(np.array([1], np.int32), np.array([7], np.int32),
                           np.zeros(1, np.float32))
            writer.reclaim()
    finally:
        metrics.disable()
    assert registry.get_sample_value("shmask_producer_chunks_total") == 1

"""A producer's ring exported by a sidecar process (shmask.remote_sidecar,
SHMASK_REMOTE_EXPORT=process, the default) across two "hosts"
(tests/netns.py): the producer in namespace A makes its `Leaving`, the
sidecar maps the ring and serves the READs of a puller in namespace B, and
applies its releases to the ring the producer sees. The producer process
itself never loads NIXL: stopped (SIGSTOP) while the puller reads, the rows
still come; killed, the sidecar exits within a second and the pull fails its
entries within the puller's timeout. A producer that forked after starting
its sidecar, then died, leaves the pipe open in its child: the sidecar
exits on its parent's change instead (no namespaces: the loopback).

Needs root (namespaces) and nixl-cu12; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import netns  # tests/netns.py
import pytest
from remote_child import host_env, last_json, run_pair, wait_for

from shmask.segment import collect_garbage

needs_nixl_hosts = pytest.mark.skipif(netns.nixl_unavailable() is not None,
                                      reason=netns.nixl_unavailable() or "")

EXPORT_PORT = 5621   # the sidecar's agent, in namespace A
PULL_PORT = 5622     # in namespace B

# Two support chunks and a selected one, published one-shot.
EXPECTED = [
    [[[3, 7, 9], [2]], [[-0.5, -1.0, -2.0], [-0.25]]],
    [[[10, 20], [30]], [[-1.0, -2.0], [-3.0]]],
    [[[5], [4, 8]], [-0.75, -1.5]],
]

PRODUCER = r"""
import json, os, sys, time
import numpy as np
import shmask
from remote_child import write_remote
from shmask._native import ffi, lib
from shmask.refs import RefBatch
from shmask.remote import RemoteBatch
from shmask.remote_refs import Leaving

out, prefix, ip, port, mode = sys.argv[1:6]
w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=120))
f32, i32 = np.float32, np.int32
refs = [w.publish(np.array([3, 1], i32), np.array([3, 7, 9, 2], i32),
                  np.array([-0.5, -1, -2, -0.25], f32), "support"),
        w.publish(np.array([2, 1], i32), np.array([10, 20, 30], i32),
                  np.array([-1, -2, -3], f32), "support"),
        w.publish(np.array([1, 2], i32), np.array([5, 4, 8], i32),
                  np.array([-0.75, -1.5], f32), "selected")]
# SHMASK_REMOTE_EXPORT from the environment the test gives us
leaving = Leaving(w, shmask.Config.from_env(remote_ip=ip, remote_port=int(port)))
batch = RefBatch.from_refs(refs)
remote = RemoteBatch.from_bytes(leaving.prefix + batch.to_bytes())
sidecar = getattr(leaving.export, "pid", None)
write_remote(out, remote, pid=os.getpid(), sidecar=sidecar,
             nixl_here=any(m.startswith("nixl") for m in sys.modules))
if mode == "hold":
    time.sleep(120)   # the test kills us
info = ffi.new("shm_info *")
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    assert lib.shm_read_info(w.segment.base, w.segment.size, info) == lib.SHM_OK
    if info.released == len(refs):
        break
    time.sleep(0.01)
stats = vars(leaving.export.stats).copy()
leaving.close()
exited = None if sidecar is None else leaving.export.proc.returncode
w.close()
print(json.dumps({"released": int(info.released), "published": int(info.published),
                  "export": stats, "sidecar_exit": exited}), flush=True)
"""

READER = r"""
import json, sys, time
import shmask
from remote_child import entries, load_remote, rows, wait_for

path, prefix, port, timeout_s, go = sys.argv[1:6]
from shmask.remote import RemotePuller
wait_for(path, seconds=60, message="the producer never wrote its batch")
puller = RemotePuller(port=int(port), timeout_s=float(timeout_s))   # before: NIXL's start
wait_for(path, go, seconds=60, message=f"the test never said {go}")
remote, data = load_remote(path)
reader = shmask.Reader(shmask.Config(name_prefix=prefix + "r"))
t = time.monotonic()
pulled = puller.pull(data)
seconds = time.monotonic() - t
print(json.dumps({"kinds": [k for k, _ in entries(pulled)], "rows": rows(reader, pulled),
                  "seconds": seconds, "stats": vars(puller.stats)}), flush=True)
"""


def _producer(hosts: netns.Hosts, path: Path, prefix: str, mode: str, export: str):
    return netns.run_in(hosts.a, [sys.executable, "-c", PRODUCER, str(path), prefix, hosts.a_ip,
                                  str(EXPORT_PORT), mode],
                        env=host_env(hosts.a_dev, SHMASK_REMOTE_EXPORT=export), timeout=100)


def _reader(hosts: netns.Hosts, path: Path, prefix: str, timeout_s: float, go: str):
    return netns.run_in(hosts.b, [sys.executable, "-c", READER, str(path), prefix,
                                  str(PULL_PORT), str(timeout_s), go],
                        env=host_env(hosts.b_dev), timeout=100)


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T: stopped, Z: zombie), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _kill_sidecar(pid: int | None) -> None:
    """Its own session (Sidecar): its group is its pid."""
    if pid is not None and _state(pid) not in (None, "Z"):
        os.killpg(pid, signal.SIGKILL)


def _sidecar_pid(path: Path) -> int | None:
    import json

    with open(path) as f:
        return json.load(f)["sidecar"]


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_the_sidecar_serves_the_reads_while_the_producer_is_stopped(prefix, tmp_path):
    """The producer SIGSTOPped once it sent the references: the puller in B
    still gets the exact rows (the sidecar, another process, served the
    READs), and its releases reach the producer's ring (counted in the
    ring's own header once the producer runs again)."""
    path = tmp_path / "remote.json"
    producer = reader = sidecar = None
    with netns.two_hosts(prefix) as hosts:
        try:
            producer = _producer(hosts, path, prefix, "wait", "process")
            reader = _reader(hosts, path, prefix, 10, ".stopped")
            wait_for(str(path), "", producer, seconds=60,
                     message="the producer never wrote its batch")
            sidecar = _sidecar_pid(path)
            os.killpg(producer.pid, signal.SIGSTOP)
            Path(str(path) + ".stopped").touch()
            out_r, err_r = reader.communicate(timeout=60)
            stopped = _state(producer.pid)
            os.killpg(producer.pid, signal.SIGCONT)
            out_p, err_p = producer.communicate(timeout=60)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
            _kill_sidecar(sidecar)
    assert reader.returncode == 0, err_r[-3000:]
    assert producer.returncode == 0, (out_p, err_p[-3000:])
    got, sent = last_json(out_r), last_json(out_p)
    with open(path) as f:
        made = __import__("json").load(f)
    assert stopped == "T", stopped   # the producer was stopped throughout the pull
    assert got["kinds"] == [2, 2, 2], got
    assert got["rows"] == EXPECTED, got
    assert made["sidecar"] not in (None, made["pid"]) and not made["nixl_here"], made
    assert got["stats"]["read_errors"] == 0, got
    # The sidecar released each record once, into the producer's ring.
    assert sent["released"] == sent["published"] == 3, sent
    assert sent["export"]["releases"] == 3 and sent["export"]["release_errors"] == 0, sent
    assert sent["sidecar_exit"] == 0, sent   # Leaving.close() stopped it
    print(f"\npull from the sidecar, producer stopped: {got['seconds'] * 1e3:.1f} ms")


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_a_killed_producer_takes_its_sidecar_and_the_pull_fails_in_time(prefix, tmp_path):
    """SIGKILL to the producer: the sidecar sees its stdin end (or its
    parent change) and exits within a few seconds; a pull afterwards fails
    every entry LOST (stale) within the puller's timeout, nothing hangs."""
    path = tmp_path / "remote.json"
    producer = reader = sidecar = None
    timeout_s = 3.0
    with netns.two_hosts(prefix) as hosts:
        try:
            producer = _producer(hosts, path, prefix, "hold", "process")
            reader = _reader(hosts, path, prefix, timeout_s, ".killed")
            wait_for(str(path), "", producer, seconds=60,
                     message="the producer never wrote its batch")
            sidecar = _sidecar_pid(path)
            assert sidecar is not None and _state(sidecar) not in (None, "Z")
            netns.kill_group(producer)
            t = time.monotonic()
            while _state(sidecar) not in (None, "Z") and time.monotonic() - t < 10:
                time.sleep(0.02)
            gone_s = time.monotonic() - t
            Path(str(path) + ".killed").touch()
            out_r, err_r = reader.communicate(timeout=60)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
            _kill_sidecar(sidecar)
            collect_garbage(prefix)   # the killed producer's ring
    assert producer.returncode == -9
    # Bounds, not speeds: a busy 2-core machine may keep either process
    # from a CPU for a second; a sidecar that waited on its producer, or a
    # pull that waited on NIXL, would take the test's whole timeout.
    assert gone_s < 5, f"the sidecar outlived its producer by {gone_s:.1f} s"
    assert reader.returncode == 0, err_r[-3000:]
    got = last_json(out_r)
    assert got["kinds"] == [3, 3, 3], got
    assert got["rows"] == [{"lost": 1}] * 3, got   # LOST_STALE: StaleChunkError when opened
    assert got["seconds"] < timeout_s + 3, got
    print(f"\nsidecar gone {gone_s * 1e3:.0f} ms after its producer; pull failed in "
          f"{got['seconds'] * 1e3:.0f} ms")


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_the_in_process_export_still_serves_with_remote_export_thread(prefix, tmp_path):
    """SHMASK_REMOTE_EXPORT=thread: no sidecar, the producer's own agent
    serves the READs and releases the records."""
    path = tmp_path / "remote.json"
    with netns.two_hosts(prefix) as hosts:
        got, sent = run_pair(lambda: _producer(hosts, path, prefix, "wait", "thread"),
                             lambda: _reader(hosts, path, prefix, 10, ""), 60, 60)
    with open(path) as f:
        made = __import__("json").load(f)
    assert made["sidecar"] is None and made["nixl_here"], made
    assert got["rows"] == EXPECTED, got
    assert sent["released"] == 3 and sent["export"]["releases"] == 3, sent


FORKING_PRODUCER = r"""
import json, os, sys, time
import shmask
from shmask.remote_sidecar import Sidecar

prefix, port = sys.argv[1], int(sys.argv[2])
w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix))
sidecar = Sidecar(w, ip="127.0.0.1", port=port)
child = os.fork()
if child == 0:   # holds the sidecar's stdin: no EOF when the producer dies
    time.sleep(60)
    os._exit(0)
print(json.dumps({"sidecar": sidecar.pid, "child": child}), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                    reason="nixl-cu12 is not installed (pip install -r tests/compat/requirements-nixl.txt)")
@pytest.mark.timeout(90)
def test_a_sidecar_whose_stdin_a_forked_child_holds_exits_with_its_producer(prefix):
    """A producer that forked after starting its sidecar dies (SIGKILL): its
    child still holds the sidecar's stdin, so no EOF comes; the sidecar
    sees its parent change and exits all the same, while the child lives."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p)}
    from shmask.remote_refs import free_port

    producer = subprocess.Popen([sys.executable, "-c", FORKING_PRODUCER, prefix, str(free_port())],
                                stdout=subprocess.PIPE, env=env, text=True,
                                start_new_session=True)
    sidecar = None
    try:
        made = json.loads(producer.stdout.readline())   # after the sidecar's descriptor
        sidecar, child = made["sidecar"], made["child"]
        assert _state(sidecar) not in (None, "Z")
        os.kill(producer.pid, signal.SIGKILL)
        producer.wait(timeout=10)
        t = time.monotonic()
        while _state(sidecar) not in (None, "Z") and time.monotonic() - t < 10:
            time.sleep(0.02)
        gone_s = time.monotonic() - t
        assert _state(child) not in (None, "Z"), "the forked child was to hold the pipe"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(producer.pid, signal.SIGKILL)   # the forked child (the group)
        producer.wait()
        _kill_sidecar(sidecar)
        collect_garbage(prefix)   # the killed producer's ring
    # A bound (the parent is polled every 0.5 s), not a speed: without the
    # poll it would live until the child's sleep ends (60 s).
    assert gone_s < 5, f"the sidecar outlived its producer by {gone_s:.1f} s"

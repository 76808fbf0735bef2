"""More than one host: two private /dev/shm mounts (`unshare -m`, each its own
tmpfs) stand in for two hosts, joined by zmq over tcp on 127.0.0.1. A ref
says which host holds its ring; a reader elsewhere is told so and what to
do; the forwarding hop turns the batch inline for it."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmask
from shmask.refs import KIND_INLINE

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and util-linux unshare (CI runs as root)")

ROWS = """
import numpy as np
def rows(step):
    rng = np.random.default_rng(1000 + step)
    lengths = np.array([3, 1], np.int32)                 # a support row, a selected row
    ids = rng.integers(0, 151936, 4).astype(np.int32)
    logprobs = rng.standard_normal(4).astype(np.float32)
    selected = rng.standard_normal(2).astype(np.float32)
    return lengths, ids, logprobs, selected
"""

HOST_A = ROWS + """
import sys, zmq, shmask
context = zmq.Context()
sock = context.socket(zmq.PAIR)
print(sock.bind_to_random_port("tcp://127.0.0.1"), shmask.host_id(), flush=True)
peer_host = int(sock.recv())
config = shmask.Config(ring_mb=4, name_prefix=sys.argv[1])
writer, reader = shmask.Writer(config), shmask.Reader(config)
queues = [writer.open_queue("support"), writer.open_queue("selected")]
for step in range(5):
    lengths, ids, logprobs, selected = rows(step)
    writer.append_step(queues, lengths, ids, logprobs, selected_logprobs=selected)
batch = writer.take_batch(queues)
sock.send(batch.to_bytes())                                  # as is
sock.send(batch.for_host(peer_host, reader).to_bytes())      # what the hop should send
assert sock.recv() == b"done"
writer.close()
"""

HOST_B = ROWS + """
import sys, zmq, numpy as np, shmask
context = zmq.Context()
sock = context.socket(zmq.PAIR)
sock.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
sock.send(str(shmask.host_id()).encode())
raw, forwarded = shmask.RefBatch.from_bytes(sock.recv()), shmask.RefBatch.from_bytes(sock.recv())
reader = shmask.Reader(shmask.Config(name_prefix=sys.argv[2]))
try:
    reader.open(raw[0])
    print("raw: opened")
except shmask.RemoteChunkError as exc:
    print("raw: RemoteChunkError", "for_host" in str(exc), flush=True)
want = [rows(step) for step in range(5)]
support = reader.open(forwarded[0])
selected = reader.open(forwarded[1])
ok = (support.lengths.tolist() == [3] * 5
      and np.array_equal(support.ids, np.concatenate([w[1][:3] for w in want]))
      and np.array_equal(support.logprobs, np.concatenate([w[2][:3] for w in want]))
      and np.array_equal(selected.ids, np.array([w[1][3] for w in want]))
      and np.array_equal(selected.logprobs, np.array([w[3][1] for w in want])))
print("forwarded:", "rows ok" if ok else "MISMATCH", shmask.host_id(), flush=True)
sock.send(b"done")
"""


def _in_private_shm(code: str, *args: str) -> subprocess.Popen:
    """A process with its own /dev/shm: a host of its own, for shared memory."""
    shell = ('mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$0" -c "$1" '
             + " ".join(f'"${i + 2}"' for i in range(len(args))))
    return subprocess.Popen(["unshare", "-m", "sh", "-c", shell, sys.executable,
                             textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@needs_namespaces
def test_remote_reader_is_told_and_the_hop_sends_inline(prefix):
    host_a = _in_private_shm(HOST_A, prefix)
    host_b = None
    try:
        port, a_id = host_a.stdout.readline().split()
        host_b = _in_private_shm(HOST_B, port, prefix)
        out_b, err_b = host_b.communicate(timeout=60)
        assert host_a.wait(timeout=30) == 0, host_a.stderr.read()[-2000:]
    finally:
        for proc in (host_a, host_b):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert host_b.returncode == 0, err_b[-2000:]
    assert "raw: RemoteChunkError True" in out_b
    forwarded = [line for line in out_b.splitlines() if line.startswith("forwarded:")][0]
    assert "rows ok" in forwarded
    b_id = forwarded.split()[-1]
    assert a_id != b_id and a_id != str(shmask.host_id())


def test_same_host_batches_pass_through_and_to_inline_copies(config, writer, reader):
    queues = [writer.open_queue("support") for _ in range(3)]
    writer.append_step(queues, np.array([2, 0, 1], np.int32), np.array([5, 6, 7], np.int32),
                       np.array([-1, -2, -3], np.float32))
    batch = writer.take_batch(queues)
    assert batch.hosts == {shmask.host_id()}
    assert batch.for_host(shmask.host_id(), reader) is batch
    inline = batch.to_inline(reader)
    assert (inline.entries["kind"][[0, 2]] == KIND_INLINE).all()
    with reader.open(inline[0]) as chunk:
        assert chunk.to_lists() == ([[5, 6]], [[-1.0, -2.0]])
    with reader.open(inline[2]) as chunk:
        assert chunk.to_lists() == ([[7]], [[-3.0]])
    writer.reclaim()
    assert writer.ring_usage()[0] < writer.config.ring_capacity_bytes
    with pytest.raises(shmask.ShmaskError):  # to_inline gave the ring records back
        reader.open(batch[0])
    forged = shmask.ChunkRef(batch[0].kind, batch[0].mode, batch[0].segment, batch[0].epoch,
                             batch[0].position, batch[0].record_bytes, 1, 2, None,
                             host=shmask.host_id() ^ 1)
    with pytest.raises(shmask.RemoteChunkError, match="another host"):
        reader.open(forged)


OPEN_IN_CHILD = """
import sys, shmask
batch = shmask.RefBatch.from_bytes(bytes.fromhex(sys.argv[1]))
print("host", shmask.host_id(), flush=True)
try:
    with shmask.Reader(shmask.Config(name_prefix=sys.argv[2])).open(batch[0]) as chunk:
        print("open:", chunk.to_lists(), flush=True)
except shmask.ShmaskError as exc:
    print("open:", type(exc).__name__, flush=True)
"""


@needs_namespaces
@pytest.mark.parametrize("shm", ["bind mount of a directory of it", "the same mount"])
def test_a_dev_shm_bind_mounted_from_a_directory_is_another_host(writer, reader, prefix, shm):
    """A container whose /dev/shm is a bind mount of a directory of the
    host's tmpfs (same device) sees other files: another host id, so its
    reader is told RemoteChunkError and for_host sends it the rows inline.
    A process in another mount namespace sharing the mount keeps our id."""
    queue = writer.open_queue("support")
    queue.append(np.array([7, 9], np.int32), np.array([-1.0, -2.0], np.float32))
    batch = writer.take_batch([queue])
    directory = f"/dev/shm/shmask-bind-{secrets.token_hex(4)}"
    os.mkdir(directory, 0o700)
    try:
        setup = f"mount --bind {directory} /dev/shm" if shm.startswith("bind") else "true"
        child = subprocess.run(
            ["unshare", "-m", "sh", "-c", f'{setup} && exec "$0" -c "$1" "$2" "$3"',
             sys.executable, OPEN_IN_CHILD, batch.to_bytes().hex(), prefix],
            capture_output=True, text=True, timeout=60)
    finally:
        os.rmdir(directory)
    assert child.returncode == 0, child.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in child.stdout.splitlines())
    child_host = int(lines["host"])
    if shm.startswith("bind"):
        assert child_host != shmask.host_id()
        assert lines["open:"] == "RemoteChunkError"
        forwarded = batch.for_host(child_host, reader)
        assert (forwarded.entries["kind"] == KIND_INLINE).all()
        with reader.open(forwarded[0]) as chunk:
            assert chunk.to_lists() == ([[7, 9]], [[-1.0, -2.0]])
    else:
        assert child_host == shmask.host_id()
        assert lines["open:"] == "([[7, 9]], [[-1.0, -2.0]])"

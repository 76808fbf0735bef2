"""shmask.remote_refs on one host: references wrapped for another host and
what a consumer does with ones it cannot use. The two-host paths (rows
pulled through NIXL, faults) are in tests/test_sglang_nodes_nixl.py and
tests/faults/cases_remote.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmask
from shmask import remote_refs
from shmask.errors import InvalidRefError
from shmask.remote import remote_prefix

nixl_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("nixl_cu12") is None,
    reason="nixl-cu12 is not installed (pip install -r tests/compat/requirements-nixl.txt)")

DESCRIPTOR = {"agent": "producer", "ip": "10.0.0.1", "port": 5611, "segments": [
    {"name": "/shmaskx-0-1-0123456789abcdef", "epoch": 5, "address": 1 << 30,
     "size": 4096 + (1 << 20)}]}


def _inline_ref() -> bytes:
    writer = shmask.Writer(shmask.Config(transport="inline"))
    try:
        return writer.publish(np.array([2], np.int32), np.array([4, 9], np.int32),
                              np.array([-1.0], np.float32), "selected").to_bytes()
    finally:
        writer.close()


def test_remote_references_are_told_apart_and_their_parts_parsed():
    plain = _inline_ref()
    wrapped = remote_prefix(DESCRIPTOR) + plain
    assert remote_refs.is_remote(wrapped) and not remote_refs.is_remote(plain)
    desc, inner = remote_refs.plain(wrapped)
    assert json.loads(desc) == DESCRIPTOR and inner == plain
    with pytest.raises(InvalidRefError):
        remote_refs.plain(plain)


@pytest.mark.parametrize("forged", [
    b"SMRR",                                             # truncated header
    remote_prefix(DESCRIPTOR)[:12] + b"{" * 40,          # descriptor not JSON
    remote_prefix(DESCRIPTOR) + b"SHMR" + b"\0" * 12,    # plain part not a batch
])
def test_a_malformed_remote_reference_is_left_to_fail_alone_with_its_reason(forged):
    """pull() passes it over (None: the other references of the message go
    on); opened alone it raises InvalidRefError, before any NIXL agent is
    made."""
    good = _inline_ref()
    assert remote_refs.pull([good, forged]) == [None, None]
    with pytest.raises(InvalidRefError):
        remote_refs.pull_one(forged)
    assert remote_refs._puller["puller"] is None


def test_route_ip_names_this_hosts_address_towards_the_head_node():
    assert remote_refs.route_ip("127.0.0.1:5000") == "127.0.0.1"
    assert remote_refs.route_ip("127.0.0.1") == "127.0.0.1"
    port = remote_refs.free_port()
    assert 0 < port < 1 << 16


CHILD = textwrap.dedent("""
    import json, os, sys, types
    import numpy as np
    from shmask import remote_refs
    from shmask.adapters import sglang as adapter
    from shmask.errors import RemoteChunkError
    from shmask.remote import remote_prefix

    out = {}
    if sys.argv[1] == "no-agent":
        desc = {"agent": "producer", "ip": "10.0.0.1", "port": 5611, "segments": [
            {"name": "/shmaskx-0-1-0123456789abcdef", "epoch": 5, "address": 1 << 30,
             "size": 4096 + (1 << 20)}]}
        writer = adapter.Writer(adapter.Config(transport="inline"))
        ref = remote_prefix(desc) + writer.publish(
            np.array([1], np.int32), np.array([3], np.int32), np.array([-1.0], np.float32),
            "selected").to_bytes()
        messages = []
        for _ in range(2):
            try:
                remote_refs.pull([ref])
            except RemoteChunkError as exc:
                messages.append(str(exc))
        out.update(messages=messages, failed_at=remote_refs._puller["failed"][0])
        remote_refs.pull.__globals__["time"].sleep(remote_refs.RETRY_S)
        try:
            remote_refs.pull([ref])
        except RemoteChunkError:
            pass
        out["retried_at"] = remote_refs._puller["failed"][0]
    elif sys.argv[1] == "mirror":
        import shmask
        from shmask.refs import RefBatch
        from shmask.remote import RemoteBatch, RemoteExport, RemotePuller
        ring = 4 << 20
        writer = shmask.Writer(shmask.Config(ring_mb=ring >> 20, lease_s=60))
        export = RemoteExport(writer, port=remote_refs.free_port())
        desc = export.descriptor("127.0.0.1")
        puller = RemotePuller(port=remote_refs.free_port(), timeout_s=20)
        reader = shmask.Reader(shmask.Config(name_prefix="x" + os.environ["SHMASK_NAME_PREFIX"]))
        rng = np.random.default_rng(1)
        exact = released = 0
        for emission in range(12):   # about 1 MiB each: the ring wraps three times
            expected, refs = [], []
            for _ in range(8):
                lengths = rng.integers(4000, 8000, 4).astype(np.int32)
                ids = rng.integers(0, 151_936, int(lengths.sum())).astype(np.int32)
                logprobs = -rng.random(ids.size).astype(np.float32)
                refs.append(writer.publish(lengths, ids, logprobs, "support"))
                expected.append((ids.tolist(), logprobs.tolist()))
            pulled = puller.pull(RemoteBatch(RefBatch.from_refs(refs), desc))
            for ref, (ids, logprobs) in zip(pulled, expected):
                with reader.open(ref) as chunk:
                    exact += (chunk.csr()[0].tolist() == ids
                              and chunk.logprobs.tolist() == logprobs)
            released += len(refs)
            while export.stats.releases < released:
                __import__("time").sleep(0.002)
        (mirror,) = puller._mirrors.values()
        start = mirror.array.ctypes.data
        rss = None
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
                    inside = int(line.split("-", 1)[0], 16) == start
                elif inside and line.startswith("Rss:"):
                    rss = int(line.split()[1]) << 10
                    break
        out.update(rss=rss, ring=ring, exact=exact, dropped=puller.stats.dropped_bytes,
                   errors=puller.stats.read_errors)
        export.close()
    elif sys.argv[1] == "mirrors":
        import shmask
        from shmask import remote as rm
        from shmask.refs import RefBatch
        from shmask.remote import RemoteBatch, RemoteExport, RemotePuller
        rm.MAX_MIRRORS = 2
        writers = [shmask.Writer(shmask.Config(ring_mb=1, lease_s=60)) for _ in range(3)]
        exports = [RemoteExport(w, port=remote_refs.free_port()) for w in writers]
        descs = [e.descriptor("127.0.0.1") for e in exports]
        puller = RemotePuller(port=remote_refs.free_port(), timeout_s=20)
        reader = shmask.Reader(shmask.Config(name_prefix="x" + os.environ["SHMASK_NAME_PREFIX"]))
        exact, kept = 0, []
        for producer in (0, 1, 0, 2, 1):   # 1 least recent when 2 comes, then 0
            ids = np.array([producer, 100 + producer], np.int32)
            ref = writers[producer].publish(np.array([2], np.int32), ids,
                                            np.array([-1.0, -2.0], np.float32), "support")
            (pulled,) = puller.pull(RemoteBatch(RefBatch.from_refs([ref]), descs[producer]))
            with reader.open(pulled) as chunk:
                exact += chunk.csr()[0].tolist() == ids.tolist()
            kept.append(sorted(descs.index(next(d for d in descs if d["agent"] == key[0]))
                               for key in puller._mirrors))
        out.update(exact=exact, kept=kept, dropped=puller.stats.mirrors_dropped,
                   errors=puller.stats.read_errors)
        for export in exports:
            export.close()
    else:
        adapter.start_scheduler(types.SimpleNamespace(
            nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000",
            sampling_mask_max_tokens=4096, enable_metrics=False))
        adapter.SamplingMaskRows("support").close()
        assert adapter.ring_ready(30) is not None, adapter._ends["ring_error"]
        rows = adapter.SamplingMaskRows("support")
        rows.append(np.array([5, 6, 7], np.int32), np.array([-1, -2, -3], np.float32))
        seen = rows.view()   # published, read back in this process, queued again
        (chunk,) = adapter.take_all([rows])
        out.update(view=seen.token_ids.tolist(), remote=remote_refs.is_remote(chunk.ref),
                   lists=chunk.to_lists(True), puller=remote_refs._puller["puller"] is not None,
                   ip=json.loads(adapter._ends["leaving"].prefix[12:])["ip"])
        rows.close()
        adapter._ends["leaving"].close()
    print(json.dumps(out), flush=True)
""")


def _child(mode: str, prefix: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          timeout=120, start_new_session=True,
                          env=dict(os.environ, SHMASK_NAME_PREFIX=prefix, SHMASK_RING_MB="2",
                                   UCX_TLS="tcp", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@nixl_missing
@pytest.mark.timeout(150)
def test_an_agent_that_cannot_start_fails_the_reference_and_is_retried_later(prefix):
    """UCX with no usable device: RemoteChunkError naming what to check,
    the same error for the next reference (no new agent per reference),
    and a new attempt after RETRY_S."""
    got = _child("no-agent", prefix, UCX_NET_DEVICES="shmask-no-such-device")
    first, second = got["messages"]
    assert "NIXL agent cannot start" in first and "UCX_NET_DEVICES" in first, first
    assert second == first
    assert got["retried_at"] > got["failed_at"]


@nixl_missing
@pytest.mark.timeout(150)
def test_a_scheduler_reads_its_own_remote_chunks_without_nixl(prefix):
    """SHMASK_REMOTE=nixl on node 1: the chunks are remote references, and
    the scheduler itself (SamplingMaskRows.view, a chunk opened where it was
    made) opens them from its own ring, with no puller made."""
    got = _child("own", prefix, SHMASK_REMOTE="nixl", UCX_NET_DEVICES="lo")
    assert got["remote"] and not got["puller"], got
    assert got["view"] == [5, 6, 7]
    assert got["lists"] == [[[5, 6, 7]], [[-1.0, -2.0, -3.0]]]
    assert got["ip"] == "127.0.0.1"


@nixl_missing
@pytest.mark.timeout(150)
def test_a_puller_keeps_the_mirrors_of_the_producers_it_pulled_from_last(prefix):
    """Past MAX_MIRRORS (2 here) the mirror of the producer least recently
    pulled from goes (its registration and address space), and pulling from
    that producer again makes a new one: three producers pulled from as 0,
    1, 0, 2, 1 keep {0, 1} (0 the more recent), {0, 2} (1 went), then
    {1, 2} (0 went); every row exact."""
    got = _child("mirrors", prefix, UCX_NET_DEVICES="lo")
    assert got["exact"] == 5 and got["errors"] == 0, got
    assert got["kept"] == [[0], [0, 1], [0, 1], [0, 2], [1, 2]], got
    assert got["dropped"] == 2, got


@nixl_missing
@pytest.mark.timeout(150)
def test_a_pullers_mirror_gives_its_pages_back_as_pulls_walk_the_ring(prefix):
    """A consumer pulling from a producer's ring for a long time must not
    end up holding a copy of the whole ring: each pull's pages of the
    private mirror are given back once its records are copied out. Twelve
    emissions of about 1 MiB wrap a 4 MiB ring three times (UCX over TCP on
    the loopback); the rows are exact and the mirror's resident memory stays
    a few pages."""
    got = _child("mirror", prefix, UCX_NET_DEVICES="lo")
    assert got["exact"] == 96 and got["errors"] == 0, got
    assert got["dropped"] >= 3 * got["ring"], got
    assert got["rss"] is not None and got["rss"] <= 64 << 10, got

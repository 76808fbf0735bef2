"""shmask.remote across two "hosts" (tests/netns.py: two network namespaces
joined by a veth pair): a producer in namespace A exports its ring to NIXL
(RemoteExport) and sends a RemoteBatch; a hop in namespace B pulls the
records (RemotePuller) into inline entries that any Reader opens without
the producer's /dev/shm, and the producer releases the records on the hop's
notification. UCX is told to use TCP on the veth only (UCX_TLS=tcp,
UCX_NET_DEVICES), so the rows cross the "network" (the namespaces still
share /dev/shm: the reader proves it never maps the producer's segment).

The child scripts' shared helpers (waiting on the files that synchronise
them, the batch handed over in a JSON file, a pulled batch's rows) are in
tests/remote_child.py, on their PYTHONPATH through its `host_env`.

Needs root (namespaces) and NIXL's `nixl-cu12` package; skipped, with the
reason, without (as tests/test_netns_nixl.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import netns  # tests/netns.py
import pytest
from remote_child import entries, host_env, last_json, load_remote, rows, run_pair, wait_for

from shmask.errors import InvalidRefError
from shmask.segment import collect_garbage

needs_nixl_hosts = pytest.mark.skipif(netns.nixl_unavailable() is not None,
                                      reason=netns.nixl_unavailable() or "")

EXPORT_PORT = 5611   # in namespace A
PULL_PORT = 5612     # in namespace B
PULL_PORT_2 = 5613   # a second, fresh puller in B

# The rows the producer publishes and the reader must see (float32-exact).
EXPECTED = [
    # support, two OK ids rows (a RowQueue)
    [[[3, 7, 9], [2]], [[-0.5, -1.0, -2.0], [-0.25]]],
    # selected, two rows
    [[[5], [4, 8]], [-0.75, -1.5]],
    # support: a bitmask row (vocab 64: ids 1, 33, 40), then a dropped row (OVERFLOW)
    [[[1, 33, 40], None], [[-0.5, -0.25, -0.125], None]],
    # support, Writer.publish (one-shot CSR)
    [[[10, 20], [30]], [[-1.0, -2.0], [-3.0]]],
]

PRODUCER = r"""
import json, os, sys, threading, time
import numpy as np
import shmask
from remote_child import wait_for, write_remote
from shmask._native import ffi, lib
from shmask.refs import RefBatch
from shmask.remote import RemoteBatch, RemoteExport

out, prefix, ip, port, wait_s, mode = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                       float(sys.argv[5]), sys.argv[6])
w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=120))
f32, i32 = np.float32, np.int32
q0, q1, q2 = w.open_queue("support"), w.open_queue("selected"), w.open_queue("support")
w.append_step([q0], np.array([3], i32), np.array([3, 7, 9], i32), np.array([-0.5, -1, -2], f32))
w.append_step([q0], np.array([1], i32), np.array([2], i32), np.array([-0.25], f32))
w.append_step([q1], np.array([1], i32), np.array([5], i32), np.array([-0.75], f32))
w.append_step([q1], np.array([2], i32), np.array([4, 8], i32), np.array([-1.5], f32))
w.append_step([q2], np.array([3], i32), np.array([1 << 1, (1 << 1) | (1 << 8)], i32),
              np.array([-0.5, -0.25, -0.125], f32), forms=np.array([1], np.uint8), vocab=64)
w.append_step([q2], np.array([0], i32), np.zeros(0, i32), np.zeros(0, f32),
              status=np.array([1], np.uint8))
taken = w.take_batch([q0, q1, q2])
one_shot = w.publish(np.array([2, 1], i32), np.array([10, 20, 30], i32),
                     np.array([-1, -2, -3], f32), "support")
batch = RefBatch.from_refs([*taken, one_shot])
assert all(ref.kind == 1 for ref in batch), list(batch)   # every chunk in the ring
export = RemoteExport(w, port=port)
if mode == "defer":
    # Release notifications are held until the reader says ".pulled": a
    # release that has not landed yet (a slow link) while it pulls again.
    # The export's thread keeps polling (it drives UCX's progress).
    handle, held, lock, holding = export._handle, [], threading.Lock(), [True]

    def deferred(message):
        with lock:
            if holding[0]:
                held.append(message)
                return
        handle(message)

    export._handle = deferred
remote = RemoteBatch(batch, export.descriptor(ip))
write_remote(out, remote, records=len(batch), segment=w.segment_name, pid=os.getpid())
if mode == "hold":
    time.sleep(wait_s)   # the test kills us
if mode == "defer":
    wait_for(out, ".pulled", seconds=wait_s, message="the reader never said .pulled")
    with lock:
        holding[0] = False
        for message in held:
            handle(message)
deadline = time.monotonic() + wait_s
while export.stats.releases < len(batch) and time.monotonic() < deadline:
    time.sleep(0.005)
if mode == "defer":   # released: another puller may pull now
    open(out + ".released", "w").close()
    wait_for(out, ".fresh", seconds=wait_s, message="the reader never said .fresh")
time.sleep(0.2)   # any late (double) release would show in release_errors
info = ffi.new("shm_info *")
assert lib.shm_read_info(w.segment.base, w.segment.size, info) == lib.SHM_OK
stats = vars(export.stats).copy()
export.close()
w.close()
print(json.dumps({"export": stats, "released": int(info.released),
                  "published": int(info.published)}), flush=True)
"""

READER = r"""
import json, os, sys, time
import shmask
from remote_child import entries, load_remote, mapped, rows, subset, wait_for
from shmask import remote as rm
from shmask.errors import ShmaskError
from shmask.refs import RefBatch
from shmask.remote import RemoteBatch, RemoteDescriptor, RemotePuller

path, prefix, port, timeout_s, script = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                         float(sys.argv[4]), sys.argv[5])
wait_for(path, seconds=40, message="the producer never wrote its batch")
remote, data = load_remote(path)
reader = shmask.Reader(shmask.Config(name_prefix=prefix + "r"))


def pulled(puller, batch):
    # the entries' kinds, their rows and how long the pull alone took
    t = time.monotonic()
    out = puller.pull(batch)
    seconds = time.monotonic() - t
    return {"kinds": [kind for kind, _ in entries(out)], "rows": rows(reader, out),
            "seconds": seconds}


def rx_bytes():
    # this namespace's veth (ip netns exec mounts its own /sys)
    dev = os.environ["UCX_NET_DEVICES"]
    return int(open(f"/sys/class/net/{dev}/statistics/rx_bytes").read())


def errors(batch):
    # what opening each entry raises, [class name, message], or None
    got = []
    for ref in batch:
        try:
            reader.open(ref).release()
            got.append(None)
        except ShmaskError as exc:
            got.append([type(exc).__name__, str(exc)])
    return got


def forged(remote, descriptor=None, entries=None):
    batch = remote.batch
    if entries is not None:
        batch = RefBatch.build(batch.segments, entries)
    return RemoteBatch(batch, descriptor or remote.descriptor)


result = {}
if script == "pull":
    puller = RemotePuller(port=port, timeout_s=timeout_s)
    result.update(pulled(puller, data), stats=vars(puller.stats))
elif script == "forge":
    desc = remote.descriptor
    puller = RemotePuller(port=port, timeout_s=timeout_s)
    seg = desc.segments[0]
    cases = {}
    # 1. an address outside the producer's registered region (past its end)
    outside = RemoteDescriptor.from_dict({**desc.to_dict(), "segments": [
        {"name": seg.name, "epoch": seg.epoch, "address": seg.address + seg.size + (1 << 20),
         "size": seg.size}]})
    # 2. a region straddling the registered one's start
    straddle = RemoteDescriptor.from_dict({**desc.to_dict(), "segments": [
        {"name": seg.name, "epoch": seg.epoch, "address": seg.address - 4096,
         "size": seg.size}]})
    # 3. a size far larger than the ring (the mirror is sized by the ring's own header)
    large = RemoteDescriptor.from_dict({**desc.to_dict(), "segments": [
        {"name": seg.name, "epoch": seg.epoch, "address": seg.address, "size": 1 << 40}]})
    # 4. entries forged: a wrong seal, a position past the ring, a misaligned one,
    #    a record that would run past the ring's end
    wrong = remote.batch.entries.copy()
    wrong[0]["seal"] ^= 1
    wrong[1]["position"] += 1 << 40
    wrong[2]["position"] += 8
    wrong[3]["record_bytes"] = 1 << 30
    # 5. the real segment at another size, once the puller has its mirror
    moved = RemoteDescriptor.from_dict({**desc.to_dict(), "segments": [
        {"name": seg.name, "epoch": seg.epoch, "address": seg.address, "size": seg.size + 4096}]})
    # ("large" on a puller of its own: one mirror per segment and epoch, and
    # a later descriptor at another size is refused: case 5)
    large_puller = RemotePuller(port=int(sys.argv[6]), timeout_s=timeout_s)
    for name, remote_forged, by in (("outside", forged(remote, outside), puller),
                                    ("straddle", forged(remote, straddle), puller),
                                    ("large", forged(remote, large), large_puller),
                                    ("entries", forged(remote, entries=wrong), puller),
                                    ("moved", forged(remote, moved), puller)):
        cases[name] = {**pulled(by, remote_forged), "error": by.stats.last_error}
        by.stats.last_error = ""
    cases["real"] = pulled(puller, data)   # the real batch still goes through
    result.update(cases=cases, stats=vars(puller.stats))
elif script == "killed":
    # The puller already connected (a real pull first), then the producer is killed.
    puller = RemotePuller(port=port, timeout_s=timeout_s)
    result["first"] = rows(reader, puller.pull(subset(remote, [0])))
    open(path + ".ready", "w").close()
    wait_for(path, ".killed")
    result["connected"] = pulled(puller, data)
    fresh = RemotePuller(port=int(sys.argv[6]), timeout_s=timeout_s)   # never connected
    result["fresh"] = pulled(fresh, data)
elif script == "twice":
    # The same batch pulled twice, the producer holding the first pull's
    # releases (they have not landed when the second pull runs).
    puller = RemotePuller(port=port, timeout_s=timeout_s)
    result["first"] = pulled(puller, data)
    rx = rx_bytes()
    again = puller.pull(data)
    result["second_rx"] = rx_bytes() - rx
    result["second"] = {"kinds": [kind for kind, _ in entries(again)],
                        "rows": rows(reader, again), "errors": errors(again)}
    open(path + ".pulled", "w").close()
    result["stats"] = vars(puller.stats)
    # A puller that never pulled it, once the releases landed: the
    # producer's record says released (its READ sees RELEASED).
    wait_for(path, ".released", seconds=40, message="the producer never said .released")
    fresh = RemotePuller(port=int(sys.argv[6]), timeout_s=timeout_s)
    result["fresh"] = rows(reader, fresh.pull(data))
    open(path + ".fresh", "w").close()
elif script == "reuse":
    # Batch 1 pulled (the remembered records capped at 3 here); the producer
    # then wraps its ring and publishes batch 2 at the same offsets, new
    # positions and seals.
    puller = RemotePuller(port=port, timeout_s=timeout_s)
    cap, rm.MAX_GIVEN = rm.MAX_GIVEN, 3
    result["first"] = rows(reader, puller.pull(data))
    [mirror] = puller._mirrors.values()
    result["given_capped"] = sorted(mirror.given)
    rm.MAX_GIVEN = cap
    wait_for(path, ".2", seconds=40, message="the producer never wrote batch 2")
    _, data2 = load_remote(path + ".2")
    result["second"] = rows(reader, puller.pull(data2))
    result["given"] = sorted(mirror.given)
    result["first_again"] = rows(reader, puller.pull(data))   # below the tail now
    result["stats"] = vars(puller.stats)
result["maps_segment"] = mapped(json.load(open(path))["segment"])
result["attached"] = len(reader._attached)
print(json.dumps(result), flush=True)
"""


def _producer(hosts: netns.Hosts, path: Path, prefix: str, wait_s: float, hold: bool,
              defer: bool = False):
    """hold: publish, then sleep (the test kills it); defer: hold each release
    notification until the reader writes ".pulled"; else release at once."""
    mode = "hold" if hold else "defer" if defer else "wait"
    return netns.run_in(hosts.a, [sys.executable, "-c", PRODUCER, str(path), prefix, hosts.a_ip,
                                  str(EXPORT_PORT), str(wait_s), mode],
                        env=host_env(hosts.a_dev), timeout=80)


def _reader(hosts: netns.Hosts, path: Path, prefix: str, script: str, timeout_s: float):
    return netns.run_in(hosts.b, [sys.executable, "-c", READER, str(path), prefix,
                                  str(PULL_PORT), str(timeout_s), script, str(PULL_PORT_2)],
                        env=host_env(hosts.b_dev), timeout=80)


@needs_nixl_hosts
@pytest.mark.timeout(90)
def test_a_hop_on_another_host_pulls_the_records_and_the_producer_releases_them(prefix, tmp_path):
    path = tmp_path / "remote.json"
    producer = reader = None
    with netns.two_hosts(prefix) as hosts:
        try:
            before = netns.link_bytes(hosts.b, hosts.b_dev)
            producer = _producer(hosts, path, prefix, wait_s=30, hold=False)
            reader = _reader(hosts, path, prefix, "pull", timeout_s=10)
            out_r, err_r = reader.communicate(timeout=60)
            out_p, err_p = producer.communicate(timeout=40)
            after = netns.link_bytes(hosts.b, hosts.b_dev)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
    assert reader.returncode == 0, err_r[-3000:]
    assert producer.returncode == 0, (out_p, err_p[-3000:])
    got, sent = last_json(out_r), last_json(out_p)
    assert got["kinds"] == [2, 2, 2, 2], got          # every entry inline
    assert got["rows"] == EXPECTED
    assert got["attached"] == 0 and not got["maps_segment"], got   # never the producer's /dev/shm
    assert got["stats"]["pulled"] == 4 and got["stats"]["read_errors"] == 0, got
    # The producer saw each record released, once, on the puller's notification.
    assert sent["export"]["releases"] == 4 and sent["export"]["release_errors"] == 0, sent
    assert sent["export"]["bad_notifs"] == 0, sent
    assert sent["released"] == sent["published"] == 4, sent
    remote, _ = load_remote(str(path))
    record_bytes = int(remote.batch.entries["record_bytes"].sum())
    rx = after["rx"] - before["rx"]
    assert rx >= record_bytes, (rx, record_bytes)   # at least the records crossed the veth
    print(f"\npull {got['seconds'] * 1e3:.1f} ms (metadata included); veth B rx {rx} bytes; "
          f"producer {sent}")


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_forged_remote_batches_cost_their_entries_only(prefix, tmp_path):
    path = tmp_path / "remote.json"
    with netns.two_hosts(prefix) as hosts:
        got, sent = run_pair(lambda: _producer(hosts, path, prefix, wait_s=60, hold=False),
                             lambda: _reader(hosts, path, prefix, "forge", timeout_s=3), 90, 70)
    cases = got["cases"]
    lost_invalid = {"lost": 2}
    assert cases["large"]["error"] == "" and cases["entries"]["error"] == "", cases
    # A region NIXL does not know: refused before any READ is issued.
    for name in ("outside", "straddle"):
        assert cases[name]["rows"] == [lost_invalid] * 4, (name, cases[name])
        assert "NIXL_ERR_NOT_FOUND" in cases[name]["error"], (name, cases[name])
        assert cases[name]["seconds"] < 3, (name, cases[name])
    # A size larger than the ring: the ring's own header sizes the mirror; the
    # rows are read and checked as usual.
    assert cases["large"]["rows"] == EXPECTED, cases["large"]
    # After "large" released every record, the forged entries: a wrong seal is
    # refused by the record's own check, bad positions and sizes before any READ.
    assert cases["entries"]["rows"] == [lost_invalid] * 4, cases["entries"]
    # The segment the puller has a mirror of, at another size: refused, no READ.
    assert cases["moved"]["rows"] == [lost_invalid] * 4, cases["moved"]
    assert "size differs" in cases["moved"]["error"], cases["moved"]
    # The real batch, pulled again by another puller than "large"'s: a
    # release travels as a notification, so whether "large"'s release
    # reached the producer before this READ is a race. Either the records
    # still read WRITTEN (the rows again: two pullers are not kept from
    # copying one record, the producer would have to claim it) or RELEASED
    # (DoubleReleaseError at the mirror's check: lost, released).
    real = cases["real"]
    assert real["rows"] == EXPECTED or real["rows"] == [{"lost": 3}] * 4, real
    assert got["attached"] == 0 and not got["maps_segment"], got
    # Each record released once; a second copy's release is refused by the core.
    assert sent["export"]["releases"] == 4, sent
    assert sent["export"]["release_errors"] == (4 if real["rows"] == EXPECTED else 0), sent
    assert sent["released"] == 4 and sent["export"]["bad_notifs"] == 0, sent
    print(f"\nforged: {({k: (v['kinds'], round(v['seconds'] * 1e3, 1)) for k, v in cases.items()})}")


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_a_producer_killed_before_the_pull_costs_lost_entries_within_the_timeout(prefix,
                                                                                  tmp_path):
    path = tmp_path / "remote.json"
    producer = reader = None
    timeout_s = 3.0
    with netns.two_hosts(prefix) as hosts:
        try:
            producer = _producer(hosts, path, prefix, wait_s=60, hold=True)
            reader = _reader(hosts, path, prefix, "killed", timeout_s=timeout_s)
            wait_for(str(path), ".ready", reader, seconds=40,
                     message="the reader never made its first pull")
            netns.kill_group(producer)
            Path(str(path) + ".killed").touch()
            out_r, err_r = reader.communicate(timeout=60)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
            collect_garbage(prefix)   # the killed producer's ring
    assert producer.returncode == -9
    assert reader.returncode == 0, err_r[-3000:]
    got = last_json(out_r)
    assert got["first"] == EXPECTED[:1], got
    # The connected puller copied entry 0 already: released (its own memory,
    # no READ); the others, and all of the fresh puller's, stale.
    released_first = {"connected": [{"lost": 3}], "fresh": [{"lost": 1}]}
    for case in ("connected", "fresh"):
        assert got[case]["kinds"] == [3, 3, 3, 3], (case, got[case])
        assert got[case]["rows"] == released_first[case] + [{"lost": 1}] * 3, (case, got[case])
        assert got[case]["seconds"] < timeout_s + 1, (case, got[case])
    print(f"\nafter the kill: connected puller {got['connected']['seconds'] * 1e3:.0f} ms, "
          f"fresh puller {got['fresh']['seconds'] * 1e3:.0f} ms (timeout {timeout_s} s)")


def test_malformed_remote_batches_raise_invalid_ref_error():
    """No NIXL, no namespaces: the parser alone."""
    from shmask.refs import RefBatch
    from shmask.remote import RemoteBatch

    batch = RefBatch.from_refs([])
    seg = {"name": "/shmaskx-0-1-0123456789abcdef", "epoch": 5, "address": 1 << 30,
           "size": 4096 + (1 << 20)}
    good = {"agent": "producer", "ip": "10.0.0.1", "port": 5611, "segments": [seg]}
    data = RemoteBatch(batch, good).to_bytes()
    assert RemoteBatch.from_bytes(data).descriptor.to_dict() == good
    bad = [b"", b"SMRB" + data[4:], data[:11], data[:20], data[:-1], data + b"\0",
           data[:8] + (1 << 31).to_bytes(4, "little") + data[12:]]
    for forged in ({**good, "port": 0}, {**good, "ip": "host"}, {**good, "agent": ""},
                   {**good, "segments": [{**seg, "size": 1 << 50}]},
                   {**good, "segments": [{**seg, "size": 100}]},
                   {**good, "segments": [{**seg, "address": (1 << 64) - 4096}]},
                   {**good, "segments": [{**seg, "address": -1}]},
                   {**good, "segments": [{**seg, "name": "/etc/passwd"}]},
                   {**good, "segments": [seg, seg]},
                   {**good, "segments": "x"}, []):
        desc = json.dumps(forged).encode()
        bad.append(data[:8] + len(desc).to_bytes(4, "little") + desc + batch.to_bytes())
        with pytest.raises(InvalidRefError):
            RemoteBatch(batch, forged)  # type: ignore[arg-type]
    bad.append(data[:8] + (3).to_bytes(4, "little") + b"{x}" + batch.to_bytes())
    for blob in bad:
        with pytest.raises(InvalidRefError):
            RemoteBatch.from_bytes(blob)


# ------------------------------------------------------- review findings

FLAP_READER = r"""
import json, sys, time
import shmask
from remote_child import load_remote, rows, subset, wait_for
from shmask.remote import RemotePuller

path, prefix, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
wait_for(path)
remote, _ = load_remote(path)
reader = shmask.Reader(shmask.Config(name_prefix=prefix + "r"))


def pull(puller, which):
    return rows(reader, puller.pull(subset(remote, which)))


puller = RemotePuller(port=port, timeout_s=1)
result = {"first": pull(puller, [0])}
open(path + ".down", "w").close()
wait_for(path, ".isdown")
result["down"] = pull(puller, [1, 2, 3])
result["quarantined"] = vars(puller.stats).get("quarantined", 0)
open(path + ".up", "w").close()
# The READ given up above lands once the link is back (UCX retransmits):
# its buffers must still be there, and no later pull may see its bytes.
results = []
for _ in range(15):
    time.sleep(1)
    results.append(pull(puller, [1, 2, 3]))
    if results[-1][0] != {"lost": 1}:
        break
result["after"] = results
result["late_left"] = len(getattr(puller, "_late", ()))
print(json.dumps(result), flush=True)
"""


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_a_read_given_up_that_lands_later_neither_crashes_nor_leaks_into_a_pull(prefix,
                                                                                 tmp_path):
    path = tmp_path / "remote.json"
    producer = reader = None
    with netns.two_hosts(prefix) as hosts:
        try:
            producer = _producer(hosts, path, prefix, wait_s=60, hold=True)
            reader = netns.run_in(hosts.b, [sys.executable, "-c", FLAP_READER, str(path), prefix,
                                            str(PULL_PORT)], env=host_env(hosts.b_dev), timeout=90)
            for step in (".down", ".up"):
                wait_for(str(path), step, reader, seconds=40,
                         message=f"the reader never reached {step}")
                netns.set_link(hosts.a, hosts.a_dev, up=step == ".up")
                Path(str(path) + ".isdown").touch()
            out_r, err_r = reader.communicate(timeout=60)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
            collect_garbage(prefix)
    assert reader.returncode == 0, (reader.returncode, err_r[-3000:])
    got = last_json(out_r)
    assert got["first"] == EXPECTED[:1], got
    assert got["down"] == [{"lost": 1}] * 3 and got["quarantined"] >= 1, got
    for after in got["after"]:   # exact rows, or lost (stale) while the READ is out: never others
        assert all(row == {"lost": 1} for row in after) or after == EXPECTED[1:], got
    print(f"\nafter the flap: {len(got['after'])} pull(s), last {got['after'][-1]}, "
          f"{got['late_left']} READ(s) still quarantined")


CLOSE_PRODUCER = r"""
import gc, json, sys, time
import numpy as np
import shmask
from remote_child import wait_for, write_remote
from shmask.refs import RefBatch
from shmask.remote import RemoteBatch, RemoteExport

path, prefix, ip, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=120))
refs = [w.publish(np.array([2, 1], np.int32), np.array([10, 20, 30], np.int32),
                  np.array([-1, -2, -3], np.float32), "support") for _ in range(3)]
export = RemoteExport(w, port=port)
write_remote(path, RemoteBatch(RefBatch.from_refs(refs), export.descriptor(ip)))
wait_for(path, ".pulled")
export.close()
w.close()
del w, refs
gc.collect()
open(path + ".closed", "w").close()
wait_for(path, ".pulled2")
del export   # the agent goes, then the mapping
gc.collect()
open(path + ".dropped", "w").close()
wait_for(path, ".pulled3")
time.sleep(0.5)
print(json.dumps({"alive": True}), flush=True)
"""

CLOSE_READER = r"""
import json, sys
from remote_child import entries, load_remote, subset, wait_for
from shmask.remote import RemotePuller

path, port = sys.argv[1], int(sys.argv[2])
wait_for(path)
remote, data = load_remote(path)
puller = RemotePuller(port=port, timeout_s=2)
result = {}
result["first"] = entries(puller.pull(subset(remote, [0])))
for before, after, name in ((".pulled", ".closed", "closed"), (".pulled2", ".dropped", "dropped")):
    open(path + before, "w").close()
    wait_for(path, after, seconds=20, message=f"the producer never said {after} (dead?)")
    result[name] = entries(puller.pull(data))
open(path + ".pulled3", "w").close()
print(json.dumps(result), flush=True)
"""


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_a_pull_after_the_export_is_closed_does_not_crash_the_producer(prefix, tmp_path):
    path = tmp_path / "remote.json"
    producer = reader = None
    with netns.two_hosts(prefix) as hosts:
        try:
            producer = netns.run_in(hosts.a, [sys.executable, "-c", CLOSE_PRODUCER, str(path),
                                              prefix, hosts.a_ip, str(EXPORT_PORT)],
                                    env=host_env(hosts.a_dev), timeout=80)
            reader = netns.run_in(hosts.b, [sys.executable, "-c", CLOSE_READER, str(path),
                                            str(PULL_PORT)], env=host_env(hosts.b_dev), timeout=80)
            out_r, err_r = reader.communicate(timeout=70)
            out_p, err_p = producer.communicate(timeout=30)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
            collect_garbage(prefix)
    assert producer.returncode == 0, (producer.returncode, err_p[-3000:])
    assert reader.returncode == 0, err_r[-3000:]
    got = last_json(out_r)
    assert got["first"] == [[2, 0]], got
    # Closed (the Writer too): the export's poll thread, the only thing that
    # drove its agent's progress (no NIXL progress thread), has stopped, so
    # no READ is served: every entry LOST (stale) at the puller's deadline,
    # but the first, which this puller copied already (released, no READ).
    # The ring stays mapped and registered while the agent lives: a READ
    # served later could not touch unmapped memory.
    assert got["closed"] == [[3, 3], [3, 1], [3, 1]], got
    # Dropped: its agent is gone with it, nothing answers: LOST (stale).
    assert [kind for kind, _ in got["dropped"]] == [3, 3, 3], got
    print(f"\nafter close: {got['closed']}; after the export is dropped: {got['dropped']}")


RESTART_PRODUCER = r"""
import sys
import numpy as np
import shmask
from remote_child import wait_for, write_remote
from shmask.refs import RefBatch
from shmask.remote import RemoteBatch, RemoteExport

path, prefix, ip, port, value = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                 int(sys.argv[5]))
w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=120))
refs = [w.publish(np.array([1], np.int32), np.array([value + i], np.int32),
                  np.array([-0.5], np.float32), "support") for i in range(2)]
export = RemoteExport(w, port=port, name="rank0")   # the same name and address each time
write_remote(path, RemoteBatch(RefBatch.from_refs(refs), export.descriptor(ip)))
wait_for(path, ".done")
export.close()
w.close()
"""

RESTART_READER = r"""
import json, sys
import shmask
from remote_child import load_remote, rows, subset, wait_for
from shmask.remote import RemotePuller

base, prefix, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
reader = shmask.Reader(shmask.Config(name_prefix=prefix + "r"))
puller = RemotePuller(port=port, timeout_s=3)
result = {}
for gen in ("g1", "g2"):
    path = base + gen
    wait_for(path)
    remote, _ = load_remote(path)
    got = []
    for i in range(2):
        [row] = rows(reader, puller.pull(subset(remote, [i])))
        got.append(row[0] if isinstance(row, list) else row)   # a row's ids alone
    result[gen] = got
    result[gen + "_mirrors"] = sorted(name for _, name, _ in puller._mirrors)
    result[gen + "_segment"] = remote.descriptor.segments[0].name
    open(path + ".done", "w").close()
print(json.dumps(result), flush=True)
"""


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_a_producer_restarted_under_the_same_name_and_address_is_pulled_again(prefix,
                                                                               tmp_path):
    base = str(tmp_path / "remote")
    reader = None
    with netns.two_hosts(prefix) as hosts:
        try:
            reader = netns.run_in(hosts.b, [sys.executable, "-c", RESTART_READER, base, prefix,
                                            str(PULL_PORT)], env=host_env(hosts.b_dev), timeout=90)
            for gen, value in (("g1", 100), ("g2", 200)):
                producer = netns.run_in(hosts.a, [sys.executable, "-c", RESTART_PRODUCER,
                                                  base + gen, prefix, hosts.a_ip,
                                                  str(EXPORT_PORT), str(value)],
                                        env=host_env(hosts.a_dev), timeout=40)
                out_p, err_p = producer.communicate(timeout=40)
                assert producer.returncode == 0, err_p[-3000:]
            out_r, err_r = reader.communicate(timeout=40)
        finally:
            netns.kill_group(reader)
            collect_garbage(prefix)
    assert reader.returncode == 0, err_r[-3000:]
    got = last_json(out_r)
    assert got["g1"] == [[[100]], [[101]]] and got["g2"] == [[[200]], [[201]]], got
    # The first READ of the new ring, refused on the old metadata, made the
    # puller forget that agent's mirrors: only the new ring's is left.
    for gen in ("g1", "g2"):
        assert got[gen + "_mirrors"] == [got[gen + "_segment"]], got


# ------------------------------------- a pull claims what it copies (issue 37)

@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_the_same_batch_pulled_twice_gives_its_rows_once(prefix, tmp_path):
    """The second pull runs before the first pull's releases land (the
    producer holds them): the puller's own memory of what it gave back
    fails each entry as a local open of a released record would, with no
    READ and no second release. A second puller, after they landed, is
    told the same by the records themselves."""
    path = tmp_path / "remote.json"
    with netns.two_hosts(prefix) as hosts:
        got, sent = run_pair(lambda: _producer(hosts, path, prefix, wait_s=40, hold=False, defer=True),
                             lambda: _reader(hosts, path, prefix, "twice", timeout_s=10), 60, 50)
    assert got["first"]["kinds"] == [2] * 4 and got["first"]["rows"] == EXPECTED, got["first"]
    second = got["second"]
    assert second["kinds"] == [3] * 4 and second["rows"] == [{"lost": 3}] * 4, second
    for error in second["errors"]:
        assert error is not None and error[0] == "DoubleReleaseError", second["errors"]
        assert "released already" in error[1] and "pulled or forwarded twice" in error[1], error
    assert got["stats"]["pulled"] == 4 and got["stats"]["lost_released"] == 4, got["stats"]
    # Another puller, after the releases landed: released already, by the
    # producer's own record (no release sent for it either).
    assert got["fresh"] == [{"lost": 3}] * 4, got["fresh"]
    # No READ: the records alone are more than what crossed the veth meanwhile.
    remote, _ = load_remote(str(path))
    record_bytes = int(remote.batch.entries["record_bytes"].sum())
    assert got["second_rx"] < record_bytes, (got["second_rx"], record_bytes)
    # One notification (the first pull's), each record released once, none refused.
    assert sent["export"]["notifs"] == 1 and sent["export"]["releases"] == 4, sent
    assert sent["export"]["release_errors"] == 0 and sent["export"]["bad_notifs"] == 0, sent
    assert sent["released"] == sent["published"] == 4, sent
    print(f"\nsecond pull: {second['kinds']}, {got['second_rx']} bytes in on the veth "
          f"(records {record_bytes}); producer {sent['export']}")


def test_a_batch_forwarded_twice_fails_its_entries_as_released_already(prefix):
    """No NIXL: the LOST reason a pull gives (LOST_RELEASED), made by the
    local hop (to_inline) from the same DoubleReleaseError, travels in a
    batch's bytes and opens as that error; a reason past it is malformed."""
    import numpy as np

    import shmask
    from shmask.refs import ENTRY_DTYPE, KIND_LOST, LOST_RELEASED, RefBatch

    w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix))
    reader = shmask.Reader(shmask.Config(name_prefix=prefix))
    try:
        batch = RefBatch.from_refs([w.publish(np.array([1], np.int32), np.array([7], np.int32),
                                              np.array([-0.5], np.float32), "support")])
        assert rows(reader, batch.to_inline(reader)) == [[[[7]], [[-0.5]]]]
        again = RefBatch.from_bytes(batch.to_inline(reader).to_bytes())
        assert entries(again) == [[KIND_LOST, LOST_RELEASED]]
        with pytest.raises(shmask.DoubleReleaseError, match="released already.*twice"):
            reader.open(again[0])
        forged = np.frombuffer(again.to_bytes(), np.uint8).copy()
        at = len(forged) - ENTRY_DTYPE.itemsize + ENTRY_DTYPE.fields["position"][1]
        assert forged[at] == LOST_RELEASED
        forged[at] = LOST_RELEASED + 1
        with pytest.raises(InvalidRefError, match="lost reference's reason"):
            RefBatch.from_bytes(forged.tobytes())
    finally:
        w.close()


REUSE_PRODUCER = r"""
import json, sys, time
import numpy as np
import shmask
from remote_child import write_remote
from shmask._native import ffi, lib
from shmask.refs import RefBatch
from shmask.remote import RemoteBatch, RemoteExport

out, prefix, ip, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=120))
local = shmask.Reader(shmask.Config(name_prefix=prefix))   # this host's own reader
info = ffi.new("shm_info *")


def one(value):
    return w.publish(np.array([1], np.int32), np.array([value], np.int32),
                     np.array([-0.5], np.float32), "support")


def ring():
    assert lib.shm_read_info(w.segment.base, w.segment.size, info) == lib.SHM_OK
    return info


def released(count):
    deadline = time.monotonic() + 40
    while export.stats.releases < count:
        assert time.monotonic() < deadline, vars(export.stats)
        time.sleep(0.005)


first = [one(10 + k) for k in range(4)]
export = RemoteExport(w, port=port)
descriptor = export.descriptor(ip)
write_remote(out, RemoteBatch(RefBatch.from_refs(first), descriptor), segment=w.segment_name)
released(4)
# Fillers up to the ring's end, each released here at once; then the
# tail passes them all and batch 2 starts over at offset 0.
capacity, size = ring().capacity, first[1].position - first[0].position
while ring().head + size <= capacity:
    local.open(one(0)).release()
w.reclaim()
second = [one(20 + k) for k in range(4)]
assert [r.position for r in second] == [capacity + r.position for r in first], (second, first)
assert not {r.seal for r in first} & {r.seal for r in second}
write_remote(out + ".2", RemoteBatch(RefBatch.from_refs(second), descriptor))
released(8)
time.sleep(0.2)   # any late (double) release would show in release_errors
print(json.dumps({"export": vars(export.stats).copy(), "first": [r.position for r in first],
                  "second": [r.position for r in second]}), flush=True)
export.close()
w.close()
"""


@needs_nixl_hosts
@pytest.mark.timeout(120)
def test_a_record_reused_at_a_pulled_records_offset_is_pulled_and_the_memory_stays_bounded(
        prefix, tmp_path):
    """A pulled record's ring bytes reused by a new record (same offset, its
    own position and seal): pulled as usual. What the puller remembers is
    capped (MAX_GIVEN, 3 here: the lowest positions go first) and forgets
    the records below the producer's tail; a pull of those is stale."""
    path = tmp_path / "remote.json"
    with netns.two_hosts(prefix) as hosts:
        got, sent = run_pair(
            lambda: netns.run_in(hosts.a, [sys.executable, "-c", REUSE_PRODUCER, str(path), prefix,
                                           hosts.a_ip, str(EXPORT_PORT)],
                                 env=host_env(hosts.a_dev), timeout=80),
            lambda: _reader(hosts, path, prefix, "reuse", timeout_s=10), 70, 50)
    assert got["first"] == [[[[10 + k]], [[-0.5]]] for k in range(4)], got["first"]
    assert got["given_capped"] == sent["first"][1:], (got, sent)   # the lowest forgotten
    assert got["second"] == [[[[20 + k]], [[-0.5]]] for k in range(4)], got["second"]
    assert got["given"] == sent["second"], (got, sent)   # batch 1's: below the tail
    assert got["first_again"] == [{"lost": 1}] * 4, got   # stale, not "released"
    assert sent["export"]["releases"] == 8 and sent["export"]["release_errors"] == 0, sent
    assert got["stats"]["lost_released"] == 0, got["stats"]


def test_release_notifications_are_bounded_and_a_failing_one_spares_the_thread():
    """No NIXL: RemoteExport's notification handling alone, on a stand-in."""
    import struct
    import threading

    from shmask.remote import (
        _RELEASE_HEADER,
        MAX_RELEASES_PER_NOTIF,
        RELEASE_MAGIC,
        ExportStats,
        RemoteExport,
    )

    class Exported:
        epoch = 7

    export = RemoteExport.__new__(RemoteExport)
    export.stats, export._exported, export._logged = ExportStats(), [Exported()], set()
    pairs = b"\0" * 16 * (MAX_RELEASES_PER_NOTIF + 1)
    export._handle(_RELEASE_HEADER.pack(RELEASE_MAGIC, 0, 7) + pairs)
    assert export.stats.bad_notifs == 1

    sent = [{"peer": [b"x", b"y"]}, {"peer": [b"z"]}]

    class Agent:
        def get_new_notifs(self):
            return sent.pop() if sent else {}

    def handle(message):
        if message != b"y":
            raise struct.error("boom")
        export.stats.releases += 1

    export._agent, export._poll_s, export._stop = Agent(), 0.001, threading.Event()
    export._handle = handle
    thread = threading.Thread(target=export._run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while sent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert thread.is_alive()
    export._stop.set()
    thread.join(5)
    assert export.stats.handle_errors == 2 and export.stats.releases == 1, export.stats


class _FakeNixl:
    """A stand-in for nixl_cu12._api in one process: a READ copies from this
    process's memory (memmove), except from the addresses in `hang`, whose
    READs stay in flight until `land()`: a READ that lands after its pull
    gave it up."""

    class nixlBind:
        class nixlNotFoundError(Exception):
            pass

    @staticmethod
    def nixl_agent_config(**kwargs):
        return kwargs

    class nixl_agent:
        backends = {"UCX": object()}

        def __init__(self, name, config):
            self.hang, self.pending, self.issued = set(), [], []
            self.meta, self.notifs, self.deregistered = set(), [], []

        def register_memory(self, regions, mem_type):
            return tuple(regions)

        def deregister_memory(self, registered):
            self.deregistered.append(registered)

        def fetch_remote_metadata(self, agent, ip, port):
            self.meta.add(agent)

        def check_remote_metadata(self, agent):
            return agent in self.meta

        def remove_remote_agent(self, agent):
            self.meta.discard(agent)

        def get_xfer_descs(self, ranges, mem_type):
            return list(ranges)

        def initialize_xfer(self, op, local, remote, agent):
            self.issued.append(remote[0][0])
            return {"local": local, "remote": remote, "state": "PROC", "released": False}

        def _copy(self, handle):
            import ctypes
            for (dst, size, _), (src, _, _) in zip(handle["local"], handle["remote"], strict=True):
                ctypes.memmove(dst, src, size)
            handle["state"] = "DONE"

        def transfer(self, handle):
            if any(lo <= handle["remote"][0][0] < hi for lo, hi in self.hang):
                self.pending.append(handle)
                return "PROC"
            self._copy(handle)
            return "DONE"

        def check_xfer_state(self, handle):
            return handle["state"]

        def release_xfer_handle(self, handle):
            assert handle["state"] != "PROC", "released in flight"
            handle["released"] = True

        def send_notif(self, agent, message):
            self.notifs.append((agent, message))

        def land(self):
            for handle in self.pending:
                self._copy(handle)
            self.pending = []


def test_a_late_read_is_quarantined_and_its_agent_left_alone_until_it_lands(prefix,
                                                                            monkeypatch):
    """No NIXL: RemotePuller on a stand-in agent (_FakeNixl) reading this
    process's own rings."""
    import numpy as np

    import shmask
    from shmask import remote as rm
    from shmask._native import ffi, lib
    from shmask.refs import RefBatch

    monkeypatch.setattr(rm, "_nixl", lambda: _FakeNixl)
    writers = [shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)) for _ in range(3)]
    reader = shmask.Reader(shmask.Config(name_prefix=prefix + "r"))
    try:
        refs, segments = [], []
        info = ffi.new("shm_info *")
        for k, w in enumerate(writers):
            refs.append(w.publish(np.array([1], np.int32), np.array([k], np.int32),
                                  np.array([-0.5], np.float32)))
            assert lib.shm_read_info(w.segment.base, w.segment.size, info) == lib.SHM_OK
            segments.append(rm.RemoteSegment(w.segment.name, int(info.epoch),
                                             rm._address(w.segment.base), w.segment.size))
        desc = rm.RemoteDescriptor("prod", "10.0.0.1", 1, tuple(segments))
        remote = rm.RemoteBatch(RefBatch.from_refs(refs), desc)
        puller = rm.RemotePuller(port=1, timeout_s=0.2)
        agent = puller._agent
        hung = segments[1]
        agent.hang.add((hung.address, hung.address + hung.size))

        def row(k):   # writer k's one row
            return [[[k]], [[-0.5]]]

        lost = {"lost": 1}   # stale
        # Ring 0 pulled and released; ring 1's READ hangs (given up, kept);
        # ring 2 not tried: its agent is forgotten.
        assert rows(reader, puller.pull(remote)) == [row(0), lost, lost]
        assert [agent_ for agent_, _ in agent.notifs] == ["prod"]
        assert not any(segments[2].address <= a < segments[2].address + segments[2].size
                       for a in agent.issued)
        assert puller.stats.quarantined == 1 and len(puller._late) == 1
        late = puller._late[0]
        assert late.registered not in agent.deregistered
        # While it is out: nothing more is read from that agent.
        issued = len(agent.issued)
        assert rows(reader, puller.pull(remote)) == [lost] * 3
        assert len(agent.issued) == issued
        # Landed: freed on the next pull, which reads afresh (no export
        # here acts on ring 0's release: it reads again).
        agent.hang.clear()
        agent.land()
        assert rows(reader, puller.pull(remote)) == [row(0), row(1), row(2)]
        assert puller._late == [] and late.registered in agent.deregistered
        assert late.handle["released"]
        # Past the bound: no READ from anyone until the quarantine drains.
        puller._late = [rm._Late(f"a{i}", {"state": "PROC"}, None, None)
                        for i in range(rm.MAX_QUARANTINE)]
        issued = len(agent.issued)
        assert rows(reader, puller.pull(remote))[1:] == [lost] * 2
        assert len(agent.issued) == issued
    finally:
        for w in writers:
            w.close()


def test_two_entries_naming_one_record_are_both_lost(prefix, monkeypatch):
    """No NIXL (_FakeNixl): a batch naming one record twice gives neither
    entry the rows (one of them is another request's)."""
    import numpy as np

    import shmask
    from shmask import remote as rm
    from shmask._native import ffi, lib
    from shmask.refs import RefBatch

    monkeypatch.setattr(rm, "_nixl", lambda: _FakeNixl)
    w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix))
    try:
        refs = [w.publish(np.array([1], np.int32), np.array([k], np.int32),
                          np.array([-0.5], np.float32)) for k in range(2)]
        info = ffi.new("shm_info *")
        assert lib.shm_read_info(w.segment.base, w.segment.size, info) == lib.SHM_OK
        desc = rm.RemoteDescriptor("prod", "10.0.0.1", 1, (rm.RemoteSegment(
            w.segment.name, int(info.epoch), rm._address(w.segment.base), w.segment.size),))
        batch = RefBatch.from_refs([refs[0], refs[1], refs[0]])
        puller = rm.RemotePuller(port=1, timeout_s=1)
        out = puller.pull(rm.RemoteBatch(batch, desc))
        got = entries(out)
        assert [kind for kind, _ in got] == [3, 2, 3]
        assert got[0][1] == got[2][1] == 2   # LOST_INVALID
        assert len(puller._agent.notifs) == 1   # the other record's release alone
    finally:
        w.close()

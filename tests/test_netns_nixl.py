"""Two hosts on one machine (tests/netns.py: two network namespaces joined
by a veth pair), and NIXL moving bytes between them: the foundation for a
multi-node transport (one-sided READs of registered memory over UCX).

The producer, in namespace A, registers a buffer of private anonymous
memory (never in /dev/shm) filled from a seed only it knows; the reader, in
namespace B, READs it through NIXL into its own registered buffer and
reports the SHA-256 of what it got; the test compares that with the
pattern's own, and checks that the veth's counters grew by at least the
bytes read: the bytes crossed the "network". UCX is told to use TCP only
(UCX_TLS=tcp): left to itself it sees the same machine and READs through
cross-memory attach (cma, process_vm_readv), which crosses no network.

Needs root (namespaces) and NIXL's `nixl-cu12` package
(tests/compat/requirements-nixl.txt, which `make test` installs); skipped, with the reason, without.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import netns  # tests/netns.py: pytest puts tests/ on sys.path, as for api_walk
import numpy as np
import pytest
from remote_child import host_env, last_json  # UCX over TCP on the veth only (no cma)

SIZE = 8 << 20
SEED = 20_260_512
SLICE_OFFSET = (3 << 20) + 1234  # unaligned on purpose
SLICE_BYTES = 4096
LISTEN_PORT = 5599               # each namespace has its own ports: no clash between tests


needs_nixl_hosts = pytest.mark.skipif(netns.nixl_unavailable() is not None,
                                      reason=netns.nixl_unavailable() or "")
needs_hosts = pytest.mark.skipif(netns.available() is not None,
                                 reason=netns.available() or "")


COMMON = r"""
import base64, hashlib, json, os, sys, time
import numpy as np
# nixl-cu12's own module: the `nixl` meta package would pick a build by
# importing torch (a second or more), and its cu13 build needs the same
from nixl_cu12._api import nixl_agent, nixl_agent_config


def make_agent(name, listen, port):
    agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=listen, listen_port=port,
                                               backends=["UCX"]))
    assert "UCX" in agent.backends, agent.get_plugin_list()
    return agent


def sha(array):
    return hashlib.sha256(memoryview(array)).hexdigest()


def emit(**fields):
    print(json.dumps(fields), flush=True)
"""

PRODUCER = COMMON + r"""
out, mode, port, wait_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
size, seed = int(sys.argv[5]), int(sys.argv[6])
agent = make_agent("producer", mode == "listener", port)
# Private anonymous memory (numpy's allocator: an 8 MiB array is an mmap of
# its own), filled from a seed the reader never sees.
buf = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
addr = buf.ctypes.data
with open("/proc/self/maps") as maps:
    mapping = next(line.strip() for line in maps
                   if int(line.split("-")[0], 16) <= addr < int(line.split()[0].split("-")[1], 16))
descs = agent.get_reg_descs([(addr, buf.nbytes, 0, "")], "DRAM")
registered = agent.register_memory(descs)
metadata = agent.get_agent_metadata()
with open(out + ".tmp", "w") as f:
    json.dump({"metadata": base64.b64encode(metadata).decode() if mode == "file" else None,
               "addr": addr, "len": buf.nbytes, "pid": os.getpid()}, f)
os.rename(out + ".tmp", out)
notifs, deadline = {}, time.monotonic() + wait_s
while time.monotonic() < deadline:
    for who, messages in agent.get_new_notifs().items():
        notifs.setdefault(who, []).extend(m.decode() for m in messages)
    if "done" in notifs.get("reader", []):
        break
    time.sleep(0.005)
agent.deregister_memory(registered)
emit(sha256=sha(buf), mapping=mapping, notifs=notifs, metadata_bytes=len(metadata))
sys.exit(0 if "done" in notifs.get("reader", []) else 3)
"""

READER = COMMON + r"""
desc_path, mode, a_ip, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
slice_offset, slice_bytes, ready_path = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
deadline = time.monotonic() + 30
while not os.path.exists(desc_path):
    assert time.monotonic() < deadline, "the producer never wrote its descriptor"
    time.sleep(0.01)
desc = json.load(open(desc_path))
agent = make_agent("reader", mode == "listener", port)
t0 = time.perf_counter()
if mode == "listener":   # the metadata crosses the veth too, from the producer's listener
    agent.fetch_remote_metadata("producer", a_ip, port)
    while not agent.check_remote_metadata("producer"):
        assert time.perf_counter() - t0 < 15, "no metadata from the producer's listener"
        time.sleep(0.01)
    remote = "producer"
else:
    remote = agent.add_remote_agent(base64.b64decode(desc["metadata"]))
    remote = remote.decode() if isinstance(remote, bytes) else remote   # 1.5.1 returns bytes
metadata_s = time.perf_counter() - t0

dst = np.zeros(desc["len"], np.uint8)          # our own memory, zeros until a READ lands
piece = np.zeros(slice_bytes, np.uint8)
registered = [agent.register_memory([(a.ctypes.data, a.nbytes, 0, "")], "DRAM") for a in (dst, piece)]


calling = ""   # the NIXL call under way, named in a fault


def read(local, remote_addr, n, limit_s=20.0):
    # One READ of n bytes at remote_addr into local; (state, seconds, backend).
    global calling
    local_descs = agent.get_xfer_descs([(local.ctypes.data, n, 0)], "DRAM")
    remote_descs = agent.get_xfer_descs([(remote_addr, n, 0)], "DRAM")
    t = time.perf_counter()
    calling = "initialize_xfer"
    handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
    try:
        calling = "transfer"
        state = agent.transfer(handle)
        calling = "check_xfer_state"
        while state == "PROC" and time.perf_counter() - t < limit_s:
            state = agent.check_xfer_state(handle)
        seconds = time.perf_counter() - t
        backend = agent.query_xfer_backend(handle)
    except Exception:
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            pass   # the first error is the one to report
        raise
    calling = "release_xfer_handle"
    agent.release_xfer_handle(handle)
    return state, seconds, backend


def measured(local, remote_addr, n):
    state, seconds, backend = read(local, remote_addr, n)
    assert state == "DONE", state
    view = local[:n]
    return {"bytes": n, "seconds": seconds, "bytes_per_s": n / seconds, "backend": backend,
            "sha256": sha(view), "head": bytes(view[:8]).hex()}


result = {"remote": remote, "metadata_s": metadata_s}
result["full"] = measured(dst, desc["addr"], desc["len"])              # first: connects too
if ready_path == "-":
    result["slice"] = measured(piece, desc["addr"] + slice_offset, slice_bytes)
    dst[:] = 0
    result["again"] = measured(dst, desc["addr"], desc["len"])        # connected: the wire's pace
    agent.send_notif(remote, b"done")
else:   # fault test: READ again and again until the producer goes away
    limit_s = float(sys.argv[8])   # the reader's own deadline for one READ
    open(ready_path, "w").close()
    reads, fault, loop_end = 0, None, time.monotonic() + 30
    while fault is None and time.monotonic() < loop_end:
        try:
            state, seconds, _ = read(dst, desc["addr"], desc["len"], limit_s)
            reads += 1
            if state != "DONE":
                fault = {"how": "state", "call": "check_xfer_state", "state": state,
                         "seconds_in_read": seconds}
        except Exception as exc:
            fault = {"how": "exception", "call": calling, "type": type(exc).__name__,
                     "message": str(exc)}
        if fault is not None:
            fault["at"] = time.time()
    result.update(reads_before_fault=reads, fault=fault)
    t = time.perf_counter()
    try:   # a READ after the fault
        state, _, _ = read(dst, desc["addr"], desc["len"], limit_s=2)
        result["after"] = {"state": state, "seconds": time.perf_counter() - t}
    except Exception as exc:
        result["after"] = {"type": type(exc).__name__, "call": calling,
                           "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    agent.remove_remote_agent(remote)
    result["remove_remote_agent_s"] = time.perf_counter() - t
for r in registered:
    agent.deregister_memory(r)
emit(**result)
"""


def _expected() -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, SIZE, dtype=np.uint8)


def _sha(data: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(data))).hexdigest()


def _start(hosts: netns.Hosts, tmp_path: Path, mode: str, ready: str, wait_s: float,
           limit_s: float = 20):
    desc = tmp_path / "producer.json"
    producer = netns.run_in(hosts.a, [sys.executable, "-c", PRODUCER, str(desc), mode,
                                      str(LISTEN_PORT), str(wait_s), str(SIZE), str(SEED)],
                            env=host_env(hosts.a_dev), timeout=55)
    reader = netns.run_in(hosts.b, [sys.executable, "-c", READER, str(desc), mode, hosts.a_ip,
                                    str(LISTEN_PORT), str(SLICE_OFFSET), str(SLICE_BYTES), ready,
                                    str(limit_s)],
                          env=host_env(hosts.b_dev), timeout=55)
    return producer, reader


@needs_nixl_hosts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["file", "listener"])
def test_reader_in_another_namespace_reads_the_producers_buffer_over_the_veth(prefix, tmp_path, mode):
    """mode "file": the producer's agent metadata goes through a file (the
    filesystem is shared); "listener": through NIXL's own listener on A's
    address (fetch_remote_metadata), over the veth like the data."""
    started = time.monotonic()
    producer = reader = None
    with netns.two_hosts(prefix) as hosts:
        try:
            before = (netns.link_bytes(hosts.a, hosts.a_dev), netns.link_bytes(hosts.b, hosts.b_dev))
            producer, reader = _start(hosts, tmp_path, mode, "-", wait_s=45)
            out_r, err_r = reader.communicate(timeout=50)
            out_p, err_p = producer.communicate(timeout=20)
            after = (netns.link_bytes(hosts.a, hosts.a_dev), netns.link_bytes(hosts.b, hosts.b_dev))
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
    assert reader.returncode == 0, err_r[-3000:]
    assert producer.returncode == 0, (out_p, err_p[-3000:])
    got, sent = last_json(out_r), last_json(out_p)

    pattern = _expected()
    assert sent["sha256"] == _sha(pattern)                  # the producer held the pattern
    assert sent["mapping"].split()[5:] in ([], ["[heap]"]), sent["mapping"]   # no file, no /dev/shm
    assert sent["notifs"] == {"reader": ["done"]}             # the reader's NIXL notification
    for read in ("full", "again"):
        assert got[read]["bytes"] == SIZE
        assert got[read]["sha256"] == _sha(pattern), f"{read}: the bytes read are not the pattern"
        assert got[read]["backend"] == "UCX"
    assert got["slice"]["sha256"] == _sha(pattern[SLICE_OFFSET:SLICE_OFFSET + SLICE_BYTES])
    assert got["slice"]["head"] == pattern[SLICE_OFFSET:SLICE_OFFSET + 8].tobytes().hex()

    # The bytes crossed the veth: B received, A sent, at least what was read.
    read_bytes = 2 * SIZE + SLICE_BYTES
    rx_b = after[1]["rx"] - before[1]["rx"]
    tx_a = after[0]["tx"] - before[0]["tx"]
    assert rx_b >= read_bytes and tx_a >= read_bytes, (rx_b, tx_a, read_bytes)

    print(f"\n[{mode}] metadata {got['metadata_s'] * 1e3:.1f} ms; first READ of {SIZE >> 20} MiB "
          f"{got['full']['seconds'] * 1e3:.1f} ms ({got['full']['bytes_per_s'] / 1e6:.0f} MB/s, "
          f"connecting included), again {got['again']['seconds'] * 1e3:.1f} ms "
          f"({got['again']['bytes_per_s'] / 1e6:.0f} MB/s); 4 KiB slice "
          f"{got['slice']['seconds'] * 1e6:.0f} us; veth B rx {rx_b} bytes; "
          f"test {time.monotonic() - started:.1f} s")


LINK_DOWN_LIMIT_S = 3.0


@needs_nixl_hosts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["sigkill", "link-down"])
def test_a_producer_gone_mid_reads_ends_the_readers_transfer_in_bounded_time(prefix, tmp_path, fault):
    """While the reader READs the producer's buffer in a loop, either the
    producer is SIGKILLed (its kernel closes the TCP connections) or A's
    end of the veth goes down (a pulled cable: no FIN, no RST, the producer
    lives on).

    sigkill: NIXL itself reports it, within milliseconds: the READ in
    flight raises nixlRemoteDisconnectError (from check_xfer_state, or
    from transfer if the kill fell between READs), and a READ after it is
    refused at once.

    link-down: NIXL reports nothing (UCX over TCP waits on the kernel's
    retransmissions: minutes); the READ stays "PROC" until the reader's own
    deadline, and release_xfer_handle / remove_remote_agent then return
    at once. A transport must keep a deadline of its own.

    Nothing hangs either way: every process group is killed in `finally`."""
    ready = tmp_path / "reader-ready"
    producer = reader = None
    limit_s = 20 if fault == "sigkill" else LINK_DOWN_LIMIT_S
    with netns.two_hosts(prefix) as hosts:
        try:
            producer, reader = _start(hosts, tmp_path, "file", str(ready), wait_s=50, limit_s=limit_s)
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert reader.poll() is None, reader.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the reader never finished its first READ"
                time.sleep(0.01)
            time.sleep(0.2)       # into the loop of READs
            faulted_at = time.time()
            if fault == "sigkill":
                netns.kill_group(producer)
            else:
                netns.set_link(hosts.a, hosts.a_dev, up=False)
            out_r, err_r = reader.communicate(timeout=40)
        finally:
            netns.kill_group(reader)
            netns.kill_group(producer)
    assert reader.returncode == 0, err_r[-3000:]
    got = last_json(out_r)
    assert got["full"]["sha256"] == _sha(_expected())   # it did read before the fault
    seen = got["fault"]
    assert seen is not None, got
    detected_s = seen["at"] - faulted_at
    if fault == "sigkill":
        assert producer.returncode == -9
        assert seen["how"] == "exception" and seen["type"] == "nixlRemoteDisconnectError", seen
        assert detected_s < 5, f"the reader saw the kill only after {detected_s:.1f} s: {seen}"
        assert got["after"].get("type") == "nixlRemoteDisconnectError", got["after"]
        assert got["after"]["seconds"] < 1, got["after"]
    else:
        # What NIXL 1.5.1 does today; should it start reporting the lost
        # peer itself, this fails and the transport's deadline can relax.
        assert seen == {**seen, "how": "state", "state": "PROC"}, seen
        assert LINK_DOWN_LIMIT_S <= seen["seconds_in_read"] < LINK_DOWN_LIMIT_S + 2, seen
        assert detected_s < LINK_DOWN_LIMIT_S + 5, detected_s
        assert got["after"].get("state") == "PROC", got["after"]
    assert got["remove_remote_agent_s"] < 2, got
    print(f"\n[{fault}] after {got['reads_before_fault']} READs the reader saw {seen} "
          f"{detected_s * 1e3:.0f} ms after the fault; a READ after: {got['after']}; "
          f"remove_remote_agent {got['remove_remote_agent_s'] * 1e3:.1f} ms")


# ---------------------------------------------------------------- the harness itself

PING_PONG = r"""
import socket, sys
role, ip, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "server":
    s = socket.create_server((ip, port))
    print("listening", flush=True)
    c, peer = s.accept()
    got = 0
    while got < size:
        chunk = c.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    c.sendall(str(got).encode())
    print(peer[0], got, flush=True)
else:
    c = socket.create_connection((ip, port), timeout=10)
    c.sendall(b"x" * size)
    print(c.recv(64).decode(), flush=True)
"""


@needs_hosts
@pytest.mark.timeout(60)
def test_two_hosts_talk_over_the_veth_and_are_removed_even_after_an_error(prefix):
    hosts = netns.names(prefix)
    # A crashed earlier run left one of the namespaces behind: made again anyway.
    subprocess.run(["ip", "netns", "add", hosts.a], check=True)
    assert len(hosts.a_dev) <= 15 and len(hosts.b_dev) <= 15
    size = 1 << 20
    server = client = None
    with pytest.raises(RuntimeError, match="on purpose"):
        with netns.two_hosts(prefix) as made:
            assert made == hosts
            try:
                before = netns.link_bytes(hosts.b, hosts.b_dev)
                server = netns.run_in(hosts.a, [sys.executable, "-c", PING_PONG, "server",
                                                hosts.a_ip, "7000", str(size)], timeout=30)
                assert server.stdout.readline().strip() == "listening"
                client = netns.run_in(hosts.b, [sys.executable, "-c", PING_PONG, "client",
                                                hosts.a_ip, "7000", str(size)], timeout=30)
                out_c, err_c = client.communicate(timeout=30)
                out_s, _ = server.communicate(timeout=30)
                after = netns.link_bytes(hosts.b, hosts.b_dev)
            finally:
                netns.kill_group(client)
                netns.kill_group(server)
            assert client.returncode == 0, err_c
            assert out_c.strip() == str(size)
            assert out_s.split() == [hosts.b_ip, str(size)]     # it came from B's address
            assert after["tx"] - before["tx"] >= size            # through B's end of the veth
            # B cannot reach this machine's own namespace: its veth is its only way out.
            assert subprocess.run(["ip", "-n", hosts.b, "route", "get", "8.8.8.8"],
                                  capture_output=True).returncode != 0
            raise RuntimeError("on purpose")
    left = netns.list_namespaces()
    assert hosts.a not in left and hosts.b not in left
    assert not os.path.exists(f"/sys/class/net/{hosts.a_dev}")
    assert not os.path.exists(f"/sys/class/net/{hosts.b_dev}")


def _group_members(group: int) -> list[int]:
    """Live (not zombie) processes of process group `group`."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(fields[2]) == group and fields[0] not in (b"Z", b"X"):
            members.append(int(entry))
    return members


@needs_hosts
@pytest.mark.timeout(60)
def test_run_in_timeout_kills_the_whole_group(prefix):
    with netns.two_hosts(prefix) as hosts:
        proc = netns.run_in(hosts.a, ["sh", "-c", "sleep 300 & sleep 300; wait"], timeout=1)
        try:
            start = time.monotonic()
            assert proc.wait(timeout=20) == -9
            assert time.monotonic() - start < 10
            # The background sleep of that group went too.
            while _group_members(proc.pid) and time.monotonic() - start < 10:
                time.sleep(0.05)
            assert _group_members(proc.pid) == []
        finally:
            netns.kill_group(proc)

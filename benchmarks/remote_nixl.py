"""Rows to another host (issue 37): inline in the batch vs pulled through NIXL.

    python benchmarks/remote_nixl.py [--requests 256] [--tokens 50] [--support 1000]
                                     [--warmup 3] [--emissions 7] [--json PATH]
    python benchmarks/remote_nixl.py --smoke --json PATH     # a tiny size, seconds

Two "hosts" on one machine: two network namespaces joined by a veth pair
(tests/netns.py's two_hosts; needs root, iproute2 and `nixl-cu12`). A
producer (the scheduler) in namespace A publishes each emission of R requests
x T tokens x W-id support rows into its ring (shmask.Writer.append_step per
token, then take_batch, as benchmarks/transport.py does); a receiver in
namespace B gets one zmq PUSH/PULL message over TCP on the veth, holds every
row readable (Reader.open), touches them (a numpy sum of every id and
logprob), gives them back and acks, so one emission is in flight at a time.
Three paths, each its own pair of processes, one after the other:

  local   the single-host ring path, for reference: the same publish, the
          refs sent as they are (RefBatch.to_bytes) to a receiver in the SAME
          namespace (zmq TCP on A's address) that opens them in /dev/shm and
          releases them
  inline  (a) the producer copies the rows into the batch
          (RefBatch.to_inline(reader), a Reader in the producer's process)
          and sends the bytes; the receiver opens the inline entries
  nixl    (b) the producer exports its ring once (RemoteExport) and sends
          RemoteBatch(batch, export.descriptor(ip)).to_bytes() (refs plus a
          descriptor); the receiver pulls the records with RemotePuller
          (UCX over TCP on the veth: UCX_TLS=tcp, UCX_NET_DEVICES=<veth>) and
          opens the inline entries it returns; the export releases the
          records on the puller's notification
  sidecar the same as nixl, but the ring is exported by a sidecar process
          (shmask.remote_sidecar.Sidecar, SHMASK_REMOTE_EXPORT=process, the
          engines' default): the producer's process never serves a READ;
          the sidecar's own CPU (CLOCK of its process, every thread) is
          measured beside it and reported apart

Why to_inline and not batch.for_host(peer_host, reader): the two namespaces
share the kernel's boot id and /dev/shm, so the receiver's shmask.host_id()
is the producer's and for_host would hand the batch back unchanged. A real
second host has another id, and for_host then does exactly to_inline's work.

Measured per emission (medians over --emissions, after --warmup):
  socket bytes   every frame the producer sends on the zmq socket (the
                 16-byte header frame included)
  veth bytes     the veth's kernel counters (A's end, rx + tx) over the
                 whole path run, setup, warm-up and NIXL metadata included,
                 divided by all emissions: what really crossed the "network"
  sender CPU     time.process_time (the whole process, every thread) around
  (send side)    publish (the T append_step calls + take_batch) + the wire
                 form (to_inline / RemoteBatch / to_bytes) + the send call;
                 columns also give each part
  sender CPU     process_time over the whole emission cycle, from the first
  (cycle)        append to the receiver's ack: adds what other threads spend
                 after the send call returns (zmq's I/O thread writing the
                 bytes; NIXL/UCX serving the READs, the release thread)
  receiver CPU   process_time around recv + pull (nixl) / parse + open every
  (calls)        entry + touch + release
  receiver CPU   process_time over the receiver's whole cycle (ack to ack): adds
  (cycle)        zmq's I/O thread receiving the bytes before recv returns and
                 UCX's threads; the harness's checksum is taken out (its
                 thread CPU clock)
  latency        wall time from the producer's refs in hand (after take_batch,
                 before the wire form) to every row readable at the receiver
                 (all entries opened); one CLOCK_MONOTONIC for both namespaces
Every emission is checked: the receiver's CRC of the rows it opened
(_common.rows_crc, request by request) must equal the CRC of the pool rows
the producer appended, on every path (so the rows are equal on all paths),
and every entry must arrive in the expected form (ring refs on local, inline
entries on inline and nixl).

Goals (issue 37): the sockets carry refs only (nixl's socket bytes <= 1% of
inline's), and the scheduler's CPU per emission within 2x of the local ring
path (both CPU figures are judged; for the sidecar path, the producer
process's whole cycle, the sidecar's CPU given beside it). Children run in their own process groups
(killed in finally); the namespaces are removed in finally.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    BATCH,
    EMIT_TOKENS,
    SEGMENT_PREFIX,
    cpu_seconds,
    die_with_parent,
    make_pool,
    now,
    print_table,
    remove_segments_of,
    ring_mb_for,
    rows_crc,
    thread_cpu,
)

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
DEFAULT_SUPPORT = 1000
DEFAULT_SIZE = (BATCH, EMIT_TOKENS, DEFAULT_SUPPORT)  # 256 x 50 x 1000, the issue's
SMOKE_SIZE = (16, 4, 50)
PATHS = ("local", "inline", "nixl", "sidecar")
DESCRIPTIONS = {
    "local": "single host: refs as-is, receiver in the same namespace reads /dev/shm",
    "inline": "(a) rows copied into the batch (to_inline), sent over the veth",
    "nixl": "(b) refs + descriptor over the veth; receiver pulls through NIXL",
    "sidecar": "(b) as nixl, the ring exported by a sidecar process, not the producer's",
}
HEADER = struct.Struct("<qd")  # emission index (or STOP), producer's refs-in-hand time
STOP = -2
HELLO = b"hello"
PORTS = {"local": (5721, 5722), "inline": (5731, 5732), "nixl": (5741, 5742),
         "sidecar": (5751, 5752)}  # data, acks
NIXL_PORTS = {"nixl": (5745, 5746), "sidecar": (5755, 5756)}  # the export's, the puller's
POLL_MS = 120_000  # a peer silent this long is dead: the child fails, the parent kills all
CHILD_TIMEOUT_S = 540.0
KIND_SHM, KIND_INLINE = 1, 2


def _netns() -> Any:
    """tests/netns.py (tests/ is not a package): imported by path."""
    spec = importlib.util.spec_from_file_location("_shmask_tests_netns", REPO / "tests" / "netns.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# ------------------------------------------------------------------ children

def _config(spec: dict[str, Any]) -> Any:
    import shmask

    return shmask.Config(ring_mb=spec["ring_mb"], name_prefix=SEGMENT_PREFIX, full_wait_ms=50,
                         lease_s=600)


def _wait(sock: Any) -> None:
    if not sock.poll(POLL_MS):
        raise TimeoutError(f"no message for {POLL_MS / 1000:.0f} s: the peer died")


def idle_cpu(seconds: float = 1.0) -> float:
    """CPU seconds per second this process spends doing nothing, its
    sockets, NIXL agent (progress and listen threads) and release thread
    still open: what those threads cost whatever the traffic."""
    started = cpu_seconds()
    time.sleep(seconds)
    return (cpu_seconds() - started) / seconds


def process_cpu(pid: int) -> float:
    """CPU seconds of another process, every thread (its CPU-time clock,
    clock_getcpuclockid: exact, where /proc's utime is in 10 ms ticks)."""
    libc = ctypes.CDLL(None, use_errno=True)
    clock = ctypes.c_int()
    err = libc.clock_getcpuclockid(pid, ctypes.byref(clock))
    if err:
        raise OSError(err, f"clock_getcpuclockid({pid})")
    return time.clock_gettime(clock.value)


def run_producer(spec: dict[str, Any]) -> None:
    die_with_parent(spec["parent"])
    import zmq

    import shmask

    path, ip = spec["path"], spec["a_ip"]
    requests, tokens, width = spec["requests"], spec["tokens"], spec["support"]
    pool = make_pool(requests, width, "support", seed=spec["seed"])
    writer = shmask.Writer(_config(spec))
    context = zmq.Context()
    export = None
    result: dict[str, Any] = {key: [] for key in (
        "append_cpu_s", "take_cpu_s", "wire_cpu_s", "send_cpu_s", "send_side_cpu_s",
        "send_side_thread_cpu_s", "cycle_cpu_s", "cycle_wall_s", "socket_bytes",
        "refs_in_hand_at", "sidecar_cycle_cpu_s")}
    sidecar = None
    try:
        queues = [writer.open_queue("support") for _ in range(requests)]
        slots = np.array([q.handle for q in queues], np.int64)
        reader = shmask.Reader(_config(spec)) if path == "inline" else None
        if path == "nixl":
            from shmask.remote import RemoteBatch, RemoteExport

            export = RemoteExport(writer, port=NIXL_PORTS[path][0])
        elif path == "sidecar":
            from shmask.remote import RemoteBatch
            from shmask.remote_sidecar import Sidecar

            export = sidecar = Sidecar(writer, ip=ip, port=NIXL_PORTS[path][0])
        data_port, ack_port = PORTS[path]
        out = context.socket(zmq.PUSH)
        out.linger = 2000
        out.bind(f"tcp://{ip}:{data_port}")
        acks = context.socket(zmq.PULL)
        acks.bind(f"tcp://{ip}:{ack_port}")
        _wait(acks)
        assert acks.recv() == HELLO
        warmup, emissions = spec["warmup"], spec["warmup"] + spec["measured"]
        step = 0
        cycle_start, cycle_began = cpu_seconds(), now()
        side_start = process_cpu(sidecar.pid) if sidecar else 0.0
        measured_start = side_measured_start = 0.0
        for emission in range(emissions):
            if emission == warmup:
                measured_start = cpu_seconds()
                side_measured_start = process_cpu(sidecar.pid) if sidecar else 0.0
            c0, t0 = cpu_seconds(), thread_cpu()
            for _ in range(tokens):
                writer.append_step(slots, *pool.step(step))
                step += 1
            c1 = cpu_seconds()
            batch = writer.take_batch(queues)
            in_hand = now()
            c2 = cpu_seconds()
            if path == "local":
                payload = batch.to_bytes()
            elif path == "inline":
                payload = batch.to_inline(reader).to_bytes()
            else:
                assert export is not None
                payload = RemoteBatch(batch, export.descriptor(ip)).to_bytes()
            c3 = cpu_seconds()
            header = HEADER.pack(emission, in_hand)
            out.send(header, zmq.SNDMORE)
            out.send(payload, copy=False)
            c4, t4 = cpu_seconds(), thread_cpu()
            sent = len(header) + len(payload)
            del payload, batch
            _wait(acks)
            acks.recv()
            cycle_end, cycle_ended = cpu_seconds(), now()
            side_end = process_cpu(sidecar.pid) if sidecar else 0.0
            if emission >= warmup:
                for key, value in (("append_cpu_s", c1 - c0), ("take_cpu_s", c2 - c1),
                                   ("wire_cpu_s", c3 - c2), ("send_cpu_s", c4 - c3),
                                   ("send_side_cpu_s", c4 - c0),
                                   ("send_side_thread_cpu_s", t4 - t0),
                                   ("cycle_cpu_s", cycle_end - cycle_start),
                                   ("cycle_wall_s", cycle_ended - cycle_began),
                                   ("socket_bytes", sent), ("refs_in_hand_at", in_hand),
                                   ("sidecar_cycle_cpu_s", side_end - side_start)):
                    result[key].append(value)
            cycle_start, cycle_began, side_start = cycle_end, cycle_ended, side_end
        result["measured_cpu_s"] = cpu_seconds() - measured_start
        if sidecar is not None:
            result["sidecar_measured_cpu_s"] = process_cpu(sidecar.pid) - side_measured_start
        out.send(HEADER.pack(STOP, now()))
        if export is not None:  # every record given back on the puller's word
            deadline = time.monotonic() + 10
            while export.stats.releases < emissions * requests and time.monotonic() < deadline:
                time.sleep(0.005)
            result["export"] = vars(export.stats).copy()
        result["idle_cpu_per_s"] = idle_cpu()
        stats = writer.stats
        result["writer"] = {"inline_chunks": stats.inline_chunks, "full_waits": stats.full_waits,
                            "expired": stats.expired}
        # The rows every emission carried, checksummed after the clocks stopped.
        result["expected_crc"] = [pool.emission_crc(e * tokens, tokens) for e in range(emissions)]
    finally:
        if export is not None:
            export.close()
        writer.close()
        context.destroy(linger=2000)
    with open(os.path.join(spec["dir"], f"{path}-producer.json"), "w") as f:
        json.dump(result, f)


def run_receiver(spec: dict[str, Any]) -> None:
    die_with_parent(spec["parent"])
    import zmq

    import shmask

    path = spec["path"]
    context = zmq.Context()
    puller = None
    result: dict[str, Any] = {key: [] for key in (
        "index", "crc", "kinds_ok", "calls_cpu_s", "cycle_cpu_s", "recv_cpu_s", "pull_cpu_s",
        "open_cpu_s", "touch_cpu_s", "release_cpu_s", "received_at", "pulled_at",
        "readable_at", "touched_at", "in_hand_at", "socket_bytes")}
    expected_kind = KIND_SHM if path == "local" else KIND_INLINE
    try:
        reader = shmask.Reader(_config(spec))
        if path in NIXL_PORTS:
            from shmask.remote import RemotePuller

            puller = RemotePuller(port=NIXL_PORTS[path][1], timeout_s=60)
        data_port, ack_port = PORTS[path]
        inbox = context.socket(zmq.PULL)
        inbox.connect(f"tcp://{spec['a_ip']}:{data_port}")
        acks = context.socket(zmq.PUSH)
        acks.linger = 2000
        acks.connect(f"tcp://{spec['a_ip']}:{ack_port}")
        acks.send(HELLO)
        cycle_start = cpu_seconds()
        while True:
            _wait(inbox)
            c0 = cpu_seconds()
            frames = inbox.recv_multipart()
            received = now()
            index, in_hand = HEADER.unpack(frames[0])
            if index == STOP:
                break
            data = frames[1]
            got = sum(len(frame) for frame in frames)
            c1 = cpu_seconds()
            batch = puller.pull(data) if puller is not None else shmask.RefBatch.from_bytes(data)
            pulled = now()
            c2 = cpu_seconds()
            kinds_ok = bool((batch.entries["kind"] == expected_kind).all())
            chunks = [reader.open(ref) for ref in batch]
            readable = now()
            c3 = cpu_seconds()
            touched = 0.0
            for chunk in chunks:  # every id and logprob read once
                touched += float(np.add.reduce(chunk.ids, dtype=np.int64))
                touched += float(np.add.reduce(chunk.logprobs, dtype=np.float64))
            touched_at = now()
            c4 = cpu_seconds()
            harness = thread_cpu()
            crc = 0
            for chunk in chunks:
                crc = rows_crc(chunk.lengths, chunk.ids, chunk.logprobs, crc)
            harness = thread_cpu() - harness
            c5 = cpu_seconds()
            for chunk in chunks:
                chunk.release()
            c6 = cpu_seconds()
            del chunks, batch, data, frames
            acks.send(HEADER.pack(index, in_hand))
            cycle_end = cpu_seconds()
            for key, value in (("index", index), ("crc", crc), ("kinds_ok", kinds_ok),
                               ("calls_cpu_s", (c4 - c0) + (c6 - c5)),
                               ("cycle_cpu_s", cycle_end - cycle_start - harness),
                               ("recv_cpu_s", c1 - c0), ("pull_cpu_s", c2 - c1),
                               ("open_cpu_s", c3 - c2), ("touch_cpu_s", c4 - c3),
                               ("release_cpu_s", c6 - c5), ("received_at", received),
                               ("pulled_at", pulled), ("readable_at", readable),
                               ("touched_at", touched_at), ("in_hand_at", in_hand),
                               ("socket_bytes", got)):
                result[key].append(value)
            cycle_start = cycle_end
        result["idle_cpu_per_s"] = idle_cpu()
        if puller is not None:
            result["puller"] = vars(puller.stats).copy()
    finally:
        if puller is not None:
            puller.close()
        context.destroy(linger=2000)
    with open(os.path.join(spec["dir"], f"{path}-receiver.json"), "w") as f:
        json.dump(result, f)


ROLES = {"producer": run_producer, "receiver": run_receiver}


# ------------------------------------------------------------------ parent

def run_path(netns: Any, hosts: Any, path: str, base: dict[str, Any],
             directory: str) -> dict[str, Any]:
    """One path's producer (namespace A) and receiver (B; A for local), each
    in a process group of its own; both killed (if still running) and the
    producer's ring unlinked (if left) on the way out, whatever happened."""
    spec = dict(base, path=path, dir=directory)
    env_a = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=hosts.a_dev)
    env_b = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=hosts.b_dev)
    where = {"producer": (hosts.a, env_a),
             "receiver": (hosts.a, env_a) if path == "local" else (hosts.b, env_b)}
    procs: dict[str, subprocess.Popen[str]] = {}
    logs = {role: open(os.path.join(directory, f"{path}-{role}.log"), "w") for role in where}
    before = netns.link_bytes(hosts.a, hosts.a_dev)
    started = time.monotonic()
    left: list[str] = []
    try:
        for role, (ns, env) in where.items():
            procs[role] = netns.run_in(
                ns, [sys.executable, str(SCRIPT), "child", role, json.dumps(spec)], env=env,
                timeout=CHILD_TIMEOUT_S, stdout=logs[role], stderr=subprocess.STDOUT,
                cwd=str(REPO))
        deadline = started + CHILD_TIMEOUT_S + 5
        while any(proc.poll() is None for proc in procs.values()):
            failed = [role for role, proc in procs.items() if proc.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            netns.kill_group(proc)
        if "producer" in procs:
            left = remove_segments_of(procs["producer"].pid)
        for log in logs.values():
            log.close()
    seconds = time.monotonic() - started
    after = netns.link_bytes(hosts.a, hosts.a_dev)
    bad = {role: proc.returncode for role, proc in procs.items() if proc.returncode != 0}
    if bad:
        tails = {role: Path(directory, f"{path}-{role}.log").read_text()[-3000:] for role in bad}
        raise RuntimeError(f"path {path}: children exited {bad}:\n" +
                           "\n".join(f"--- {role}\n{tail}" for role, tail in tails.items()))
    with open(os.path.join(directory, f"{path}-producer.json")) as f:
        producer = json.load(f)
    with open(os.path.join(directory, f"{path}-receiver.json")) as f:
        receiver = json.load(f)
    veth = (after["rx"] - before["rx"]) + (after["tx"] - before["tx"])
    return {"producer": producer, "receiver": receiver, "seconds": seconds,
            "veth_bytes": veth, "segments_left_unlinked": left}


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(path: str, raw: dict[str, Any], warmup: int, emissions: int,
              expected_len: int) -> dict[str, Any]:
    p, r = raw["producer"], raw["receiver"]
    measured = [i for i, index in enumerate(r["index"]) if index >= warmup]

    def rec(key: str) -> list[float]:
        return [r[key][i] for i in measured]

    latency = [r["readable_at"][i] - r["in_hand_at"][i] for i in measured]
    to_socket = [r["received_at"][i] - r["in_hand_at"][i] for i in measured]
    pull = [r["pulled_at"][i] - r["received_at"][i] for i in measured]
    opening = [r["readable_at"][i] - r["pulled_at"][i] for i in measured]
    crc_ok = (r["index"] == list(range(emissions))
              and all(r["crc"][i] == p["expected_crc"][index] for i, index in enumerate(r["index"])))
    return {
        "path": path, "description": DESCRIPTIONS[path],
        "socket_bytes": med(p["socket_bytes"]),
        "socket_bytes_received": med(rec("socket_bytes")),
        "veth_bytes_per_emission": raw["veth_bytes"] / emissions,
        "sender_send_side_cpu_s": med(p["send_side_cpu_s"]),
        "sender_send_side_thread_cpu_s": med(p["send_side_thread_cpu_s"]),
        "sender_cycle_cpu_s": med(p["cycle_cpu_s"]),
        "sender_cycle_wall_s": med(p["cycle_wall_s"]),
        "sender_idle_cpu_per_s": p["idle_cpu_per_s"],
        "receiver_idle_cpu_per_s": r["idle_cpu_per_s"],
        "sender_cpu_per_emission_s": p["measured_cpu_s"] / max(1, emissions - warmup),
        # the sidecar process's CPU (sidecar path; 0 elsewhere): per cycle, and
        # its whole measured stretch / the measured emissions
        "sidecar_cycle_cpu_s": med(p["sidecar_cycle_cpu_s"]) if path == "sidecar" else 0.0,
        "sidecar_cpu_per_emission_s": (p["sidecar_measured_cpu_s"] / max(1, emissions - warmup)
                                       if path == "sidecar" else 0.0),
        "sender_parts_cpu_s": {k: med(p[f"{k}_cpu_s"]) for k in ("append", "take", "wire", "send")},
        "receiver_calls_cpu_s": med(rec("calls_cpu_s")),
        "receiver_cycle_cpu_s": med(rec("cycle_cpu_s")),
        "receiver_parts_cpu_s": {k: med(rec(f"{k}_cpu_s"))
                                 for k in ("recv", "pull", "open", "touch", "release")},
        "latency_s": med(latency),
        "latency_parts_s": {"in_hand_to_received": med(to_socket), "received_to_pulled": med(pull),
                            "pulled_to_readable": med(opening)},
        "rows_checked": crc_ok and all(r["kinds_ok"]) and len(r["crc"]) == expected_len,
        "crc_ok": crc_ok, "kinds_ok": all(r["kinds_ok"]),
        "crc": r["crc"], "expected_crc": p["expected_crc"],
        "writer": p.get("writer"), "export": p.get("export"), "puller": r.get("puller"),
        "seconds": raw["seconds"], "segments_left_unlinked": raw["segments_left_unlinked"],
        "raw": {"producer": {k: v for k, v in p.items() if k != "expected_crc"},
                "receiver": {k: v for k, v in r.items() if k != "crc"}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help=f"R (default {DEFAULT_SIZE[0]})")
    parser.add_argument("--tokens", type=int, help=f"T per emission (default {DEFAULT_SIZE[1]})")
    parser.add_argument("--support", type=int, help=f"W ids per row (default {DEFAULT_SIZE[2]})")
    parser.add_argument("--warmup", type=int, help="emissions not measured (default 3; smoke 1)")
    parser.add_argument("--emissions", type=int, help="measured emissions (default 7; smoke 3)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{' x '.join(map(str, SMOKE_SIZE))} (sizes given still apply)")
    parser.add_argument("--json", help="write every figure here too")
    args = parser.parse_args()
    sizes = SMOKE_SIZE if args.smoke else DEFAULT_SIZE
    requests = args.requests if args.requests is not None else sizes[0]
    tokens = args.tokens if args.tokens is not None else sizes[1]
    support = args.support if args.support is not None else sizes[2]
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    measured = args.emissions if args.emissions is not None else (3 if args.smoke else 7)
    if min(requests, tokens, support, measured) < 1 or warmup < 0:
        parser.error("sizes and --emissions must be >= 1, --warmup >= 0")
    netns = _netns()
    reason = netns.available()
    if reason is None and importlib.util.find_spec("nixl_cu12") is None:
        reason = "nixl-cu12 is not installed (pip install -r tests/compat/requirements-nixl.txt)"
    if reason is not None:
        print(f"remote_nixl: cannot run here: {reason}", file=sys.stderr)
        return 2
    emissions = warmup + measured
    ring_mb = ring_mb_for(requests, tokens, support, 2)
    load_before = loadavg()
    print(f"remote_nixl: {requests} requests x {tokens} tokens x {support}-id support rows per "
          f"emission; {warmup} warm-up + {measured} measured emissions per path; ring {ring_mb} "
          f"MiB; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"  machine: nproc {os.cpu_count()}, loadavg before {load_before}")
    base = {"parent": os.getpid(), "requests": requests, "tokens": tokens, "support": support,
            "warmup": warmup, "measured": measured, "ring_mb": ring_mb, "seed": 0}
    directory = tempfile.mkdtemp(prefix="shmaskbench-remote-")
    results: dict[str, dict[str, Any]] = {}
    try:
        with netns.two_hosts(f"shmrn{os.getpid()}") as hosts:
            base.update(a_ip=hosts.a_ip, b_ip=hosts.b_ip)
            print(f"  namespaces {hosts.a} ({hosts.a_ip}, {hosts.a_dev}) and {hosts.b} "
                  f"({hosts.b_ip}, {hosts.b_dev}); UCX_TLS=tcp, UCX_NET_DEVICES=<veth>")
            for path in PATHS:
                raw = run_path(netns, hosts, path, base, directory)
                results[path] = summarise(path, raw, warmup, emissions, emissions)
                print(f"  {path}: done in {raw['seconds']:.1f} s")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    left_ns = [ns for ns in netns.list_namespaces() if ns.startswith(f"shmrn{os.getpid()}")]
    load_after = loadavg()

    a, b, local = results["inline"], results["nixl"], results["local"]
    side = results["sidecar"]
    same_rows = (a["crc"] == b["crc"] == local["crc"] == side["crc"] == a["expected_crc"])
    ms, mb = 1e3, 1e6
    print_table(
        f"Rows to another host: {requests} x {tokens} x {support} support per emission; medians "
        f"of {measured} (after {warmup} warm-up)",
        ["path", "socket bytes", "veth MB", "sender CPU ms (send side)",
         "sender thread CPU ms (send side)", "sender CPU ms (cycle)",
         "sidecar CPU ms (cycle)", "receiver CPU ms (calls)", "receiver CPU ms (cycle)",
         "latency ms", "rows checked"],
        [[key, r["socket_bytes"], r["veth_bytes_per_emission"] / mb,
          r["sender_send_side_cpu_s"] * ms, r["sender_send_side_thread_cpu_s"] * ms,
          r["sender_cycle_cpu_s"] * ms, r["sidecar_cycle_cpu_s"] * ms,
          r["receiver_calls_cpu_s"] * ms, r["receiver_cycle_cpu_s"] * ms, r["latency_s"] * ms,
          r["rows_checked"]] for key, r in results.items()]
        + [[name, x["socket_bytes"] / y["socket_bytes"],
            (x["veth_bytes_per_emission"] / y["veth_bytes_per_emission"]
             if y["veth_bytes_per_emission"] else float("nan")),
            x["sender_send_side_cpu_s"] / y["sender_send_side_cpu_s"],
            x["sender_send_side_thread_cpu_s"] / y["sender_send_side_thread_cpu_s"],
            x["sender_cycle_cpu_s"] / y["sender_cycle_cpu_s"], "",
            x["receiver_calls_cpu_s"] / y["receiver_calls_cpu_s"],
            x["receiver_cycle_cpu_s"] / y["receiver_cycle_cpu_s"],
            x["latency_s"] / y["latency_s"], ""]
           for name, x, y in (("ratio b/a (nixl / inline)", b, a),
                              ("ratio b/local (nixl / local)", b, local),
                              ("ratio sidecar/local", side, local),
                              ("ratio a/local (inline / local)", a, local))],
        note="local: " + DESCRIPTIONS["local"] + "; inline: " + DESCRIPTIONS["inline"]
             + "; nixl: " + DESCRIPTIONS["nixl"] + ". socket bytes: every frame the producer "
             "sent on the zmq socket per emission. veth "
             "MB: the veth's rx + tx over the whole path run / emissions (10^6 bytes; local: "
             "loopback, none). send side: process_time around publish (append_step x T + "
             "take_batch) + wire form + send; thread: the same, the calling thread's CPU "
             "only (time.thread_time). cycle: process_time over the emission's whole "
             "cycle (every thread: zmq I/O, NIXL/UCX; sidecar path: the producer process alone). "
             "sidecar CPU: the sidecar process's CPU over the same cycle (every thread: UCX "
             "serving the READs, the release thread). receiver calls: recv + pull/parse + open "
             "+ touch + release; receiver cycle: ack to ack, the checksum taken out. latency: "
             "refs in hand (after take_batch) -> every row readable at the receiver.")
    print_table(
        "Parts (medians, ms)",
        ["path", "append x T", "take_batch", "wire form", "send", "recv", "pull / parse", "open",
         "touch", "release", "to socket", "pull wall", "open wall", "cycle wall",
         "idle CPU % sender", "idle CPU % receiver"],
        [[key, *(r["sender_parts_cpu_s"][k] * ms for k in ("append", "take", "wire", "send")),
          *(r["receiver_parts_cpu_s"][k] * ms
            for k in ("recv", "pull", "open", "touch", "release")),
          *(r["latency_parts_s"][k] * ms for k in ("in_hand_to_received", "received_to_pulled",
                                                   "pulled_to_readable")),
          r["sender_cycle_wall_s"] * ms, 100 * r["sender_idle_cpu_per_s"],
          100 * r["receiver_idle_cpu_per_s"]]
         for key, r in results.items()],
        note="CPU (process_time) per call, then wall: refs in hand -> recv returned, recv -> "
             "pulled (nixl) / parsed, pulled -> every entry opened; the producer's emission "
             "cycle (first append -> ack). idle CPU: each process's CPU over 1 s of doing "
             "nothing after the last emission, its sockets and NIXL agent still open (100% = "
             "one core).")
    refs_ratio = b["socket_bytes"] / a["socket_bytes"]
    cpu_send = b["sender_send_side_cpu_s"] / local["sender_send_side_cpu_s"]
    cpu_cycle = b["sender_cycle_cpu_s"] / local["sender_cycle_cpu_s"]
    cpu_thread = b["sender_send_side_thread_cpu_s"] / local["sender_send_side_thread_cpu_s"]
    cpu_side = side["sender_cycle_cpu_s"] / local["sender_cycle_cpu_s"]
    goals = {
        "refs_only": {"nixl_socket_bytes": b["socket_bytes"],
                      "inline_socket_bytes": a["socket_bytes"], "ratio": refs_ratio,
                      "limit": 0.01, "pass": refs_ratio <= 0.01},
        "scheduler_cpu_send_side": {"nixl_s": b["sender_send_side_cpu_s"],
                                    "local_s": local["sender_send_side_cpu_s"],
                                    "ratio": cpu_send, "limit": 2.0, "pass": cpu_send <= 2.0},
        "scheduler_cpu_send_side_thread": {"nixl_s": b["sender_send_side_thread_cpu_s"],
                                           "local_s": local["sender_send_side_thread_cpu_s"],
                                           "ratio": cpu_thread, "limit": 2.0,
                                           "pass": cpu_thread <= 2.0},
        "scheduler_cpu_cycle": {"nixl_s": b["sender_cycle_cpu_s"],
                                "local_s": local["sender_cycle_cpu_s"],
                                "ratio": cpu_cycle, "limit": 2.0, "pass": cpu_cycle <= 2.0},
        # the producer process with the sidecar; the sidecar's CPU beside it, not judged
        "scheduler_cpu_cycle_sidecar": {"sidecar_path_producer_s": side["sender_cycle_cpu_s"],
                                        "local_s": local["sender_cycle_cpu_s"],
                                        "sidecar_process_cycle_s": side["sidecar_cycle_cpu_s"],
                                        "sidecar_process_per_emission_s":
                                            side["sidecar_cpu_per_emission_s"],
                                        "ratio": cpu_side, "limit": 2.0, "pass": cpu_side <= 2.0},
    }

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    print(f"goal: sockets carry refs only: nixl {b['socket_bytes']:,.0f} B vs inline "
          f"{a['socket_bytes']:,.0f} B per emission = {100 * refs_ratio:.4f}% (<= 1%): "
          f"{verdict(goals['refs_only']['pass'])}")
    print(f"goal: scheduler CPU within 2x of the single-host ring path: send side "
          f"{b['sender_send_side_cpu_s'] * ms:.1f} vs {local['sender_send_side_cpu_s'] * ms:.1f} ms "
          f"= {cpu_send:.2f}x: {verdict(cpu_send <= 2)}; send side, the scheduler's thread "
          f"alone {b['sender_send_side_thread_cpu_s'] * ms:.1f} vs "
          f"{local['sender_send_side_thread_cpu_s'] * ms:.1f} ms = {cpu_thread:.2f}x: "
          f"{verdict(cpu_thread <= 2)}; whole cycle "
          f"{b['sender_cycle_cpu_s'] * ms:.1f} vs {local['sender_cycle_cpu_s'] * ms:.1f} ms = "
          f"{cpu_cycle:.2f}x: {verdict(cpu_cycle <= 2)}")
    print(f"goal, the export in a sidecar: the producer process's whole cycle "
          f"{side['sender_cycle_cpu_s'] * ms:.1f} vs {local['sender_cycle_cpu_s'] * ms:.1f} ms = "
          f"{cpu_side:.2f}x: {verdict(cpu_side <= 2)}; the sidecar process meanwhile "
          f"{side['sidecar_cycle_cpu_s'] * ms:.1f} ms per cycle (median; "
          f"{side['sidecar_cpu_per_emission_s'] * ms:.1f} ms per measured emission, total / "
          f"count); producer + sidecar "
          f"{(side['sender_cycle_cpu_s'] + side['sidecar_cycle_cpu_s']) * ms:.1f} ms; latency "
          f"{side['latency_s'] * ms:.1f} ms (nixl in-process {b['latency_s'] * ms:.1f}, local "
          f"{local['latency_s'] * ms:.1f})")
    print(f"rows: every emission's CRC equals the pool's on every path: "
          f"{all(r['crc_ok'] for r in results.values())}; the same on all four paths: {same_rows}; "
          f"entry kinds as expected: {all(r['kinds_ok'] for r in results.values())}")
    for key, r in results.items():
        extra = f", export {r['export']}" if r["export"] else ""
        extra += f", puller {r['puller']}" if r["puller"] else ""
        print(f"  {key}: writer {r['writer']}{extra}")
    print(f"loadavg before {load_before}, after {load_after}; namespaces left: {left_ns}; ring "
          f"segments unlinked after the children: "
          f"{sum(len(r['segments_left_unlinked']) for r in results.values())}")
    ok = (all(r["rows_checked"] for r in results.values()) and same_rows and not left_ns)
    if args.json:
        out = {"benchmark": "remote_nixl", "requests": requests, "tokens": tokens,
               "support": support, "mode": "support", "warmup": warmup, "measured": measured,
               "ring_mb": ring_mb, "smoke": args.smoke,
               "machine": {"nproc": os.cpu_count(), "loadavg_before": load_before,
                           "loadavg_after": load_after, "python": sys.version.split()[0]},
               "goals": goals, "rows_equal_on_all_paths": same_rows, "checked": ok,
               "namespaces_left": left_ns, "paths": list(results.values())}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "child":
        ROLES[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        sys.exit(main())

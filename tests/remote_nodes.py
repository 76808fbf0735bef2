"""SGLang on two nodes, played on two "hosts" (tests/netns.py), with
SHMASK_REMOTE=nixl: namespace A is a scheduler of ``--node-rank 1``,
namespace B the tokenizer manager on node 0. Used by
tests/test_sglang_nodes_nixl.py (rows exact) and by the fault matrix
(tests/faults/cases_remote.py: the producer killed, the link dropped, an
agent that cannot be reached, forged descriptors, records reused).

The scheduler calls the adapter as the patched SGLang does
(``start_scheduler`` with SGLang's ``nnodes`` / ``node_rank`` /
``dist_init_addr``, ``SamplingMaskRows.append``, ``take_all``) and sends
each emission's chunks msgpack-encoded (as ``BatchTokenIDOutput`` carries
them) over a zmq TCP socket; the tokenizer decodes them and calls
``lists_or_abort`` for each request, as the patched
``_handle_batch_output`` does. Row ids are random, so another request's
or another emission's rows would show as "other" rows.

Files beside ``path`` synchronise the three parties (the test, A, B); the
waiting on them, and what else the scripts share with
tests/test_remote_nixl.py's, is in tests/remote_child.py (on the scripts'
PYTHONPATH through ``node_env``). No pytest import: usable from the fault
matrix.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import netns
from remote_child import host_env, last_json, wait_for

ZMQ_PORT = 5631  # the tokenizer's socket, in namespace B
REQUESTS = 16
REMOTE_TIMEOUT_S = 2.0
LEASE_S = 1.0  # the "reused" mode's lease: records are reclaimed after it
UNREACHABLE_IP = "10.255.255.1"  # no route from either namespace
MODES = ("none", "kill", "link", "unreachable", "forged", "reused")

SCHEDULER = r"""
import json, os, sys, time, types
import msgspec
import numpy as np
import zmq
from remote_child import wait_for, write_json
from shmask._native import ffi, lib
from shmask.adapters import sglang as adapter

REUSE = 8
head_ip, path, mode, requests, port, width, lease = (
    sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]),
    float(sys.argv[7]))

adapter.start_scheduler(types.SimpleNamespace(
    nnodes=2, node_rank=1, dist_init_addr=f"{head_ip}:5000", sampling_mask_max_tokens=4096,
    enable_metrics=False))
adapter.SamplingMaskRows("support").close()   # the first request starts the ring
ring = adapter.ring_ready(30)
leaving = adapter._ends["leaving"]
assert ring is not None and leaving is not None, adapter._ends["ring_error"]
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.connect(f"tcp://{head_ip}:{port}")


def emit(seed):
    rng = np.random.default_rng(seed)
    rows = [adapter.SamplingMaskRows("support" if i % 2 == 0 else "selected")
            for i in range(requests)]
    expected = [[[], []] for _ in range(requests)]
    for step in range(3):
        for i, r in enumerate(rows):
            n = int(rng.integers(1, width))
            ids = np.sort(rng.choice(151_936, n, replace=False)).astype(np.int32)
            if i % 2 == 0:
                logprobs = -rng.random(n).astype(np.float32)
                expected[i][1].append(logprobs.tolist())
            else:
                logprobs = np.float32(-rng.random())
                expected[i][1].append(float(logprobs))
            r.append(ids, logprobs)
            expected[i][0].append(ids.tolist())
    chunks = adapter.take_all(rows)
    for r in rows:
        r.close()
    sock.send_multipart([msgspec.msgpack.encode(chunks), json.dumps(expected).encode()])


emit(11)
if mode == "link":
    emit(12)   # read after the link went down
write_json(path, {"segment": ring.segment_name, "pid": os.getpid()})
if mode == "kill":
    time.sleep(120)   # the test kills us
elif mode == "link":
    wait_for(path, ".up", seconds=90)
    seed = 13
    while not os.path.exists(path + ".recovered") and not os.path.exists(path + ".done"):
        emit(seed)   # one emission a half second until the tokenizer reads one whole
        seed += 1
        time.sleep(0.5)
elif mode == "reused":
    wait_for(path, ".held", seconds=90)
    time.sleep(lease + 0.5)   # the first emission's records are past their lease
    for k in range(REUSE):    # and the ring wraps over them (the tokenizer reads these)
        emit(20 + k)
        time.sleep(0.2)
wait_for(path, ".done", seconds=90)
info = ffi.new("shm_info *")
assert lib.shm_read_info(ring.segment.base, ring.segment.size, info) == lib.SHM_OK
print(json.dumps({"export": vars(leaving.export.stats).copy(), "released": int(info.released),
                  "published": int(info.published), "expired": int(info.expired),
                  "descriptor": json.loads(leaving.prefix[12:])}), flush=True)
leaving.close()
"""

TOKENIZER = r"""
import json, os, sys, time, types
import msgspec
import zmq
from remote_child import mapped, wait_for
from shmask import remote_refs
from shmask.adapters import sglang as adapter
from shmask._native import lib
from shmask.refs import ChunkRef
from shmask.remote import RemoteBatch, RemoteDescriptor, remote_prefix

my_ip, path, port, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sock = zmq.Context.instance().socket(zmq.PULL)
sock.bind(f"tcp://{my_ip}:{port}")


def receive():
    assert sock.poll(60_000), "no message from the scheduler"
    payload, expected = sock.recv_multipart()
    return payload, json.loads(expected)


def decode(payload):
    return msgspec.msgpack.decode(payload, type=list[adapter.SamplingMaskChunk | None])


def forge(chunks, change):
    # every chunk's descriptor replaced; its plain reference kept
    for chunk in chunks:
        desc, inner = RemoteBatch.parts(chunk.ref)
        raw = json.loads(desc)
        change(raw)
        chunk.ref = remote_prefix(RemoteDescriptor.from_dict(raw)) + inner
    return chunks


def ring_ranges(chunks):
    # [start, end) of each ring record within the ring's data area
    ranges = []
    for chunk in chunks:
        desc, inner = RemoteBatch.parts(chunk.ref) if remote_refs.is_remote(chunk.ref) else (None, None)
        if desc is None:
            continue
        capacity = json.loads(desc)["segments"][0]["size"] - lib.SHM_HEADER_BYTES
        ref = ChunkRef.from_bytes(inner)
        start = ref.position % capacity
        ranges.append((start, start + ref.record_bytes))
    return ranges


def read(chunks, expected):
    recv = types.SimpleNamespace(rids=[f"r{i}" for i in range(len(chunks))],
                                 finished_reasons=[None] * len(chunks),
                                 output_token_sampling_mask=chunks)
    aborted = []
    manager = types.SimpleNamespace(rid_to_state={}, abort_request=aborted.append)
    out = {"ok": 0, "failed": 0, "other": 0, "errors": [], "aborted": 0}
    start = time.monotonic()
    for i in range(len(chunks)):
        meta = {}
        got = list(adapter.lists_or_abort(manager, recv, i, meta, support_logprobs=i % 2 == 0))
        reason = meta.get("finish_reason")
        if reason is not None:
            out["failed"] += 1
            if reason.get("status_code") == 500 and reason.get("type") == "abort":
                out["errors"].append(reason["message"].split("(", 1)[1].split(":")[0])
                out.setdefault("first_error", reason["message"][:400])
        elif got == expected[i]:
            out["ok"] += 1
        else:
            out["other"] += 1
    out["seconds"] = time.monotonic() - start
    out["aborted"] = len(aborted)
    return out


result = {"reads": []}
payload, expected = receive()
result["payload_bytes"] = len(payload)
result["rows_bytes"] = sum(8 * len(ids) for request in expected for ids in request[0])
if mode != "link":
    open(path + ".received", "w").close()
if mode == "kill":
    wait_for(path, ".killed", seconds=90)
    result["reads"].append(read(decode(payload), expected))
elif mode == "link":
    # The first emission read whole (agent and metadata up), the second
    # after the link went down, then emissions until one reads whole.
    payload2, expected2 = receive()
    result["reads"].append(read(decode(payload), expected))
    open(path + ".received", "w").close()
    wait_for(path, ".isdown", seconds=90)
    result["reads"].append(read(decode(payload2), expected2))
    open(path + ".read", "w").close()
    wait_for(path, ".up", seconds=90)
    start = time.monotonic()
    while time.monotonic() - start < 20:
        payload2, expected2 = receive()
        got = read(decode(payload2), expected2)
        result["reads"].append(got)
        if got["ok"] == len(expected2):
            result["recovered_s"] = time.monotonic() - start
            open(path + ".recovered", "w").close()
            break
elif mode == "forged":
    def moved(raw):
        raw["segments"][0]["address"] += 1 << 20
    def unknown(raw):
        raw["segments"][0]["name"] = raw["segments"][0]["name"][:-4] + "beef"
    result["reads"].append(read(forge(decode(payload), moved), expected))
    result["reads"].append(read(forge(decode(payload), unknown), expected))
    result["reads"].append(read(decode(payload), expected))   # the real one still goes through
elif mode == "reused":
    # The first emission is held past its lease while the scheduler writes
    # eight more (read as they come): its records are reclaimed and their
    # bytes hold later rows when it is finally read.
    open(path + ".held", "w").close()
    first = ring_ranges(decode(payload))
    later, overwritten = [], 0
    for _ in range(8):
        payload2, expected2 = receive()
        chunks2 = decode(payload2)
        overwritten += sum(1 for a, b in first for c, d in ring_ranges(chunks2) if a < d and c < b)
        later.append(read(chunks2, expected2))
    result["reads"].append(read(decode(payload), expected))
    result["reads"] += later
    result["overwritten"] = overwritten
else:
    result["reads"].append(read(decode(payload), expected))
puller = remote_refs._puller["puller"]
result["stats"] = vars(puller.stats) if puller else None
result["mapped"] = mapped(json.load(open(path))["segment"])
result["own_shm"] = not os.path.exists("/dev/shm" + json.load(open(path))["segment"])
open(path + ".done", "w").close()
print(json.dumps(result), flush=True)
"""


def node_env(dev: str, prefix: str, **extra: str) -> dict[str, str]:
    """A process's environment on one \"host\" (remote_child.host_env),
    with SHMASK_REMOTE=nixl, the test's ring prefix, a 2 s pull timeout."""
    return host_env(dev, SHMASK_REMOTE="nixl", SHMASK_NAME_PREFIX=prefix,
                    SHMASK_REMOTE_TIMEOUT_S=str(REMOTE_TIMEOUT_S), **extra)


def wait_file(path: str, suffix: str, *procs: Any, seconds: float = 60) -> None:
    """remote_child.wait_for, for 60 s unless told (the test side's wait;
    tests/test_vllm_nodes_nixl.py calls it too, as it does node_env and
    last_json)."""
    wait_for(path, suffix, *procs, seconds=seconds)


def run(prefix: str, directory: str | os.PathLike[str], mode: str = "none",
        width: int = 1000) -> tuple[dict[str, Any], dict[str, Any] | None, int | None]:
    """One run in `mode` (MODES): (the tokenizer's result, the scheduler's
    result or None when it was killed, the scheduler's exit status)."""
    assert mode in MODES, mode
    path = str(Path(directory) / f"nodes-{mode}.json")
    ring_mb = "1" if mode == "reused" else "16"
    scheduler = tokenizer = None
    with netns.two_hosts(prefix) as hosts:
        try:
            # The tokenizer's host has a /dev/shm of its own, as another machine.
            tokenizer = netns.run_in(
                hosts.b, [sys.executable, "-c", TOKENIZER, hosts.b_ip, path, str(ZMQ_PORT), mode],
                env=node_env(hosts.b_dev, prefix), timeout=150, own_shm=True)
            extra = {"SHMASK_RING_MB": ring_mb}
            if mode == "unreachable":
                extra["SHMASK_REMOTE_IP"] = UNREACHABLE_IP
            if mode == "reused":
                extra["SHMASK_LEASE_S"] = str(LEASE_S)
                extra["SHMASK_FULL_WAIT_MS"] = "20"
            scheduler = netns.run_in(
                hosts.a, [sys.executable, "-c", SCHEDULER, hosts.b_ip, path, mode, str(REQUESTS),
                          str(ZMQ_PORT), str(width), str(LEASE_S)],
                env=node_env(hosts.a_dev, prefix, **extra), timeout=150)
            if mode in ("kill", "link"):
                wait_file(path, ".received", tokenizer, scheduler)
                wait_file(path, "", tokenizer, scheduler)
                if mode == "kill":
                    netns.kill_group(scheduler)
                    Path(path + ".killed").touch()
                else:
                    netns.set_link(hosts.a, hosts.a_dev, up=False)
                    Path(path + ".isdown").touch()
                    wait_file(path, ".read", tokenizer, seconds=30)
                    netns.set_link(hosts.a, hosts.a_dev, up=True)
                    Path(path + ".up").touch()
            out_t, err_t = tokenizer.communicate(timeout=120)
            if tokenizer.returncode != 0:
                raise AssertionError(f"tokenizer exited {tokenizer.returncode}: {err_t[-3000:]}")
            sent = None
            if mode != "kill":
                out_s, err_s = scheduler.communicate(timeout=60)
                if scheduler.returncode != 0:
                    raise AssertionError(f"scheduler exited {scheduler.returncode}: "
                                         f"{err_s[-3000:]}")
                sent = last_json(out_s)
        finally:
            netns.kill_group(tokenizer)
            netns.kill_group(scheduler)
    return last_json(out_t), sent, scheduler.returncode

"""vLLM with a headless engine core on node 1 and its front-end on node 0,
SHMASK_REMOTE=nixl: two "hosts" (tests/netns.py), the adapter on each side
as the patched vLLM calls it (``outputs_go_to`` with the handshake's output
addresses, ``publish_step`` / ``slice_request`` in the engine core,
``resolve_outputs`` in the front-end's output processor), vLLM's
SamplingMaskLists played by the adapter's field-for-field stand-in (vLLM
itself is tested in tests/compat). The masks are pulled in one NIXL pull
for the message and come back exact; if the engine core dies before the
pull, each request fails alone (FinishReason.ERROR) within
SHMASK_REMOTE_TIMEOUT_S.

Needs root (namespaces) and nixl-cu12; skipped with the reason without.
"""

from __future__ import annotations

import sys
from pathlib import Path

import netns  # tests/netns.py
import pytest
import remote_nodes  # tests/remote_nodes.py

from shmask.segment import collect_garbage

needs_nixl_hosts = pytest.mark.skipif(netns.nixl_unavailable() is not None,
                                      reason=netns.nixl_unavailable() or "")

ZMQ_PORT = 5641
REQUESTS = 12

ENGINE_CORE = r"""
import json, sys, time
import msgspec
import numpy as np
import zmq
from remote_child import wait_for, write_json
from shmask._native import ffi, lib
from shmask.adapters import vllm as adapter

head_ip, path, port, requests, hold = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                       sys.argv[5] == "hold")
assert adapter.outputs_go_to([f"tcp://{head_ip}:{port}"]) == f"{head_ip}:{port}"
publisher = adapter.MaskPublisher(mask_lists=adapter._MaskLists)
assert publisher.leaving is not None and publisher.writer.segment is not None
rng = np.random.default_rng(5)
rows = [np.sort(rng.choice(151_936, int(n), replace=False)).astype(np.int32)
        for n in rng.integers(1000, 8000, requests)]
offsets = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
step = publisher.publish_step(adapter._MaskLists(np.concatenate(rows), offsets, None))
refs = [step.slice_request(i, 1).token_ids.tobytes() for i in range(requests)]
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.connect(f"tcp://{head_ip}:{port}")
sock.send_multipart([msgspec.msgpack.encode(refs), json.dumps([r.tolist() for r in rows]).encode()])
write_json(path, {"segment": publisher.writer.segment_name})
if hold:
    time.sleep(120)   # the test kills us
wait_for(path, ".done", seconds=60)
info = ffi.new("shm_info *")
writer = publisher.writer
assert lib.shm_read_info(writer.segment.base, writer.segment.size, info) == lib.SHM_OK
print(json.dumps({"export": vars(publisher.leaving.export.stats).copy(),
                  "released": int(info.released), "published": int(info.published)}), flush=True)
publisher.close()
"""

FRONT_END = r"""
import json, sys, time, types
import msgspec
import numpy as np
import zmq
from remote_child import mapped, wait_for
from shmask import remote_refs
from shmask.adapters import vllm as adapter

my_ip, path, port, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sock = zmq.Context.instance().socket(zmq.PULL)
sock.bind(f"tcp://{my_ip}:{port}")
assert sock.poll(60_000), "no message from the engine core"
payload, expected = sock.recv_multipart()
expected = json.loads(expected)
open(path + ".received", "w").close()
if mode == "kill":
    wait_for(path, ".killed")
refs = msgspec.msgpack.decode(payload)
outputs = [types.SimpleNamespace(request_id=f"r{i}", finish_reason=None, error=None,
                                 new_sampling_mask=adapter._MaskLists(
                                     np.frombuffer(ref, np.uint8), None, None))
           for i, ref in enumerate(refs)]
resolver = adapter.MaskResolver(mask_lists=adapter._MaskLists)
start = time.monotonic()
failed = resolver.resolve_outputs(outputs)
seconds = time.monotonic() - start
got = [None if o.new_sampling_mask is None else o.new_sampling_mask.token_ids.tolist()
       for o in outputs]
errors = [o.error.message.split("(", 1)[1].split(":")[0] for o in outputs if o.error]
puller = remote_refs._puller["puller"]
maps_segment = mapped(json.load(open(path))["segment"])
open(path + ".done", "w").close()
print(json.dumps({"ok": sum(g == e for g, e in zip(got, expected)), "failed": failed,
                  "errors": errors, "seconds": seconds, "payload_bytes": len(payload),
                  "rows_bytes": 4 * sum(len(e) for e in expected), "mapped": maps_segment,
                  "stats": vars(puller.stats) if puller else None}), flush=True)
"""


def _run(prefix: str, tmp_path: Path, mode: str) -> tuple[dict, dict | None, int | None]:
    path = str(tmp_path / "engine.json")
    engine = front = None
    with netns.two_hosts(prefix) as hosts:
        try:
            # the front-end's host has a /dev/shm of its own, as another machine
            front = netns.run_in(
                hosts.b, [sys.executable, "-c", FRONT_END, hosts.b_ip, path, str(ZMQ_PORT), mode],
                env=remote_nodes.node_env(hosts.b_dev, prefix), timeout=120, own_shm=True)
            engine = netns.run_in(
                hosts.a, [sys.executable, "-c", ENGINE_CORE, hosts.b_ip, path, str(ZMQ_PORT),
                          str(REQUESTS), "hold" if mode == "kill" else "wait"],
                env=remote_nodes.node_env(hosts.a_dev, prefix, SHMASK_RING_MB="16"), timeout=120)
            if mode == "kill":
                remote_nodes.wait_file(path, ".received", front, engine)
                remote_nodes.wait_file(path, "", front, engine)
                netns.kill_group(engine)
                Path(path + ".killed").touch()
            out_f, err_f = front.communicate(timeout=90)
            sent = None
            if mode != "kill":
                out_e, err_e = engine.communicate(timeout=60)
                assert engine.returncode == 0, (out_e, err_e[-3000:])
                sent = remote_nodes.last_json(out_e)
        finally:
            netns.kill_group(front)
            netns.kill_group(engine)
            collect_garbage(prefix)
    assert front.returncode == 0, err_f[-3000:]
    return remote_nodes.last_json(out_f), sent, engine.returncode


@needs_nixl_hosts
@pytest.mark.timeout(150)
def test_a_headless_engine_cores_masks_reach_the_front_end_through_nixl(prefix, tmp_path):
    got, sent, code = _run(prefix, tmp_path, "pull")
    assert got["ok"] == REQUESTS and got["failed"] == [] and got["errors"] == [], got
    assert got["stats"]["pulls"] == 1 and got["stats"]["pulled"] == REQUESTS, got["stats"]
    assert not got["mapped"]
    assert got["payload_bytes"] < 0.05 * got["rows_bytes"], got
    assert code == 0 and sent["released"] == sent["published"] == REQUESTS, sent
    assert sent["export"]["releases"] == REQUESTS and sent["export"]["release_errors"] == 0
    print(f"\n{REQUESTS} masks: message {got['payload_bytes']} B for {got['rows_bytes']} B of "
          f"ids; resolved in {got['seconds'] * 1e3:.1f} ms (NIXL metadata included)")


@needs_nixl_hosts
@pytest.mark.timeout(150)
def test_an_engine_core_killed_before_the_pull_fails_each_request_alone(prefix, tmp_path):
    got, _, code = _run(prefix, tmp_path, "kill")
    assert code == -9
    assert got["ok"] == 0 and got["failed"] == [f"r{i}" for i in range(REQUESTS)], got
    assert got["errors"] == ["StaleChunkError"] * REQUESTS, got
    assert got["seconds"] < 2 + 3, got["seconds"]

"""What the two-"host" NIXL tests share between their child scripts and
their test side: the children's environment, waiting on the files that
synchronise the parties, the RemoteBatch a producer hands over in a JSON
file, a pulled batch's rows and entries, and the one JSON line a child
prints.

Imported by the child scripts (``python -c``) of tests/test_remote_nixl.py,
tests/remote_nodes.py and tests/test_vllm_nodes_nixl.py, which find it
because `host_env` puts tests/ on their PYTHONPATH, and by the first two
modules themselves, tests/test_netns_nixl.py and tests/test_remote_sidecar.py
(whose test sides run their pairs with `run_pair`; remote_nodes re-exports
what tests/test_vllm_nodes_nixl.py and the fault matrix take from it). No
pytest import: the children and the fault matrix load it.
"""

from __future__ import annotations

import base64
import json
import os
import time
from typing import Any

from shmask.errors import ShmaskError
from shmask.reader import Reader
from shmask.refs import KIND_LOST, RefBatch
from shmask.remote import RemoteBatch

TESTS = os.path.dirname(os.path.abspath(__file__))


def host_env(dev: str, **extra: str) -> dict[str, str]:
    """A child's environment on one "host": UCX over TCP on its veth only,
    so the rows cross the "network", and tests/ importable (this module)."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=dev, PYTHONPATH=path, **extra)


def last_json(out: str) -> dict[str, Any]:
    """The last line of a child's stdout that is a JSON object: its result
    (NIXL and UCX may print lines of their own before it)."""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"no JSON line in {out[-3000:]!r}")
    return json.loads(lines[-1])


def wait_for(path: str, suffix: str = "", *procs: Any, seconds: float | None = None,
             message: str | None = None) -> None:
    """Until `path + suffix` exists. AssertionError if one of `procs` (the
    test side's Popens) exits first, or after `seconds` (None: no limit)
    with `message`, by default which file was not there in how long."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while not os.path.exists(path + suffix):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a party exited before {suffix}: "
                                     f"{proc.communicate()[1][-3000:]}")
        if deadline is not None and time.monotonic() > deadline:
            raise AssertionError(message or f"no {suffix} within {seconds} s")
        time.sleep(0.01)


def write_json(path: str, value: Any) -> None:
    """`value` to `path` whole or not at all (renamed into place): the
    other party waits for the name, then reads it at once."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.rename(path + ".tmp", path)


def write_remote(path: str, remote: RemoteBatch, **extra: Any) -> None:
    """A producer's RemoteBatch, base64 under "remote", beside `extra`."""
    write_json(path, {"remote": base64.b64encode(remote.to_bytes()).decode(), **extra})


def load_remote(path: str) -> tuple[RemoteBatch, bytes]:
    """The RemoteBatch `write_remote` wrote, and its bytes (a pull of the
    bytes as they came off the wire parses them itself)."""
    with open(path) as f:
        data = base64.b64decode(json.load(f)["remote"])
    return RemoteBatch.from_bytes(data), data


def subset(remote: RemoteBatch, which: list[int]) -> RemoteBatch:
    """The RemoteBatch of `remote`'s entries at `which`, same descriptor."""
    return RemoteBatch(remote.batch.select(which), remote.descriptor)


def rows(reader: Reader, batch: RefBatch) -> list[Any]:
    """Each ref of a pulled `batch` opened with `reader`: [ids, logprobs],
    or {"lost": position} (the LOST reason), or {"error": name} where the
    open raised; the chunks are released."""
    got: list[Any] = []
    for ref in batch:
        if ref.kind == KIND_LOST:
            got.append({"lost": ref.position})
            continue
        try:
            chunk = reader.open(ref)
        except ShmaskError as exc:
            got.append({"error": type(exc).__name__})
            continue
        ids, logprobs = chunk.to_lists()
        chunk.release()
        got.append([ids, logprobs])
    return got


def entries(batch: RefBatch) -> list[list[int]]:
    """[kind, position] of each entry of a pulled `batch`."""
    return [[int(e["kind"]), int(e["position"])] for e in batch.entries]


def mapped(segment: str) -> bool:
    """Whether this process maps `segment` (a reader on another "host"
    must not)."""
    with open("/proc/self/maps") as maps:
        return segment.lstrip("/") in maps.read()


def run_pair(start_producer: Any, start_reader: Any, reader_s: float,
             producer_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The test side of a producer and a reader on two "hosts": starts the
    producer, then the reader (each a callable that returns its Popen),
    waits for the reader, then the producer, and kills both process groups
    whatever happens (netns.kill_group). Asserts that both exited 0 (their
    stderr in the message) and returns their results: (the reader's last
    JSON line, the producer's)."""
    import netns  # the test side only: the children never call this

    producer = reader = None
    try:
        producer = start_producer()
        reader = start_reader()
        out_r, err_r = reader.communicate(timeout=reader_s)
        out_p, err_p = producer.communicate(timeout=producer_s)
    finally:
        netns.kill_group(reader)
        netns.kill_group(producer)
    assert reader.returncode == 0, err_r[-3000:]
    assert producer.returncode == 0, (out_p, err_p[-3000:])
    return last_json(out_r), last_json(out_p)

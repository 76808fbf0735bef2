"""examples/server.py for real: the server, producer and detokenizer as
processes, driven over HTTP (httpx), every row of every response checked
against the producer's seed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from workload import expected_chunk, request_lengths  # noqa: E402

REQUESTS, TOKENS, TOP_K, SEED = 6, 90, 24, 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["support", "selected"])
def server(request):
    from conftest import SESSION_PREFIX

    mode = request.param
    port = free_port()
    env = {**os.environ, "SHMASK_NAME_PREFIX": SESSION_PREFIX, "SHMASK_RING_MB": "8"}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "server.py"), "--port", str(port),
         "--requests", str(REQUESTS), "--tokens", str(TOKENS), "--top-k", str(TOP_K),
         "--mode", mode, "--seed", str(SEED), "--emit-every", "8"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"server did not start: {process.communicate()[0]}")
        time.sleep(0.1)
    yield url, mode
    # SIGTERM for one mode, Ctrl-C for the other: either way the server shuts
    # down, stops the engine and exits 0 (no segment left: the session checks)
    process.send_signal(signal.SIGTERM if mode == "support" else signal.SIGINT)
    output = process.communicate(timeout=30)[0]
    assert process.returncode == 0, output
    assert f"{url}/generate" in output  # it printed where it listens


def check_rows(meta: dict, rid: int, mode: str, start: int = 0) -> int:
    """Every row in meta_info equals the seeded workload's; returns the rows."""
    ids, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    rows = len(ids)
    lengths, want_ids, want_logprobs = expected_chunk(SEED, TOP_K, rid, start, rows, mode)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert ids == [want_ids[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]
    exact = want_logprobs.astype(np.float64)  # float() of each float32, as JSON carries it
    if mode == "support":
        assert logprobs == [exact[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]
    else:
        assert logprobs == exact.tolist()
    return rows


def test_whole_responses(server):
    url, mode = server
    lengths = request_lengths(np.arange(REQUESTS), TOKENS)
    with httpx.Client(timeout=20) as client:
        for rid in range(REQUESTS):
            reply = client.post(url + "/generate", json={"rid": rid})
            assert reply.status_code == 200
            meta = reply.json()["meta_info"]
            assert check_rows(meta, rid, mode) == lengths[rid] > 0
            assert meta["output_token_sampling_mask_length"] == lengths[rid]
            assert list(meta)[-3:] == ["output_token_sampling_mask", "output_token_sampling_logprobs",
                                       "output_token_sampling_mask_length"]


@pytest.mark.parametrize("incremental", [False, True])
def test_streaming(server, incremental):
    url, mode = server
    lengths = request_lengths(np.arange(REQUESTS), TOKENS)
    with httpx.Client(timeout=20) as client:
        for rid in (0, REQUESTS - 1):
            events = []
            with client.stream("POST", url + "/generate",
                               json={"rid": rid, "stream": True, "incremental": incremental}) as reply:
                assert reply.headers["content-type"].startswith("text/event-stream")
                body = b"".join(reply.iter_bytes())
            assert body.endswith(b"data: [DONE]\n\n")
            for line in body.split(b"\n\n")[:-1]:
                assert line.startswith(b"data: ")
                events.append(line[6:])
            assert events.pop() == b"[DONE]" and events
            seen = 0
            for event in events:
                meta = orjson.loads(event)["meta_info"]
                rows = check_rows(meta, rid, mode, start=seen if incremental else 0)
                seen = seen + rows if incremental else rows
            assert seen == lengths[rid]
            assert meta["finish_reason"]["type"] == "length"


def test_bad_request(server):
    url, _ = server
    assert httpx.post(url + "/generate", json={"rid": REQUESTS}).status_code == 400
    for body in (b"not json", b"[1, 2]", b'{"rid": true}', b'{"rid": "3"}'):
        assert httpx.post(url + "/generate", content=body).status_code == 400, body

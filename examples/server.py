"""An HTTP front end in the shape of SGLang's tokenizer manager: FastAPI +
uvicorn, a `/generate` endpoint that streams (SSE) or returns whole
responses whose meta_info holds SGLang's three sampling-mask fields,
accumulated across emissions and written straight from shared memory.

    python examples/server.py [--port 30000 --requests 32 --tokens 200 --top-k 100]

It starts the example producer (examples/producer.py, the "engine": a
seeded decode loop over --requests requests) and the example detokenizer
(examples/detokenizer.py) as processes joined by zmq, exactly as
examples/pipeline.py wires them, and plays the tokenizer manager itself.
Its event loop only routes: an asyncio task receives each emission's
references and hands every chunk to a thread pool (shmask.offload.Offload,
--threads), where it is opened, folded into its request's state as JSON
pieces and released at once (shmask.adapters.sglang.SamplingMaskJSON), so
no ring record is held while a client is slow. Each request has a lane in
the pool: its folds and response builds run in order, one at a time, while
other requests' run beside them (the native JSON writer lets go of the
GIL). Responses embed the pieces as orjson.Fragments
(shmask.adapters.sglang.response_meta_info): no Python list per row. So
/health answers while 64 requests stream, and SIGTERM or Ctrl-C ends open
streams (with an error event), stops the engine and exits within a second
or two.

    curl -s localhost:30000/generate -d '{"rid": 3}'
    curl -sN localhost:30000/generate -d '{"rid": 3, "stream": true, "incremental": true}'
    curl -s localhost:30000/health

`rid` picks one of the engine's requests (0 .. --requests-1); a request can
be asked for any number of times. Streaming with `"incremental": true` (as
SGLang's --incremental-streaming-output) sends one `data: {...}` event per
emission with that emission's rows, built on the request's lane as soon as
it is folded (a client more than 64 events behind gets the rest coalesced).
Without it, each event holds every row so far (cumulative, SGLang's
default) and is built when the stream is ready to send, so emissions that
arrived meanwhile share one event (one copy of every row per emission would
be quadratic). Then `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import msgspec
import numpy as np
import orjson
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from workload import configure, request_lengths

import shmask
from shmask.adapters.sglang import SamplingMaskJSON, response_meta_info
from shmask.offload import Offload, fold_ref

HERE = Path(__file__).resolve().parent
T = TypeVar("T")


MAX_QUEUED_EVENTS = 64  # per stream; beyond, emissions coalesce into one event


class ReqState:
    """One request's accumulated output (SGLang's ReqState, masks only).

    `masks` and `streams` change only on the request's lane of the Offload
    pool (folds and event builds run there one at a time, in order); the
    loop reads them and waits on `updated`."""

    __slots__ = ("rid", "length", "masks", "streams", "error", "updated")

    def __init__(self, rid: int, length: int, support: bool) -> None:
        self.rid = rid
        self.length = length  # tokens the engine generates for it
        self.masks = SamplingMaskJSON(support)
        self.streams: list[Stream] = []
        self.error: str | None = None  # this request failed; the others go on
        self.updated = asyncio.Event()

    @property
    def finished(self) -> bool:
        return len(self.masks) >= self.length

    def fold(self, start: int, chunk: shmask.Chunk) -> None:
        """One emission's chunk into the state (on the lane, a worker thread),
        then one event for each incremental stream that keeps up."""
        if self.error is not None:
            return  # the chunk is only released
        if start != len(self.masks):
            raise RuntimeError(f"request {self.rid}: emission starts at token {start}, "
                               f"{len(self.masks)} received")
        self.masks.extend(chunk)
        for stream in self.streams:
            # Built now, each event holds exactly this emission's rows; a
            # cumulative stream builds when it is ready to send (what
            # SGLang's streams do: one copy of every row per event is
            # quadratic), as does one whose client lags MAX_QUEUED_EVENTS.
            if stream.incremental and len(stream.events) < MAX_QUEUED_EVENTS:
                stream.build(self)

    def notify(self) -> None:
        """Wake everything waiting on this request (on the loop)."""
        self.updated.set()
        self.updated = asyncio.Event()


class Stream:
    """One open SSE stream: events built on its request's lane, sent by the loop."""

    __slots__ = ("incremental", "events", "sent", "done")

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self.events: collections.deque[bytes] = collections.deque()  # workers append, loop pops
        self.sent = 0  # rows that the built events cover
        self.done = False  # the last event (finish_reason set) is built

    def build(self, state: ReqState) -> None:
        """One event of every row not yet in an event (on the lane)."""
        total = len(state.masks)
        if self.done or (total == self.sent and not state.finished):
            return
        start = self.sent if self.incremental else 0
        self.events.append(b"data: " + response(state, start) + b"\n\n")
        self.sent = total
        self.done = state.finished


class TokenizerManager:
    """Receives the detokenizer's emissions and keeps every request's state.
    The loop only routes: every chunk is opened, folded and released on the
    Offload pool, on its request's lane."""

    def __init__(self, args: argparse.Namespace, endpoints: dict[str, str]) -> None:
        self.args = args
        self.endpoints = endpoints
        support = args.mode == "support"
        lengths = request_lengths(np.arange(args.requests), args.tokens)
        self.states = [ReqState(r, int(n), support) for r, n in enumerate(lengths)]
        self.reader = shmask.Reader(configure())
        self.offload = Offload(args.threads)
        self.engine_done = False
        self.error: str | None = None  # the engine broke: every request fails
        self.stopping = False
        self.stopped: asyncio.Future[None] | None = None  # done when shutdown begins
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.stopped = asyncio.get_running_loop().create_future()
        self.context = zmq.asyncio.Context()
        self.inp = self.context.socket(zmq.PULL)
        self.inp.bind(self.endpoints["tokenizer"])
        # The producer and detokenizer report their stats here at the end;
        # someone must take them, or their sockets linger forever.
        self.results = self.context.socket(zmq.PULL)
        self.results.bind(self.endpoints["results"])
        self.control = self.context.socket(zmq.PUSH)
        self.control.bind(self.endpoints["control"])
        self._tasks = [asyncio.create_task(self._handle_loop()),
                       asyncio.create_task(self._drain_results())]

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
        for state in self.states:
            state.notify()

    async def stop(self) -> None:
        self.shut_down()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Jobs not started are dropped (their chunks go with the engine),
        # running ones (one fold each) finish; then nothing reads the ring.
        self.offload.close()
        self.reader.close()
        for socket in (self.inp, self.results, self.control):
            socket.close(linger=0)
        self.context.term()

    async def _handle_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        try:
            while True:
                header_bytes, batch_bytes = await self.inp.recv_multipart()
                header = decoder.decode(header_bytes)
                if header.get("stop"):
                    # Every chunk is released once folded: the producer may
                    # unlink its ring once every lane has done the folds
                    # queued before (a no-op job on each lane runs after them).
                    await asyncio.gather(*(self.offload.run(state.rid, _nothing)
                                           for state in self.states))
                    self.engine_done = True
                    await self.control.send(b"exit")
                    continue
                requests = np.frombuffer(header["requests"], np.int32).tolist()
                starts = np.frombuffer(header["starts"], np.int32).tolist()
                batch = shmask.RefBatch.from_bytes(batch_bytes)
                if len(batch) != len(requests) or not all(0 <= r < len(self.states)
                                                          for r in requests):
                    raise RuntimeError(f"an emission names requests {requests} for "
                                       f"{len(batch)} refs")
                for ref, rid, start in zip(batch, requests, starts, strict=True):
                    state = self.states[rid]
                    # Waits (off the loop) while the pool has its fill of
                    # jobs: the socket then queues, and the engine behind it.
                    folded = await self.offload.put(
                        rid, fold_ref, self.reader, ref, functools.partial(state.fold, start))
                    folded.add_done_callback(functools.partial(self._folded, state))
                await asyncio.sleep(0)  # a burst of queued emissions lets the loop in
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken engine must fail requests, not hang them
            self.error = f"{type(exc).__name__}: {exc}"
            for state in self.states:
                state.notify()
            raise

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
            raise HTTPException(500, f"engine failed: {self.error}")
        if state.error is not None:
            raise HTTPException(500, f"request {state.rid} failed: {state.error}")
        if self.stopping:
            raise HTTPException(503, "the server is shutting down")

    async def on_lane(self, state: ReqState, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the request's lane (after its folds so far), for a
        client: given up when shutdown begins (raises HTTPException, as it
        does when the request or the engine failed)."""
        assert self.stopped is not None
        job = asyncio.wrap_future(self.offload.submit(state.rid, fn, *args))
        await asyncio.wait((job, self.stopped), return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            job.cancel()  # not started: dropped; running: it ends on its own
        self.check(state)
        return job.result()


def _nothing() -> None:
    pass


def response(state: ReqState, start: int = 0) -> bytes:
    finished = state.finished
    meta_info = {
        "id": str(state.rid),
        "finish_reason": {"type": "length", "length": state.length} if finished else None,
        "completion_tokens": len(state.masks),
        **response_meta_info(state.masks, start=start),
    }
    return orjson.dumps({"text": "", "output_ids": [], "meta_info": meta_info})


def error_event(exc: HTTPException) -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": exc.detail, "code": exc.status_code}}) \
        + b"\n\n"


def build_app(args: argparse.Namespace, endpoints: dict[str, str]) -> tuple[FastAPI, TokenizerManager]:
    manager = TokenizerManager(args, endpoints)
    offload = manager.offload

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        yield
        await manager.stop()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if manager.error is None else 503)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as exc:
            raise HTTPException(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "the body must be a JSON object")
        rid = body.get("rid")
        if type(rid) is not int or not 0 <= rid < len(manager.states):
            raise HTTPException(400, f"rid must be an int in [0, {len(manager.states)})")
        state = manager.states[rid]
        manager.check(state)
        if body.get("stream"):
            return StreamingResponse(stream(state, bool(body.get("incremental"))),
                                     media_type="text/event-stream")
        while not state.finished:
            await state.updated.wait()
            manager.check(state)
        # Built on the request's lane: after its last fold, off the loop.
        return Response(await manager.on_lane(state, response, state),
                        media_type="application/json")

    async def stream(state: ReqState, incremental: bool) -> AsyncIterator[bytes]:
        subscriber = Stream(incremental)
        try:
            await manager.on_lane(state, state.streams.append, subscriber)
            while True:
                while subscriber.events:
                    yield subscriber.events.popleft()
                if subscriber.done:
                    break
                manager.check(state)
                if len(state.masks) > subscriber.sent or state.finished:
                    # Rows that no event holds (a cumulative stream, or a
                    # client that lagged): one event of them all.
                    await manager.on_lane(state, subscriber.build, state)
                    continue
                await state.updated.wait()
            yield b"data: [DONE]\n\n"
        except HTTPException as exc:  # shutdown, or this request failed
            yield error_event(exc)
        except Exception as exc:  # building its response failed: this stream ends
            yield error_event(HTTPException(500, f"{type(exc).__name__}: {exc}"))
        finally:
            with contextlib.suppress(RuntimeError):  # the pool is closed: nothing folds any more
                offload.submit(state.rid, unsubscribe, state, subscriber)

    return app, manager


def unsubscribe(state: ReqState, stream: Stream) -> None:
    if stream in state.streams:  # a stream cancelled while subscribing may not be
        state.streams.remove(stream)


class Server(uvicorn.Server):
    """uvicorn's server, telling the manager at once when a signal asks it to
    exit: uvicorn's graceful shutdown waits for every open response, and a
    stream of a long request would keep it waiting."""

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
            self.loop.call_soon_threadsafe(self.manager.shut_down)


def start_engine(args: argparse.Namespace, endpoints: dict[str, str]) -> list[subprocess.Popen]:
    """The producer and the detokenizer, wired as examples/pipeline.py does."""
    common = ["--results", endpoints["results"]]
    workload = ["--top-k", str(args.top_k), "--mode", args.mode]
    commands = [
        [str(HERE / "detokenizer.py"), "--inp", endpoints["detok"], "--out",
         endpoints["tokenizer"], *common],
        [str(HERE / "producer.py"), "--out", endpoints["detok"], "--control", endpoints["control"],
         *common, *workload, "--requests", str(args.requests), "--tokens", str(args.tokens),
         "--emit-every", str(args.emit_every), "--seed", str(args.seed)],
    ]
    return [subprocess.Popen([sys.executable, *command], env=dict(os.environ))
            for command in commands]


def stop_engine(processes: list[subprocess.Popen], finished: bool) -> None:
    # A finished engine exits on its own once told (the producer unlinks its
    # ring); one still running is terminated at once (death by SIGTERM
    # unlinks the ring all the same), and killed if it does not go.
    for process in processes:
        if finished:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)
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
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--mode", choices=["support", "selected"], default="support")
    parser.add_argument("--emit-every", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads that fold chunks and build responses off the event loop "
                             "(default SHMASK_OFFLOAD_THREADS, else the cores, at most 8)")
    args = parser.parse_args()
    os.environ.setdefault("SHMASK_RING_MB", "64")  # the children inherit it

    with tempfile.TemporaryDirectory(prefix="shmask-serve-") as tmp:
        endpoints = {name: f"ipc://{tmp}/{name}"
                     for name in ("tokenizer", "detok", "results", "control")}
        app, manager = build_app(args, endpoints)
        # The graceful-shutdown timeout is a backstop: streams end as soon as
        # the signal arrives (Server.handle_exit).
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=1)
        server = Server(config, manager)
        processes = start_engine(args, endpoints)
        print(f"shmask example server: http://{args.host}:{args.port}/generate "
              f"({args.requests} requests x {args.tokens} tokens, top_k {args.top_k}, "
              f"{args.mode} mode, seed {args.seed})", flush=True)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the
        # signal; end normally instead, so the engine is stopped below (a
        # default SIGTERM would kill this process and orphan the children).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        finally:
            stop_engine(processes, manager.engine_done)


if __name__ == "__main__":
    main()

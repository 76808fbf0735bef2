"""An HTTP front end in the shape of SGLang's tokenizer manager: FastAPI +
uvicorn, a `/generate` endpoint that streams (SSE) or returns whole
responses whose meta_info holds SGLang's three sampling-mask fields,
accumulated across emissions and written straight from shared memory.

    python examples/server.py [--port 30000 --requests 32 --tokens 200 --top-k 100]

It starts the example producer (examples/producer.py, the "engine": a
seeded decode loop over --requests requests) and the example detokenizer
(examples/detokenizer.py) as processes joined by zmq, exactly as
examples/pipeline.py wires them, and plays the tokenizer manager itself: an
asyncio task receives each emission's references, opens the chunks, folds
their rows into the request's state as JSON pieces and releases them at
once (shmask.adapters.sglang.SamplingMaskJSON), so no ring record is held
while a client is slow. Responses embed those pieces as orjson.Fragments
(shmask.adapters.sglang.response_meta_info): no Python list per row.

    curl -s localhost:30000/generate -d '{"rid": 3}'
    curl -sN localhost:30000/generate -d '{"rid": 3, "stream": true}'

`rid` picks one of the engine's requests (0 .. --requests-1); a request can
be asked for any number of times. Streaming sends one `data: {...}` event per
emission that arrived since the last event (cumulative fields, as SGLang by
default; `"incremental": true` sends only the new rows, as SGLang's
--incremental-streaming-output), then `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

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

HERE = Path(__file__).resolve().parent


class ReqState:
    """One request's accumulated output (SGLang's ReqState, masks only)."""

    __slots__ = ("rid", "length", "masks", "changed")

    def __init__(self, rid: int, length: int, support: bool) -> None:
        self.rid = rid
        self.length = length  # tokens the engine generates for it
        self.masks = SamplingMaskJSON(support)
        self.changed = asyncio.Condition()

    @property
    def finished(self) -> bool:
        return len(self.masks) >= self.length


class TokenizerManager:
    """Receives the detokenizer's emissions and keeps every request's state."""

    def __init__(self, args: argparse.Namespace, endpoints: dict[str, str]) -> None:
        self.args = args
        self.endpoints = endpoints
        support = args.mode == "support"
        lengths = request_lengths(np.arange(args.requests), args.tokens)
        self.states = [ReqState(r, int(n), support) for r, n in enumerate(lengths)]
        self.reader = shmask.Reader(configure())
        self.engine_done = False
        self.error: str | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
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

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
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
                    # Every chunk was released on arrival: the producer may
                    # unlink its ring and exit.
                    self.engine_done = True
                    await self.control.send(b"exit")
                    continue
                requests = np.frombuffer(header["requests"], np.int32).tolist()
                starts = np.frombuffer(header["starts"], np.int32).tolist()
                batch = shmask.RefBatch.from_bytes(batch_bytes)
                for ref, rid, start in zip(batch, requests, starts, strict=True):
                    state = self.states[rid]
                    if start != len(state.masks):
                        raise RuntimeError(f"request {rid}: emission starts at token {start}, "
                                           f"{len(state.masks)} received")
                    with self.reader.open(ref) as chunk:  # released when folded in
                        state.masks.extend(chunk)
                    async with state.changed:
                        state.changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken engine must fail requests, not hang them
            self.error = f"{type(exc).__name__}: {exc}"
            for state in self.states:
                async with state.changed:
                    state.changed.notify_all()
            raise

    async def _drain_results(self) -> None:
        while True:
            await self.results.recv()

    async def wait(self, state: ReqState, seen: int) -> None:
        """Until the request has more than `seen` rows, or ends."""
        async with state.changed:
            await state.changed.wait_for(
                lambda: len(state.masks) > seen or state.finished or self.error is not None)
        if self.error is not None:
            raise HTTPException(500, f"engine failed: {self.error}")


def response(state: ReqState, start: int = 0) -> bytes:
    finished = state.finished
    meta_info = {
        "id": str(state.rid),
        "finish_reason": {"type": "length", "length": state.length} if finished else None,
        "completion_tokens": len(state.masks),
        **response_meta_info(state.masks, start=start),
    }
    return orjson.dumps({"text": "", "output_ids": [], "meta_info": meta_info})


def build_app(args: argparse.Namespace, endpoints: dict[str, str]) -> FastAPI:
    manager = TokenizerManager(args, endpoints)

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
        if body.get("stream"):
            return StreamingResponse(stream(state, bool(body.get("incremental"))),
                                     media_type="text/event-stream")
        while not state.finished:
            await manager.wait(state, len(state.masks))
        return Response(response(state), media_type="application/json")

    async def stream(state: ReqState, incremental: bool) -> AsyncIterator[bytes]:
        sent = 0
        while True:
            await manager.wait(state, sent)
            total = len(state.masks)
            if total > sent or state.finished:
                yield b"data: " + response(state, start=sent if incremental else 0) + b"\n\n"
                sent = total
            if state.finished:
                break
        yield b"data: [DONE]\n\n"

    return app


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


def stop_engine(processes: list[subprocess.Popen]) -> None:
    # A finished engine exits on its own once told (the producer unlinks its
    # ring); one still running is terminated, and the producer's SIGTERM
    # handler unlinks the ring all the same.
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=5)
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
    args = parser.parse_args()
    os.environ.setdefault("SHMASK_RING_MB", "64")  # the children inherit it

    with tempfile.TemporaryDirectory(prefix="shmask-serve-") as tmp:
        endpoints = {name: f"ipc://{tmp}/{name}"
                     for name in ("tokenizer", "detok", "results", "control")}
        app = build_app(args, endpoints)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        server = uvicorn.Server(config)
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
            stop_engine(processes)


if __name__ == "__main__":
    main()

"""The scheduler: a decode loop that samples supports for every running
request, stages them in RowQueues, and every `--emit-every` tokens (and when
a request finishes) publishes them and sends one RefBatch to the detokenizer.

Two ways to run: with `--requests`/`--tokens`, a fixed set of requests from
the start (examples/pipeline.py, `make demo`); with `--serve ENDPOINT`, an
engine that serves (examples/server.py): requests arrive on that zmq
endpoint whenever clients send them, each with its own workload key, top_k
and length, join the running batch at the next step and leave it when
done; idle, it waits for one. shmask settings come from SHMASK_* variables.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np
import zmq
from workload import configure, exit_with, request_lengths, rows_at, step_rows

import shmask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="zmq endpoint of the detokenizer")
    parser.add_argument("--results", required=True, help="zmq endpoint for the final stats")
    parser.add_argument("--control", help="zmq endpoint that says when to exit (fixed requests)")
    parser.add_argument("--serve", metavar="ENDPOINT",
                        help="serve requests that arrive on this zmq endpoint (examples/server.py)")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="with --serve: the least time a decode step takes (0: as fast as it can)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--mode", choices=["support", "selected"], default="support")
    parser.add_argument("--emit-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exit-with", type=int, default=None, metavar="PID",
                        help="exit when this process (the one that started it) dies")
    args = parser.parse_args()
    exit_with(args.exit_with)

    context = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.connect(args.out)
    results = context.socket(zmq.PUSH)
    results.connect(args.results)
    encoder = msgspec.msgpack.Encoder()

    writer = shmask.Writer(configure())
    if args.serve:
        serve(args, writer, context, out)
        return
    if not args.control:
        parser.error("--control is required without --serve")
    requests = np.arange(args.requests, dtype=np.int64)
    lengths_of_request = request_lengths(requests, args.tokens)
    queues = [writer.open_queue(args.mode) for _ in requests]
    slots = np.array([q.handle for q in queues], np.int64)
    emitted_from = np.zeros(args.requests, np.int64)  # first token not yet emitted
    append_s = emit_s = 0.0
    emissions: list[float] = []
    bytes_sent = 0
    for token in range(int(lengths_of_request.max())):
        running = token < lengths_of_request
        lengths, ids, logprobs = step_rows(args.seed, args.top_k, requests[running], token, args.mode)
        t0 = time.perf_counter()
        writer.append_step(slots[running], lengths, ids, logprobs)
        append_s += time.perf_counter() - t0
        finishing = running & (token + 1 == lengths_of_request)
        due = running & (((token + 1) % args.emit_every == 0) | finishing)
        if not due.any():
            continue
        t0 = time.perf_counter()
        index = np.flatnonzero(due)
        batch = writer.take_batch([queues[i] for i in index])
        header = encoder.encode({"requests": index.astype(np.int32).tobytes(),
                                 "starts": emitted_from[index].astype(np.int32).tobytes()})
        out.send_multipart([header, batch.to_bytes()], copy=False)
        emitted_from[index] = token + 1
        for i in np.flatnonzero(finishing):
            queues[i].close()
        elapsed = time.perf_counter() - t0
        emit_s += elapsed
        emissions.append(elapsed)
        bytes_sent += len(header) + batch.nbytes
    out.send_multipart([encoder.encode({"stop": True}), b""])
    stats = writer.stats
    results.send(encoder.encode({
        "stage": "scheduler", "append_s": append_s, "emit_s": emit_s,
        "emission_ms_median": 1000 * float(np.median(emissions)), "emissions": len(emissions),
        "chunks": stats.chunks, "rows": stats.rows, "payload_bytes": stats.payload_bytes,
        "inline_chunks": stats.inline_chunks, "socket_bytes": bytes_sent,
    }))
    # Keep the ring until the consumers are done with it (the pipeline says so).
    control = context.socket(zmq.PULL)
    control.connect(args.control)
    control.recv()
    writer.close()
    for socket in (out, results, control):
        socket.close(linger=-1)  # see detokenizer.py
    context.term()


class Running:
    """A request in the serving engine's batch."""

    __slots__ = ("slot", "key", "top_k", "tokens", "mode", "queue", "done", "emitted")

    def __init__(self, slot: int, key: int, top_k: int, tokens: int, mode: str,
                 writer: shmask.Writer) -> None:
        self.slot, self.key, self.top_k, self.tokens, self.mode = slot, key, top_k, tokens, mode
        self.queue = writer.open_queue(mode)
        self.done = 0  # tokens generated
        self.emitted = 0  # tokens sent to the detokenizer


def serve(args: argparse.Namespace, writer: shmask.Writer, context: zmq.Context,
          out: zmq.Socket) -> None:
    """The serving loop: admit what arrived, one decode step of every
    running request, an emission of those due. It runs until it is
    terminated (the server stops it with SIGTERM, which takes the ring)."""
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.serve)
    decoder, encoder = msgspec.msgpack.Decoder(), msgspec.msgpack.Encoder()
    running: dict[int, Running] = {}
    while True:
        started = time.perf_counter()
        # Idle, wait for a request; busy, take whatever arrived since the last step.
        while inbox.poll(0 if running else None):
            request = decoder.decode(inbox.recv())
            # each request's own rows: its workload key, top_k and mode
            running[request["slot"]] = Running(
                request["slot"], request["key"], request["top_k"], request["tokens"],
                request.get("mode", args.mode), writer)
        batch = list(running.values())
        for mode in ("support", "selected"):  # one append a mode: its rows' logprobs differ in shape
            group = [r for r in batch if r.mode == mode]
            if not group:
                continue
            top_ks = np.array([r.top_k for r in group], np.int64)
            lengths, ids, logprobs = rows_at(
                args.seed, top_ks, np.array([r.key for r in group], np.int64),
                np.array([r.done for r in group], np.int64), mode, int(top_ks.max()))
            writer.append_step(np.array([r.queue.handle for r in group], np.int64), lengths, ids,
                               logprobs)
        due = []
        for r in batch:
            r.done += 1
            if r.done == r.tokens or r.done - r.emitted >= args.emit_every:
                due.append(r)
        if due:
            refs = writer.take_batch([r.queue for r in due])
            header = encoder.encode({"requests": np.array([r.slot for r in due], np.int32).tobytes(),
                                     "starts": np.array([r.emitted for r in due], np.int32).tobytes()})
            out.send_multipart([header, refs.to_bytes()], copy=False)
            for r in due:
                r.emitted = r.done
                if r.done == r.tokens:
                    r.queue.close()
                    del running[r.slot]
        rest = args.step_ms / 1000 - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)


if __name__ == "__main__":
    main()

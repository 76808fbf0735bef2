"""The detokenizer: forwards each emission's references to the tokenizer
process that owns each request (request % n). It never touches the rows:
routing is `RefBatch.select`, a few dozen bytes per request."""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np
import zmq
from workload import exit_with

import shmask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inp", required=True, help="zmq endpoint to bind for the scheduler")
    parser.add_argument("--out", required=True, nargs="+", help="one endpoint per tokenizer")
    parser.add_argument("--results", required=True)
    parser.add_argument("--exit-with", type=int, default=None, metavar="PID",
                        help="exit when this process (the one that started it) dies")
    args = parser.parse_args()
    exit_with(args.exit_with)

    context = zmq.Context()
    inp = context.socket(zmq.PULL)
    inp.bind(args.inp)
    outs = []
    for endpoint in args.out:
        socket = context.socket(zmq.PUSH)
        socket.connect(endpoint)
        outs.append(socket)
    results = context.socket(zmq.PUSH)
    results.connect(args.results)
    decoder, encoder = msgspec.msgpack.Decoder(), msgspec.msgpack.Encoder()
    busy_s, per_emission, socket_bytes = 0.0, [], 0
    while True:
        header_bytes, batch_bytes = inp.recv_multipart(copy=True)
        t0 = time.perf_counter()
        header = decoder.decode(header_bytes)
        if header.get("stop"):
            for socket in outs:
                socket.send_multipart([header_bytes, b""])
            break
        batch = shmask.RefBatch.from_bytes(batch_bytes)
        requests = np.frombuffer(header["requests"], np.int32)
        starts = np.frombuffer(header["starts"], np.int32)
        owner = requests % len(outs)
        for n, socket in enumerate(outs):
            index = np.flatnonzero(owner == n)
            if index.size == 0:
                continue
            part = encoder.encode({"requests": requests[index].tobytes(),
                                   "starts": starts[index].tobytes()})
            routed = batch.select(index) if len(outs) > 1 else batch
            socket.send_multipart([part, routed.to_bytes()], copy=False)
            socket_bytes += len(part) + routed.nbytes
        elapsed = time.perf_counter() - t0
        busy_s += elapsed
        per_emission.append(elapsed)
    results.send(encoder.encode({
        "stage": "detokenizer", "busy_s": busy_s, "socket_bytes": socket_bytes,
        "emission_ms_median": 1000 * float(np.median(per_emission)) if per_emission else 0.0,
    }))
    for socket in (inp, results, *outs):
        # Wait until every message is delivered: a tokenizer still starting
        # up must not lose the end of the stream (the pipeline's timeout
        # bounds the wait if a peer died).
        socket.close(linger=-1)
    context.term()


if __name__ == "__main__":
    main()

"""A tokenizer process: opens every chunk it is sent, checks every row
against the seeded workload, builds the response lists from the views, and
releases the chunk."""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np
import zmq
from workload import configure, exit_with, expected_chunk

import shmask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inp", required=True, help="zmq endpoint to bind")
    parser.add_argument("--results", required=True)
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--mode", choices=["support", "selected"], default="support")
    parser.add_argument("--seed", type=int, default=0, help="the seed the producer used")
    parser.add_argument("--exit-with", type=int, default=None, metavar="PID",
                        help="exit when this process (the one that started it) dies")
    args = parser.parse_args()
    exit_with(args.exit_with)

    context = zmq.Context()
    inp = context.socket(zmq.PULL)
    inp.bind(args.inp)
    results = context.socket(zmq.PUSH)
    results.connect(args.results)
    decoder, encoder = msgspec.msgpack.Decoder(), msgspec.msgpack.Encoder()
    reader = shmask.Reader(configure())
    chunks = rows = mismatches = payload = inline = 0
    open_s = build_s = 0.0
    per_emission = []
    while True:
        header_bytes, batch_bytes = inp.recv_multipart()
        header = decoder.decode(header_bytes)
        if header.get("stop"):
            break
        t_emission = time.perf_counter()
        requests = np.frombuffer(header["requests"], np.int32)
        starts = np.frombuffer(header["starts"], np.int32)
        batch = shmask.RefBatch.from_bytes(batch_bytes)
        for ref, request, start in zip(batch, requests, starts, strict=True):
            t0 = time.perf_counter()
            chunk = reader.open(ref)
            t1 = time.perf_counter()
            ids_lists, logprobs_lists = chunk.to_lists()  # the response fields
            t2 = time.perf_counter()
            open_s += t1 - t0
            build_s += t2 - t1
            want = expected_chunk(args.seed, args.top_k, int(request), int(start), chunk.rows,
                                  args.mode)
            mismatches += _count_bad_rows(chunk, *want)
            chunks += 1
            rows += chunk.rows
            payload += chunk.lengths.nbytes + chunk.ids.nbytes + chunk.logprobs.nbytes
            inline += ref.inline
            chunk.release()
        per_emission.append(time.perf_counter() - t_emission)
        results.send(encoder.encode({"stage": "progress", "rows": int(sum(r.rows for r in batch))}))
    results.send(encoder.encode({
        "stage": "tokenizer", "chunks": chunks, "rows": rows, "mismatches": mismatches,
        "payload_bytes": payload, "inline_chunks": inline, "open_s": open_s, "build_s": build_s,
        "emission_ms_median": 1000 * float(np.median(per_emission)) if per_emission else 0.0,
    }))
    reader.close()
    inp.close()
    results.close(linger=-1)  # deliver the report, however slow the pipeline is
    context.term()


def _count_bad_rows(chunk: shmask.Chunk, lengths, ids, logprobs) -> int:
    """Rows of `chunk` that differ from the expected CSR rows in any bit."""
    if chunk.rows != lengths.size:
        return max(chunk.rows, lengths.size)
    bad = chunk.lengths != lengths
    if not bad.any() and chunk.nnz == ids.size:
        row_of = np.repeat(np.arange(chunk.rows), lengths)
        wrong_ids = chunk.ids != ids
        if chunk.support_mode:
            wrong_ids |= chunk.logprobs.view(np.uint32) != logprobs.view(np.uint32)
        else:
            bad |= chunk.logprobs.view(np.uint32) != logprobs.view(np.uint32)
        bad[row_of[wrong_ids]] = True
    else:
        bad[:] = True
    return int(bad.sum())


if __name__ == "__main__":
    main()

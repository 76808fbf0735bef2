"""Where the time of SGLang's meta_info JSON goes with the native writer.

One emission of 256 requests x 50 rows x 1000 support (the rows of
benchmarks/responses.py's SGLang comparison, read out of a ring), timed in
parts, median of 3, in one run:

  sglang lists + orjson     what responses.py takes as the baseline
  write only                the C writer into this thread's scratch (no
                            result object: what the rows cost to format)
  dumps                     response_json.dumps of the meta_info, every
                            document kept (format + the one gathered copy
                            into fresh memory)
  dumps, dropped            the same, each document dropped once built (as
                            a server does after sending it: memory reused)
  gather of ready text      the copy alone: the same documents from text
                            formatted beforehand (fresh memory's page faults
                            are most of it)
  writer + orjson           the arrays as orjson Fragments (the path an
                            engine whose HTTP layer runs orjson takes)

The last column divides the baseline by each row. The floor bounds what any
writer can reach in responses.py: baseline / floor is the largest speedup.

    PYTHONPATH=. python benchmarks/json_writer_profile.py [threads ...]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import orjson
from _common import SEGMENT_PREFIX, make_pool, now, print_table, ring_mb_for

import shmask
from shmask.response_json import _gather, _scratch_buffer, _write_rows, dumps, json_threads

REQUESTS, TOKENS, WIDTH, REPEATS = 256, 50, 1000, 3


def document(chunk: Any, ids: bytes, logprobs: bytes) -> bytes:
    return orjson.dumps({"output_token_sampling_mask": orjson.Fragment(ids),
                         "output_token_sampling_logprobs": orjson.Fragment(logprobs),
                         "output_token_sampling_mask_length": chunk.rows})


def sglang_document(chunk: Any) -> bytes:
    masks, values, start = [], [], 0
    for length in chunk.lengths.tolist():
        masks.append(chunk.ids[start:start + length].tolist())
        values.append(chunk.logprobs[start:start + length].tolist())
        start += length
    return orjson.dumps({"output_token_sampling_mask": masks,
                         "output_token_sampling_logprobs": values,
                         "output_token_sampling_mask_length": chunk.rows})


def median_ms(chunks: list[Any], build: Callable[[Any], Any], keep: bool) -> float:
    times = []
    for _ in range(REPEATS):
        kept = []
        started = now()
        for chunk in chunks:
            result = build(chunk)
            if keep:
                kept.append(result)
        times.append((now() - started) * 1000)
        del kept
    return statistics.median(times)


def main(thread_counts: list[int]) -> None:
    pool = make_pool(REQUESTS, WIDTH, "support", seed=WIDTH)
    config = shmask.Config(ring_mb=ring_mb_for(REQUESTS, TOKENS, WIDTH, 2),
                           name_prefix=SEGMENT_PREFIX)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue("support") for _ in range(REQUESTS)]
        for step in range(TOKENS):
            writer.append_step(queues, *pool.step(step))
        chunks = [reader.open(ref) for ref in writer.take_batch(queues)]
        baseline = median_ms(chunks, sglang_document, keep=True)
        rows: list[tuple[Any, ...]] = [("sglang lists + orjson", "", baseline, 1.0)]
        dropped = median_ms(chunks, sglang_document, keep=False)
        rows.append(("sglang lists + orjson, dropped", "", dropped, baseline / dropped))
        for threads in thread_counts:
            def write(chunk: Any, threads: int = threads) -> Any:
                return _write_rows(True, chunk.lengths, chunk.flags, chunk.ids, chunk.logprobs,
                                   threads, _scratch_buffer)[1]

            def native(chunk: Any, threads: int = threads) -> bytes:
                holes = chunk.json_rows()
                return dumps({"output_token_sampling_mask": holes.ids,
                              "output_token_sampling_logprobs": holes.logprobs,
                              "output_token_sampling_mask_length": chunk.rows}, threads=threads)

            def full(chunk: Any, threads: int = threads) -> bytes:
                ids, logprobs, _ = chunk.json_arrays(threads)
                return document(chunk, ids, logprobs)

            ready: dict[int, bytes] = {id(chunk): native(chunk) for chunk in chunks}

            def gather(chunk: Any, threads: int = threads,
                       ready: dict[int, bytes] = ready) -> bytes:
                return _gather([ready[id(chunk)]], threads)

            for name, build, keep in (("write only", write, False), ("dumps", native, True),
                                      ("dumps, dropped", native, False),
                                      ("gather of ready text", gather, True),
                                      ("writer + orjson", full, True)):
                took = median_ms(chunks, build, keep)
                rows.append((name, threads, took, baseline / took))
            del ready
        for chunk in chunks:
            chunk.release()
        for queue in queues:
            queue.close()
    print_table(f"meta_info JSON of {REQUESTS} requests x {TOKENS} rows x {WIDTH} support "
                f"(median of {REPEATS} ms)", ("part", "threads", "ms", "baseline / this"), rows)


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or sorted({1, json_threads()}))

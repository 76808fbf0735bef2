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

import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

from _common import now, print_table
from responses import (
    fragments_meta_info,
    native_meta_info,
    one_emission,
    sent_ms,
    sglang_lists,
    sglang_meta_info,
)

from shmask.response_json import _gather, _scratch_buffer, _write_rows, json_threads

REQUESTS, TOKENS, WIDTH, REPEATS = 256, 50, 1000, 3


def sglang_document(chunk: Any) -> bytes:
    """SGLang's way: a list per row (the per-row tolist loop), then orjson."""
    return sglang_meta_info(*sglang_lists(None, chunk.lengths, chunk.ids, chunk.logprobs),
                            chunk.rows)


def median_ms(chunks: list[Any], build: Callable[[Any], Any], keep: bool) -> float:
    """Median over REPEATS of building every chunk's result: all kept, or
    each dropped once built (responses.sent_ms)."""
    times = []
    for _ in range(REPEATS):
        if keep:
            started = now()
            kept = [build(chunk) for chunk in chunks]
            times.append(now() - started)
            del kept
        else:
            times.append(sent_ms(chunks, build))
    return statistics.median(times) * 1000


def main(thread_counts: list[int]) -> None:
    with one_emission(REQUESTS, TOKENS, WIDTH) as chunks:
        baseline = median_ms(chunks, sglang_document, keep=True)
        rows: list[tuple[Any, ...]] = [("sglang lists + orjson", "", baseline, 1.0)]
        dropped = median_ms(chunks, sglang_document, keep=False)
        rows.append(("sglang lists + orjson, dropped", "", dropped, baseline / dropped))
        for threads in thread_counts:
            def write(chunk: Any, threads: int = threads) -> Any:
                return _write_rows(True, chunk.lengths, chunk.flags, chunk.ids, chunk.logprobs,
                                   threads, _scratch_buffer)[1]

            native = functools.partial(native_meta_info, threads=threads)
            full = functools.partial(fragments_meta_info, threads=threads)
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
    print_table(f"meta_info JSON of {REQUESTS} requests x {TOKENS} rows x {WIDTH} support "
                f"(median of {REPEATS} ms)", ("part", "threads", "ms", "baseline / this"), rows)


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or sorted({1, json_threads()}))

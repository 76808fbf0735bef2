"""Where the time of binary_rows.loads goes, per response body.

The bodies of benchmarks/responses.py's binary comparison (one emission of
REQUESTS requests x 50 rows x 1000 support, each request's meta_info as
encode_meta_info writes it), decoded at the client, median microseconds
per body over REPEATS passes over every body:

  lists baseline        orjson.loads + np.fromiter of the JSON lists
                        (responses.lists_to_arrays): the goal's baseline
  binary_rows.loads     the whole client path, each result dropped at once
  loads, all kept       the same, every result kept until the pass ends (as
                        responses.py does): fresh memory for each
  native scan           shm_b64_scan of the body alone
  native decode         shm_b64_decode of its four fields alone, into
                        memory reused across calls (no page faults)
  orjson.loads          of the binary body (its base64 as Python strings)

loads - scan - decode is what Python and fresh memory add.

    PYTHONPATH=. python benchmarks/loads_profile.py [requests] [repeats]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from _common import EMIT_TOKENS, now
from responses import lists_to_arrays, one_emission, sglang_lists, sglang_meta_info

from shmask import binary_rows
from shmask.binary_rows import encode_meta_info, loads
from shmask.response_json import json_threads


def per_body_us(bodies: list[bytes], call: Callable[[bytes], Any], repeats: int,
                keep: bool = False) -> float:
    """Median over `repeats` passes of the time per body, in microseconds:
    each result dropped at once (its memory reused by the next), or all
    kept until the pass ends (fresh memory for each, as responses.py)."""
    times = []
    for _ in range(repeats):
        kept = []
        started = now()
        for body in bodies:
            result = call(body)
            if keep:
                kept.append(result)
        times.append((now() - started) / len(bodies) * 1e6)
        del kept, result
    return statistics.median(times)


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    ffi, lib = binary_rows._native()
    with one_emission(requests, EMIT_TOKENS, 1000) as chunks:
        bodies = [encode_meta_info(c) for c in chunks]
        lists = [sglang_meta_info(*sglang_lists(None, c.lengths, c.ids, c.logprobs), c.rows)
                 for c in chunks]
        for chunk, body in zip(chunks, bodies, strict=True):  # the decoded rows are right
            rows = loads(body)[binary_rows.MASK_FIELD]
            assert np.array_equal(rows.ids, chunk.ids)
            assert np.array_equal(rows.logprobs.view(np.uint32), chunk.logprobs.view(np.uint32))
    spans = {}
    found = np.empty((4, 8), np.int64)
    error_at = ffi.new("uint64_t *")

    def scan(body: bytes) -> Any:
        count = lib.shm_b64_scan(ffi.from_buffer(body), len(body),
                                 ffi.from_buffer("int64_t[]", found), 4, error_at)
        assert count == 1
        return found[0].copy()

    for body in bodies:
        spans[id(body)] = scan(body)
    out = np.empty(1 << 20, np.uint8)
    results = np.empty(8, np.int64)
    threads = json_threads()

    def decode(body: bytes) -> None:
        found_spans = spans[id(body)]
        plan, at = [], 0
        for f in range(4):  # lengths, status, ids, logprobs
            begin, end = int(found_spans[2 * f]), int(found_spans[2 * f + 1])
            if begin < 0:
                continue
            size = (end - begin) // 4 * 3 - (body[end - 1] == 61) - (body[end - 2] == 61)
            plan += [begin, end - begin, at, size]
            at += (size + 63) // 64 * 64
        span_array = np.array(plan, np.uint64)
        code = lib.shm_b64_decode(ffi.from_buffer(body), len(body),
                                  ffi.from_buffer("uint64_t[]", span_array), len(plan) // 4,
                                  ffi.from_buffer("uint8_t[]", out), out.size,
                                  ffi.from_buffer("int64_t[]", results), threads)
        assert code == 0

    rows = [
        ("lists baseline", per_body_us(lists, lambda b: lists_to_arrays(orjson.loads(b)),
                                       max(3, repeats // 5))),
        ("binary_rows.loads", per_body_us(bodies, loads, repeats)),
        ("loads, all kept", per_body_us(bodies, loads, repeats, keep=True)),
        ("native scan", per_body_us(bodies, scan, repeats)),
        ("native decode", per_body_us(bodies, decode, repeats)),
        ("orjson.loads", per_body_us(bodies, orjson.loads, repeats)),
    ]
    size = statistics.mean(map(len, bodies)) / 1e3
    print(f"{requests} bodies of {size:.0f} KB, {threads} threads, median of {repeats}")
    for name, us in rows:
        print(f"  {name:<20} {us:9.1f} us/body   {rows[0][1] / us:7.1f}x")
    loads_us, scan_us, decode_us = rows[1][1], rows[3][1], rows[4][1]
    print(f"  {'loads - scan - decode':<20} {loads_us - scan_us - decode_us:9.1f} us/body")


if __name__ == "__main__":
    main()

"""Part 3: response building from chunks read out of the ring.

  to_lists   Chunk.to_lists() (ids per row, logprobs per row) against the
             floor: ids.tolist() + logprobs.tolist() of the same views, unsplit
  JSON       Chunk.to_json() (the three response fields written by orjson
             straight from the views) against json.dumps of the same fields as
             lists (the lists already built; building them is the row above)

Each chunk is one request's emission, 50 rows of support W (support mode),
published with Writer.publish and opened with a Reader, like the tokenizer
does. Times are the median per chunk. Both JSON documents are parsed back
and every value compared bit for bit (floats by their float64 bits), and
also against float() of the producer's float32 values.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from _common import EMIT_TOKENS, SEGMENT_PREFIX, console, make_pool, median_ms, now, print_table

import shmask

FIELDS = ("mask_ids", "mask_logprobs", "mask_lengths")
TARGET_JSON = 10.0


def chunk_rows(pool: Any, request: int, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One request's CSR rows for `tokens` steps of the pool."""
    slots = [s % len(pool.lengths) for s in range(tokens)]
    lengths = np.array([pool.lengths[p, request] for p in slots], np.int32)
    ids = np.concatenate([pool.ids[p, request, :n] for p, n in zip(slots, lengths, strict=True)])
    logprobs = np.concatenate([pool.logprobs[p, request, :n] for p, n in zip(slots, lengths, strict=True)])
    return lengths, ids, logprobs


def float_bits(values: list[Any]) -> np.ndarray:
    flat = [v for row in values for v in row]
    return np.array(flat, np.float64).view(np.uint64)


def same_document(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal field by field, floats compared by their bits (== alone would
    let -0.0 pass for 0.0)."""
    return (a.keys() == b.keys() and a["mask_ids"] == b["mask_ids"]
            and a["mask_lengths"] == b["mask_lengths"]
            and np.array_equal(float_bits(a["mask_logprobs"]), float_bits(b["mask_logprobs"])))


def measure(width: int, requests: int, tokens: int) -> dict[str, Any]:
    pool = make_pool(requests, width, "support", seed=width)
    sources = [chunk_rows(pool, r, tokens) for r in range(requests)]
    ring_bytes = sum(sum(a.nbytes for a in rows) for rows in sources) + 64 * 1024 * requests
    config = shmask.Config(ring_mb=max(8, 2 * ring_bytes // 2**20 + 1), name_prefix=SEGMENT_PREFIX)
    times: dict[str, list[float]] = {"to_lists": [], "tolist": [], "to_json": [], "json_dumps": []}
    mismatches = 0
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        refs = [writer.publish(lengths, ids, logprobs, "support") for lengths, ids, logprobs in sources]
        for ref, (lengths, ids, logprobs) in zip(refs, sources, strict=True):
            with reader.open(ref) as chunk:
                started = now()
                lists = chunk.to_lists()
                times["to_lists"].append(now() - started)

                started = now()
                floor = (chunk.ids.tolist(), chunk.logprobs.tolist())
                times["tolist"].append(now() - started)
                del floor

                started = now()
                document = chunk.to_json()
                times["to_json"].append(now() - started)

                fields = dict(zip(FIELDS, (*lists, chunk.lengths.tolist()), strict=True))
                started = now()
                baseline = json.dumps(fields)
                times["json_dumps"].append(now() - started)

                expected = {"mask_ids": [row.tolist() for row in np.split(ids, np.cumsum(lengths)[:-1])],
                            "mask_logprobs": [[float(v) for v in row]
                                              for row in np.split(logprobs, np.cumsum(lengths)[:-1])],
                            "mask_lengths": lengths.tolist()}
                parsed = json.loads(document)
                if not (same_document(parsed, json.loads(baseline)) and same_document(parsed, expected)):
                    mismatches += 1
    result = {name: median_ms(values) for name, values in times.items()}
    return {"width": width, "chunks": requests, **result, "mismatches": mismatches,
            "lists_ratio": result["to_lists"] / result["tolist"],
            "json_speedup": result["json_dumps"] / result["to_json"]}


def run(quick: bool = False) -> list[dict[str, Any]]:
    if quick:
        tokens, sizes = 10, {20: 16, 200: 8}
    else:
        tokens, sizes = EMIT_TOKENS, {20: 256, 1000: 64, 8192: 8}
    console().print(__doc__)
    rows = []
    for width, requests in sizes.items():
        rows.append(measure(width, requests, tokens))
        console().log(f"part 3: support {width}: to_json {rows[-1]['to_json']:.3f} ms, "
                      f"json.dumps {rows[-1]['json_dumps']:.3f} ms")
    print_table(
        f"Part 3 - response building, one chunk of {tokens} rows (median ms per chunk)",
        ("support", "chunks", "to_lists", "tolist floor", "to_lists / tolist", "to_json",
         "json.dumps(lists)", "JSON speedup", f">= {TARGET_JSON:g}x", "mismatches"),
        [(r["width"], r["chunks"], r["to_lists"], r["tolist"], r["lists_ratio"], r["to_json"],
          r["json_dumps"], r["json_speedup"], "PASS" if r["json_speedup"] >= TARGET_JSON else "MISS",
          r["mismatches"]) for r in rows]
    )
    return rows


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)

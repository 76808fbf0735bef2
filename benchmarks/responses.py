"""Part 3: response building from chunks read out of the ring.

  to_lists   Chunk.to_lists() (ids per row, logprobs per row) against the
             floor: ids.tolist() + logprobs.tolist() of the same views, unsplit
  JSON       Chunk.to_json() (the three response fields written by the native
             response writer straight from the views) against json.dumps of
             the same fields as lists (the lists already built; building them
             is the row above)
  SGLang     one emission's meta_info JSON for 256 requests x 50 rows x 1000
             entries (support mode): SGLang's SamplingMaskChunk.to_lists +
             orjson.dumps, against the native writer (Chunk.json_arrays as
             orjson Fragments) on 1 thread and on SHMASK_JSON_THREADS threads;
             byte-identical checked for every request, medians of the totals
  binary     the same emission as binary rows (shmask.binary_rows, the opt-in
             sampling_mask_format "base64"): at the server, the meta_info
             bytes with the base64 object (encode_meta_info: the whole
             meta_info written natively, on SHMASK_JSON_THREADS threads and
             on 1; encode_chunk + orjson; the per-request accumulator's
             extend + fields) against SGLang's to_lists + orjson and the
             native JSON writer; at the client, binary_rows.loads of the
             body and orjson.loads + decode_rows against orjson.loads +
             numpy arrays of the JSON lists (lengths, flat ids, flat
             logprobs: np.fromiter over the rows); every decoded value
             checked bit for bit, every binary document byte for byte

Each chunk is one request's emission, 50 rows of support W (support mode),
published with Writer.publish and opened with a Reader, like the tokenizer
does. Times are the median per chunk. Both JSON documents are parsed back
and every value compared bit for bit (floats by their float64 bits), and
also against float() of the producer's float32 values.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
from _common import (
    BATCH,
    EMIT_TOKENS,
    SEGMENT_PREFIX,
    console,
    make_pool,
    median_ms,
    now,
    print_table,
    ring_mb_for,
)

import shmask
from shmask import response_json
from shmask.binary_rows import (
    EmissionBuffer,
    SamplingMaskBase64,
    decode_rows,
    encode_chunk,
    encode_meta_info,
    encode_meta_info_many,
    loads,
)
from shmask.response_json import json_threads

FIELDS = ("mask_ids", "mask_logprobs", "mask_lengths")
TARGET_JSON = 10.0
TARGET_THREADS = 10.0  # issue 18: the native writer against SGLang's to_lists + orjson
TARGET_ONE_THREAD = 3.0
TARGET_BINARY_SERVER = 100.0  # issue 18, item 3: binary rows against the JSON lists
TARGET_BINARY_CLIENT = 50.0
BINARY_BASELINE = "sglang to_lists + orjson"


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


def sglang_chunk_class() -> Any:
    """SGLang's SamplingMaskChunk where SGLang is installed, else None.
    Imported once, before anything is timed (importing SGLang takes seconds)."""
    try:
        from sglang.srt.sampling.sampling_mask import SamplingMaskChunk
    except ImportError:
        return None
    return SamplingMaskChunk


def sglang_lists(chunk_class: Any, lengths: np.ndarray, ids: np.ndarray,
                 logprobs: np.ndarray) -> tuple[list[list[int]], list[Any]]:
    """SGLang's SamplingMaskChunk(...).to_lists(support_logprobs=True), or
    without SGLang the same loop (one tolist per row)."""
    if chunk_class is None:
        masks, values, start = [], [], 0
        for length in lengths.tolist():
            masks.append(ids[start:start + length].tolist())
            values.append(logprobs[start:start + length].tolist())
            start += length
        return masks, values
    masks, values = chunk_class(lengths=lengths, token_ids=ids,
                                logprobs=logprobs).to_lists(support_logprobs=True)
    return masks, values


def sglang_meta_info(masks: Any, logprobs: Any, rows: int) -> bytes:
    """The three sampling-mask fields of SGLang's meta_info, as orjson writes them."""
    return orjson.dumps({"output_token_sampling_mask": masks,
                         "output_token_sampling_logprobs": logprobs,
                         "output_token_sampling_mask_length": rows})


@contextlib.contextmanager
def one_emission(requests: int, tokens: int, width: int) -> Iterator[list[shmask.Chunk]]:
    """One emission of `tokens` steps for `requests` requests (support
    mode, support `width`), published through a ring and opened as the
    tokenizer does: the chunks, released when the block ends."""
    pool = make_pool(requests, width, "support", seed=width)
    config = shmask.Config(ring_mb=ring_mb_for(requests, tokens, width, 2),
                           name_prefix=SEGMENT_PREFIX)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue("support") for _ in range(requests)]
        for step in range(tokens):
            lengths, ids, logprobs = pool.step(step)
            writer.append_step(queues, lengths, ids, logprobs)
        chunks = [reader.open(ref) for ref in writer.take_batch(queues)]
        try:
            yield chunks
        finally:
            for c in chunks:
                c.release()
            for q in queues:
                q.close()


def fragments_meta_info(chunk: shmask.Chunk, threads: int) -> bytes:
    """The meta_info fields with the native writer's arrays as orjson
    Fragments (the path of an engine whose HTTP layer runs orjson)."""
    masks, values, _ = chunk.json_arrays(threads)
    return sglang_meta_info(orjson.Fragment(masks), orjson.Fragment(values), chunk.rows)


def native_document(chunk: shmask.Chunk) -> dict[str, Any]:
    """The meta_info fields with the chunk's rows as holes for response_json.dumps."""
    rows = chunk.json_rows()
    return {"output_token_sampling_mask": rows.ids,
            "output_token_sampling_logprobs": rows.logprobs,
            "output_token_sampling_mask_length": chunk.rows}


def native_meta_info(chunk: shmask.Chunk, threads: int) -> bytes:
    """The same bytes written by response_json.dumps (one copy of the rows' text)."""
    return response_json.dumps(native_document(chunk), threads=threads)


def native_meta_info_many(chunks: list[shmask.Chunk], threads: int) -> list[bytes]:
    """Every chunk's bytes by response_json.dumps_many: the emission's
    documents at once, each written whole by one of `threads` threads."""
    return response_json.dumps_many([native_document(c) for c in chunks], threads=threads)


SENT = ", sent"  # a path timed with each document dropped once built


def sent_ms(chunks: list[Any], build: Any) -> float:
    """Seconds to build every chunk's document, each dropped once built (as
    a server does once it has written the response to its socket: the next
    document reuses the memory), against keeping them all (every page of
    every document fresh: a page fault per 4 KiB)."""
    started = now()
    for c in chunks:
        build(c)  # the result is dropped at once
    return now() - started


def measure_sglang(requests: int, tokens: int, width: int, repeats: int) -> dict[str, Any]:
    """One emission's meta_info bytes for every request, on the same chunks
    (read out of a ring like the tokenizer does): SGLang's lists + orjson;
    the native writer's arrays as orjson Fragments (the path an engine whose
    HTTP layer runs orjson.dumps takes); and shmask.response_json.dumps,
    which writes the rows into the document natively (one copy, no orjson
    pass over them), on 1 and on SHMASK_JSON_THREADS threads. Each path
    twice: every document of the emission kept (fresh memory throughout),
    and each dropped once built (", sent": memory reused, as a server
    sending each response); and response_json.dumps_many, the emission's
    documents in one call, each written whole by one thread (kept). Totals
    over all requests, medians over `repeats`, the paths interleaved within
    each repeat."""
    chunk_class = sglang_chunk_class()
    threads = json_threads()

    def lists(c: Any) -> bytes:
        return sglang_meta_info(*sglang_lists(chunk_class, c.lengths, c.ids, c.logprobs), c.rows)

    paths: dict[str, Any] = {
        "sglang to_lists + orjson": lists,
        "native arrays as orjson Fragments, 1 thread": lambda c: fragments_meta_info(c, 1),
        f"native arrays as orjson Fragments, {threads} threads":
            lambda c: fragments_meta_info(c, threads),
        "native dumps, 1 thread": lambda c: native_meta_info(c, 1),
        f"native dumps, {threads} threads": lambda c: native_meta_info(c, threads)}
    times: dict[str, list[float]] = {name + mode: [] for name in paths for mode in ("", SENT)}
    many = f"native dumps_many, {threads} threads"
    times[many] = []
    mismatches = 0
    with one_emission(requests, tokens, width) as chunks:
        for _ in range(repeats):
            out: dict[str, list[bytes]] = {}
            for name, build in paths.items():
                started = now()
                out[name] = [build(c) for c in chunks]
                times[name].append(now() - started)
            for name, build in paths.items():
                times[name + SENT].append(sent_ms(chunks, build))
            # The whole emission in one call (kept: the call returns them all).
            started = now()
            out[many] = native_meta_info_many(chunks, threads)
            times[many].append(now() - started)
            baseline = out["sglang to_lists + orjson"]
            mismatches += sum(a != b for got in out.values() for a, b in zip(got, baseline,
                                                                             strict=True))
    result = {name: median_ms(values) for name, values in times.items()}
    return {"requests": requests, "tokens": tokens, "width": width, "threads": threads,
            "times": result, "mismatches": mismatches, "repeats": repeats,
            "sglang": "SGLang's SamplingMaskChunk" if chunk_class else "the same loop (no SGLang)"}


def print_sglang(result: dict[str, Any]) -> None:
    times = result["times"]
    goals = {"native dumps, 1 thread": TARGET_ONE_THREAD,
             f"native dumps, {result['threads']} threads": TARGET_THREADS,
             f"native dumps_many, {result['threads']} threads": TARGET_THREADS}
    rows = []
    for mode, label in (("", "kept"), (SENT, "sent")):
        baseline = times["sglang to_lists + orjson" + mode]
        for name in (n for n in times if n.endswith(SENT) == bool(mode)):
            took, path = times[name], name.removesuffix(SENT)
            speedup = baseline / took
            goal = goals.get(path)
            rows.append((label, path, took, took / result["requests"], speedup,
                         f">= {goal:g}x" if goal else "",
                         ("PASS" if speedup >= goal else "MISS") if goal else ""))
    print_table(
        f"SGLang meta_info JSON of one emission: {result['requests']} requests x "
        f"{result['tokens']} rows x {result['width']} support (median of {result['repeats']}, "
        f"{result['mismatches']} byte mismatches; to_lists: {result['sglang']}; kept: every "
        f"document of the emission held; sent: each dropped once built)",
        ("documents", "path", "ms (all requests)", "ms per request", "speedup vs SGLang",
         "goal", "verdict"), rows)


def lists_to_arrays(meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A client's CSR arrays from the JSON lists (support mode): lengths,
    flat ids, flat logprobs; np.fromiter over the chained rows (faster than
    np.array per row, and than np.array of one flattened list)."""
    masks, values = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    lengths = np.fromiter(map(len, masks), np.int32, len(masks))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(masks), np.int32, total)
    logprobs = np.fromiter(itertools.chain.from_iterable(values), np.float32, total)
    return lengths, ids, logprobs


def measure_binary(requests: int, tokens: int, width: int, repeats: int) -> dict[str, Any]:
    """One emission's meta_info for every request, JSON lists and binary
    rows, built at the server and decoded at the client; totals over all
    requests, medians over `repeats`. Every decoded array is compared with
    the chunk's own rows (floats by their bits)."""
    chunk_class = sglang_chunk_class()
    threads = json_threads()
    server = (BINARY_BASELINE, f"native JSON, {threads} threads", "binary, encode_chunk",
              "binary, accumulator extend + fields", "floor: one copy of the raw rows",
              f"binary, encode_meta_info (native, {threads} threads)",
              "binary, encode_meta_info (native, 1 thread)",
              BINARY_BASELINE + SENT, f"binary, encode_meta_info (native, {threads} threads)" + SENT,
              f"binary, encode_meta_info_many (native, {threads} threads)",
              f"binary, encode_meta_info_many into an EmissionBuffer ({threads} threads)")
    client = ("orjson.loads + np.fromiter (JSON lists)", "orjson.loads + decode_rows (binary)",
              "floor: orjson.loads of the binary meta_info", "binary_rows.loads")
    times: dict[str, list[float]] = {name: [] for name in server + client}
    sizes: dict[str, int] = {}
    mismatches = 0
    buffer = EmissionBuffer()  # reused by every repeat: each finds the last one's block free
    with one_emission(requests, tokens, width) as chunks:
        for _ in range(repeats):
            out: dict[str, list[bytes]] = {}
            started = now()
            out[server[0]] = [sglang_meta_info(*sglang_lists(chunk_class, c.lengths, c.ids,
                                                             c.logprobs), c.rows) for c in chunks]
            times[server[0]].append(now() - started)
            started = now()
            out[server[1]] = [fragments_meta_info(c, threads) for c in chunks]
            times[server[1]].append(now() - started)
            started = now()
            out[server[2]] = [orjson.dumps({"output_token_sampling_mask":
                                            orjson.Fragment(encode_chunk(c)),
                                            "output_token_sampling_mask_length": c.rows})
                              for c in chunks]
            times[server[2]].append(now() - started)
            started = now()
            out[server[3]] = []
            for c in chunks:
                accumulated = SamplingMaskBase64(True)
                accumulated.extend(c)
                out[server[3]].append(orjson.dumps(accumulated.fields()))
            times[server[3]].append(now() - started)
            # What any path that copies the rows out of the ring pays at least.
            started = now()
            floor = [(bytes(c.lengths), bytes(c.ids), bytes(c.logprobs)) for c in chunks]
            times[server[4]].append(now() - started)
            del floor
            for name, path_threads in ((server[5], threads), (server[6], 1)):
                started = now()
                out[name] = [encode_meta_info(c, threads=path_threads) for c in chunks]
                times[name].append(now() - started)
            times[server[7]].append(sent_ms(chunks, lambda c: sglang_meta_info(
                *sglang_lists(chunk_class, c.lengths, c.ids, c.logprobs), c.rows)))
            times[server[8]].append(sent_ms(chunks, lambda c: encode_meta_info(c, threads=threads)))
            started = now()  # the emission in one native call (kept: it returns them all)
            out[server[9]] = encode_meta_info_many(chunks, threads=threads)
            times[server[9]].append(now() - started)
            started = now()  # the same into the block the repeat before used (its views dropped)
            views = encode_meta_info_many(chunks, threads=threads, into=buffer)
            times[server[10]].append(now() - started)
            mismatches += sum(bytes(a) != b for a, b in zip(views, out[server[2]], strict=True))
            del views
            mismatches += sum(a != b for a, b in zip(out[server[1]], out[server[0]], strict=True))
            for name in (server[3], server[5], server[6], server[9]):  # encode_chunk's bytes
                mismatches += sum(a != b for a, b in zip(out[name], out[server[2]], strict=True))

            started = now()
            from_lists = [lists_to_arrays(orjson.loads(b)) for b in out[server[0]]]
            times[client[0]].append(now() - started)
            started = now()
            decoded = [decode_rows(orjson.loads(b)) for b in out[server[2]]]
            times[client[1]].append(now() - started)
            started = now()
            parsed = [orjson.loads(b) for b in out[server[2]]]
            times[client[2]].append(now() - started)
            del parsed
            started = now()
            scanned = [loads(b) for b in out[server[5]]]
            times[client[3]].append(now() - started)
            for c, rows, arrays, meta in zip(chunks, decoded, from_lists, scanned, strict=True):
                native = meta["output_token_sampling_mask"]
                ok = (np.array_equal(rows.lengths, c.lengths) and np.array_equal(rows.ids, c.ids)
                      and np.array_equal(rows.logprobs.view(np.uint32), c.logprobs.view(np.uint32))
                      and not rows.status.any() and np.array_equal(arrays[0], c.lengths)
                      and np.array_equal(arrays[1], c.ids)
                      and np.array_equal(arrays[2].view(np.uint32), c.logprobs.view(np.uint32))
                      and np.array_equal(native.lengths, c.lengths)
                      and np.array_equal(native.ids, c.ids)
                      and np.array_equal(native.logprobs.view(np.uint32),
                                         c.logprobs.view(np.uint32))
                      and not native.status.any()
                      and meta["output_token_sampling_mask_length"] == c.rows)
                mismatches += not ok
            sizes = {name: sum(map(len, out[name])) for name in (server[0], server[2])}
    result = {name: median_ms(values) for name, values in times.items()}
    return {"requests": requests, "tokens": tokens, "width": width, "times": result,
            "server": server, "client": client, "sizes": sizes, "mismatches": mismatches,
            "repeats": repeats,
            "sglang": "SGLang's SamplingMaskChunk" if chunk_class else "the same loop (no SGLang)",
            "codec": "pybase64" if shmask.binary_rows._pybase64 is not None else "binascii"}


def print_binary(result: dict[str, Any]) -> None:
    times, server, client = result["times"], result["server"], result["client"]
    rows = []
    for names, goal in ((server, TARGET_BINARY_SERVER), (client, TARGET_BINARY_CLIENT)):
        for name in names:
            # A ", sent" path (each document dropped once built) against the baseline sent alike.
            speedup = times[names[0] + (SENT if name.endswith(SENT) else "")] / times[name]
            binary = (name.startswith("binary") or "decode_rows" in name
                      or name.endswith(".loads"))  # the goals' paths
            rows.append((name, times[name], times[name] / result["requests"], speedup,
                         f">= {goal:g}x" if binary else "",
                         ("PASS" if speedup >= goal else "MISS") if binary else ""))
    sizes = result["sizes"]
    print_table(
        f"Binary rows of one emission: {result['requests']} requests x {result['tokens']} rows "
        f"x {result['width']} support (median of {result['repeats']}, {result['mismatches']} "
        f"mismatches; codec {result['codec']}; to_lists: {result['sglang']}; meta_info "
        f"{sizes.get(server[0], 0) / 2**20:.0f} MiB as JSON lists, "
        f"{sizes.get(server[2], 0) / 2**20:.0f} MiB binary; \"{SENT[2:]}\": each document "
        f"dropped once built, against the baseline sent alike)",
        ("path", "ms (all requests)", "ms per request", "speedup", "goal", "verdict"), rows)


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
    sglang = (measure_sglang(16, 10, 200, 2) if quick
              else measure_sglang(BATCH, EMIT_TOKENS, 1000, 5))
    print_table(
        f"Part 3 - response building, one chunk of {tokens} rows (median ms per chunk)",
        ("support", "chunks", "to_lists", "tolist floor", "to_lists / tolist", "to_json",
         "json.dumps(lists)", "JSON speedup", f">= {TARGET_JSON:g}x", "mismatches"),
        [(r["width"], r["chunks"], r["to_lists"], r["tolist"], r["lists_ratio"], r["to_json"],
          r["json_dumps"], r["json_speedup"], "PASS" if r["json_speedup"] >= TARGET_JSON else "MISS",
          r["mismatches"]) for r in rows]
    )
    print_sglang(sglang)
    binary = (measure_binary(16, 10, 200, 2) if quick
              else measure_binary(BATCH, EMIT_TOKENS, 1000, 3))
    print_binary(binary)
    rows[-1]["mismatches"] += sglang["mismatches"] + binary["mismatches"]  # run.py counts them
    return rows


if __name__ == "__main__":
    if "--sglang" in sys.argv:  # only the SGLang comparison
        print_sglang(measure_sglang(BATCH, EMIT_TOKENS, 1000, 5))
    elif "--binary" in sys.argv:  # only the binary rows (--requests N for fewer)
        count = int(sys.argv[sys.argv.index("--requests") + 1]) if "--requests" in sys.argv else BATCH
        print_binary(measure_binary(count, EMIT_TOKENS, 1000, 3))
    else:
        run(quick="--quick" in sys.argv)

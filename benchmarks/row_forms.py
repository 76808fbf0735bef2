"""Wide rows through the transport: the same supports sent as ids and as
bitmasks, side by side in one run (issue 9).

Per configuration: `batch` requests (64), each emission `tokens` steps of one
row per request, every row a support of `size` ids out of V = 151936. For each form:
bytes published (ids or words, plus support logprobs), producer CPU per step
(append_step) and per emission (take_batch), and reader CPU per chunk
(open + to_lists + release). Medians over emissions; ratio = bitmask / ids.

    python benchmarks/row_forms.py [--sizes 4748 20000 151936] [--emissions 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import SEGMENT_PREFIX, VOCAB, print_table

import shmask


def bitmask(ids: np.ndarray) -> np.ndarray:
    """Words of a bitmask row (bit j of word w: id 32 w + j)."""
    bits = np.zeros(-(-VOCAB // 32) * 32, np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def run(size: int, form: int, mode: str, batch: int, tokens: int,
        emissions: int) -> dict[str, float]:
    rng = np.random.default_rng(size)
    support = np.sort(rng.choice(VOCAB, size, replace=False)).astype(np.int32)
    data = bitmask(support) if form else support
    ids = np.tile(data, batch)
    if mode == "support":
        logprobs = np.tile(rng.standard_normal(size).astype(np.float32), batch)
    else:
        logprobs = rng.standard_normal(batch).astype(np.float32)
    lengths = np.full(batch, size, np.int32)
    status = np.zeros(batch, np.int32)
    forms = np.full(batch, form, np.int32)
    per_emission = batch * tokens * (4 * data.size + (4 * size if mode == "support" else 4))
    config = shmask.Config(ring_mb=max(64, int(per_emission * 2.5 / 2**20) + 1),
                           name_prefix=SEGMENT_PREFIX, lease_s=600, max_tokens=VOCAB)
    append_s, take_s, read_s, published = [], [], [], []
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue(mode) for _ in range(batch)]
        handles = np.array([q.handle for q in queues], np.int64)
        for emission in range(emissions + 1):  # the first warms buffers up
            before = writer.stats.payload_bytes
            for _ in range(tokens):
                started = time.perf_counter()
                writer.append_step(handles, lengths, ids, logprobs, status=status, forms=forms,
                                   vocab=VOCAB)
                if emission:
                    append_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            batch = writer.take_batch(handles)
            took = time.perf_counter() - started
            started = time.perf_counter()
            for ref in list(batch)[:8]:  # a tokenizer's share: 8 requests' chunks
                with reader.open(ref) as chunk:
                    rows, _ = chunk.to_lists()
                    assert rows[0] == support.tolist()  # decoded exactly, either form
            read = (time.perf_counter() - started) / 8
            for ref in list(batch)[8:]:
                reader.discard(ref)
            if emission:
                take_s.append(took)
                read_s.append(read)
                published.append(writer.stats.payload_bytes - before)
        for q in queues:
            q.close()
    return {"bytes": statistics.median(published), "append": statistics.median(append_s),
            "take": statistics.median(take_s), "read": statistics.median(read_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4748, 20000, VOCAB])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--emissions", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for mode in ("selected", "support"):
        for size in args.sizes:
            ids = run(size, 0, mode, args.batch, args.tokens, args.emissions)
            mask = run(size, 1, mode, args.batch, args.tokens, args.emissions)
            for key, unit, scale in (("bytes", "MB / emission", 1e-6),
                                     ("append", "append_step ms / step", 1e3),
                                     ("take", "take_batch ms / emission", 1e3),
                                     ("read", "open + to_lists ms / chunk", 1e3)):
                rows.append([mode, f"{size:,}", unit, f"{ids[key] * scale:,.2f}",
                             f"{mask[key] * scale:,.2f}", f"{mask[key] / ids[key]:.3f}"])
    print_table(f"Wide rows: ids vs bitmask ({args.batch} requests x {args.tokens} tokens, "
                f"V = {VOCAB:,}; medians of {args.emissions} emissions)",
                ["mode", "support", "measure", "ids", "bitmask", "ratio"], rows)


if __name__ == "__main__":
    main()

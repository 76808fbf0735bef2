"""Every float32 bit pattern (all 2^32) through the native response writer
against orjson: `make test-exhaustive` (minutes; one process per CPU).

Each block of consecutive bit patterns is written by shmask.response_json's
float_json and by orjson.dumps of the same values as Python floats (what
SGLang's to_lists + orjson does), and the two byte strings must be equal.
The first difference is printed with its bit pattern. Exit status 0 only if
all 2^32 agree.

    python tests/exhaustive_float_json.py [--processes N] [--block-bits B] [--shard K/N]
                                          [--against orjson|one-by-one]

--against one-by-one compares the writer's two conversions with each other
instead (eight at a time with AVX-512, and one value at a time, which this
script proves against orjson): both native, so about a minute per core.

--shard K/N checks every N-th block from block K (K in 0..N-1), so that N
machines (or N runs) share the work; all N shards passing is the full check.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import numpy as np
import orjson

from shmask.response_json import avx512, float_json

TOTAL = 2**32


def check_block(args: tuple[int, int, str]) -> tuple[int, str | None]:
    """(count, None) if bit patterns [start, start + count) agree, else
    (count, a message naming the first that does not)."""
    start, count, against = args
    values = np.arange(start, start + count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # The writer takes an array's first value one by one and the values
    # after it in blocks of eight (AVX-512): one value in front (and a block
    # a multiple of 8) puts every pattern of the block in a lane.
    values = np.concatenate([np.ones(1, np.float32), values])
    if against == "orjson":
        ours = float_json(values)
        with np.errstate(invalid="ignore"):
            theirs = orjson.dumps(values.astype(np.float64).tolist())
    else:
        avx512(True)
        ours = float_json(values)
        avx512(False)
        theirs = float_json(values)
    if ours == theirs:
        return count, None
    mine, want = ours[1:-1].split(b","), theirs[1:-1].split(b",")
    first = start - (len(values) - count)  # the pattern of the first value written
    for index, (a, b) in enumerate(zip(mine, want, strict=False)):
        if a != b:
            return count, f"float32 0x{first + index:08x}: wrote {a!r}, {against} {b!r}"
    return count, f"block 0x{start:08x}: {len(mine)} values written, {against} {len(want)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--block-bits", type=int, default=21, help="log2 of values per block")
    parser.add_argument("--shard", default="0/1", help="K/N: every N-th block from block K")
    parser.add_argument("--against", choices=("orjson", "one-by-one"), default="orjson",
                        help="the reference: orjson, or the writer's one-value-at-a-time path")
    args = parser.parse_args()
    if args.block_bits < 3:
        parser.error("--block-bits must be at least 3 (the writer's blocks of eight)")
    if args.against == "one-by-one" and not avx512(True):
        parser.error("--against one-by-one: this CPU has no AVX-512, so there is one path only")
    shard, shards = (int(part) for part in args.shard.split("/"))
    if not 0 <= shard < shards:
        parser.error(f"--shard {args.shard}: K must be in 0..N-1")
    block = 1 << args.block_bits
    blocks = [(start, block, args.against) for start in range(0, TOTAL, block)][shard::shards]
    total = len(blocks) * block
    what = f"all {TOTAL:,}" if shards == 1 else f"shard {shard}/{shards}: {total:,} of the {TOTAL:,}"
    reference = f"orjson {orjson.__version__}" if args.against == "orjson" else "the one-by-one path"
    simd = "eight at a time (AVX-512)" if avx512() else "one by one"
    print(f"checking {what} float32 bit patterns, written {simd}, against {reference} "
          f"in {len(blocks)} blocks, {args.processes} processes", flush=True)
    started = time.monotonic()
    checked, failures = 0, []
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        for done, (count, failure) in enumerate(pool.imap_unordered(check_block, blocks), 1):
            checked += count
            if failure:
                failures.append(failure)
                print("MISMATCH", failure, flush=True)
            if done % max(1, len(blocks) // 64) == 0 or done == len(blocks):
                elapsed = time.monotonic() - started
                eta = elapsed / checked * (total - checked)
                print(f"{checked / total:6.1%}  {checked:>13,} checked  {elapsed:7.0f} s elapsed  "
                      f"~{eta:.0f} s left  {len(failures)} mismatching blocks", flush=True)
    elapsed = time.monotonic() - started
    if failures:
        print(f"FAIL: {len(failures)} blocks differ ({elapsed:.0f} s)")
        return 1
    print(f"PASS: {what} float32 bit patterns ({checked:,}), written {simd}, byte-identical "
          f"to {reference} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

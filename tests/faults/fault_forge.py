"""Forged references, run in a child process: `python fault_forge.py seed start end`.

Prints one line per case, "<index> <code>", before moving on, so the parent
knows which case was running if this process dies (crash) or stops printing
(hang). Codes:

  T   the forged ref opened and gave the true rows of the chunk it names
  E:X a shmask error X (the expected outcome for most forgeries)
  I   an inline ref whose bytes the forgery altered gave altered rows: the
      rows travel in the message itself, so this is not detectable, and no
      shared memory was read
  O   rows that are not those of the ring record the ref names (violation)
  X:X a non-shmask exception X (violation)
  W:X a wrong-typed field gave X instead of InvalidRefError (violation)

Every case is derived from (seed, index) alone, so a case is re-run exactly
after a crash, and a pool of real chunks is rebuilt per round of cases.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
from fault_lib import MODE_SELECTED, MODE_SUPPORT, check_rows, encode_rows

import shmask
from shmask.refs import ENTRY_DTYPE

ROUND = 50
FIELDS = ("kind", "mode", "segment", "epoch", "position", "record_bytes", "rows", "nnz")
USED_FIELDS = {0: ("kind", "rows", "nnz"), 2: ("kind", "mode", "rows", "nnz", "payload"),
               1: FIELDS}
WRONG_TYPES = ("text", 1.5, math.nan, math.inf, None, b"\x01", [1], {"a": 1}, 1j, object())


class Pool:
    """Real chunks of one round: one-shot publishes, queue takes (capacity
    larger than the rows), an inline chunk and an empty one, each with a
    distinct row count so one forged field cannot name another real chunk."""

    def __init__(self, writer, inline_writer, seed: int, round_: int) -> None:
        self.refs, self.truth = [], []
        rows_left = list(range(1, 8))
        rng = np.random.default_rng([seed, round_, 1])
        rng.shuffle(rows_left)
        base = (round_ * 8) % 2000
        for j in range(3):  # one-shot publishes, both modes
            mode = MODE_SUPPORT if j != 1 else MODE_SELECTED
            rows = encode_rows(seed, base + j, mode, 0, rows_left.pop(), 40)
            self.refs.append(writer.publish(*rows, "support" if mode == MODE_SUPPORT else "selected"))
            self.truth.append(rows)
        queues = [writer.open_queue("support") for _ in range(2)]
        for j, queue in enumerate(queues):  # queue buffers published in place
            rows = encode_rows(seed, base + 3 + j, MODE_SUPPORT, 0, rows_left.pop(), 40)
            start = 0
            for length in rows[0]:
                queue.append(rows[1][start:start + length], rows[2][start:start + length])
                start += length
            self.truth.append(rows)
        self.refs.extend(writer.take_batch(queues))
        for queue in queues:
            queue.close()
        rows = encode_rows(seed, base + 5, MODE_SUPPORT, 0, rows_left.pop(), 40)
        self.refs.append(inline_writer.publish(*rows))
        self.truth.append(rows)
        self.refs.append(shmask.ChunkRef(0, MODE_SUPPORT, "", 0, 0, 0, 0, 0, None))
        self.truth.append((np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32)))
        self.by_position = {(r.segment, r.position): t for r, t in zip(self.refs, self.truth,
                                                                        strict=True) if r.kind == 1}
        self.batch = shmask.RefBatch.from_refs(self.refs)

    def release(self, reader) -> None:
        for ref in self.refs:
            if ref.kind == 1:
                try:
                    reader.open(ref).release()
                except shmask.ShmaskError:
                    pass


def interesting(rng, current, others) -> object:
    pick = rng.integers(9)
    if pick == 0:
        return int(rng.choice(others))
    if pick == 1:
        return int(current) + int(rng.choice([-4096, -64, -1, 1, 64, 4096]))
    if pick == 2:
        return int(rng.choice([0, 1, 2, 3, 255, 256, 2**16 - 1, 2**31 - 1, 2**32 - 1, 2**32,
                               2**63 - 1, 2**63, 2**64 - 1]))
    if pick == 3:
        return int(rng.choice([-1, -2**63, 2**64, 2**70, -2**70]))
    bits = int(rng.choice([8, 16, 32, 40, 64]))
    return int(rng.integers(0, 2**62)) % (1 << bits) if bits < 64 else int(
        rng.integers(0, 2**63 - 1, dtype=np.int64)) * 2 + int(rng.integers(2))


def copy_ref(ref, **changes) -> shmask.ChunkRef:
    fields = {f: getattr(ref, f) for f in ("kind", "mode", "segment", "epoch", "position",
                                           "record_bytes", "rows", "nnz", "payload")}
    fields.update(changes)
    return shmask.ChunkRef(**fields)


def forge_refs(rng, pool: Pool, names: list[str]) -> tuple[list, bool, bool]:
    """(forged refs, wrong_typed, inline_bytes_touched)."""
    choice = rng.random()
    index = int(rng.integers(len(pool.refs)))
    ref = pool.refs[index]
    if choice < 0.45:  # 1-3 fields of a real ref set to interesting values
        changes = {}
        for field in rng.choice(FIELDS, size=int(rng.integers(1, 4)), replace=False):
            if field == "segment":
                changes[field] = str(rng.choice(names))
            else:
                others = [getattr(r, field) for r in pool.refs]
                changes[field] = interesting(rng, getattr(ref, field), others)
        return [copy_ref(ref, **changes)], False, False
    if choice < 0.60:  # one field of the wrong type
        # only fields the ref's kind reads (an inline ref has no segment, an
        # empty one no payload): a wrong type there must be InvalidRefError
        field = str(rng.choice(USED_FIELDS[ref.kind]))
        value = WRONG_TYPES[int(rng.integers(len(WRONG_TYPES)))]
        if field == "segment":
            value = [7, b"/x", None, 1.5, ["/x"]][int(rng.integers(5))]
        if field == "payload":
            value = ["text", 7, [1, 2], 1.5, object()][int(rng.integers(5))]
        return [copy_ref(ref, **{field: value})], True, False
    if choice < 0.70:  # a real ref, a mangled batch header or entry through numpy
        entries = pool.batch.entries.copy()
        field = str(rng.choice(ENTRY_DTYPE.names))
        limit = np.iinfo(entries.dtype[field]).max
        entries[field][int(rng.integers(len(entries)))] = int(rng.integers(0, 2**63 - 1,
                                                                        dtype=np.int64)) % (limit + 1) \
            if rng.random() < 0.5 else limit
        data = pool.batch.to_bytes()
        inline_size = len(pool.refs[5].payload)
        head = len(data) - inline_size - entries.nbytes
        forged = data[:head] + entries.tobytes() + data[len(data) - inline_size:]
        return list(shmask.RefBatch.from_bytes(forged)), False, False
    # raw bytes of the whole batch: flips, cuts, growth
    data = bytearray(pool.batch.to_bytes())
    inline_start = len(data) - len(pool.refs[5].payload)
    touched = False
    for _ in range(int(rng.integers(1, 5))):
        at = int(rng.integers(len(data)))
        data[at] = int(rng.integers(256))
        touched |= at >= inline_start
    action = rng.random()
    if action < 0.2:
        data = data[:int(rng.integers(len(data)))]
        touched = True
    elif action < 0.3:
        data += bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))
        touched = True
    return list(shmask.RefBatch.from_bytes(bytes(data))), False, touched


def run_case(reader, pool: Pool, names, seed: int, index: int) -> str:
    rng = np.random.default_rng([seed, index])
    try:
        refs, wrong_typed, inline_touched = forge_refs(rng, pool, names)
    except shmask.ShmaskError as exc:
        return f"E:{type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - parsing a forged batch must raise shmask errors
        return f"X:{type(exc).__name__}"
    code = "T"
    for ref in refs:
        try:
            chunk = reader.open(ref)
            rows = (chunk.lengths.copy(), chunk.ids.copy(), chunk.logprobs.copy())
            chunk.to_lists()
            chunk.to_json()
        except shmask.InvalidRefError as exc:
            code = f"E:{type(exc).__name__}"
            continue
        except shmask.ShmaskError as exc:
            code = f"W:{type(exc).__name__}" if wrong_typed else f"E:{type(exc).__name__}"
            continue
        except Exception as exc:  # noqa: BLE001
            return f"{'W' if wrong_typed else 'X'}:{type(exc).__name__}"
        if wrong_typed:
            return "W:accepted"
        if ref.kind == 1:
            truth = pool.by_position.get((ref.segment, ref.position))
            if truth is None or check_rows(*rows, truth):
                return "O"
        elif ref.kind == 2:
            original = pool.truth[5]
            if check_rows(*rows, original):
                if not inline_touched:
                    return "O"
                code = "I"
        elif rows[0].size:
            return "O"  # an empty ref gave rows
    return code


def main(seed: int, start: int, end: int) -> None:
    prefix = os.environ["SHMASK_NAME_PREFIX"]
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1, lease_s=3600)
    writer = shmask.Writer(config)
    other = shmask.Writer(config)  # a second live ring: a real name with another epoch
    inline_writer = shmask.Writer(shmask.Config(transport="inline", name_prefix=prefix))
    reader = shmask.Reader(config)
    names = [writer.segment_name, other.segment_name, "/" + prefix + "-0-1-" + "0" * 16,
             "/etc/passwd", "../../etc/shadow", "", "/" + "a" * 300, "/dev/shm/x", "\x00"]
    pool = None
    out = sys.stdout
    for index in range(start, end):
        if pool is None or index % ROUND == 0:
            if pool is not None:
                pool.release(reader)
                writer.reclaim()
            pool = Pool(writer, inline_writer, seed, index // ROUND)
        out.write(f"{index} {run_case(reader, pool, names, seed, index)}\n")
        out.flush()
    print("done", flush=True)
    writer.close()
    other.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

"""Exact rows of any size through the transport: ids rows, bitmask rows and
dropped rows (OVERFLOW / INVALID) mixed in one chunk, through a real ring and
read in another process, inline, and forged. The oracle is plain numpy: a
row is a set of ids (or a status), the bitmask is built here, not by shmask."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

import shmask
from shmask import InvalidRefError, InvalidRowsError
from shmask._native import ffi, lib
from shmask.refs import RefBatch

OK, OVERFLOW, INVALID = 0, 1, 2
IDS, BITMASK = 0, 1


def bitmask(ids: np.ndarray, vocab: int) -> np.ndarray:
    """int32 words, bit j of word w set <=> id 32 w + j (the oracle's own packing)."""
    words = np.zeros((vocab + 31) // 32, np.uint32)
    for i in ids.tolist():
        words[i // 32] |= np.uint32(1 << (i % 32))
    return words.view(np.int32)


class Oracle:
    """Rows as the consumer must see them: (ids, logprobs) or None for a dropped row."""

    def __init__(self, vocab: int, mode: str, seed: int) -> None:
        self.vocab, self.mode = vocab, mode
        self.rng = np.random.default_rng(seed)

    def row(self, size: int | None, form: int) -> dict:
        """One row: `size` None drops it (status chosen at random)."""
        if size is None:
            status = int(self.rng.choice([OVERFLOW, INVALID]))
            return {"status": status, "form": IDS, "ids": None, "values": np.zeros(0, np.float32),
                    "selected": np.float32(np.nan) if status == INVALID else np.float32(-1.5)}
        ids = np.sort(self.rng.choice(self.vocab, size, replace=False)).astype(np.int32)
        values = self.rng.standard_normal(size).astype(np.float32)
        return {"status": OK, "form": form, "ids": ids, "values": values,
                "selected": np.float32(self.rng.standard_normal())}

    def step_arrays(self, rows: list[dict]) -> dict:
        data = [r["ids"] if r["form"] == IDS else bitmask(r["ids"], self.vocab)
                for r in rows if r["ids"] is not None]
        return {
            "lengths": np.array([0 if r["ids"] is None else r["ids"].size for r in rows], np.int32),
            "ids": np.concatenate(data) if data else np.zeros(0, np.int32),
            "logprobs": np.concatenate([r["values"] for r in rows]) if self.mode == "support"
            else np.array([r["selected"] for r in rows], np.float32),
            "status": np.array([r["status"] for r in rows], np.int32),
            "forms": np.array([r["form"] for r in rows], np.int32),
        }

    def expected_lists(self, rows: list[dict]) -> tuple[list, list]:
        ids = [None if r["ids"] is None else r["ids"].tolist() for r in rows]
        if self.mode == "support":
            values = [None if r["ids"] is None else r["values"].tolist() for r in rows]
        else:
            values = [None if r["ids"] is None else float(r["selected"]) for r in rows]
        return ids, values


def sizes_for(vocab: int, max_tokens: int) -> list[tuple[int | None, int]]:
    """(size, form) cases: empty, one, the crossover (32 L = V) -1/0/+1,
    max_tokens -1/0/+1 as bitmask past it, half and all of the vocabulary,
    dropped rows."""
    crossover = -(-vocab // 32)
    cases = [(0, IDS), (1, IDS), (crossover - 1, IDS), (crossover, BITMASK),
             (crossover + 1, BITMASK), (max_tokens - 1, IDS), (max_tokens, IDS),
             (max_tokens + 1, BITMASK), (vocab // 2, BITMASK), (vocab, BITMASK), (None, IDS),
             (None, IDS), (5, BITMASK)]  # a small row may travel as a bitmask too
    return cases


def _read_in_child(conn, config: shmask.Config) -> None:
    """Another process: open every ref it is sent, send back what it saw."""
    with shmask.Reader(config) as reader:
        while True:
            data = conn.recv_bytes()
            if not data:
                return
            out = []
            try:
                for ref in RefBatch.from_bytes(data):
                    with reader.open(ref) as chunk:
                        out.append((chunk.to_lists(), chunk.status.tolist(), chunk.to_json()))
            except Exception as exc:  # the parent's assertion shows it
                out = [repr(exc)]
            conn.send(out)


@pytest.fixture
def child_reader(config):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_read_in_child, args=(child, config), daemon=True)
    process.start()
    child.close()  # the child's end lives in the child: a dead child means EOF here
    yield parent
    parent.send_bytes(b"")
    process.join(30)
    assert process.exitcode == 0


@pytest.mark.parametrize("mode", ["support", "selected"])
@pytest.mark.parametrize("vocab", [70001, 2048 + 17])
def test_mixed_forms_cross_process(config, child_reader, mode, vocab):
    """Four queues, 12 steps each with the cases in a shuffled order: rows
    grow the queues' buffers (at V = 70001 some emissions outgrow the 1 MiB
    ring and travel inline), and another process reads every row back
    exactly, dropped rows as None."""
    import orjson

    max_tokens = 100
    oracle = Oracle(vocab, mode, seed=vocab)
    cases = sizes_for(vocab, max_tokens)
    with shmask.Writer(config) as writer:
        queues = [writer.open_queue(mode) for _ in range(4)]
        handles = np.array([q.handle for q in queues], np.int64)
        for _ in range(3):
            expected: list[list[dict]] = [[] for _ in queues]
            for _ in range(4):
                order = oracle.rng.permutation(len(cases))
                for start in range(0, len(cases) - 3, 4):
                    rows = [oracle.row(*cases[order[start + i]]) for i in range(4)]
                    arrays = oracle.step_arrays(rows)
                    writer.append_step(handles, arrays["lengths"], arrays["ids"],
                                       arrays["logprobs"], status=arrays["status"],
                                       forms=arrays["forms"], vocab=vocab)
                    for queue_rows, row in zip(expected, rows, strict=True):
                        queue_rows.append(row)
            batch = writer.take_batch(handles)
            child_reader.send_bytes(batch.to_bytes())
            seen = child_reader.recv()
            for queue_rows, ((ids, values), status, json_bytes) in zip(expected, seen,
                                                                       strict=True):
                want_ids, want_values = oracle.expected_lists(queue_rows)
                assert status == [r["status"] for r in queue_rows]
                assert ids == want_ids
                if mode == "support":
                    assert values == want_values
                else:  # NaN != NaN: compare the non-dropped rows
                    assert [v for v in values if v is not None] == \
                        [v for v in want_values if v is not None]
                    assert [v is None for v in values] == [v is None for v in want_values]
                assert json_bytes == orjson.dumps(
                    {"mask_ids": ids, "mask_logprobs": values,
                     "mask_lengths": [None if i is None else len(i) for i in ids]})
        for q in queues:
            q.close()


def test_inline_and_to_inline_carry_forms_and_statuses(config, prefix):
    """The same rows through the inline transport and through
    RefBatch.to_inline (the hop to another host) read back identically."""
    vocab = 5000
    oracle = Oracle(vocab, "support", seed=3)
    rows = [oracle.row(*case) for case in sizes_for(vocab, 50)]
    arrays = oracle.step_arrays(rows)
    inline_config = shmask.Config(transport="inline", name_prefix=prefix)
    with shmask.Writer(inline_config) as inline_writer, shmask.Writer(config) as writer, \
            shmask.Reader(config) as reader:
        for w in (inline_writer, writer):
            queue = w.open_queue("support")
            handles = np.full(len(rows), queue.handle, np.int64)
            w.append_step(handles, arrays["lengths"], arrays["ids"], arrays["logprobs"],
                          status=arrays["status"], forms=arrays["forms"], vocab=vocab)
            batch = w.take_batch([queue])
            if w is writer:
                assert batch[0].kind == shmask.refs.KIND_SHM
                batch = batch.to_inline(reader)
            assert batch[0].inline and batch[0].vocab == vocab
            assert batch[0].words == arrays["ids"].size != batch[0].nnz
            with reader.open(RefBatch.from_bytes(batch.to_bytes())[0]) as chunk:
                assert chunk.to_lists() == oracle.expected_lists(rows)
                assert chunk.status.tolist() == [r["status"] for r in rows]
            queue.close()


def test_plain_chunks_carry_no_flags(writer, reader):
    """A chunk of OK ids rows only reads as before: no flags, words == nnz."""
    queue = writer.open_queue("support")
    writer.append_step([queue], np.array([3], np.int32), np.array([1, 5, 9], np.int32),
                       np.zeros(3, np.float32), status=np.zeros(1, np.int32),
                       forms=np.zeros(1, np.int32))
    ref = queue.take()
    assert ref.words == ref.nnz == 3 and ref.vocab == 0
    with reader.open(ref) as chunk:
        assert chunk.flags is None and chunk.status.tolist() == [OK]
        assert chunk.row(0)[0].tolist() == [1, 5, 9]
    queue.close()


@pytest.mark.parametrize("case, message", [
    ("status_3", "status values"),
    ("dropped_with_length", "length"),
    ("dropped_bitmask", "flags"),
    ("no_vocab", "vocab"),
    ("popcount", "set bits"),
    ("bit_past_vocab", "set bits"),
    ("longer_than_vocab", "length"),
])
def test_bad_rows_are_refused_and_nothing_lands(writer, reader, case, message):
    vocab = 100
    queue = writer.open_queue("support")
    good_ids = np.array([2, 7], np.int32)
    writer.append_step([queue], np.array([2], np.int32), good_ids, np.zeros(2, np.float32))
    lengths = np.array([3], np.int32)
    words = bitmask(np.array([1, 2, 3]), vocab)
    status, forms, step_vocab = np.array([OK]), np.array([BITMASK]), vocab
    if case == "status_3":
        status = np.array([3])
    elif case == "dropped_with_length":
        status, forms = np.array([OVERFLOW]), np.array([IDS])
    elif case == "dropped_bitmask":
        status, lengths = np.array([INVALID]), np.array([0], np.int32)
    elif case == "no_vocab":
        step_vocab = 0
    elif case == "popcount":
        lengths = np.array([4], np.int32)
    elif case == "bit_past_vocab":
        words = words.copy()
        words[-1] |= np.int32(1 << 10)  # id 106 >= vocab 100
        lengths = np.array([4], np.int32)
    elif case == "longer_than_vocab":
        lengths = np.array([101], np.int32)
    with pytest.raises(InvalidRowsError, match=message):
        writer.append_step([queue], lengths, words, np.zeros(int(lengths[0]), np.float32),
                           status=status, forms=forms, vocab=step_vocab)
    with reader.open(queue.take()) as chunk:  # the refused step appended nothing
        assert chunk.to_lists() == ([[2, 7]], [[0.0, 0.0]])
    queue.close()


def test_one_vocabulary_per_buffer(writer):
    """A queue's bitmask rows share one width until its next take."""
    queue = writer.open_queue("selected")
    one = np.zeros(1, np.float32)
    writer.append_step([queue], np.array([1], np.int32), bitmask(np.array([3]), 64), one,
                       status=np.array([OK]), forms=np.array([BITMASK]), vocab=64)
    with pytest.raises(InvalidRowsError, match="vocab"):
        writer.append_step([queue], np.array([1], np.int32), bitmask(np.array([3]), 96), one,
                           status=np.array([OK]), forms=np.array([BITMASK]), vocab=96)
    queue.take()
    writer.append_step([queue], np.array([1], np.int32), bitmask(np.array([3]), 96), one,
                       status=np.array([OK]), forms=np.array([BITMASK]), vocab=96)
    assert queue.take().vocab == 96
    queue.close()


def _record_arrays(writer, ref):
    """(flags, ids) of a published record, as writable views of the segment."""
    layout = ffi.new("shm_layout *")
    capacity = int(writer._ring.capacity)
    start = lib.SHM_HEADER_BYTES + (ref.position & (capacity - 1))
    view = np.frombuffer(writer.segment.buffer, np.uint8)
    # capacities as the record header holds them (rows_capacity at 28, words_capacity at 72)
    rows_capacity = int(view[start + 28:start + 32].view(np.uint32)[0])
    words_capacity = int(view[start + 72:start + 80].view(np.uint64)[0])
    nnz_capacity = int(view[start + 40:start + 48].view(np.uint64)[0])
    assert lib.shm_record_layout(ref.mode, rows_capacity, words_capacity, nnz_capacity,
                                 layout) == lib.SHM_OK
    flags = view[start + layout.flags_offset:][:ref.rows]
    ids = view[start + layout.ids_offset:][:4 * ref.words].view(np.int32)
    return flags, ids


@pytest.mark.parametrize("forgery", ["flag_bits", "status_with_length", "bitmask_bit",
                                     "bitmask_to_ids"])
def test_forged_rows_in_shared_memory_are_refused(writer, reader, forgery):
    """Another process rewrites a published chunk's flags or bitmask: the
    reader refuses the chunk with InvalidRefError, never decodes it."""
    vocab = 300
    queue = writer.open_queue("support")
    ids = np.concatenate([np.array([4, 8], np.int32), bitmask(np.arange(0, 300, 3), vocab)])
    writer.append_step(np.full(2, queue.handle, np.int64), np.array([2, 100], np.int32), ids,
                       np.zeros(102, np.float32), status=np.array([OK, OK]),
                       forms=np.array([IDS, BITMASK]), vocab=vocab)
    ref = queue.take()
    flags, data = _record_arrays(writer, ref)
    assert flags.tolist() == [0, lib.SHM_ROW_BITMASK]
    if forgery == "flag_bits":
        flags[0] = 8
    elif forgery == "status_with_length":
        flags[0] = lib.SHM_ROW_OVERFLOW
    elif forgery == "bitmask_bit":
        data[2] ^= 2  # one more set bit than the row's length says
    elif forgery == "bitmask_to_ids":
        flags[1] = 0  # its 100 ids would run past the chunk's words
    with pytest.raises(InvalidRefError, match="rows are malformed"):
        reader.open(ref)
    queue.close()


def test_plain_rows_over_recycled_flags(writer, reader):
    """Flags are written per row only once a buffer needs them: a buffer of
    OK ids rows that lands on ring memory last filled with 0xff bytes (full
    bitmask rows) still reads as OK ids rows (the take zeroes its flags)."""
    queue = writer.open_queue("selected")
    rng = np.random.default_rng(5)
    for emission in range(120):  # the 1 MiB ring wraps several times
        if emission % 2:
            plain = int(rng.integers(1, 400))  # sizes vary, so records land anywhere
            writer.append_step([queue] * plain, np.ones(plain, np.int32),
                               np.full(plain, 7, np.int32), np.full(plain, -0.5, np.float32))
        else:
            rows = int(rng.integers(500, 3000))  # vocab 64: two words, every bit set
            writer.append_step(np.full(rows, queue.handle, np.int64), np.full(rows, 64, np.int32),
                               np.full(2 * rows, -1, np.int32), np.zeros(rows, np.float32),
                               status=np.zeros(rows, np.int32), forms=np.ones(rows, np.int32),
                               vocab=64)
        with reader.open(queue.take()) as chunk:
            if emission % 2:
                assert chunk.flags is None
                assert chunk.to_lists() == ([[7]] * plain, [-0.5] * plain)
            else:
                assert chunk.row(0)[0].tolist() == list(range(64))
    assert int(writer._ring.head) > 2 * writer.ring_usage()[1]  # the ring wrapped twice
    queue.close()


def test_fuzzed_rows_in_shared_memory_never_crash_or_overrun(writer, reader):
    """Random bytes of a published chunk's lengths, flags and id data
    rewritten by another process: every open and decode either raises a
    ShmaskError or returns as many ids as the lengths say (an id rewritten
    inside an ids row is that request's own garbage: ids rows are opaque
    int32); nothing crashes or raises anything else."""
    vocab = 1000
    rng = np.random.default_rng(11)
    oracle = Oracle(vocab, "support", seed=11)
    rows = [oracle.row(*case) for case in sizes_for(vocab, 20)]
    arrays = oracle.step_arrays(rows)
    outcomes = {"refused": 0, "read": 0}
    for trial in range(300):
        queue = writer.open_queue("support")
        writer.append_step(np.full(len(rows), queue.handle, np.int64), arrays["lengths"],
                           arrays["ids"], arrays["logprobs"], status=arrays["status"],
                           forms=arrays["forms"], vocab=vocab)
        ref = queue.take()
        assert ref.kind == shmask.refs.KIND_SHM
        flags, data = _record_arrays(writer, ref)
        view = np.frombuffer(writer.segment.buffer, np.uint8)
        lengths_at = lib.SHM_HEADER_BYTES + (ref.position & (int(writer._ring.capacity) - 1)) + 128
        target = trial % 3
        for _ in range(int(rng.integers(1, 4))):
            if target == 0:
                view[lengths_at + int(rng.integers(0, 4 * ref.rows))] = rng.integers(0, 256)
            elif target == 1:
                flags[int(rng.integers(0, ref.rows))] = rng.integers(0, 256)
            else:
                data[int(rng.integers(0, data.size))] ^= np.int32(1 << int(rng.integers(0, 31)))
        try:
            with reader.open(ref) as chunk:
                ids, offsets = chunk.csr()
                assert ids.size == offsets[-1] == chunk.lengths.sum()
                chunk.to_json()
                outcomes["read"] += 1
        except shmask.ShmaskError:
            outcomes["refused"] += 1
            reader.discard(ref)  # give the refused record back, or the ring fills up
        queue.close()
    assert outcomes["refused"] > 150 and sum(outcomes.values()) == 300

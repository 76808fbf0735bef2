"""Issue 17, items 1, 2, 3, 7 and 10: a request never sees another request's
rows, whatever threads, garbled references or a writer rewriting the
record do; a late read is StaleChunkError through every accessor; one
unreadable chunk costs its own entry only when a hop carries rows inline.

Rows here are recognisable by value: request q's row s holds ids
q << 20 | s << 8 | k, so rows of another request are told apart."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import shmask
from shmask.binary_rows import encode_meta_info, encode_meta_info_many
from shmask.refs import ENTRY_DTYPE, KIND_LOST, KIND_SHM, RefBatch
from shmask.response_json import dumps, dumps_many

VOCAB = 1 << 30


def _rows(request: int, steps: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR rows of one request: row s has `width - s % 3` ids."""
    lengths = np.array([width - s % 3 for s in range(steps)], np.int32)
    ids = np.concatenate([(request << 20 | s << 8) + np.arange(n, dtype=np.int64)
                          for s, n in enumerate(lengths)]).astype(np.int32)
    return lengths, ids, (ids % 1000).astype(np.float32) / -1000


def _publish(writer: shmask.Writer, requests: int, steps: int = 4,
             width: int = 12) -> list[shmask.ChunkRef]:
    queues = [writer.open_queue("support") for _ in range(requests)]
    handles = np.array([q.handle for q in queues], np.int64)
    rows = [_rows(q, steps, width) for q in range(requests)]
    for s in range(steps):
        lengths = np.array([r[0][s] for r in rows], np.int32)
        ids = np.zeros((requests, width), np.int32)
        logprobs = np.zeros((requests, width), np.float32)
        for q, (row_lengths, row_ids, row_logprobs) in enumerate(rows):
            start = int(row_lengths[:s].sum())
            ids[q, :lengths[q]] = row_ids[start:start + lengths[q]]
            logprobs[q, :lengths[q]] = row_logprobs[start:start + lengths[q]]
        writer.append_step(handles, lengths, ids, logprobs)
    refs = list(writer.take_batch(queues))
    for queue in queues:
        queue.close()
    return refs


def _request_of(chunk: shmask.Chunk) -> set[int]:
    return set((chunk.csr()[0] >> 20).tolist())


def test_reader_shared_by_threads_returns_each_ref_its_own_rows(config):
    """Item 1: threads share one Reader (cffi lets go of the GIL inside the
    native open); every ref must come back with its own request's rows."""
    threads, per_thread = 6, 150
    previous = sys.getswitchinterval()
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        refs = _publish(writer, threads * per_thread, steps=2, width=6)
        wrong: list[tuple[int, set[int]]] = []
        errors: list[BaseException] = []

        def work(first: int) -> None:
            try:
                for q in range(first, len(refs), threads):
                    with reader.open(refs[q]) as chunk:
                        lengths, ids, _ = _rows(q, 2, 6)
                        got = chunk.to_lists()[0]
                        if _request_of(chunk) != {q} or not np.array_equal(chunk.lengths, lengths) \
                                or [x for row in got for x in row] != ids.tolist():
                            wrong.append((q, _request_of(chunk)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        sys.setswitchinterval(1e-6)
        try:
            workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(120)
        finally:
            sys.setswitchinterval(previous)
        assert not errors, errors[:3]
        assert not wrong, f"{len(wrong)} refs came back with other rows, e.g. {wrong[:3]}"
        assert reader.stats.opens == len(refs)


def test_ref_opens_only_the_record_it_was_issued_for(config):
    """Item 2: a ref pointed at another live record of the same shape, or
    with its position garbled, never opens that record."""
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        refs = _publish(writer, 2)
        a, b = refs
        assert (a.rows, a.nnz, a.record_bytes) == (b.rows, b.nnz, b.record_bytes)
        a.position, b.position = b.position, a.position  # each names the other's record
        for forged in (a, b):
            with pytest.raises(shmask.InvalidRefError, match="seal"):
                reader.open(forged)
        # Every single-byte garble of the wire entry: refused, or its own rows.
        a.position, b.position = b.position, a.position
        wire = bytearray(a.to_bytes())
        entry_at = len(wire) - ENTRY_DTYPE.itemsize
        other = 0
        for at in range(entry_at, len(wire)):
            for flip in (0x01, 0x80, 0xFF):
                garbled = bytearray(wire)
                garbled[at] ^= flip
                try:
                    ref = RefBatch.from_bytes(bytes(garbled))[0]
                    with reader.open(ref) as chunk:
                        other += _request_of(chunk) != {0}
                except shmask.ShmaskError:
                    pass
        assert other == 0
        with reader.open(a) as chunk:  # the real ref still opens its own rows
            assert _request_of(chunk) == {0}
        reader.discard(b)


def test_a_forged_row_count_allocates_nothing_before_it_is_refused(config):
    """A ref claiming millions of rows in a big ring is refused without the
    reader first allocating a geometry copy sized by that claim."""
    import dataclasses
    import tracemalloc
    config = dataclasses.replace(config, ring_mb=64)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        ref = _publish(writer, 1)[0]
        forged = RefBatch.from_bytes(ref.to_bytes())[0]
        forged.rows = reader._attach(ref.segment).max_rows  # ~13 M rows: 64 MiB of copy
        tracemalloc.start()
        try:
            for _ in range(3):
                with pytest.raises(shmask.InvalidRefError):
                    reader.open(forged)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"refusing a forged ref allocated {peak} bytes"
        with reader.open(ref) as chunk:
            assert _request_of(chunk) == {0}


def _record_geometry(reader: shmask.Reader, ref: shmask.ChunkRef) -> tuple[np.ndarray, int, int]:
    """A writable view of the ring and where the record's lengths and flags are."""
    attached = reader._attach(ref.segment)
    memory = np.frombuffer(attached.segment.buffer, np.uint8)
    record = 4096 + (ref.position & (attached.capacity - 1))
    rows_capacity = int(memory[record + 28:record + 32].view(np.uint32)[0])
    lengths_at = record + 128
    return memory, lengths_at, lengths_at + -(-4 * rows_capacity // 64) * 64


def test_rows_rewritten_after_open_keep_their_row_boundaries(writer, reader):
    """Item 3: a writer rewriting lengths or flags after open changes values
    at most, never which row they belong to."""
    queue = writer.open_queue("support")
    queue.append(np.array([10, 11, 12], np.int32), np.full(3, -1.0, np.float32))
    queue.append(np.array([20], np.int32), np.full(1, -2.0, np.float32))
    ref = queue.take()
    chunk = reader.open(ref)
    memory, lengths_at, flags_at = _record_geometry(reader, ref)
    memory[lengths_at:lengths_at + 8].view(np.int32)[:] = [2, 2]
    ids, _ = chunk.row(1)
    assert ids.tolist() == [20]
    assert chunk.to_lists()[0] == [[10, 11, 12], [20]]
    chunk.release()
    queue.close()

    # A bitmask row whose flag is rewritten to "ids row" (0) or to garbage.
    vocab = 100
    mask = np.zeros(4, np.int32)
    for i in (3, 40, 99):
        mask[i // 32] |= 1 << (i % 32)
    for forged_flag in (0, 0x80):
        queue = writer.open_queue("support")
        writer.append_step(np.array([queue.handle]), np.array([3], np.int32), mask,
                           np.array([-1.0, -2.0, -3.0], np.float32), forms=np.array([1]),
                           vocab=vocab)
        ref = queue.take()
        chunk = reader.open(ref)
        memory, lengths_at, flags_at = _record_geometry(reader, ref)
        memory[flags_at] = forged_flag
        ids, _ = chunk.row(0)
        assert ids.tolist() == [3, 40, 99], forged_flag
        assert chunk.to_lists()[0] == [[3, 40, 99]]
        chunk.release()
        queue.close()


def _bitmask_chunk_read_late(writer: shmask.Writer, reader: shmask.Reader) -> shmask.Chunk:
    """A bitmask chunk opened, then given back by the producer and its bytes
    written over by other rows (negative lengths, dropped and odd flags,
    float bits for words): what a tokenizer past its lease holds."""
    vocab = 64
    queue = writer.open_queue("support")
    mask = np.array([0b1011, 0], np.int32)
    handle = np.array([queue.handle])
    for _ in range(2):
        writer.append_step(handle, np.array([3], np.int32), mask,
                           np.array([-1.0, -2.0, -3.0], np.float32), forms=np.array([1]),
                           vocab=vocab)
    ref = queue.take()
    chunk = reader.open(ref)
    queue.abort()  # WRITTEN -> EXPIRED: the space is the producer's again
    memory, lengths_at, flags_at = _record_geometry(reader, ref)
    memory[lengths_at:lengths_at + 8].view(np.int32)[:] = [-5, 7]
    memory[flags_at:flags_at + 2] = [2, 0x80]
    memory[flags_at + 64:flags_at + 80].view(np.float32)[:] = -1.0
    return chunk


def _ids_chunk_read_late(writer: shmask.Writer, reader: shmask.Reader) -> shmask.Chunk:
    """A plain ids chunk (no flags: csr() hands out views of the record)
    opened, then given back by the producer and its space written over by
    another request's rows."""
    queue = writer.open_queue("support")
    handle = np.array([queue.handle])
    for _ in range(2):
        writer.append_step(handle, np.array([3], np.int32), np.array([1, 2, 3], np.int32),
                           np.array([-1.0, -2.0, -3.0], np.float32))
    ref = queue.take()
    chunk = reader.open(ref)
    assert chunk.flags is None
    queue.abort()  # WRITTEN -> EXPIRED: the space is the producer's again
    writer.reclaim()
    other = writer.open_queue("support")
    for _ in range(2):
        writer.append_step(np.array([other.handle]), np.array([3], np.int32),
                           np.array([7, 8, 9], np.int32), np.array([-4.0, -5.0, -6.0], np.float32))
    other.take()
    return chunk


@pytest.mark.parametrize("make_chunk", [_bitmask_chunk_read_late, _ids_chunk_read_late],
                         ids=["bitmask rows", "plain ids rows"])
def test_late_read_of_a_bitmask_chunk_is_stale_through_every_accessor(writer, reader,
                                                                       make_chunk):
    """Item 7: every accessor of a chunk read past its lease (space reused)
    raises StaleChunkError, never ValueError or RowDroppedError, and never
    hands out views of another request's rows (plain ids chunks too)."""
    accessors = {
        "to_lists": lambda c: c.to_lists(),
        "to_json": lambda c: c.to_json(),
        "json_arrays": lambda c: c.json_arrays(),
        "dumps(json_rows)": lambda c: dumps({"ids": c.json_rows().ids}),
        "dumps_many(json_rows)": lambda c: dumps_many([{"ids": c.json_rows().ids}] * 3,
                                                      threads=2),
        "encode_meta_info": lambda c: encode_meta_info(c),
        "encode_meta_info_many": lambda c: encode_meta_info_many([c], threads=2),
        "csr": lambda c: c.csr(),
        "row": lambda c: c.row(1),
        "slice": lambda c: c.slice(1).to_lists(),
        "check": lambda c: c.check(),
    }
    for name, accessor in accessors.items():
        chunk = make_chunk(writer, reader)
        with pytest.raises(shmask.StaleChunkError):
            accessor(chunk)
            pytest.fail(f"{name} read a reclaimed chunk")
        writer.reclaim()


@pytest.mark.parametrize("batch", ["encode_meta_info_many", "dumps_many"])
def test_a_late_read_in_a_batch_costs_only_its_document(writer, reader, batch):
    """One chunk of an emission read past its lease, among good ones: its
    document is StaleChunkError in its place, the others are written."""
    good = []
    for n in range(3):
        queue = writer.open_queue("support")
        for _ in range(2):
            writer.append_step(np.array([queue.handle]), np.array([2], np.int32),
                               np.array([n, n + 1], np.int32),
                               np.array([-1.0, -2.0], np.float32))
        good.append(reader.open(queue.take()))
        queue.close()
    late = _ids_chunk_read_late(writer, reader)
    chunks = [good[0], late, good[1], good[2]]
    if batch == "encode_meta_info_many":
        got = encode_meta_info_many(chunks, threads=2, return_exceptions=True)
        expected = [encode_meta_info(c) for c in good]
    else:
        got = dumps_many([{"ids": c.json_rows().ids} for c in chunks], threads=2,
                         return_exceptions=True)
        expected = [dumps({"ids": c.json_rows().ids}) for c in good]
    assert isinstance(got[1], shmask.StaleChunkError)
    assert [got[0], got[2], got[3]] == expected
    for chunk in good:
        chunk.release()


def test_one_unreadable_chunk_costs_only_its_entry_in_for_host(writer, reader):
    """Item 10: for_host/to_inline mark the chunk they cannot read and
    forward the others, each released exactly once."""
    queues = [writer.open_queue("support") for _ in range(3)]
    rows = [_rows(q, 3, 5) for q in range(3)]
    for q, queue in enumerate(queues):
        lengths, ids, logprobs = rows[q]
        start = 0
        for n in lengths:
            queue.append(ids[start:start + n], logprobs[start:start + n])
            start += n
    batch = writer.take_batch(queues)
    queues[1].abort()
    other_host = shmask.host_id() ^ 1
    forwarded = RefBatch.from_bytes(batch.for_host(other_host, reader).to_bytes())
    assert forwarded.entries["kind"].tolist() == [2, KIND_LOST, 2]
    for q in (0, 2):
        with reader.open(forwarded[q]) as chunk:
            assert chunk.lengths.tolist() == rows[q][0].tolist()
            assert chunk.ids.tolist() == rows[q][1].tolist()
    with pytest.raises(shmask.StaleChunkError, match="forwarded"):
        reader.open(forwarded[1])
    # The hop gave back the two it copied, once: nothing left to discard.
    assert reader.discard_batch(batch) == 0
    assert (batch.entries["kind"] == KIND_SHM).all()
    for queue in queues:
        queue.close()


# ------------------------------------------------ issue 33, item 9: one rule for ids
# Ids are non-negative int32 (0 <= id < 2**31) wherever rows enter; no
# vocabulary bounds an ids row (a bitmask row's vocab is only its width).
NEGATIVE_ID = r"id -7\b.* negative: ids are non-negative int32 \(0 <= id < 2\*\*31\)"


def test_publish_refuses_a_negative_id(writer):
    with pytest.raises(shmask.InvalidRowsError, match=NEGATIVE_ID):
        writer.publish(np.array([2, 1], np.int32), np.array([3, -7, 5], np.int32),
                       np.zeros(3, np.float32))
    assert writer.stats.chunks == 0


def _bitmask_of(ids: list[int], vocab: int) -> np.ndarray:
    words = np.zeros((vocab + 31) // 32, np.uint32)
    for i in ids:
        words[i // 32] |= np.uint32(1 << (i % 32))
    return words.view(np.int32)


@pytest.mark.parametrize("layout", ["padded", "flat", "forms"])
def test_append_step_refuses_a_negative_id_and_appends_nothing(writer, reader, layout):
    """A step whose last row holds a negative id (its queue also earlier in
    the step, as with speculative decoding) is refused whole, naming the row
    and the id: the rows before it, already copied, are taken back. A
    bitmask row's word with bit 31 set (id 31) is no negative id, and an
    undone bitmask row leaves its queue free to take another width."""
    queues = [writer.open_queue("support") for _ in range(2)]
    handles = np.array([queues[0].handle, queues[1].handle, queues[0].handle], np.int64)
    good = np.array([[1, 2, 3], [4, 5, 6], [31, 40, 50]], np.int32)
    bad = good.copy()
    bad[2, 1] = -7
    values = np.zeros((3, 3), np.float32)
    if layout == "padded":
        step = {"ids": bad, "logprobs": values}
        retry = {"ids": good, "logprobs": values}
    elif layout == "flat":
        step = {"ids": bad.ravel(), "logprobs": values.ravel()}
        retry = {"ids": good.ravel(), "logprobs": values.ravel()}
    else:  # row 1 a bitmask of width 64 holding id 31 (bit 31 of its first word)
        bitmask = _bitmask_of([31, 33, 40], 64)
        step = {"ids": np.concatenate([bad[0], bitmask, bad[2]]), "logprobs": values.ravel(),
                "forms": np.array([0, 1, 0]), "vocab": 64}
        retry = {"ids": np.concatenate([good[0], _bitmask_of([31, 33, 40], 96), good[2]]),
                 "logprobs": values.ravel(), "forms": np.array([0, 1, 0]), "vocab": 96}
    lengths = np.array([3, 3, 3], np.int32)
    with pytest.raises(shmask.InvalidRowsError, match="append_step row 2 .*" + NEGATIVE_ID):
        writer.append_step(handles, lengths, **step)
    assert [q.rows for q in queues] == [0, 0]
    writer.append_step(handles, lengths, **retry)  # another width: the undone row left none
    assert [q.rows for q in queues] == [2, 1]
    lists = [reader.open(ref).to_lists()[0] for ref in writer.take_batch(queues)]
    second = [31, 33, 40] if layout == "forms" else [4, 5, 6]
    assert lists == [[[1, 2, 3], [31, 40, 50]], [second]]


def test_a_forged_negative_id_in_the_ring_is_refused_by_every_response(writer, reader, config):
    """A negative id written into a published record (a process of the same
    uid; the reader maps the ring writable) never reaches a response:
    to_lists, to_json and the binary encoder each refuse the chunk, naming
    the rule. Open does not read ids (the hot path's budget; such a writer
    could rewrite them after open anyway): it checks the rows' geometry."""
    marker = 123_456_789
    ref = writer.publish(np.array([2, 2], np.int32), np.array([1, 2, 3, marker], np.int32),
                         np.zeros(4, np.float32))
    ring = np.frombuffer(reader._attach(ref.segment).segment.buffer, np.int32)
    (where,) = np.flatnonzero(ring == marker)
    ring[where] = -7
    with reader.open(ref) as chunk:
        with pytest.raises(shmask.InvalidRefError, match="row 1 .*" + NEGATIVE_ID):
            chunk.to_lists()
        with pytest.raises(shmask.ShmaskError):
            chunk.to_json()
        with pytest.raises(shmask.ShmaskError):
            shmask.binary_rows.encode_chunk(chunk)
        ring[where] = marker  # put back: the same chunk gives its rows
        assert chunk.to_lists()[0] == [[1, 2], [3, marker]]


def test_a_forged_negative_id_inline_is_refused_at_open(prefix):
    inline = shmask.Config(transport="inline", name_prefix=prefix)
    with shmask.Writer(inline) as writer:
        ref = writer.publish(np.array([1, 2], np.int32), np.array([4, 5, 6], np.int32),
                             np.zeros(3, np.float32))
    payload = bytearray(ref.payload)
    ids_at = 4 * 2 + 4  # lengths, then flags padded to 4
    payload[ids_at + 4:ids_at + 8] = np.array([-7], "<i4").tobytes()
    forged = shmask.ChunkRef(ref.kind, ref.mode, "", 0, 0, len(payload), ref.rows, ref.nnz,
                             memoryview(bytes(payload)))
    with pytest.raises(shmask.InvalidRefError, match="row 1 holds " + NEGATIVE_ID):
        shmask.Reader(inline).open(forged)


def test_the_checking_copy_moves_rows_of_every_length_exactly(writer, reader):
    """The per-step copy checks ids as it moves them (inline, eight words a
    vector, overlapping at a row's end): rows of every length from 0 to
    140, and long ones, padded or flat, land exactly, ids and logprobs,
    with a largest id and a NaN's bits among them."""
    rng = np.random.default_rng(33)
    lengths = np.array([*range(141), 1000, 4097], np.int32)
    queues = [writer.open_queue("support") for _ in range(lengths.size)]
    for layout in ("padded", "flat"):
        rows = [rng.integers(0, 2**31, n, dtype=np.int64).astype(np.int32) for n in lengths]
        rows[-1][-1] = 2**31 - 1
        values = [rng.standard_normal(n).astype(np.float32) for n in lengths]
        values[-2][7] = np.float32("nan")
        if layout == "padded":
            ids = np.zeros((lengths.size, lengths.max()), np.int32)
            logprobs = np.zeros(ids.shape, np.float32)
            for i, n in enumerate(lengths):
                ids[i, :n], logprobs[i, :n] = rows[i], values[i]
        else:
            ids, logprobs = np.concatenate(rows), np.concatenate(values)
        writer.append_step(queues, lengths, ids, logprobs)
        for ref, row, value in zip(writer.take_batch(queues), rows, values, strict=True):
            if not row.size:
                continue
            with reader.open(ref) as chunk:
                assert np.array_equal(chunk.ids, row)
                assert chunk.logprobs.tobytes() == value.tobytes()

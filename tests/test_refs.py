"""References on the wire: pickle, msgpack, routing, and forged input."""

from __future__ import annotations

import pickle
import pickletools

import msgspec
import numpy as np
import pytest
from conftest import assert_chunk_equal, random_chunk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmask
from shmask.refs import ENTRY_DTYPE, RefBatch


def _batch(writer, n, rng):
    queues = [writer.open_queue() for _ in range(n)]
    lengths = rng.integers(1, 5, n).astype(np.int32)
    writer.append_step(queues, lengths, rng.integers(0, 99, (n, 4)).astype(np.int32),
                       rng.random((n, 4)).astype(np.float32))
    batch = writer.take_batch(queues)
    for q in queues:
        q.close()
    return batch


def _pickle_ops(obj) -> int:
    return sum(1 for _ in pickletools.genops(pickle.dumps(obj, protocol=5)))


def test_pickle_round_trip_is_o1_objects(writer, reader):
    rng = np.random.default_rng(20)
    small, large = _batch(writer, 3, rng), _batch(writer, 300, rng)
    # the pickle of a 300-entry batch has exactly as many opcodes as a 3-entry one
    assert _pickle_ops(small) == _pickle_ops(large)
    back = pickle.loads(pickle.dumps(large))
    assert back.to_bytes() == large.to_bytes() and len(back) == 300
    for ref in back:
        reader.open(ref).release()
    for ref in small:
        reader.open(ref).release()


def test_msgpack_round_trip_is_one_ext_object(writer, reader):
    rng = np.random.default_rng(21)
    batch = _batch(writer, 200, rng)
    message = {"rids": ["a", "b"], "masks": batch}
    encoded = msgspec.msgpack.encode(message, enc_hook=shmask.msgpack_enc_hook)
    raw = msgspec.msgpack.decode(encoded)  # without the hook: one Ext, whatever the size
    assert isinstance(raw["masks"], msgspec.msgpack.Ext)
    decoded = msgspec.msgpack.decode(encoded, ext_hook=shmask.msgpack_ext_hook)
    assert decoded["masks"].to_bytes() == batch.to_bytes()
    for ref in decoded["masks"]:
        reader.open(ref).release()


def test_chunk_ref_pickles(writer, reader):
    lengths, ids, logprobs = random_chunk(np.random.default_rng(22), 4, 6)
    ref = pickle.loads(pickle.dumps(writer.publish(lengths, ids, logprobs)))
    with reader.open(ref) as chunk:
        assert_chunk_equal(chunk, lengths, ids, logprobs)


def test_select_routes_subsets_including_inline(writer, reader):
    rng = np.random.default_rng(23)
    chunks = [random_chunk(rng, 3, 5) for _ in range(6)]
    refs = [writer.publish(*c) for c in chunks]
    inline_writer = shmask.Writer(shmask.Config(**{**writer.config.__dict__, "transport": "inline"}))
    refs[2] = inline_writer.publish(*chunks[2])
    refs[4] = inline_writer.publish(*chunks[4])
    inline_writer.close()
    batch = shmask.RefBatch.from_refs(refs)
    odd, even = batch.select([5, 3, 1]), batch.select(np.array([4, 2, 0]))
    for sub, order in ((odd, [5, 3, 1]), (even, [4, 2, 0])):
        sub = shmask.RefBatch.from_bytes(sub.to_bytes())
        for ref, i in zip(sub, order, strict=True):
            with reader.open(ref) as chunk:
                assert_chunk_equal(chunk, *chunks[i])
    with pytest.raises(IndexError):
        batch.select([6])


# ----------------------------------------------------------------- forged refs

FIELDS = ("position", "record_bytes", "rows", "nnz", "mode", "segment", "kind")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=st.integers(0, 2**64 - 1), spare=st.integers(0, 3))
def test_forged_entry_fields_raise_shmask_errors(writer, reader, field, value, spare):
    """Any field of a real batch replaced by any value: a shmask error or the
    true rows (when the forged value happens to be harmless), never a crash
    and never other rows."""
    rng = np.random.default_rng(spare)
    chunks = [random_chunk(rng, 3, 6) for _ in range(2)]
    refs = [writer.publish(*c) for c in chunks]
    batch = shmask.RefBatch.from_refs(refs)
    entries = batch.entries.copy()
    limit = {"mode": 255, "kind": 255, "segment": 2**16 - 1, "rows": 2**32 - 1}.get(field, 2**64 - 1)
    entries[field][0] = value % (limit + 1)
    data = batch.to_bytes()
    forged = data[: len(data) - entries.nbytes] + entries.tobytes()
    try:
        for ref, want in zip(shmask.RefBatch.from_bytes(forged), chunks, strict=True):
            with reader.open(ref) as chunk:
                assert_chunk_equal(chunk, *want)
    except shmask.ShmaskError:
        pass
    for ref in refs:  # leave the ring clean for the next example
        try:
            reader.open(ref).release()
        except shmask.ShmaskError:
            pass
    writer.reclaim()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)),
                                               max_size=4))
def test_forged_batch_bytes_raise_shmask_errors(writer, reader, cut, flips):
    inline = shmask.Writer(shmask.Config(**{**writer.config.__dict__, "transport": "inline"}))
    rng = np.random.default_rng(cut)
    refs = [writer.publish(*random_chunk(rng, 2, 4)), inline.publish(*random_chunk(rng, 2, 4))]
    inline.close()
    data = bytearray(shmask.RefBatch.from_refs(refs).to_bytes())
    for at, byte in flips:
        if at < len(data):
            data[at] = byte
    data = data[: max(cut, 0)] if cut < len(data) else data
    try:
        for ref in shmask.RefBatch.from_bytes(bytes(data)):
            with reader.open(ref) as chunk:
                chunk.to_lists()
    except shmask.ShmaskError:
        pass
    try:
        reader.open(refs[0]).release()
    except shmask.ShmaskError:
        pass
    writer.reclaim()


def test_forged_segment_names_are_refused(reader):
    entries = np.zeros(1, ENTRY_DTYPE)
    entries["kind"], entries["mode"], entries["rows"] = 1, 2, 1
    for name in ("/etc/passwd", "../x", "/shmask-0-1-notahexstring0000", "/" + "a" * 60, ""):
        batch = shmask.RefBatch.build([(name, 1)], entries)
        with pytest.raises(shmask.ShmaskError):
            reader.open(batch[0])


def test_split_gives_each_entry_as_its_own_batch(writer):
    queues = [writer.open_queue("support") for _ in range(3)]
    writer.append_step(queues, np.array([1, 0, 2], np.int32), np.array([4, 5, 6], np.int32),
                       np.zeros(3, np.float32))
    batch = writer.take_batch(queues)
    inline = shmask.RefBatch.from_refs([batch[0], writer.publish(
        np.array([1], np.int32), np.array([9], np.int32), np.zeros(1, np.float32))])
    for whole in (batch, inline.to_inline(shmask.Reader(writer.config))):
        parts = whole.split()
        assert len(parts) == len(whole)
        for i, part in enumerate(parts):
            assert part == whole[i].to_bytes()
            assert shmask.ChunkRef.from_bytes(part).rows == whole[i].rows


def test_a_takes_batch_is_what_build_and_parsing_give(writer, reader):
    """Writer.take_batch packs its own entries without parsing them back:
    the same bytes, entries, segments and inline payloads as build() and
    from_bytes() give, with inline chunks among ring ones."""
    rng = np.random.default_rng(3)
    batch = _batch(writer, 5, rng)
    inline = shmask.refs.ChunkRef.from_bytes(shmask.RefBatch.from_refs([writer.publish(
        np.array([2], np.int32), np.array([7, 9], np.int32), np.zeros(2, np.float32))]
    ).to_inline(reader)[0].to_bytes())
    entries = np.concatenate((np.array(batch.entries), np.zeros(1, ENTRY_DTYPE)))
    entries[-1] = (shmask.refs.KIND_INLINE, inline.mode, 0, inline.rows, 0,
                   len(inline.payload), inline.nnz, inline.words, inline.vocab, 0)
    own = shmask.RefBatch._of_own_entries(batch.segments, entries, [inline.payload])
    built = shmask.RefBatch.build(batch.segments, entries, [inline.payload])
    assert own.to_bytes() == built.to_bytes()
    parsed = shmask.RefBatch.from_bytes(own.to_bytes())
    assert own.segments == parsed.segments and np.array_equal(own.entries, parsed.entries)
    assert own[5].payload == parsed[5].payload == inline.payload
    assert_chunk_equal(reader.open(own[5]), [2], [7, 9], np.zeros(2, np.float32))
    reader.discard_batch(batch)


def test_one_entry_prefix_makes_each_ring_entry_its_own_batch(writer, reader):
    """Also from a batch with an inline entry and two segments (the prefix
    is the header and the whole segment table, as select keeps it)."""
    taken = _batch(writer, 4, np.random.default_rng(4))
    inline = RefBatch.from_refs([writer.publish(
        np.array([2], np.int32), np.array([7, 9], np.int32), np.zeros(2, np.float32))]
    ).to_inline(reader)
    entries = np.concatenate((np.array(taken.entries), np.array(inline.entries)))
    entries["segment"][1] = 1
    batch = RefBatch.build([*taken.segments, ("/shmask-other", 3, 0)], entries,
                           [bytes(inline[0].payload)])
    prefix = batch.one_entry_prefix()
    for i in range(len(taken)):
        assert prefix + batch.entries[i].tobytes() == batch.select([i]).to_bytes()
        assert shmask.ChunkRef.from_bytes(prefix + batch.entries[i].tobytes()).to_bytes() == \
            batch[i].to_bytes()


# ------------------------------------------------ issue 33: select takes indices or a mask
def test_select_takes_a_boolean_mask_of_every_request(writer, reader):
    """Item 1: `batch.select(owner == k)` picks the requests where the mask
    is True, in batch order; True is never taken for request 1."""
    rng = np.random.default_rng(33)
    chunks = [random_chunk(rng, 2, 5) for _ in range(4)]
    batch = shmask.RefBatch.from_refs([writer.publish(*c) for c in chunks])
    owner = np.array([0, 1, 0, 1])
    for mask, picked in (([True, False, True, False], [0, 2]), (np.zeros(4, bool), []),
                         (owner == 1, [1, 3]), (owner == 0, [0, 2])):
        sub = shmask.RefBatch.from_bytes(batch.select(mask).to_bytes())
        assert sub.entries.tobytes() == batch.entries[picked].tobytes()
    for ref, i in zip(sub, picked, strict=True):  # owner == 0's chunks open to their own rows
        with reader.open(ref) as chunk:
            assert_chunk_equal(chunk, *chunks[i])


@pytest.mark.parametrize(("indices", "error", "says"), [
    ([1.0, 2.0], TypeError, "1.0"), (np.array([0.0, 1.5]), TypeError, "float64"),
    ([True, 2], TypeError, "True"), ([0, np.True_], TypeError, "True"),
    (np.array([True, False]), ValueError, "one value per request \\(4\\), got 2"),
    ([True] * 5, ValueError, "got 5"), (np.array([[0, 1]]), ValueError, "1-D"),
    ([4], IndexError, "index 4 is outside \\[-4, 4\\)"), ([-5], IndexError, "-5"),
    ("01", TypeError, "str"), (2, TypeError, "int"),
])
def test_select_refuses_what_it_would_have_cast(writer, indices, error, says):
    batch = shmask.RefBatch.from_refs([
        writer.publish(np.array([1], np.int32), np.array([i], np.int32), np.zeros(1, np.float32))
        for i in range(4)])
    with pytest.raises(error, match=says):
        batch.select(indices)
    assert [r.nnz for r in batch.select(np.array([3, -4], np.int64))] == [1, 1]


@pytest.mark.parametrize(("index", "error", "says"), [
    (1.0, TypeError, "must be an int, got 1.0"), (True, TypeError, "must be an int, got True"),
    (slice(0, 2), TypeError, "must be an int, got slice"), (4, IndexError, "outside \\[-4, 4\\)")])
def test_a_batch_index_is_an_int(writer, index, error, says):
    """batch[i] is one request: a float, a bool or a slice is refused saying so
    (numpy took True for a new axis and a slice for several entries)."""
    batch = shmask.RefBatch.from_refs([writer.publish(
        np.array([1], np.int32), np.array([i], np.int32), np.zeros(1, np.float32)) for i in range(4)])
    with pytest.raises(error, match=says):
        batch[index]
    assert batch[-1].nnz == 1

"""shmask.adapters.sglang without SGLang installed: real Writer/Reader over
real shared memory; SGLang's behaviour is modelled by plain lists built the
way its tokenizer manager builds them (tolist per row, extend per emission).
tests/compat checks the same against the released SGLang modules."""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import types

import msgspec
import numpy as np
import orjson
import pytest
from conftest import run_child

import shmask
import shmask.remote_refs
from shmask import response_json
from shmask.adapters import sglang as adapter


@pytest.fixture(autouse=True)
def ends(writer, reader, monkeypatch):
    monkeypatch.setitem(adapter._ends, "writer", writer)
    monkeypatch.setitem(adapter._ends, "reader", reader)
    return writer, reader


def random_row(rng, support: bool, max_len: int = 12):
    n = int(rng.integers(0, max_len + 1))
    ids = np.sort(rng.choice(151_936, n, replace=False)).astype(np.int32)
    logprobs = (rng.standard_normal(n if support else 1) - 4).astype(np.float32)
    return ids, logprobs


def lists_meta(masks, logprobs, start=0):
    """meta_info as SGLang's tokenizer manager fills it (then slices it for
    incremental streaming)."""
    return {adapter.MASK_FIELD: masks[start:], adapter.LOGPROBS_FIELD: logprobs[start:],
            adapter.LENGTH_FIELD: len(masks)}


def drive(rng, modes, emissions=3, steps=4):
    """Append rows per request and step, take per emission; returns the
    chunks per emission and the lists SGLang would hold per request."""
    rows = [adapter.SamplingMaskRows(mode) for mode in modes]
    expected = [([], []) for _ in modes]
    per_emission = []
    for _ in range(emissions):
        for _ in range(steps):
            for r, mode in zip(rows, modes, strict=True):
                ids, logprobs = random_row(rng, mode == "support")
                r.append(ids, logprobs)
                masks, values = expected[rows.index(r)]
                masks.append(ids.tolist())
                values.append(logprobs.tolist() if mode == "support" else logprobs.tolist()[0])
        per_emission.append(adapter.take_all(rows))
    return rows, per_emission, expected


def test_rows_take_to_lists_mixed_modes(writer):
    rng = np.random.default_rng(0)
    modes = ["selected", "support", "support", "selected", None]
    rows, per_emission, expected = drive(rng, modes)
    for i, mode in enumerate(modes):
        masks, values = [], []
        for chunks in per_emission:
            m, v = chunks[i].to_lists(support_logprobs=mode == "support")
            masks.extend(m)
            values.extend(v)
        assert masks == expected[i][0]
        assert values == expected[i][1]
    for r in rows:
        r.close()
    writer.reclaim()
    assert writer.ring_usage()[0] < 64 * len(rows) * 2, "to_lists must release every record"


def test_numpy_fields_match_sglang_layout():
    rng = np.random.default_rng(1)
    rows, per_emission, expected = drive(rng, ["support", "selected"], emissions=1)
    support, selected = per_emission[0]
    assert support.lengths.dtype == np.int32 and support.token_ids.dtype == np.int32
    assert support.logprobs.dtype == np.float32
    assert support.lengths.tolist() == [len(m) for m in expected[0][0]]
    assert support.logprobs.size == support.token_ids.size  # one value per entry
    assert selected.logprobs.size == selected.lengths.size  # one value per row
    assert support.support_logprobs and not selected.support_logprobs
    for chunk in (support, selected):
        chunk.release()
        chunk.release()  # idempotent: SGLang paths may drop a chunk twice
        with pytest.raises(shmask.ShmaskError):
            _ = chunk.lengths


def test_wrong_mode_is_an_error_not_misshaped_lists():
    rows, per_emission, _ = drive(np.random.default_rng(2), ["support"], emissions=1)
    with pytest.raises(shmask.ShmaskError, match="support"):
        per_emission[0][0].to_lists(support_logprobs=False)


def test_view_leaves_rows_queued():
    rng = np.random.default_rng(3)
    for mode in ("support", "selected"):
        r = adapter.SamplingMaskRows(mode)
        ids, logprobs = random_row(rng, mode == "support")
        r.append(ids, logprobs)
        first = r.view()
        assert first.token_ids.tolist() == ids.tolist()
        second = r.view()
        np.testing.assert_array_equal(second.logprobs, first.logprobs)
        masks, values = r.take().to_lists(mode == "support")
        assert masks == [ids.tolist()]
        assert values == ([logprobs.tolist()] if mode == "support" else logprobs.tolist())
        r.close()


def test_pickle_and_msgpack_carry_only_the_reference():
    rows, per_emission, expected = drive(np.random.default_rng(4), ["support", "selected"])
    chunks = per_emission[0]
    pickled = pickle.dumps(chunks, protocol=5)
    assert len(pickled) < 400, "two chunks must pickle to a few hundred bytes, rows stay in shm"
    packed = msgspec.msgpack.encode(chunks)
    assert len(packed) < 300
    back = msgspec.msgpack.decode(packed, type=list[adapter.SamplingMaskChunk])
    assert [c.ref for c in back] == [c.ref for c in chunks]
    again = pickle.loads(pickled)
    assert again[0].to_lists(True)[0] == expected[0][0][:4]
    # An opened chunk pickles as its reference, never its views.
    opened = per_emission[1][1]
    _ = opened.lengths
    assert pickle.loads(pickle.dumps(opened, protocol=5)).rows_ is None
    opened.release()


def test_chunks_are_not_gc_tracked():
    rows = [adapter.SamplingMaskRows("support") for _ in range(64)]
    for r in rows:
        r.append(np.arange(5, dtype=np.int32), np.zeros(5, np.float32))
    chunks = adapter.take_all(rows)
    gc.collect()
    before = len(gc.get_objects())
    decoded = [msgspec.msgpack.decode(msgspec.msgpack.encode(chunks),
                                      type=list[adapter.SamplingMaskChunk])
               for _ in range(4)]
    unpickled = [pickle.loads(pickle.dumps(chunks, protocol=5)) for _ in range(4)]
    after = len(gc.get_objects())
    # 8 lists of 64 chunks: the lists are tracked, the 512 chunks are not.
    assert after - before <= 8 + 8, after - before
    assert not any(gc.is_tracked(c) for batch in decoded + unpickled for c in batch)
    # Still untracked once opened (it then holds a shmask Chunk, which is).
    for c in decoded[0]:
        assert c.lengths.tolist() == [5]
        assert not gc.is_tracked(c)
        c.release()


def test_append_step_statuses_and_mixed_modes():
    rng = np.random.default_rng(5)
    modes = ["support", "selected", "support", "selected"]
    rows = [adapter.SamplingMaskRows(m) for m in modes]
    width = 6
    expected = [([], []) for _ in rows]
    for step in range(5):
        lengths = rng.integers(0, width + 1, len(rows)).astype(np.int32)
        ids = rng.integers(0, 1000, (len(rows), width)).astype(np.int32)
        selected = rng.standard_normal(len(rows)).astype(np.float32)
        support = rng.standard_normal((2, width)).astype(np.float32)  # the support rows only
        statuses = np.zeros(len(rows), np.int64)
        if step == 3:
            statuses[1] = 1  # OVERFLOW: SGLang aborts the request, the row is never committed
        adapter.append_step(rows, lengths, ids, selected, support, statuses)
        s = 0
        for i, mode in enumerate(modes):
            if statuses[i] == 0:
                n = int(lengths[i])
                expected[i][0].append(ids[i, :n].tolist())
                expected[i][1].append(support[s, :n].tolist() if mode == "support"
                                      else float(selected[i]))
            s += mode == "support"
    for i, chunk in enumerate(adapter.take_all(rows)):
        assert chunk.to_lists(modes[i] == "support") == expected[i]
    assert len(expected[1][0]) == 4  # the non-OK row was left out


def test_take_all_keeps_none_for_requests_without_masks():
    rows = [adapter.SamplingMaskRows("selected"), None, adapter.SamplingMaskRows("support")]
    rows[0].append(np.array([3], np.int32), np.array([-0.5], np.float32))
    chunks = adapter.take_all(rows)
    assert chunks[1] is None
    assert chunks[0].to_lists(False) == ([[3]], [-0.5])
    assert chunks[2].to_lists(True) == ([], [])


def ref_fields(ref):
    return (ref.kind, ref.mode, ref.segment, ref.epoch, ref.position, ref.record_bytes, ref.rows,
            ref.nnz, None if ref.payload is None else bytes(ref.payload))


def test_split_refs_equals_each_entry(writer):
    queues = [writer.open_queue("support") for _ in range(5)]
    for i, q in enumerate(queues[:4]):
        q.append(np.arange(i + 1, dtype=np.int32), np.ones(i + 1, np.float32))
    batch = writer.take_batch(queues)
    split = [shmask.ChunkRef.from_bytes(b) for b in adapter.split_refs(batch)]
    # Same references (an empty one may carry the segment table: harmless)
    assert [ref_fields(r) for r in split] == [ref_fields(r) for r in batch]
    assert split[4].kind == 0 and split[0].kind == 1
    shmask.Reader().discard_batch(batch)


def test_split_refs_inline_fallback(prefix):
    inline = shmask.Writer(shmask.Config(transport="inline", name_prefix=prefix))
    queues = [inline.open_queue("selected") for _ in range(3)]
    queues[1].append(np.array([7, 8], np.int32), np.array([-1.0], np.float32))
    batch = inline.take_batch(queues)
    refs = adapter.split_refs(batch)
    assert refs == [batch[i].to_bytes() for i in range(3)]
    assert adapter.SamplingMaskChunk(refs[1]).to_lists(False) == ([[7, 8]], [-1.0])
    inline.close()


def test_release_without_reading_and_abort_give_records_back(writer):
    rows = adapter.SamplingMaskRows("support")
    rows.append(np.arange(100, dtype=np.int32), np.zeros(100, np.float32))
    chunk = rows.take()
    chunk.release()  # never opened: discarded by reference
    rows.append(np.arange(100, dtype=np.int32), np.zeros(100, np.float32))
    unread = rows.take()
    assert rows.abort() == 1  # the chunk no reader released
    with pytest.raises(shmask.StaleChunkError):
        unread.to_lists(True)
    writer.reclaim()
    assert writer.ring_usage()[0] == 0


def test_lists_or_abort_fails_only_the_request_whose_chunk_cannot_be_read(writer):
    """What the patched tokenizer manager calls per request: a chunk given
    back already (read after its lease) and a garbled reference finish their
    own requests with SGLang's abort finish reason (status 500, the error
    named) and an abort to the scheduler; the others get their lists."""
    from types import SimpleNamespace

    rows = [adapter.SamplingMaskRows(m) for m in ("support", "selected", "support", "support")]
    for i, r in enumerate(rows):
        r.append(np.arange(i, i + 3, dtype=np.int32),
                 np.zeros(3 if r.support else 1, np.float32))
    chunks = adapter.take_all(rows)
    assert rows[2].abort() == 1  # its record is given back before the tokenizer reads it
    garbled = bytearray(chunks[3].ref)
    garbled[-shmask.refs.ENTRY_DTYPE.itemsize] ^= 0x80  # the entry kind
    chunks[3].release()
    chunks[3] = adapter.SamplingMaskChunk(bytes(garbled))
    aborted = []
    manager = SimpleNamespace(abort_request=aborted.append)
    recv = SimpleNamespace(rids=["a", "b", "c", "d"], finished_reasons=[None, None, None, None],
                           output_token_sampling_mask=chunks)
    got = []
    for i, r in enumerate(rows):
        meta = {"finish_reason": None}
        got.append((adapter.lists_or_abort(manager, recv, i, meta, support_logprobs=r.support),
                    meta["finish_reason"]))
    assert got[0] == (([[0, 1, 2]], [[0.0, 0.0, 0.0]]), None)
    assert got[1] == (([[1, 2, 3]], [0.0]), None)
    for i, error in ((2, "StaleChunkError"), (3, "InvalidRefError")):
        lists, reason = got[i]
        assert lists == ([], []) and reason is recv.finished_reasons[i]
        assert reason["type"] == "abort" and reason["status_code"] == 500
        assert f"could not be read ({error}: " in reason["message"]
    assert aborted == ["c", "d"]
    for r in rows:
        r.close()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0


def test_release_chunk_never_raises(writer):
    rows = adapter.SamplingMaskRows("support")
    rows.append(np.arange(3, dtype=np.int32), np.zeros(3, np.float32))
    chunk = rows.take()
    assert rows.abort() == 1
    adapter.release_chunk(chunk)  # given back already: logged, not raised
    adapter.release_chunk(adapter.SamplingMaskChunk(b"not a reference"))
    adapter.release_chunk(None)
    rows.close()


def meta_bytes(meta):
    return orjson.dumps({"id": "r", "finish_reason": None, **meta, "completion_tokens": 3})


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_response_meta_info_byte_identical(mode):
    rng = np.random.default_rng(6)
    support = mode == "support"
    rows = adapter.SamplingMaskRows(mode)
    acc = adapter.SamplingMaskJSON(support)
    masks, values = [], []
    assert meta_bytes(adapter.response_meta_info(acc)) == meta_bytes(lists_meta(masks, values))
    special = np.array([-np.inf, np.nan, -0.0, 1e-45, -3.4028235e38, 0.1], np.float32)
    for emission in range(4):
        for step in range(3):
            ids, logprobs = random_row(rng, support, max_len=6)
            if emission == 1:
                logprobs = (special[:ids.size] if support else special[step:step + 1]).copy()
                ids = ids[:logprobs.size] if support else ids
            rows.append(ids, logprobs)
            masks.append(ids.tolist())
            values.append(logprobs.tolist() if support else logprobs.tolist()[0])
        acc.extend(rows.take())
        # cumulative streaming / non-streaming: the whole accumulation
        assert meta_bytes(adapter.response_meta_info(acc)) == meta_bytes(lists_meta(masks, values))
        # incremental streaming: every offset, on and inside emission boundaries; the
        # RawJSON form through response_json.dumps gives the same bytes
        for start in range(len(masks) + 1):
            expected = meta_bytes(lists_meta(masks, values, start))
            assert meta_bytes(adapter.response_meta_info(acc, start=start)) == expected, start
            assert dumps_meta(adapter.response_meta_info(acc, start=start, raw=True)) == expected
    rows.close()


def dumps_meta(meta):
    return response_json.dumps({"id": "r", "finish_reason": None, **meta, "completion_tokens": 3})


def test_meta_info_rows_written_by_dumps_byte_identical():
    """meta_info_rows: an open chunk's fields as holes response_json.dumps
    fills from the ring, the bytes SGLang writes from its lists."""
    rng = np.random.default_rng(8)
    rows, per_emission, expected = drive(rng, ["selected", "support"], emissions=1)
    for i in range(2):
        chunk = per_emission[0][i]
        assert dumps_meta(adapter.meta_info_rows(chunk.open())) == meta_bytes(
            lists_meta(*expected[i]))
        chunk.release()
    none = shmask.Chunk(shmask.refs.MODE_SUPPORT, np.zeros(0, np.int32), np.zeros(0, np.int32),
                        np.zeros(0, np.float32), None)
    assert dumps_meta(adapter.meta_info_rows(none)) == meta_bytes(lists_meta([], []))
    for r in rows:
        r.close()


def test_response_meta_info_from_chunks():
    rng = np.random.default_rng(7)
    rows, per_emission, expected = drive(rng, ["selected", "support"], emissions=2)
    for i, support in enumerate((False, True)):
        meta = adapter.response_meta_info([e[i] for e in per_emission], support_logprobs=support)
        assert orjson.dumps(meta) == orjson.dumps(lists_meta(*expected[i]))
        assert isinstance(meta[adapter.MASK_FIELD], orjson.Fragment)
    with pytest.raises(TypeError):
        adapter.response_meta_info([])


def test_response_meta_info_failure_gives_back_every_chunk(writer):
    """Issue 33 #7: response_meta_info(chunks) stopped at the first chunk that
    failed and held the ones after it until the lease. The request fails
    with that chunk's error and every chunk goes back to the ring, whether
    the chunks come as a list or a generator."""
    for as_given in (list, iter):
        support = adapter.SamplingMaskRows("support")
        selected = adapter.SamplingMaskRows("selected")
        chunks = []
        for _ in range(4):
            support.append(np.arange(3, dtype=np.int32), np.zeros(3, np.float32))
            chunks.append(support.take())
        selected.append(np.arange(2, dtype=np.int32), np.zeros(1, np.float32))
        chunks.insert(1, selected.take())  # the wrong mode for this request
        with pytest.raises(shmask.ShmaskError, match="selected-mode rows"):
            adapter.response_meta_info(as_given(chunks), support_logprobs=True)
        support.close()
        selected.close()
        writer.reclaim()
        assert writer.ring_usage()[0] == 0, as_given


def test_staging_flushes_per_step_and_isolates_a_bad_row(writer, config):
    rows = [adapter.SamplingMaskRows("support") for _ in range(3)]
    staging = adapter._staging_of(writer)
    for r in rows:
        r.append(np.array([1, 2], np.int32), np.zeros(2, np.float32))
    assert len(staging.handles) == 3
    rows[0].append(np.array([3], np.int32), np.zeros(1, np.float32))  # the next step
    assert len(staging.handles) == 1, "a second row of a staged request flushes the step"
    too_long = config.max_tokens + 1
    with pytest.raises(shmask.InvalidRowsError, match="SHMASK_MAX_TOKENS"):  # its own append
        rows[1].append(np.arange(too_long, dtype=np.int32), np.zeros(too_long, np.float32))
    for bad_ids, bad_logprobs in ((np.array([2**31 + 5]), np.zeros(1)),    # past int32
                                  (np.array([1.5, 2.5]), np.zeros(2)),      # not integers
                                  (np.array([1, 2]), np.zeros(3))):         # lengths differ
        with pytest.raises(shmask.InvalidRowsError):
            rows[2].append(bad_ids, bad_logprobs)
    chunks = adapter.take_all(rows)
    assert chunks[0].to_lists(True)[0] == [[1, 2], [3]]
    assert chunks[1].to_lists(True)[0] == [[1, 2]]  # the refused row only is missing
    assert chunks[2].to_lists(True)[0] == [[1, 2]]


def test_a_row_refused_at_flush_is_raised_by_its_own_request_only(writer):
    a, b = adapter.SamplingMaskRows("support"), adapter.SamplingMaskRows("support")
    a.append(np.array([1], np.int32), np.zeros(1, np.float32))
    b.append(np.array([2], np.int32), np.zeros(1, np.float32))
    b.queue.close()  # behind the adapter's back: the flush cannot write b's row
    a.append(np.array([3], np.int32), np.zeros(1, np.float32))  # flushes; must not raise
    assert a.take().to_lists(True)[0] == [[1], [3]]
    with pytest.raises(shmask.InvalidRowsError):
        b.take()


def test_a_collected_request_during_a_flush_writes_nothing_twice(writer):
    """The cyclic GC may finalize a rows object inside a flush."""
    class Request:  # an engine request caught in a reference cycle
        def __init__(self) -> None:
            self.rows = adapter.SamplingMaskRows("support")
            self.me = self

    a, b = adapter.SamplingMaskRows("support"), adapter.SamplingMaskRows("support")
    a.append(np.array([1, 2], np.int32), np.zeros(2, np.float32))
    b.append(np.array([3], np.int32), np.zeros(1, np.float32))
    staging = adapter._staging_of(writer)
    gc.collect()
    gc.disable()
    try:
        junk = Request()
        junk.rows.append(np.array([9], np.int32), np.zeros(1, np.float32))
        del junk
        gc.set_threshold(1)
        gc.enable()
        staging.flush()  # an allocation inside may run the pass that finalizes junk
    finally:
        gc.set_threshold(700)
        gc.enable()
    gc.collect()
    first, second = adapter.take_all([a, b])
    assert first.to_lists(True)[0] == [[1, 2]]
    assert second.to_lists(True)[0] == [[3]]
    assert not staging.closing, "the collected request's queue is closed after the flush"


@pytest.mark.parametrize("forged_state", [{"x": 1}, 7, False, "open"])
def test_a_received_chunk_always_starts_unread(writer, forged_state):
    """rows_ is the receiver's own state: a sender cannot set it."""
    rows = adapter.SamplingMaskRows("support")
    rows.append(np.array([4, 5], np.int32), np.zeros(2, np.float32))
    chunk = rows.take()
    wire = msgspec.msgpack.encode([chunk.ref, forged_state])
    received = msgspec.msgpack.decode(wire, type=adapter.SamplingMaskChunk)
    assert received.rows_ is None
    assert received.to_lists(True)[0] == [[4, 5]]


# ------------------------------------------- arrays for in-process consumers
def put_row(writer, rows, ids, logprobs, status=0):
    """One row straight into the request's queue, with a status (SGLang's
    own loop never sends a row that is not OK; an engine may)."""
    handle = np.array([rows.handle], np.int64)
    n = 0 if status else ids.size
    values = logprobs[:n] if rows.support else np.zeros(n, np.float32)
    selected = logprobs[:1] if logprobs.size else np.zeros(1, np.float32)
    writer.append_step(handle, np.array([n], np.int32), ids[:n], values, selected,
                       status=np.array([status], np.uint8))


def stream_with_drops(writer, seed, modes, emissions=3, steps=4):
    """Chunks per emission for requests in `modes`, rows of mixed lengths,
    some rows OVERFLOW / INVALID (no ids)."""
    rng = np.random.default_rng(seed)
    rows = [adapter.SamplingMaskRows(m) for m in modes]
    out = []
    for _ in range(emissions):
        for _ in range(steps):
            for r in rows:
                ids, logprobs = random_row(rng, r.support)
                status = int(rng.choice([0, 0, 0, 1, 2]))
                put_row(writer, r, ids, logprobs, status)
        out.append(adapter.take_all(rows))
    return rows, out


def tokenizer_step(manager, recv, i, meta, support):
    """The patched tokenizer manager's lines for one request (lists_or_abort,
    then extend its state's lists and fill meta_info from them)."""
    state = manager.rid_to_state[recv.rids[i]]
    masks, logprobs = adapter.lists_or_abort(manager, recv, i, meta, support_logprobs=support)
    state.output_token_sampling_mask.extend(masks)
    state.output_token_sampling_logprobs.extend(logprobs)
    meta[adapter.MASK_FIELD] = state.output_token_sampling_mask
    meta[adapter.LOGPROBS_FIELD] = state.output_token_sampling_logprobs
    meta[adapter.LENGTH_FIELD] = len(state.output_token_sampling_mask)


def run_tokenizer(emissions, modes):
    """Each emission through tokenizer_step; the meta_info per emission."""
    from types import SimpleNamespace

    rids = [f"r{i}" for i in range(len(modes))]
    manager = SimpleNamespace(abort_request=lambda rid: None, rid_to_state={
        rid: SimpleNamespace(output_token_sampling_mask=[], output_token_sampling_logprobs=[])
        for rid in rids})
    metas = []
    for chunks in emissions:
        recv = SimpleNamespace(rids=rids, finished_reasons=[None] * len(rids),
                               output_token_sampling_mask=chunks)
        metas.append([{} for _ in rids])
        for i, mode in enumerate(modes):
            tokenizer_step(manager, recv, i, metas[-1][i], mode == "support")
    return metas


def assert_arrays_equal_lists(csr, logprobs_face, masks, values, support):
    """Row for row: the CSR's arrays hold what the lists hold."""
    assert isinstance(csr, adapter.SamplingMaskCSR)
    assert isinstance(logprobs_face, adapter.SamplingLogprobsCSR)
    assert len(csr) == len(masks) == len(logprobs_face) == len(values)
    assert csr.token_ids.dtype == np.int32 and csr.lengths.dtype == np.int32
    assert csr.logprobs.dtype == np.float32 and csr.status.dtype == np.uint8
    offsets = csr.offsets
    assert offsets[0] == 0 and offsets[-1] == csr.token_ids.size
    assert csr.logprobs.size == (csr.token_ids.size if support else len(csr))
    for i, (row, value) in enumerate(zip(masks, values, strict=True)):
        ids = csr.token_ids[offsets[i]:offsets[i + 1]]
        if row is None:  # a dropped row: None in both lists
            assert value is None and csr.status[i] != 0 and csr.lengths[i] == 0
            assert csr[i] is None and logprobs_face[i] is None
            continue
        assert csr.status[i] == 0 and ids.tolist() == row and csr[i].tolist() == row
        if support:
            got = csr.logprobs[offsets[i]:offsets[i + 1]]
            assert got.tolist() == value and logprobs_face[i].tolist() == value
        else:
            assert float(csr.logprobs[i]) == value == logprobs_face[i]
    assert csr.to_lists() == (masks, values)


def test_arrays_mode_equals_lists_row_for_row(writer, monkeypatch):
    """The same stream (mixed modes, dropped rows) read in lists mode and in
    arrays mode, through the patched tokenizer manager's lines: the CSR
    arrays hold the lists' values row for row, at every emission."""
    modes = ["support", "selected", "support", "selected"]
    rows_a, as_lists = stream_with_drops(writer, 7, modes)
    lists_metas = run_tokenizer(as_lists, modes)
    rows_b, as_arrays = stream_with_drops(writer, 7, modes)
    monkeypatch.setitem(adapter._ends, "mask_format", "arrays")
    arrays_metas = run_tokenizer(as_arrays, modes)
    dropped = 0
    for lists_meta, arrays_meta in zip(lists_metas, arrays_metas, strict=True):
        for i, mode in enumerate(modes):
            want, got = lists_meta[i], arrays_meta[i]
            masks, values = want[adapter.MASK_FIELD], want[adapter.LOGPROBS_FIELD]
            assert isinstance(masks, list)  # the default: SGLang's lists
            assert got[adapter.LENGTH_FIELD] == want[adapter.LENGTH_FIELD]
            assert got[adapter.LOGPROBS_FIELD].rows is got[adapter.MASK_FIELD]  # one storage
            # meta_info holds the state's growing object: compare up to its length then
            n = got[adapter.LENGTH_FIELD]
            assert_arrays_equal_lists(got[adapter.MASK_FIELD][:n],
                                      got[adapter.LOGPROBS_FIELD][:n], masks[:n], values[:n],
                                      mode == "support")
            dropped += sum(m is None for m in masks)
    assert dropped > 5
    for r in rows_a + rows_b:
        r.close()


def test_arrays_are_copies_and_the_ring_record_is_released(writer, monkeypatch):
    """One copy out of the ring, then the record goes back: the writer
    reclaims the whole ring while the arrays still hold the rows (also after
    the ring reused the space), and a later extend never changes a view
    taken before it."""
    monkeypatch.setitem(adapter._ends, "mask_format", "arrays")
    modes = ["support", "selected"]
    rows, emissions = stream_with_drops(writer, 8, modes)
    final = run_tokenizer(emissions, modes)[-1]
    csrs = [meta[adapter.MASK_FIELD] for meta in final]
    snapshots = [(c.token_ids.copy(), c.logprobs.copy(), c.lengths.copy()) for c in csrs]
    assert all(chunk.rows_ is False for chunks in emissions for chunk in chunks)  # released
    for r in rows:
        r.close()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0, "every chunk's record must be back after the copy"
    # The ring reuses the space: the arrays are the request's own.
    more, later = stream_with_drops(writer, 99, modes)
    run_tokenizer(later, modes)
    for csr, (ids, logprobs, lengths) in zip(csrs, snapshots, strict=True):
        np.testing.assert_array_equal(csr.token_ids, ids)
        np.testing.assert_array_equal(csr.logprobs.view(np.uint32), logprobs.view(np.uint32))
        np.testing.assert_array_equal(csr.lengths, lengths)
        assert not csr.token_ids.flags.writeable
    view, count = csrs[0].token_ids, len(csrs[0])
    csrs[0].extend(csrs[0][:])  # grows past its buffers
    assert len(csrs[0]) == 2 * count
    np.testing.assert_array_equal(view, snapshots[0][0])
    np.testing.assert_array_equal(csrs[0].token_ids, np.concatenate([snapshots[0][0]] * 2))
    for r in more:
        r.close()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0


def test_arrays_mode_incremental_slices_and_coalescing_as_sglang_does(writer, monkeypatch):
    """SGLang slices meta_info values with [offset:] (incremental streaming)
    and joins queued chunks by iterating them: both give the lists' rows."""
    modes = ["support", "selected"]
    rows_a, as_lists = stream_with_drops(writer, 9, modes)
    lists_final = run_tokenizer(as_lists, modes)[-1]
    rows_b, as_arrays = stream_with_drops(writer, 9, modes)
    monkeypatch.setitem(adapter._ends, "mask_format", "arrays")
    arrays_final = run_tokenizer(as_arrays, modes)[-1]
    for i, mode in enumerate(modes):
        masks = lists_final[i][adapter.MASK_FIELD]
        values = lists_final[i][adapter.LOGPROBS_FIELD]
        csr = arrays_final[i][adapter.MASK_FIELD]
        face = arrays_final[i][adapter.LOGPROBS_FIELD]
        for offset in range(len(masks) + 1):
            assert_arrays_equal_lists(csr[offset:], face[offset:], masks[offset:],
                                      values[offset:], mode == "support")
        joined = [item for item in csr]  # what _coalesce_streaming_chunks does
        assert [None if x is None else x.tolist() for x in joined] == masks
        joined = [item for item in face]
        assert [x if x is None or isinstance(x, float) else x.tolist()
                for x in joined] == values
        np.testing.assert_array_equal(np.asarray(face), csr.logprobs)
    for r in rows_a + rows_b:
        r.close()


def test_default_mask_format_is_lists(writer, monkeypatch, config):
    assert adapter.mask_format() == "lists"
    assert shmask.Config.from_env({}).mask_format == "lists"
    assert shmask.Config.from_env({"SHMASK_MASK_FORMAT": "Arrays"}).mask_format == "arrays"
    with pytest.raises(shmask.ConfigError, match="SHMASK_MASK_FORMAT='csv'"):
        shmask.Config.from_env({"SHMASK_MASK_FORMAT": "csv"})
    with pytest.raises(shmask.ShmaskError, match="mask_format"):
        adapter.configure(mask_format="csv")
    arrays_reader = shmask.Reader(shmask.Config.from_env(
        {"SHMASK_MASK_FORMAT": "arrays"}, ring_mb=1, name_prefix=config.name_prefix))
    monkeypatch.setitem(adapter._ends, "reader", arrays_reader)
    try:
        assert adapter.mask_format() == "arrays"  # the Reader's SHMASK_MASK_FORMAT
    finally:
        arrays_reader.close()


def test_to_arrays_of_one_chunk(writer):
    rows, emissions = stream_with_drops(writer, 10, ["support"], emissions=1)
    lists_rows, lists_emissions = stream_with_drops(writer, 10, ["support"], emissions=1)
    csr = emissions[0][0].to_arrays(support_logprobs=True)
    masks, values = lists_emissions[0][0].to_lists(support_logprobs=True)
    assert_arrays_equal_lists(csr, csr.logprob_rows, masks, values, True)
    with pytest.raises(shmask.ShmaskError, match="support"):
        stream_with_drops(writer, 11, ["support"], emissions=1)[1][0][0].to_arrays(False)
    for r in rows + lists_rows:
        r.close()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0


# ------------------------------------------------------------- start-up
def _server_args(**fields):
    """The two ServerArgs attributes start_scheduler reads (SGLang 0.5.23's
    names; tests/compat checks them on the released package)."""
    return types.SimpleNamespace(**({"sampling_mask_max_tokens": 4096, "enable_metrics": False}
                                    | fields))


def _fresh_ends(monkeypatch, prefix: str, ring_mb: int) -> str:
    """The adapter as a new scheduler process has it: no Writer yet, and a
    name prefix of its own (the test's fixtures hold a ring under the
    test's prefix); returns it."""
    for name in ("writer", "inline", "making", "ring_error", "head", "leaving"):
        monkeypatch.setitem(adapter._ends, name, None)
    monkeypatch.setenv("SHMASK_NAME_PREFIX", prefix + "lazy")
    monkeypatch.setenv("SHMASK_RING_MB", str(ring_mb))
    return prefix + "lazy"


def _segments(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def _close_ends() -> None:
    adapter.ring_ready(30)
    for name in ("inline", "writer"):
        if adapter._ends[name] is not None:
            adapter._ends[name].close()


def test_start_scheduler_makes_no_ring_until_a_request_asks_for_masks(monkeypatch, prefix,
                                                                      reader):
    """A scheduler that never sees a request for masks reserves no /dev/shm.
    The first request's rows go inline while the ring is made on another
    thread; requests after it use the ring; one take over both kinds gives
    each request its rows, and the Reader opens both kinds of reference."""
    prefix = _fresh_ends(monkeypatch, prefix, 2)
    try:
        assert adapter.start_scheduler(_server_args()) is None
        assert adapter._ends["writer"] is None and adapter._ends["inline"] is None
        assert _segments(prefix) == [] and adapter.ring_ready(0) is None
        first = adapter.SamplingMaskRows("support")
        assert first.writer.segment is None  # inline, made at once
        ring = adapter.ring_ready(30)
        assert ring is not None and prefix in ring.segment_name
        assert ring.config.ring_capacity_bytes == 2 << 20 and len(_segments(prefix)) == 1
        second = adapter.SamplingMaskRows("support")
        assert second.writer is ring and first.writer is not ring
        ids = np.arange(5, dtype=np.int32)
        first.append(ids, np.full(5, -1.5, np.float32))
        second.append(ids[:3] + 7, np.full(3, -0.5, np.float32))
        # one step across both Writers, as SGLang's output streamer calls it
        adapter.append_step([second, first], np.array([2, 1], np.int32),
                            np.array([[1, 2, 0], [9, 0, 0]], np.int32),
                            np.array([-0.1, -0.2], np.float32),
                            np.array([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]], np.float32))
        chunks = adapter.take_all([first, None, second])
        assert chunks[1] is None
        assert chunks[0].to_lists(True) == ([[0, 1, 2, 3, 4], [9]], [[-1.5] * 5, [-3.0]])
        assert chunks[2].to_lists(True) == ([[7, 8, 9], [1, 2]], [[-0.5] * 3, [-1.0, -2.0]])
        first.close()
        second.close()
    finally:
        _close_ends()


def test_a_ring_that_cannot_be_made_leaves_masks_inline_with_one_warning(monkeypatch, prefix,
                                                                         reader, caplog):
    """SHMASK_RING_MB past what /dev/shm holds (a Docker default of 64 MiB,
    or ENOSPC): the server keeps serving masks inline, and says why once,
    naming --shm-size and SHMASK_RING_MB."""
    free_mib = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize >> 20
    # a power of two past what /dev/shm has free
    prefix = _fresh_ends(monkeypatch, prefix, 1 << (free_mib + 1).bit_length())
    try:
        with caplog.at_level(logging.WARNING, logger="shmask"):
            rows = [adapter.SamplingMaskRows("selected")]
            assert adapter.ring_ready(30) is None
            rows += [adapter.SamplingMaskRows("selected") for _ in range(3)]
        warnings = [r.getMessage() for r in caplog.records if "no shared-memory ring" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "--shm-size" in warnings[0] and "SHMASK_RING_MB" in warnings[0]
        assert all(r.writer is adapter._ends["inline"] for r in rows) and _segments(prefix) == []
        for i, r in enumerate(rows):
            r.append(np.array([i, i + 1], np.int32), np.float32(-0.25 * i))
        for i, chunk in enumerate(adapter.take_all(rows)):
            assert chunk.to_lists(False) == ([[i, i + 1]], [-0.25 * i])
        for r in rows:
            r.close()
    finally:
        _close_ends()


NODE_1 = {"nnodes": 2, "node_rank": 1, "dist_init_addr": "10.11.12.13:5000"}


@pytest.mark.parametrize("server", [NODE_1, {**NODE_1, "dist_init_addr": None}])
def test_a_scheduler_on_another_node_sends_its_rows_inline_by_default(monkeypatch, prefix, reader,
                                                                      server):
    """SGLang's tokenizer runs on node 0 only: a scheduler of --node-rank 1
    sends its outputs to another host, which cannot map its ring. With
    SHMASK_REMOTE unset every chunk rides inline in its reference from the
    first request (no ring is made), and any Reader opens it."""
    prefix = _fresh_ends(monkeypatch, prefix, 2)
    monkeypatch.delenv("SHMASK_REMOTE", raising=False)
    try:
        adapter.start_scheduler(_server_args(**server))
        assert adapter._ends["head"] == (server["dist_init_addr"] or "")
        rows = [adapter.SamplingMaskRows("support")]
        adapter.ring_ready(30)  # a ring, had one been started, is made by now
        rows.append(adapter.SamplingMaskRows("selected"))
        assert adapter._ends["making"] is None  # none was started
        assert all(r.writer.segment is None for r in rows) and _segments(prefix) == []
        rows[0].append(np.array([3, 9], np.int32), np.array([-0.5, -1.5], np.float32))
        rows[1].append(np.array([4], np.int32), np.float32(-0.25))
        chunks = adapter.take_all(rows)
        assert all(shmask.ChunkRef.from_bytes(c.ref).inline for c in chunks)
        assert chunks[0].to_lists(True) == ([[3, 9]], [[-0.5, -1.5]])
        assert chunks[1].to_lists(False) == ([[4]], [-0.25])
        for r in rows:
            r.close()
    finally:
        _close_ends()


def test_node_0_and_a_single_node_keep_the_ring():
    assert adapter.outputs_leave_host(_server_args(**{**NODE_1, "node_rank": 0})) is None
    assert adapter.outputs_leave_host(_server_args(nnodes=1, node_rank=0)) is None
    assert adapter.outputs_leave_host(_server_args()) is None  # attributes absent
    assert adapter.outputs_leave_host(None) is None
    assert adapter.outputs_leave_host(_server_args(**NODE_1)) == "10.11.12.13:5000"


def test_an_export_that_fails_leaves_that_schedulers_rows_inline(monkeypatch, prefix, reader,
                                                                 caplog):
    """SHMASK_REMOTE=nixl on a node whose NIXL cannot export the ring (not
    installed, its agent cannot listen): the ring is given back, the rows go
    inline, one warning says why; never a reference the tokenizer cannot read."""
    prefix = _fresh_ends(monkeypatch, prefix, 2)
    monkeypatch.setenv("SHMASK_REMOTE", "nixl")

    def no_nixl(*args, **kwargs):
        raise ImportError("No module named 'nixl_cu12'")

    monkeypatch.setattr(shmask.remote_refs, "Leaving", no_nixl)
    try:
        adapter.start_scheduler(_server_args(**NODE_1))
        with caplog.at_level(logging.WARNING, logger="shmask"):
            first = adapter.SamplingMaskRows("selected")
            assert adapter.ring_ready(30) is None
            later = adapter.SamplingMaskRows("selected")
        warned = [r.getMessage() for r in caplog.records if "NIXL" in r.getMessage()]
        assert len(warned) == 1 and "nixl_cu12" in warned[0], warned
        assert first.writer is later.writer is adapter._ends["inline"]
        assert _segments(prefix) == []  # the ring made for the export was closed
        first.append(np.array([1, 2], np.int32), np.float32(-1.0))
        (chunk,) = adapter.take_all([first])
        assert shmask.ChunkRef.from_bytes(chunk.ref).inline
        assert chunk.to_lists(False) == ([[1, 2]], [-1.0])
        first.close()
        later.close()
    finally:
        _close_ends()


@pytest.mark.parametrize("start", [adapter.start_scheduler, adapter.start_tokenizer])
def test_start_refuses_max_tokens_below_sglangs_and_names_both(start, monkeypatch, prefix):
    monkeypatch.setitem(adapter._ends, "writer", None)
    monkeypatch.setitem(adapter._ends, "reader", None)
    monkeypatch.setenv("SHMASK_NAME_PREFIX", prefix)
    monkeypatch.setenv("SHMASK_MAX_TOKENS", "2048")
    with pytest.raises(shmask.ConfigError) as info:
        start(_server_args(sampling_mask_max_tokens=4096))
    message = str(info.value)
    assert "SHMASK_MAX_TOKENS=2048" in message
    assert "--sampling-mask-max-tokens=4096" in message
    assert adapter._ends["writer"] is None and adapter._ends["reader"] is None  # nothing made
    monkeypatch.setenv("SHMASK_MAX_TOKENS", "4096")  # equal is enough
    made = start(_server_args(sampling_mask_max_tokens=4096))
    if made is not None:  # the tokenizer's Reader (the scheduler makes its ring later)
        made.close()


def test_start_scheduler_turns_metrics_on_with_sglangs_rank_labels(prefix):
    """In a child (metrics are process-wide): SGLang's --enable-metrics on,
    its collector's labels on shmask's series, the ring shown once made."""
    child = textwrap.dedent("""
        import types
        from prometheus_client import REGISTRY, generate_latest
        from shmask import metrics
        from shmask.adapters import sglang
        args = types.SimpleNamespace(sampling_mask_max_tokens=4096, enable_metrics=False)
        assert sglang.start_scheduler(args) is None
        assert not metrics.enabled()
        args.enable_metrics = True
        sglang.start_scheduler(args, metrics_labels={
            "model_name": "m", "tp_rank": 1, "pp_rank": 0, "dp_rank": None, "priority": ""})
        sglang.SamplingMaskRows("selected")  # the first request for masks
        writer = sglang.ring_ready(30)
        print(writer.segment_name)
        print(generate_latest(REGISTRY).decode())
        writer.close()
    """)
    pytest.importorskip("prometheus_client")
    env = dict(os.environ, SHMASK_NAME_PREFIX=prefix, SHMASK_RING_MB="1")
    done = run_child([sys.executable, "-c", child], env)
    assert done.returncode == 0, done.stderr
    segment, text = done.stdout.split("\n", 1)
    labels = f'model_name="m",pp_rank="0",segment="{segment}",tp_rank="1"'
    line = f"shmask_ring_capacity_bytes{{{labels}}} 1.048576e+06"
    assert line in text.splitlines()


def _without_msgspec(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a child where msgspec cannot be imported (a base
    install without the msgpack extra)."""
    blocker = textwrap.dedent("""
        import sys
        class _NoMsgspec:
            def find_spec(self, name, path=None, target=None):
                if name == "msgspec" or name.startswith("msgspec."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _NoMsgspec())
    """)
    return subprocess.run([sys.executable, "-c", blocker + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, start_new_session=True)


def test_without_msgspec_the_errors_name_the_extra():
    done = _without_msgspec("""
        import shmask
        try:
            import shmask.adapters.sglang
        except ImportError as exc:
            print("sglang:", exc)
        batch = shmask.RefBatch.from_bytes(shmask.RefBatch.build([], [], []).to_bytes())
        try:
            shmask.msgpack_enc_hook(batch)
        except ImportError as exc:
            print("hook:", exc)
    """)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    for what in ("sglang", "hook"):
        assert "msgspec" in lines[what] and "pip install 'shmask[msgpack]'" in lines[what]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang not installed")
def test_sglang_server_args_carry_what_start_reads():
    """The released ServerArgs has the two attributes (flat, as the
    scheduler reads them) with the defaults the docs state."""
    child = ("from sglang.srt.server_args import ServerArgs\n"
             "args = ServerArgs(model_path='m')\n"
             "print(args.sampling_mask_max_tokens, args.enable_metrics)\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4096", "False"]
    assert shmask.Config().max_tokens >= 4096  # the defaults agree


def test_arrays_mode_switched_mid_request_fails_it_and_gives_the_chunk_back(writer, monkeypatch):
    """A request that began with lists cannot continue as arrays: it fails
    alone, and its chunk's record goes back at once, not at the lease."""
    from types import SimpleNamespace

    modes = ["support", "support"]
    rows, emissions = stream_with_drops(writer, 11, modes, emissions=2)
    rids = ["r0", "r1"]
    manager = SimpleNamespace(abort_request=lambda rid: None, rid_to_state={
        rid: SimpleNamespace(output_token_sampling_mask=[], output_token_sampling_logprobs=[])
        for rid in rids})
    first = SimpleNamespace(rids=rids, finished_reasons=[None, None],
                            output_token_sampling_mask=emissions[0])
    for i in range(2):  # the first emission as lists
        tokenizer_step(manager, first, i, {}, True)
    monkeypatch.setitem(adapter._ends, "mask_format", "arrays")
    manager.rid_to_state["r1"].output_token_sampling_mask = []  # r1 starts over: arrays are fine
    second = SimpleNamespace(rids=rids, finished_reasons=[None, None],
                             output_token_sampling_mask=emissions[1])
    metas = [{}, {}]
    for i in range(2):
        tokenizer_step(manager, second, i, metas[i], True)
    assert second.finished_reasons[0]["type"] == "abort"  # r0 failed alone
    assert second.finished_reasons[1] is None
    assert isinstance(metas[1][adapter.MASK_FIELD], adapter.SamplingMaskCSR)
    for r in rows:
        r.close()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0, "the failed request's chunk must be given back"

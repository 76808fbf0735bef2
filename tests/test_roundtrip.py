"""Round trips through a real ring, both modes, both producer paths."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_chunk_equal, random_chunk

import shmask


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_publish_round_trip(writer, reader, mode):
    rng = np.random.default_rng(1)
    lengths, ids, logprobs = random_chunk(rng, 50, 40, mode)
    ref = writer.publish(lengths, ids, logprobs, mode)
    assert not ref.inline and ref.rows == 50 and ref.nnz == ids.size
    with reader.open(ref) as chunk:
        assert chunk.mode_name == mode
        assert_chunk_equal(chunk, lengths, ids, logprobs)
        assert not chunk.ids.flags.writeable, "readers must not write into the ring"


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_queue_round_trip_padded_and_csr(writer, reader, mode):
    rng = np.random.default_rng(2)
    queues = [writer.open_queue(mode) for _ in range(5)]
    expected = [[] for _ in queues]
    for step in range(30):
        width = 17
        lengths = rng.integers(0, width + 1, len(queues)).astype(np.int32)
        ids = rng.integers(0, 1000, (len(queues), width)).astype(np.int32)
        if mode == "support":
            logprobs = rng.standard_normal((len(queues), width)).astype(np.float32)
        else:
            logprobs = rng.standard_normal(len(queues)).astype(np.float32)
        if step % 2:  # flat CSR input on odd steps
            ids_in = np.concatenate([ids[i, :n] for i, n in enumerate(lengths)])
            lp_in = (np.concatenate([logprobs[i, :n] for i, n in enumerate(lengths)])
                     if mode == "support" else logprobs)
        else:
            ids_in, lp_in = ids, logprobs
        slots = np.array([q.handle for q in queues], np.int64) if step % 3 else queues
        writer.append_step(slots, lengths, ids_in, lp_in)
        for i, n in enumerate(lengths):
            expected[i].append((ids[i, :n].copy(),
                                logprobs[i, :n].copy() if mode == "support" else logprobs[i]))
    batch = writer.take_batch(queues)
    assert len(batch) == len(queues)
    for i, ref in enumerate(batch):
        with reader.open(ref) as chunk:
            ids_lists, lp_lists = chunk.to_lists()
            assert len(ids_lists) == 30
            for row, (want_ids, want_lp) in enumerate(expected[i]):
                assert ids_lists[row] == want_ids.tolist()
                if mode == "support":
                    assert lp_lists[row] == [float(x) for x in want_lp]
                else:
                    assert lp_lists[row] == float(want_lp)
    for q in queues:
        q.close()


def test_to_lists_bit_identical_to_float_of_float32(writer, reader):
    values = np.array([0.1, -1e-30, -3.4028235e38, -0.0, 1e-45, -2.5, -np.inf], np.float32)
    ref = writer.publish(np.array([len(values)], np.int32), np.arange(len(values), dtype=np.int32),
                         values, "support")
    with reader.open(ref) as chunk:
        _, logprobs = chunk.to_lists()
    got = np.array(logprobs[0], np.float64)
    want = np.array([float(v) for v in values], np.float64)
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_json_path_equals_json_dumps_of_lists(writer, reader, mode):
    rng = np.random.default_rng(3)
    lengths, ids, logprobs = random_chunk(rng, 20, 30, mode)
    ref = writer.publish(lengths, ids, logprobs, mode)
    with reader.open(ref) as chunk:
        ids_lists, lp_lists = chunk.to_lists()
        fast = json.loads(chunk.to_json(("ids", "logprobs", "lengths")))
    slow = json.loads(json.dumps({"ids": ids_lists, "logprobs": lp_lists,
                                  "lengths": lengths.tolist()}))
    assert fast == slow
    flat = [x for row in fast["logprobs"] for x in row] if mode == "support" else fast["logprobs"]
    np.testing.assert_array_equal(np.array(flat, np.float32).view(np.uint32), logprobs.view(np.uint32))


def test_streaming_slices(writer, reader):
    rng = np.random.default_rng(4)
    lengths, ids, logprobs = random_chunk(rng, 10, 8)
    ref = writer.publish(lengths, ids, logprobs)
    with reader.open(ref) as chunk:
        whole_ids, whole_lp = chunk.to_lists()
        pieces = [chunk.slice(i, i + 3) for i in range(0, 10, 3)]
        joined_ids = [row for piece in pieces for row in piece.to_lists()[0]]
        joined_lp = [row for piece in pieces for row in piece.to_lists()[1]]
        assert joined_ids == whole_ids and joined_lp == whole_lp
        with pytest.raises(shmask.ShmaskError):
            pieces[0].release()
        ids3, lp3 = chunk.row(3)
        assert ids3.tolist() == whole_ids[3] and lp3.tolist() == whole_lp[3]


def test_empty_take_and_empty_chunk(writer, reader):
    queue = writer.open_queue()
    ref = queue.take()
    assert ref.rows == 0
    with reader.open(ref) as chunk:
        assert chunk.to_lists() == ([], [])
    queue.append(np.zeros(0, np.int32), np.zeros(0, np.float32))  # a row with empty support
    with reader.open(queue.take()) as chunk:
        assert chunk.to_lists() == ([[]], [[]])
    queue.close()


def test_inline_transport_round_trip(config, reader):
    config = shmask.Config(**{**config.__dict__, "transport": "inline"})
    with shmask.Writer(config) as writer:
        assert writer.segment is None
        rng = np.random.default_rng(5)
        lengths, ids, logprobs = random_chunk(rng, 7, 9)
        ref = writer.publish(lengths, ids, logprobs)
        assert ref.inline
        queue = writer.open_queue()
        writer.append_step([queue], lengths[:1], ids[:lengths[0]], logprobs[:lengths[0]])
        batch = writer.take_batch([queue])
        assert batch[0].inline
    with reader.open(ref) as chunk:
        assert_chunk_equal(chunk, lengths, ids, logprobs)
    with reader.open(batch[0]) as chunk:
        assert chunk.ids.tolist() == ids[:lengths[0]].tolist()


@pytest.mark.parametrize("mode", ["support", "selected"])
@pytest.mark.parametrize("lengths", [[0], [0, 0, 0], [1], [0, 3, 0, 0, 2, 0], [300, 0, 200], [1] * 40])
def test_json_path_row_splits(writer, reader, mode, lengths):
    """Short and long rows, empty rows anywhere."""
    lengths = np.array(lengths, np.int32)
    ids = np.arange(lengths.sum(), dtype=np.int32) * 7
    logprobs = -np.linspace(0, 3, ids.size if mode == "support" else lengths.size).astype(np.float32)
    with reader.open(writer.publish(lengths, ids, logprobs, mode)) as chunk:
        ids_lists, lp_lists = chunk.to_lists()
        assert json.loads(chunk.to_json(("a", "b", "c"))) == {
            "a": ids_lists, "b": lp_lists, "c": lengths.tolist()}

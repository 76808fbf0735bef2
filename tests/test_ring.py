"""Ring mechanics with a real segment: wrap-around, release order, full
ring, leases and the seqlock re-check."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import assert_chunk_equal, random_chunk

import shmask


def test_wrap_around_with_random_sizes(writer, reader):
    """Many times the ring's capacity goes through it; every chunk intact."""
    rng = np.random.default_rng(10)
    capacity = writer.config.ring_capacity_bytes
    moved = 0
    held = []
    while moved < 8 * capacity:
        lengths, ids, logprobs = random_chunk(rng, int(rng.integers(1, 40)), 300, vocab=5000)
        ref = writer.publish(lengths, ids, logprobs)
        assert not ref.inline, "ring should never be full when chunks are released"
        held.append((ref, lengths, ids, logprobs))
        moved += ref.record_bytes
        if len(held) > rng.integers(0, 6):  # release a few at a time, oldest first
            ref, *want = held.pop(0)
            with reader.open(ref) as chunk:
                assert_chunk_equal(chunk, *want)
    used, ring_capacity = writer.ring_usage()
    assert ring_capacity == capacity
    assert sum(ref.record_bytes for ref, *_ in held) <= used <= capacity
    for ref, *want in held:
        with reader.open(ref) as chunk:
            assert_chunk_equal(chunk, *want)
    writer.reclaim()
    assert writer.ring_usage()[0] == 0, "every record was released: the ring must be empty"
    assert writer.stats.inline_chunks == 0


def test_out_of_order_release_reclaims_in_fifo(writer, reader):
    rng = np.random.default_rng(11)
    refs = [writer.publish(*random_chunk(rng, 4, 10)) for _ in range(6)]
    chunks = [reader.open(ref) for ref in refs]
    for i in (5, 3, 1, 4):  # release out of order; record 0 still blocks the tail
        chunks[i].release()
    used_before, _ = writer.ring_usage()
    writer.reclaim()
    assert writer.ring_usage()[0] == used_before, "a held record must block what follows"
    chunks[0].release()
    writer.reclaim()
    used_after, _ = writer.ring_usage()
    # 0 and 1 are gone; 2 blocks now
    assert used_after == used_before - refs[0].record_bytes - refs[1].record_bytes
    chunks[2].release()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0


def test_double_release_raises(writer, reader):
    ref = writer.publish(*random_chunk(np.random.default_rng(12), 3, 5))
    chunk = reader.open(ref)
    chunk.release()
    with pytest.raises(shmask.DoubleReleaseError):
        chunk.release()
    # a second opener of the same ref sees it is released, and cannot release it again
    with pytest.raises(shmask.DoubleReleaseError):
        reader.open(ref)


def test_full_ring_falls_back_inline_with_data_intact(writer, reader):
    rng = np.random.default_rng(13)
    held, refs = [], []
    while True:
        lengths, ids, logprobs = random_chunk(rng, 50, 400, vocab=10_000)
        t0 = time.monotonic()
        ref = writer.publish(lengths, ids, logprobs)
        elapsed = time.monotonic() - t0
        refs.append(ref)
        held.append((lengths, ids, logprobs))
        if ref.inline:
            break
        assert len(refs) < 1000
    # it waited for releases (bounded by SHMASK_FULL_WAIT_MS), then went inline
    assert writer.config.full_wait_ms / 1000 <= elapsed < 5
    assert writer.stats.inline_chunks == 1 and writer.stats.full_waits >= 1
    batch = shmask.RefBatch.from_refs(refs)  # inline payload survives the wire format
    for ref, want in zip(shmask.RefBatch.from_bytes(batch.to_bytes()), held, strict=True):
        with reader.open(ref) as chunk:
            assert_chunk_equal(chunk, *want)
    # once released, the ring takes chunks again
    assert not writer.publish(*held[0]).inline


def test_full_ring_queue_stages_privately_and_goes_inline(config, reader):
    with shmask.Writer(config) as writer:
        rng = np.random.default_rng(14)
        blocker = writer.publish(*random_chunk(rng, 100, 1000, vocab=100_000))
        queue = writer.open_queue()
        rows = []
        for _ in range(200):  # far more than the ring can stage behind the blocker
            lengths, ids, logprobs = random_chunk(rng, 1, 1000, vocab=100_000)
            writer.append_step([queue], lengths, ids, logprobs)
            rows.append((ids, logprobs))
        ref = queue.take()
        assert ref.inline
        with reader.open(ref) as chunk:
            assert chunk.rows == 200
            np.testing.assert_array_equal(chunk.ids, np.concatenate([r[0] for r in rows]))
            np.testing.assert_array_equal(chunk.logprobs, np.concatenate([r[1] for r in rows]))
        reader.open(blocker).release()
        queue.close()


def test_staging_buffer_blocking_the_tail_is_moved(config, reader):
    """A long-lived queue at the tail must not wedge the ring."""
    with shmask.Writer(config) as writer:
        rng = np.random.default_rng(15)
        slow = writer.open_queue()
        lengths, ids, logprobs = random_chunk(rng, 1, 50)
        writer.append_step([slow], lengths, ids, logprobs)
        for _ in range(200):  # 200 x ~100 KiB through a 1 MiB ring
            ref = writer.publish(*random_chunk(rng, 30, 800, vocab=100_000))
            assert not ref.inline
            reader.open(ref).release()
        assert writer.stats.staging_moves >= 1
        with reader.open(slow.take()) as chunk:
            assert chunk.ids.tolist() == ids.tolist()
        slow.close()


def test_lease_expiry_gives_stale_chunk_error(config, reader):
    config = shmask.Config(**{**config.__dict__, "lease_s": 0.05})
    with shmask.Writer(config) as writer:
        rng = np.random.default_rng(16)
        late = writer.publish(*random_chunk(rng, 5, 10))
        opened = writer.publish(*random_chunk(rng, 5, 10))
        chunk = reader.open(opened)
        time.sleep(0.1)
        writer.reclaim()
        assert writer.stats.expired == 2
        with pytest.raises(shmask.StaleChunkError):
            reader.open(late)
        with pytest.raises(shmask.StaleChunkError):
            chunk.release()


def test_chunk_reclaimed_while_converting_raises(config, reader):
    """Seqlock re-check: rows overwritten under a reader must not be returned."""
    config = shmask.Config(**{**config.__dict__, "lease_s": 0.01})
    with shmask.Writer(config) as writer:
        rng = np.random.default_rng(17)
        chunk = reader.open(writer.publish(*random_chunk(rng, 20, 100)))
        time.sleep(0.05)
        # The producer moves on: the lease expires, the space is reused.
        for _ in range(40):
            ref = writer.publish(*random_chunk(rng, 20, 400, vocab=100_000))
            reader.open(ref).release()
        with pytest.raises(shmask.StaleChunkError):
            chunk.to_lists()
        with pytest.raises(shmask.StaleChunkError):
            chunk.to_json()


def test_chunk_larger_than_ring_goes_inline(writer, reader):
    lengths = np.array([100_000, 100_000], np.int32)
    writer_big = np.arange(200_000, dtype=np.int32) % 151_936
    with pytest.raises(shmask.InvalidRowsError):
        writer.publish(lengths, writer_big, np.zeros(200_000, np.float32))  # > max_tokens
    lengths = np.full(40, 8000, np.int32)
    ids = np.tile(np.arange(8000, dtype=np.int32), 40)
    ref = writer.publish(lengths, ids, np.zeros(ids.size, np.float32))
    assert ref.inline  # 2.5 MB record in a 1 MiB ring
    with reader.open(ref) as chunk:
        assert chunk.nnz == ids.size


def test_second_opener_cannot_release_twice(writer, config):
    """Two readers open the same ref (a routing bug): only one release wins."""
    ref = writer.publish(*random_chunk(np.random.default_rng(18), 3, 5))
    with shmask.Reader(config) as first, shmask.Reader(config) as second:
        a, b = first.open(ref), second.open(ref)
        a.release()
        with pytest.raises(shmask.DoubleReleaseError):
            b.release()


def test_forged_position_inside_a_payload_is_refused(writer, reader):
    """A ref pointing into a record's payload, at bytes crafted to look like a
    published record header, must not be read as one (the tag check)."""
    from shmask.refs import ENTRY_DTYPE

    header = np.zeros(16, np.uint32)  # 64 bytes, as the record header lays them out
    header[0:2] = [0, 0]  # tag: deliberately not the forged position
    header[2], header[3] = 2, 2  # state WRITTEN, mode support
    header[4] = 256  # record_bytes (low word)
    header[6], header[7] = 1, 1  # rows, rows_capacity
    header[8], header[10] = 1, 1  # nnz, nnz_capacity
    lengths = np.array([64] + [0] * 15, np.int32)  # 16 rows -> ids start 128 bytes in
    ids = np.concatenate([header.view(np.int32), np.arange(1, 49, dtype=np.int32)])  # lengths [1]
    ref = writer.publish(lengths, ids, np.zeros(64, np.float32))
    forged = np.zeros(1, ENTRY_DTYPE)
    forged["kind"], forged["mode"], forged["rows"], forged["nnz"] = 1, 2, 1, 1
    forged["position"], forged["record_bytes"] = ref.position + 128, 256
    batch = shmask.RefBatch.build([(ref.segment, ref.epoch)], forged)
    with pytest.raises(shmask.ShmaskError):
        reader.open(batch[0])
    reader.open(ref).release()


def test_corrupted_record_size_stops_reclaim_instead_of_jumping(writer, reader, caplog):
    """A reader that scribbles over a released record's size must not make
    the producer move its tail off a record boundary."""
    rng = np.random.default_rng(19)
    refs = [writer.publish(*random_chunk(rng, 4, 10)) for _ in range(3)]
    for ref in refs:
        reader.open(ref).release()
    scribble = np.frombuffer(reader._attach(refs[0].segment).segment.buffer, np.uint64)
    scribble[(4096 + refs[1].position) // 8 + 2] = 12345  # record_bytes of the second record
    writer.reclaim()
    used, _ = writer.ring_usage()
    assert used == refs[1].record_bytes + refs[2].record_bytes, "tail stops at the bad header"
    assert "overwritten" in caplog.text
    assert writer.publish(*random_chunk(rng, 2, 4)).rows == 2  # still publishing

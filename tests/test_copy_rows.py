"""Reader.copy_rows and Reader.copy_ref_table (native/shmask_copy.c): many
chunks' leading rows copied out of a real ring and released in one native
call, with Reader.open's checks; what they do not copy they neither read
nor release, so the usual open still says what was wrong (the vLLM frontend
relies on that: shmask/adapters/vllm.py resolve_outputs)."""

from __future__ import annotations

import numpy as np
import pytest

import shmask
from shmask.errors import DoubleReleaseError, InvalidRefError, RowDroppedError
from shmask.refs import ENTRY_DTYPE, RefBatch

VOCAB = 1000


def words_of(ids: list[int]) -> np.ndarray:
    words = np.zeros((VOCAB + 31) // 32, np.uint32)
    for i in ids:
        words[i // 32] |= np.uint32(1 << (i % 32))
    return words.view(np.int32)


@pytest.fixture
def ring(prefix):
    with shmask.Writer(shmask.Config(ring_mb=4, name_prefix=prefix, max_tokens=64)) as writer, \
            shmask.Reader(writer.config) as reader:
        yield writer, reader


def publish(writer, steps: list[list[tuple[list[int] | None, int, bool]]]) -> RefBatch:
    """One chunk a request: steps[s][r] = (ids or None, status, bitmask) of
    request r's row at step s (selected mode, as vLLM's masks)."""
    queues = [writer.open_queue("selected") for _ in steps[0]]
    handles = np.array([q.handle for q in queues], np.int64)
    for rows in steps:
        lengths = np.array([0 if ids is None else len(ids) for ids, _, _ in rows], np.int32)
        data = [np.zeros(0, np.int32)] + [
            words_of(ids) if bitmask else np.array(ids, np.int32)
            for ids, _, bitmask in rows if ids is not None]
        writer.append_step(handles, lengths, np.concatenate(data), np.zeros(0, np.float32),
                           np.zeros(len(rows), np.float32),
                           status=np.array([s for _, s, _ in rows], np.int32),
                           forms=np.array([int(b) for _, _, b in rows], np.int32), vocab=VOCAB)
    batch = writer.take_batch(handles)
    for queue in queues:
        queue.close()
    return batch


def rows_of(result, i: int) -> list[list[int]]:
    ids, starts, row_starts, row_lengths, copied = result
    assert copied[i]
    lengths = row_lengths[row_starts[i]:row_starts[i + 1]].tolist()
    bounds = np.cumsum([starts[i], *lengths]).tolist()
    return [ids[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]


def test_rows_are_copied_and_released(ring) -> None:
    writer, reader = ring
    batch = publish(writer, [
        [([3, 7, 9], 0, False), ([1, 500, 999], 0, True), ([5], 0, False)],
        [([2], 0, False), ([0, 31, 32], 0, True), ([6, 8], 0, False)],
    ])
    result = reader.copy_rows(batch, np.array([1, 2, 2]))
    assert result[4].all()
    assert rows_of(result, 0) == [[3, 7, 9]]  # the first row only: keep 1 of 2
    assert rows_of(result, 1) == [[1, 500, 999], [0, 31, 32]]  # bitmask rows decoded
    assert rows_of(result, 2) == [[5], [6, 8]]
    for ref in batch:  # released: a second read is refused
        with pytest.raises(DoubleReleaseError):
            reader.open(ref)
    again = reader.copy_rows(batch, np.array([1, 2, 2]))
    assert not again[4].any()


def test_a_dropped_row_is_neither_copied_nor_released(ring) -> None:
    writer, reader = ring
    batch = publish(writer, [
        [([3], 0, False), (None, 1, False), ([4], 0, False)],
        [([5], 0, False), ([6], 0, False), (None, 2, False)],
    ])
    # request 1's first row is OVERFLOW; request 2's second row INVALID but
    # only its first is kept
    result = reader.copy_rows(batch, np.array([2, 1, 1]))
    assert result[4].tolist() == [True, False, True]
    assert rows_of(result, 0) == [[3], [5]] and rows_of(result, 2) == [[4]]
    with reader.open(batch[1]) as chunk:  # still there: the usual open says why
        with pytest.raises(RowDroppedError):
            chunk.check_rows(0, 1)


def test_forged_and_oversized_entries_cost_only_themselves(ring) -> None:
    writer, reader = ring
    batch = publish(writer, [[([3], 0, False), ([4], 0, False), ([5], 0, False),
                              ([6], 0, False)]])
    entries = batch.entries.copy()
    entries["seal"][0] ^= 1  # another record's seal
    entries["rows"][1] = 2**31  # a forged row count: sizes nothing
    entries["nnz"][2] = 2**63  # a forged id count: allocates nothing, copies nothing
    forged = RefBatch.build(batch.segments, entries)
    result = reader.copy_rows(forged, np.array([1, 2**31, 1, 1], np.uint32))
    assert result[4].tolist() == [False, False, False, True]
    assert rows_of(result, 3) == [[6]]
    assert result[3].size == 2  # room for entries 0 and 3 only: the forged counts take none
    for i in range(3):  # the real records are untouched
        with reader.open(batch[i]) as chunk:
            assert chunk.rows == 1
    with pytest.raises(InvalidRefError):
        reader.open(forged[0])


def test_keep_outside_the_rows_is_not_copied(ring) -> None:
    writer, reader = ring
    batch = publish(writer, [[([3], 0, False), ([4], 0, False)]])
    result = reader.copy_rows(batch, np.array([0, 2]))
    assert not result[4].any()
    with pytest.raises(ValueError, match="shape"):
        reader.copy_rows(batch, np.array([1]))


# ---------------------------------------------- a step's references as a table
def table_rows_of(result, i: int) -> list[list[int]]:
    ids, starts, row_first, row_lengths, copied = result
    assert copied[i]
    lengths = row_lengths[row_first[i]:row_first[i + 1]].tolist()
    bounds = np.cumsum([starts[i], *lengths]).tolist()
    assert bounds[-1] == starts[i + 1]
    return [ids[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]


def test_a_step_table_is_copied_and_released(ring) -> None:
    """One-entry references side by side (what vLLM's frontend receives,
    one per request): every row's rows copied, bitmask rows decoded, each
    record released; keep trims positions."""
    writer, reader = ring
    batch = publish(writer, [
        [([3, 7, 9], 0, False), ([1, 500, 999], 0, True), ([5], 0, False)],
        [([2], 0, False), ([0, 31, 32], 0, True), ([6, 8], 0, False)],
    ])
    table = batch.one_entry_batches()
    result = reader.copy_ref_table(table, batch.segments[0], np.array([1, 2, 2]))
    assert result[4].all()
    assert table_rows_of(result, 0) == [[3, 7, 9]]
    assert table_rows_of(result, 1) == [[1, 500, 999], [0, 31, 32]]
    assert table_rows_of(result, 2) == [[5], [6, 8]]
    for ref in batch:
        with pytest.raises(DoubleReleaseError):
            reader.open(ref)
    assert not reader.copy_ref_table(table, batch.segments[0])[4].any()


def test_a_table_row_unlike_the_first_is_left_to_its_own_open(ring) -> None:
    """Only rows whose header and segment table equal row 0's byte for byte,
    with a ring entry of segment 0 in a valid mode, are taken; the others
    (and a dropped row, a forged seal or count) are neither read nor
    released, and the rest of the step is copied."""
    writer, reader = ring
    batch = publish(writer, [[([i], 0, False) for i in range(3, 11)] + [(None, 1, False)]])
    table = batch.one_entry_batches()
    entries = table[:, -ENTRY_DTYPE.itemsize:].copy().view(ENTRY_DTYPE).reshape(-1)
    prefix = table.shape[1] - ENTRY_DTYPE.itemsize
    table[1, 8] ^= 1  # its header differs from the leader's
    entries["segment"][2] = 1  # a segment its header does not name
    entries["mode"][3] = 9  # no such mode
    entries["kind"][4] = 2  # inline
    entries["seal"][5] ^= 1  # another record's seal
    entries["nnz"][6] = 2**63  # a forged count: not taken, so it sizes nothing
    table[:, prefix:] = entries.view(np.uint8).reshape(len(entries), -1)
    result = reader.copy_ref_table(table, batch.segments[0])
    assert result[4].tolist() == [True] + [False] * 6 + [True, False]
    assert table_rows_of(result, 0) == [[3]] and table_rows_of(result, 7) == [[10]]
    assert result[0].size == 2  # the forged count took no room
    for i in range(1, 7):  # the real records are untouched
        with reader.open(batch[i]) as chunk:
            assert chunk.rows == 1
    with reader.open(batch[8]) as chunk:  # OVERFLOW: still there, its open says why
        with pytest.raises(RowDroppedError):
            chunk.check_rows(0, 1)


def test_a_table_of_another_segment_or_shape_copies_nothing(ring) -> None:
    writer, reader = ring
    batch = publish(writer, [[([3], 0, False), ([4], 0, False)]])
    table = batch.one_entry_batches()
    name, epoch, host = batch.segments[0]
    assert not reader.copy_ref_table(table, (name, epoch + 1, host))[4].any()  # an old ring
    assert not reader.copy_ref_table(table[:, -ENTRY_DTYPE.itemsize:].copy(),
                                     batch.segments[0])[4].any()  # no room for a header
    with pytest.raises(ValueError, match="uint8"):
        reader.copy_ref_table(table.view(np.int8), batch.segments[0])
    with pytest.raises(ValueError, match="shape"):
        reader.copy_ref_table(table, batch.segments[0], np.array([1]))
    assert table_rows_of(reader.copy_ref_table(table, batch.segments[0]), 1) == [[4]]


@pytest.mark.parametrize("rows", [65, 200])
def test_a_record_of_more_rows_than_the_core_copies_is_left_alone(ring, rows) -> None:
    """A genuine record of more than SHM_COPY_MAX_ROWS rows, kept whole or
    trimmed to its first row: not copied (its geometry would not fit the
    core's buffer), not released; its own open reads it."""
    writer, reader = ring
    batch = publish(writer, [[([r % 50], 0, False)] for r in range(rows)])
    table = batch.one_entry_batches()
    for keep in (None, np.array([1])):
        result = reader.copy_ref_table(table, batch.segments[0], keep)
        assert not result[4].any() and result[0].size == 0
    with reader.open(batch[0]) as chunk:
        assert chunk.rows == rows

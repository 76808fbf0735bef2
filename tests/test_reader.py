"""A Reader's main contract: it opens what a Writer published, a chunk is
released once, and a chunk the Writer gave back is stale, never another
chunk's rows. Real Writer, ring and Reader."""

from __future__ import annotations

import numpy as np
import pytest

import shmask


def _take_one_row(queue: shmask.writer.RowQueue, ids: list[int]) -> shmask.refs.ChunkRef:
    queue.append(np.array(ids, np.int32), np.full(len(ids), -1.0, np.float32))
    return queue.take()


def test_open_release_once(writer: shmask.Writer, reader: shmask.Reader) -> None:
    queue = writer.open_queue()
    chunk = reader.open(_take_one_row(queue, [2, 5, 11]))
    assert chunk.rows == 1 and chunk.row(0)[0].tolist() == [2, 5, 11]
    chunk.release()
    assert chunk.released
    with pytest.raises(shmask.DoubleReleaseError):
        chunk.release()
    queue.close()


def test_an_aborted_requests_chunk_is_stale(writer: shmask.Writer,
                                             reader: shmask.Reader) -> None:
    queue = writer.open_queue()
    ref = _take_one_row(queue, [7])
    assert queue.abort() == 1  # the chunk no reader released is given back
    with pytest.raises(shmask.StaleChunkError):
        reader.open(ref)

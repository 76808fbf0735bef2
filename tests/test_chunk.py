"""A Chunk's main contract, by its flags byte (shmask/layout.py): an OK ids
row reads as its ids, a bitmask row as its decoded ids, a dropped row raises
RowDroppedError naming its status and is None in the lists. Real Writer,
ring and Reader."""

from __future__ import annotations

import numpy as np
import pytest

import shmask
from shmask import layout

VOCAB = 70  # three bitmask words


def _publish_three_rows(writer: shmask.Writer) -> shmask.refs.ChunkRef:
    """Row 0: ids [4, 9]; row 1: a bitmask of ids {1, 33, 69}; row 2: OVERFLOW."""
    queue = writer.open_queue()
    bitmask = np.zeros(3, np.uint32)
    for token in (1, 33, 69):
        bitmask[token // 32] |= np.uint32(1 << (token % 32))
    for ids, logprobs, status, form in (
            (np.array([4, 9], np.int32), np.array([-0.25, -2.0], np.float32), layout.ROW_OK, 0),
            (bitmask.view(np.int32), np.array([-1.0, -2.0, -3.0], np.float32), layout.ROW_OK, 1),
            (np.zeros(0, np.int32), np.zeros(0, np.float32), layout.ROW_OVERFLOW, 0)):
        length = 3 if form else ids.size
        writer.append_step(np.array([queue.handle], np.int64), np.array([length], np.int32),
                           ids, logprobs, status=np.array([status], np.uint8),
                           forms=np.array([form], np.uint8), vocab=VOCAB)
    ref = queue.take(final=True)
    queue.close()
    return ref


def test_rows_read_by_their_flags(writer: shmask.Writer, reader: shmask.Reader) -> None:
    with reader.open(_publish_three_rows(writer)) as chunk:
        assert chunk.status.tolist() == [layout.ROW_OK, layout.ROW_OK, layout.ROW_OVERFLOW]
        ids, logprobs = chunk.row(0)
        assert ids.tolist() == [4, 9] and np.asarray(logprobs).tolist() == [-0.25, -2.0]
        ids, logprobs = chunk.row(1)
        assert ids.tolist() == [1, 33, 69] and np.asarray(logprobs).tolist() == [-1.0, -2.0, -3.0]
        with pytest.raises(shmask.RowDroppedError, match="OVERFLOW") as dropped:
            chunk.row(2)
        assert (dropped.value.row, dropped.value.status) == (2, layout.ROW_OVERFLOW)
        id_lists, _ = chunk.to_lists()
        assert id_lists == [[4, 9], [1, 33, 69], None]
        chunk.check_rows(0, 2)  # the OK rows only

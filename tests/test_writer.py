"""The Writer's device port (shmask/device_port.py): what a GPU-direct
publisher may ask of it, and the one rule it keeps while one is attached:
every CPU change of a queue runs inside the publisher's quiesced()."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import shmask
from shmask.device_port import DeviceAttachment, DevicePort


class RecordingAttachment:
    """A publisher that stores nothing: it records each quiesce the Writer
    asks of it (what a DirectPublisher would answer by waiting for its
    kernel). The Writer, its ring and its queues are real."""

    def __init__(self) -> None:
        self.depth = 0
        self.quiesces = 0
        self.waits = 0
        self.closes = 0

    @property
    def quiet(self) -> bool:
        return self.depth > 0

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        self.quiesces += 1
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def wait(self) -> None:
        self.waits += 1

    def close(self) -> None:
        self.closes += 1


def _step(writer: shmask.Writer, queue: shmask.writer.RowQueue) -> None:
    writer.append_step(np.array([queue.handle], np.int64), np.array([2], np.int32),
                       np.array([3, 7], np.int32), np.array([-0.5, -1.5], np.float32))


def test_writer_is_a_device_port(writer: shmask.Writer) -> None:
    port: DevicePort = writer
    attachment: DeviceAttachment = RecordingAttachment()
    assert port.ring_handle is not None and port.attached is None
    port.attach_direct(attachment)
    assert port.attached is attachment
    with pytest.raises(ValueError, match="already has a DirectPublisher"):
        port.attach_direct(RecordingAttachment())
    port.default_publisher = attachment
    port.detach_direct(attachment)
    assert port.attached is None and port.default_publisher is None


def test_every_cpu_change_of_a_queue_runs_quiesced_once(writer: shmask.Writer,
                                                       reader: shmask.Reader) -> None:
    attachment = RecordingAttachment()
    queue = writer.open_queue()
    writer.attach_direct(attachment)
    _step(writer, queue)
    assert attachment.quiesces == 1
    batch = writer.take_batch([queue])
    assert attachment.quiesces == 2  # take_batch's own reclaim does not quiesce again
    with reader.open(batch[0]) as chunk:
        assert chunk.row(0)[0].tolist() == [3, 7]
    writer.reclaim()
    assert attachment.quiesces == 2  # returning released records moves no queue buffer
    writer.reclaim(move_staging=True)
    assert attachment.quiesces == 3
    assert queue.rows == 0 and attachment.waits == 1
    queue.close()
    assert attachment.quiesces == 4
    writer.close()
    assert attachment.closes == 1


def test_a_closed_writer_raises_without_quiescing(writer: shmask.Writer) -> None:
    attachment = RecordingAttachment()
    queue = writer.open_queue()
    writer.attach_direct(attachment)
    writer.close()
    with pytest.raises(shmask.ShmaskError):
        _step(writer, queue)
    with pytest.raises(shmask.ShmaskError):
        writer.take_batch([queue])
    assert attachment.quiesces == 0

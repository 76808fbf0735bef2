"""Host hand-off: CSR rows land in (pinned when CUDA is present) staging
buffers and reach the writer as views of them, not copies."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shmask.kernels import HostStaging, Status, capture, compact, publish  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class RecordingWriter:
    """Stands in for shmask.Writer: records what append_step received."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def append_step(self, slots, lengths, ids, logprobs) -> None:
        self.calls.append((slots, lengths, ids, logprobs))


class Queue:
    def __init__(self, slot: int) -> None:
        self.slot = slot


def captured_rows():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 400, generator=gen) * 3, -1)
    sampled = probs.argmax(1)
    rows = torch.tensor([True, False, True, True, True])
    top_k = torch.tensor([3, 3, 40, 5, 300], dtype=torch.int32)
    return capture(probs.to(DEVICE), sampled.to(DEVICE), top_k=top_k.to(DEVICE),
                   rows=rows.to(DEVICE), max_tokens=100)


def test_fetch_copies_only_realized_rows_into_reused_buffers() -> None:
    result = captured_rows()
    staging = HostStaging(batch_capacity=2, entries_capacity=4)  # both must grow
    host = staging.fetch(result)
    total = int(result.offsets[-1])
    assert total == 3 + 40 + 5  # skipped row and the 300-token overflow row move nothing
    assert host.status.tolist() == [Status.OK, Status.SKIPPED, Status.OK, Status.OK,
                                    Status.OVERFLOW]
    assert np.array_equal(host.ids, result.ids[:total].cpu().numpy())
    assert np.array_equal(host.values, result.values[:total].cpu().numpy())
    assert np.array_equal(host.offsets, result.offsets.cpu().numpy())
    assert np.shares_memory(host.ids, staging.ids.numpy())
    assert np.shares_memory(host.values, staging.values.numpy())
    assert staging.ids.is_pinned() == torch.cuda.is_available()
    before = staging.ids.data_ptr()
    again = staging.fetch(result)  # steady state: same buffers, no allocation
    assert staging.ids.data_ptr() == before and np.shares_memory(again.ids, host.ids)


def test_publish_support_mode_hands_views_and_drops_skipped_rows() -> None:
    result = captured_rows()
    staging = HostStaging()
    host = staging.fetch(result)
    writer = RecordingWriter()
    slots = np.array([10, 11, 12, 13, 14], dtype=np.int32)
    statuses = publish(writer, slots, host)
    (sent_slots, lengths, ids, logprobs), = writer.calls
    assert sent_slots.tolist() == [10, 12, 13, 14]
    assert lengths.tolist() == [3, 40, 5, 0]
    assert statuses.tolist() == [Status.OK, Status.OK, Status.OK, Status.OVERFLOW]
    assert ids is host.ids and logprobs is host.values  # the staging views themselves
    assert np.shares_memory(ids, staging.ids.numpy())
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32
    assert ids.size == lengths.sum() == logprobs.size
    first, _ = result.row(0)
    assert ids[:3].tolist() == first.cpu().tolist()


def test_publish_selected_mode_and_queue_objects() -> None:
    result = captured_rows()
    host = HostStaging().fetch(result)
    writer = RecordingWriter()
    queues = [Queue(s) for s in range(5)]
    publish(writer, queues, host, mode="selected")
    (sent, lengths, ids, logprobs), = writer.calls
    assert [q.slot for q in sent] == [0, 2, 3, 4]
    assert logprobs.shape == (4,) and logprobs.dtype == np.float32
    want = result.selected_logprob.cpu().numpy()[[0, 2, 3, 4]]
    assert np.allclose(logprobs, want)


def test_publish_checks_its_arguments() -> None:
    compacted = compact(torch.tensor([[0.0, float("-inf"), 1.0]], device=DEVICE), 4)
    host = HostStaging().fetch(compacted)
    with pytest.raises(ValueError, match="mode"):
        publish(RecordingWriter(), np.array([1], dtype=np.int32), host, mode="padded")
    with pytest.raises(ValueError, match="one per row"):
        publish(RecordingWriter(), np.array([1, 2], dtype=np.int32), host)
    with pytest.raises(ValueError, match="selected"):
        publish(RecordingWriter(), np.array([1], dtype=np.int32), host, mode="selected")
    with pytest.raises(ValueError, match="capacities"):
        HostStaging(batch_capacity=0)

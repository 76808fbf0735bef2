"""A failure in a call that takes several chunks releases what it has not
consumed (issue 33, and #7: sglang's response_meta_info stopped at the first
chunk that failed and held the ones after it until the lease).

One table: every call of the adapters and of Offload that takes several
chunks, given a batch of real ring chunks where chunk k fails (stale: its
request was aborted by the producer; forged: its seal garbled; released:
given back already). The failing request gets its error, the others their
rows, and every other chunk goes back to the ring: after the queues close,
the producer reclaims the whole ring (ring usage 0), which it cannot while
one record is held.

Reader.discard_batch and RefBatch/binary_rows/response_json calls belong to
other modules; they are not in this table."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import shmask
from shmask.adapters import sglang, vllm
from shmask.offload import Offload, fold_ref

REQUESTS = 5
WAIT_S = 30  # a bound for waits that must not hang; no assertion is on speed
# How chunk k fails -> the error its request gets.
SPOILS = {"stale": shmask.StaleChunkError, "forged": shmask.InvalidRefError,
          "released": shmask.DoubleReleaseError}


@dataclass
class Batch:
    """REQUESTS requests' chunks of one emission (one row each, selected
    mode), as the bytes each request's reference travels as."""

    writer: shmask.Writer
    reader: shmask.Reader
    queues: list[Any]
    refs: list[bytes]
    real: list[bytes] = field(default_factory=list)  # the unspoiled references

    def spoil(self, k: int, how: str) -> None:
        if how == "stale":
            assert self.queues[k].abort() == 1  # the producer gave its record back
        elif how == "released":
            self.reader.discard(shmask.ChunkRef.from_bytes(self.refs[k]))
        else:  # the seal's top byte garbled: the record is not this ref's to open
            data = self.refs[k]
            self.refs[k] = data[:-1] + bytes([data[-1] ^ 0x80])

    def assert_all_given_back(self, k: int, how: str) -> None:
        """Every chunk but k was released by the call; k's record is held only
        where its ref was forged (nobody could name it): given back here.
        Then the producer reclaims the whole ring."""
        for i, data in enumerate(self.real):
            given_back = self.reader.discard_batch([shmask.ChunkRef.from_bytes(data)])
            assert given_back == (1 if i == k and how == "forged" else 0), (i, given_back)
        for queue in self.queues:
            queue.close()
        self.writer.reclaim()
        assert self.writer.ring_usage()[0] == 0, "a chunk is still held in the ring"


@pytest.fixture
def batch(writer, reader, monkeypatch):
    monkeypatch.setitem(sglang._ends, "writer", writer)
    monkeypatch.setitem(sglang._ends, "reader", reader)
    queues = [writer.open_queue("selected") for _ in range(REQUESTS)]
    writer.append_step(queues, np.full(REQUESTS, 2, np.int32),
                       np.arange(2 * REQUESTS, dtype=np.int32), np.zeros(REQUESTS, np.float32))
    refs = writer.take_batch(queues).split()
    return Batch(writer, reader, queues, list(refs), list(refs))


# ----------------------------------------------------------- the calls
# Each takes the batch's references and the failing index k, and checks
# that request k alone failed, with `error`.

def sglang_response_meta_info(batch: Batch, k: int, error: type) -> None:
    # One request's chunks (a whole response): the request fails, raised.
    chunks = [sglang.SamplingMaskChunk(data) for data in batch.refs]
    with pytest.raises(error) as raised:
        sglang.response_meta_info(chunks, support_logprobs=False)
    assert type(raised.value) is error


def sglang_lists_or_abort(batch: Batch, k: int, error: type) -> None:
    # A message's chunks, one per request, as SGLang's tokenizer loop reads them.
    chunks = [sglang.SamplingMaskChunk(data) for data in batch.refs]
    aborted: list[str] = []
    manager = SimpleNamespace(abort_request=aborted.append)
    rids = [f"r{i}" for i in range(REQUESTS)]
    recv = SimpleNamespace(rids=rids, finished_reasons=[None] * REQUESTS,
                           output_token_sampling_mask=chunks)
    for i in range(REQUESTS):
        lists = sglang.lists_or_abort(manager, recv, i, {"finish_reason": None}, False)
        assert (lists == ([], [])) == (i == k)
    assert aborted == [rids[k]]
    assert f"({error.__name__}: " in recv.finished_reasons[k]["message"]
    assert [reason is None for reason in recv.finished_reasons] == [
        i != k for i in range(REQUESTS)]


def vllm_resolve_outputs(batch: Batch, k: int, error: type) -> None:
    resolver = vllm.MaskResolver(reader=batch.reader, mask_lists=vllm._MaskLists)
    outputs = [SimpleNamespace(request_id=f"r{i}", finish_reason=None, error=None,
                               new_sampling_mask=vllm._MaskLists(np.frombuffer(data, np.uint8)))
               for i, data in enumerate(batch.refs)]
    assert resolver.resolve_outputs(outputs) == [f"r{k}"]
    for i, output in enumerate(outputs):
        if i == k:
            assert output.new_sampling_mask is None
            assert f"({error.__name__}: " in output.error.message
        else:
            assert output.error is None
            assert output.new_sampling_mask.token_ids.tolist() == [2 * i, 2 * i + 1]


def offload_fold_ref(batch: Batch, k: int, error: type) -> None:
    # A request's chunks folded on workers, one fold_ref job each.
    async def main() -> list[Any]:
        with Offload(threads=2) as offload:
            futures = [await offload.put("r", fold_ref, batch.reader,
                                         shmask.ChunkRef.from_bytes(data),
                                         lambda chunk: chunk.ids.tolist())
                       for data in batch.refs]
            return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True),
                                          WAIT_S)

    results = asyncio.run(main())
    for i, result in enumerate(results):
        if i == k:
            assert type(result) is error, result
        else:
            assert result == [2 * i, 2 * i + 1]


CALLS: list[Callable[[Batch, int, type], None]] = [
    sglang_response_meta_info, sglang_lists_or_abort, vllm_resolve_outputs, offload_fold_ref]


@pytest.mark.parametrize("k", [0, REQUESTS // 2, REQUESTS - 1])
@pytest.mark.parametrize("how", list(SPOILS))
@pytest.mark.parametrize("call", CALLS, ids=[c.__name__ for c in CALLS])
def test_a_failing_chunk_costs_its_request_and_releases_the_rest(batch, call, how, k):
    batch.spoil(k, how)
    call(batch, k, SPOILS[how])
    batch.assert_all_given_back(k, how)


# --------------------------------------------------- the Reader's own calls

def _whole(batch: Batch) -> shmask.RefBatch:
    return shmask.RefBatch.from_refs([shmask.ChunkRef.from_bytes(data) for data in batch.refs])


@pytest.mark.parametrize("k", [0, 2, REQUESTS - 1])
def test_open_batch_gives_back_what_it_did_not_open(batch, k):
    """Reader.open_batch: a chunk that fails to open raises into the caller,
    and the chunks after it (never opened) go back to the ring; so do those
    left when the caller stops early."""
    batch.spoil(k, "stale")
    chunks = batch.reader.open_batch(_whole(batch))
    for _ in range(k):
        next(chunks).release()
    with pytest.raises(shmask.StaleChunkError):
        next(chunks)
    batch.assert_all_given_back(k, "stale")


def test_open_batch_stopped_early_gives_back_the_rest(batch):
    whole = _whole(batch)
    chunks = batch.reader.open_batch(whole)
    next(chunks).release()
    chunks.close()  # the caller stops after one
    for queue in batch.queues:
        queue.close()
    batch.writer.reclaim()
    assert batch.writer.ring_usage()[0] == 0, "a chunk is still held in the ring"


def test_discard_batch_goes_on_past_a_bad_segment(batch):
    """A batch whose refs name a segment that is not a shmask ring (forged)
    besides a real one: the real one's chunks go back, then the bad name is
    raised (InvalidRefError), not the other way round."""
    whole = _whole(batch)
    name, epoch, host = whole.segments[0]
    entries = np.concatenate([whole.entries[:1], whole.entries])
    entries["segment"][0] = 0  # the first ref names the forged segment, the rest the ring
    entries["segment"][1:] = 1
    both = shmask.RefBatch.build([("not-a-ring", epoch, host), (name, epoch, host)], entries, [])
    with pytest.raises(shmask.InvalidRefError, match="not a shmask segment"):
        batch.reader.discard_batch(both)
    for queue in batch.queues:
        queue.close()
    batch.writer.reclaim()
    assert batch.writer.ring_usage()[0] == 0, "a chunk is still held in the ring"

"""Several responses at once (response_json.dumps_many, through
shmask.documents.map_documents): the same bytes as one call per document,
in order, on any number of threads; a document that fails costs only its
own result; a forked child builds too."""

from __future__ import annotations

import threading
import time

import numpy as np
import orjson
import pytest
from conftest import forked_answer
from test_response_json import expected_arrays, publish_rows, random_rows

import shmask
from shmask.binary_rows import EmissionBuffer, encode_meta_info, encode_meta_info_many
from shmask.documents import map_documents
from shmask.response_json import RawJSON, dumps, dumps_many


@pytest.fixture
def chunks(writer, reader):
    """Seven chunks of different sizes and modes, opened from a real ring."""
    rng = np.random.default_rng(2201)
    opened = []
    for index in range(7):
        mode = "support" if index % 3 else "selected"
        rows = random_rows(rng, 5 + 9 * index, 3000, 40 * index + 3, dropped=0.1, bitmasks=0.1)
        opened.append(reader.open(publish_rows(writer, mode, rows, 3000)))
    yield opened
    for chunk in opened:
        chunk.release()


def document(chunk: shmask.Chunk, index: int) -> dict:
    rows = chunk.json_rows()
    return {"rid": f"r{index}", "meta_info": {"mask": rows.ids, "logprobs": rows.logprobs,
                                              "lengths": rows.lengths_field, "n": chunk.rows}}


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_dumps_many_is_dumps_of_each_in_order(chunks, threads):
    expected = []
    for index, chunk in enumerate(chunks):
        ids, logprobs, lengths = expected_arrays(chunk)
        expected.append(b'{"rid":"r%d","meta_info":{"mask":%s,"logprobs":%s,"lengths":%s,"n":%d}}'
                        % (index, ids, logprobs, lengths, chunk.rows))
    docs = [document(chunk, index) for index, chunk in enumerate(chunks)]
    assert dumps_many(docs, threads=threads) == expected
    assert [dumps(doc) for doc in docs] == expected
    assert dumps_many(docs[:1], threads=threads) == expected[:1]  # fewer documents than threads
    assert dumps_many([], threads=threads) == []


def test_a_failing_document_costs_only_itself(chunks):
    docs = [document(chunk, index) for index, chunk in enumerate(chunks)]
    good = dumps_many(docs, threads=3)
    docs[2] = {"rid": "bad", "value": object()}  # orjson cannot write it
    got = dumps_many(docs, threads=3, return_exceptions=True)
    assert isinstance(got[2], TypeError)
    assert got[:2] + got[3:] == good[:2] + good[3:]
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps_many(docs, threads=3)


def test_a_builder_may_build_documents_itself():
    """map_documents called from one of its own threads runs there: with
    every thread waiting on work queued behind it, the pool would hang."""
    def build(item, each):
        return sum(map_documents(lambda x, e: x + item, list(range(4)), 2))

    # In a forked child, whose process group a hang costs (killed at the timeout).
    answer = forked_answer(lambda: b"same" if map_documents(build, list(range(6)), 2) == [
        6 + 4 * i for i in range(6)] else b"diff", timeout=30)
    assert answer == b"same"


def test_threads_are_checked():
    with pytest.raises(ValueError, match="positive int"):
        map_documents(lambda item, each: item, [1], 0)


def test_a_forked_child_builds_documents():
    """The parent's document threads do not exist in a forked child: its
    calls must still run (a pool carried over would queue work forever)."""
    for _ in range(3):  # the pool's threads have run items and wait idle at the fork
        assert map_documents(lambda item, each: item * 2, list(range(8)), 4) == list(
            range(0, 16, 2))
    time.sleep(0.1)
    answer = forked_answer(lambda: b"same" if map_documents(
        lambda item, each: item * 3, list(range(8)), 4) == list(range(0, 24, 3)) else b"diff",
        timeout=30)
    assert answer == b"same"


# ------------------------------------------------- binary rows, one native call

@pytest.mark.parametrize("threads", [1, 2, 5, 16])
def test_encode_meta_info_many_is_encode_meta_info_of_each(chunks, threads):
    starts = [3 * index for index in range(len(chunks))]
    lengths = [None if index % 2 else 1000 + index for index in range(len(chunks))]
    expected = [encode_meta_info(chunk, start, length=length)
                for chunk, start, length in zip(chunks, starts, lengths, strict=True)]
    assert encode_meta_info_many(chunks, starts, threads, lengths=lengths) == expected
    assert encode_meta_info_many(chunks, threads=threads) == [encode_meta_info(c)
                                                              for c in chunks]
    assert encode_meta_info_many(chunks[:2], threads=threads) == [encode_meta_info(c)
                                                                  for c in chunks[:2]]
    assert encode_meta_info_many([], threads=threads) == []
    with pytest.raises(shmask.ShmaskError, match="7 chunks but 2 starts"):
        encode_meta_info_many(chunks, [0, 1])


def test_a_failing_chunk_costs_only_itself(chunks):
    expected = [encode_meta_info(chunk) for chunk in chunks]
    given = list(chunks)
    given[1] = "not a chunk"
    starts = [0] * len(chunks)
    starts[3] = -1  # refused before anything is written
    got = encode_meta_info_many(given, starts, 4, return_exceptions=True)
    assert isinstance(got[1], AttributeError)
    assert isinstance(got[3], shmask.ShmaskError) and "non-negative" in str(got[3])
    assert [got[i] for i in (0, 2, 4, 5, 6)] == [expected[i] for i in (0, 2, 4, 5, 6)]
    with pytest.raises(AttributeError):
        encode_meta_info_many(given, threads=4)


# ------------------------------------- binary rows into a reused emission buffer


@pytest.mark.parametrize("threads", [1, 5])
def test_into_a_buffer_gives_the_same_bytes_as_read_only_views(chunks, threads):
    expected = [encode_meta_info(chunk, 2, length=900) for chunk in chunks]
    buffer = EmissionBuffer()
    got = encode_meta_info_many(chunks, [2] * len(chunks), threads, lengths=[900] * len(chunks),
                                into=buffer)
    assert all(isinstance(view, memoryview) and view.readonly for view in got)
    assert [bytes(view) for view in got] == expected
    # a server places a document in its response as it is (RawJSON takes a view)
    response = dumps({"rid": "r0", "meta_info": RawJSON(got[0])})
    assert response == orjson.dumps({"rid": "r0", "meta_info": orjson.Fragment(expected[0])})
    del got
    # nothing refers to the block any more: the next emission writes into it
    again = encode_meta_info_many(chunks, threads=threads, into=buffer)
    assert [bytes(view) for view in again] == [encode_meta_info(c) for c in chunks]
    assert buffer.blocks_made == 1


@pytest.mark.parametrize("keep", ["document", "slice", "array", "owner", "bytes"])
def test_a_document_still_held_is_never_written_over(chunks, keep):
    """A client or a send queue that still holds a document of one emission
    (or anything made from it) when the next one is written: the next one
    goes to a new block and the held bytes stay as they were. Rows of
    another chunk written over them would hand one request another's
    rows."""
    buffer = EmissionBuffer()
    first = encode_meta_info_many(chunks, into=buffer)
    want = bytes(first[0])
    assert not first[0].obj.flags.writeable  # a document's owner is read-only too
    held = {"document": first[0], "slice": first[0][10:],
            "array": np.frombuffer(first[0], dtype=np.uint8), "owner": first[0].obj,
            "bytes": bytes(first[0])}[keep]
    del first
    second = encode_meta_info_many(chunks[3:], into=buffer)  # other rows, fewer bytes
    assert [bytes(view) for view in second] == [encode_meta_info(c) for c in chunks[3:]]
    if keep == "owner":  # the whole block: the first document at its first 64-byte boundary
        start = -held.ctypes.data % 64
        assert bytes(held[start:start + len(want)]) == want
    else:
        assert bytes(held) == (want[10:] if keep == "slice" else want)
    assert buffer.blocks_made == (1 if keep == "bytes" else 2)
    del second, held
    third = encode_meta_info_many(chunks[:2], into=buffer)  # both blocks free now
    assert [bytes(view) for view in third] == [encode_meta_info(c) for c in chunks[:2]]
    assert buffer.blocks_made == (1 if keep == "bytes" else 2)


def test_documents_start_on_64_byte_boundaries(chunks):
    docs = encode_meta_info_many(chunks, threads=3, into=EmissionBuffer())
    assert [np.frombuffer(doc, dtype=np.uint8).ctypes.data % 64 for doc in docs] == [0] * 7


def test_threads_sharing_a_buffer_never_share_a_block(chunks):
    """Two threads writing emissions into one buffer at once: each holds its
    documents while the other writes, and each sees its own bytes."""
    buffer = EmissionBuffer()
    want = [encode_meta_info(c) for c in chunks]
    start = threading.Barrier(2)
    failures: list[str] = []

    def emissions(order: list[int]) -> None:
        start.wait()
        for _ in range(20):
            docs = encode_meta_info_many([chunks[i] for i in order], threads=2, into=buffer)
            time.sleep(0.0005)  # held while the other thread writes
            if [bytes(d) for d in docs] != [want[i] for i in order]:
                failures.append(f"order {order}")

    threads = [threading.Thread(target=emissions, args=(order,))
               for order in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == [] and not any(t.is_alive() for t in threads)


class _Reclaimed:
    """A record the producer took back while its chunk was being written."""

    def check(self) -> None:
        raise shmask.StaleChunkError("reclaimed (test)")

    def release(self) -> None:
        pass


def test_into_keeps_failures_in_their_place(chunks):
    given = list(chunks)
    starts = [0] * len(chunks)
    starts[2] = -1
    got = encode_meta_info_many(given, starts, 3, return_exceptions=True, into=EmissionBuffer())
    assert isinstance(got[2], shmask.ShmaskError)
    assert [bytes(got[i]) for i in (0, 1, 3)] == [encode_meta_info(chunks[i]) for i in (0, 1, 3)]
    # a chunk found stale once written: its document is not handed out
    c = chunks[1]
    stale = shmask.Chunk(c.mode, c.lengths, c.ids, c.logprobs, _Reclaimed(), flags=c.flags,
                         vocab=c.vocab)
    got = encode_meta_info_many([chunks[0], stale, chunks[2]], return_exceptions=True,
                                into=EmissionBuffer())
    assert isinstance(got[1], shmask.StaleChunkError)
    assert [bytes(got[i]) for i in (0, 2)] == [encode_meta_info(chunks[i]) for i in (0, 2)]
    with pytest.raises(TypeError, match="EmissionBuffer"):
        encode_meta_info_many(chunks, into=bytearray(10))


@pytest.mark.parametrize("core", [True, False], ids=["native", "numpy"])
def test_both_paths_refuse_a_negative_start_alike(chunks, monkeypatch, core):
    """With or without the compiled core a bad start is refused, in its
    place, and the other chunks are written the same."""
    from shmask import binary_rows

    expected = [encode_meta_info(chunk) for chunk in chunks]
    if not core:
        monkeypatch.setattr(binary_rows, "_native_core", False)
    got = encode_meta_info_many(chunks, [0, -1] + [0] * (len(chunks) - 2), 3,
                                return_exceptions=True)
    assert isinstance(got[1], shmask.ShmaskError) and "non-negative" in str(got[1])
    assert got[:1] + got[2:] == expected[:1] + expected[2:]
    with pytest.raises(ValueError, match="positive int"):
        encode_meta_info_many(chunks, threads=0)


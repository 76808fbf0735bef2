"""Rows in both forms (ascending ids, V-bit bitmask) and with their statuses
(OK, OVERFLOW, INVALID) on the consumer side, against a plain numpy oracle:
Chunks are built straight from arrays (no shared memory, no producer), the
bitmasks by np.bitwise_or.at, independently of the decoder's unpackbits.
Then the adapters' outputs on the same chunks."""

from __future__ import annotations

import json
import pickle
from typing import NamedTuple

import numpy as np
import orjson
import pytest

import shmask
from shmask.adapters import sglang as sglang_adapter
from shmask.adapters import vllm as vllm_adapter
from shmask.chunk import ROW_BITMASK, ROW_INVALID, ROW_OK, ROW_OVERFLOW, Chunk
from shmask.refs import KIND_SHM, MODE_SELECTED, MODE_SUPPORT, ChunkRef

FIELDS = ("ids", "logprobs", "lengths")
MODES = {"support": MODE_SUPPORT, "selected": MODE_SELECTED}


class Row(NamedTuple):
    """One row as the oracle knows it: ids None unless the status is OK."""

    status: int
    bitmask: bool
    ids: np.ndarray | None
    logprobs: np.ndarray  # support mode: one per id; selected mode: one value


def make_row(rng, vocab: int, support: bool, size: int | None, bitmask: bool = False,
             status: int = ROW_OK) -> Row:
    if status != ROW_OK:
        # What the sampler leaves in an INVALID row's selected logprob.
        value = np.float32(np.nan if status == ROW_INVALID else -1.5)
        return Row(status, False, None, np.zeros(0, np.float32) if support
                   else np.array([value], np.float32))
    assert size is not None
    ids = np.sort(rng.choice(vocab, size, replace=False)).astype(np.int32)
    logprobs = (rng.standard_normal(size if support else 1) - 3).astype(np.float32)
    return Row(ROW_OK, bitmask, ids, logprobs)


def bitmask_words(ids: np.ndarray, vocab: int) -> np.ndarray:
    words = np.zeros(-(-vocab // 32), np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def build(rows: list[Row], mode: str, vocab: int, record=None) -> Chunk:
    lengths = np.array([0 if r.ids is None else r.ids.size for r in rows], np.int32)
    flags = np.array([r.status | (ROW_BITMASK if r.bitmask else 0) for r in rows], np.uint8)
    data = [np.zeros(0, np.int32)]
    for r in rows:
        if r.ids is not None:
            data.append(bitmask_words(r.ids, vocab) if r.bitmask else r.ids)
    logprobs = np.concatenate([np.zeros(0, np.float32)] + [r.logprobs for r in rows])
    return Chunk(MODES[mode], lengths, np.concatenate(data), logprobs, record, flags=flags,
                 vocab=vocab)


def oracle_lists(rows: list[Row], mode: str) -> tuple[list, list]:
    ids = [None if r.ids is None else [int(i) for i in r.ids] for r in rows]
    if mode == "support":
        logprobs = [None if r.ids is None else [float(x) for x in r.logprobs] for r in rows]
    else:
        logprobs = [None if r.ids is None else float(r.logprobs[0]) for r in rows]
    return ids, logprobs


def oracle_json(rows: list[Row], mode: str) -> bytes:
    ids, logprobs = oracle_lists(rows, mode)
    lengths = [None if r is None else len(r) for r in ids]
    return orjson.dumps(dict(zip(FIELDS, (ids, logprobs, lengths), strict=True)))


def check_against_oracle(chunk: Chunk, rows: list[Row], mode: str) -> None:
    ids, logprobs = oracle_lists(rows, mode)
    assert chunk.rows == len(rows)
    assert chunk.nnz == sum(len(r) for r in ids if r is not None)
    np.testing.assert_array_equal(chunk.status, [r.status for r in rows])
    assert chunk.to_lists() == (ids, logprobs)
    out = chunk.to_json(FIELDS)
    assert out == oracle_json(rows, mode)
    assert out == orjson.dumps(dict(zip(FIELDS, (*chunk.to_lists(), [
        None if r is None else len(r) for r in chunk.to_lists()[0]]), strict=True)))
    parsed = json.loads(out)
    assert parsed["ids"] == ids and parsed["lengths"] == [None if r is None else len(r)
                                                          for r in ids]
    flat_ids, offsets = chunk.csr()
    assert flat_ids.dtype == np.int32 and offsets.dtype == np.int64
    np.testing.assert_array_equal(flat_ids, np.concatenate(
        [np.zeros(0, np.int32)] + [r.ids for r in rows if r.ids is not None]))
    np.testing.assert_array_equal(offsets, np.cumsum([0] + [0 if r is None else len(r)
                                                            for r in ids]))
    for i, row in enumerate(rows):
        if row.ids is None:
            with pytest.raises(shmask.RowDroppedError) as raised:
                chunk.row(i)
            assert raised.value.row == i and raised.value.status == row.status
            continue
        got_ids, got_logprobs = chunk.row(i)
        assert got_ids.dtype == np.int32
        np.testing.assert_array_equal(got_ids, row.ids)
        if mode == "support":
            np.testing.assert_array_equal(got_logprobs, row.logprobs)
        else:
            assert got_logprobs == float(row.logprobs[0])


@pytest.mark.parametrize("mode", ["support", "selected"])
@pytest.mark.parametrize("vocab", [33, 70, 1000, 65_537, 151_936])
def test_edge_sizes_in_both_forms(mode, vocab):
    rng = np.random.default_rng(vocab)
    support = mode == "support"
    rows = [make_row(rng, vocab, support, 0), make_row(rng, vocab, support, 1),
            make_row(rng, vocab, support, 0, bitmask=True),
            make_row(rng, vocab, support, 1, bitmask=True),
            make_row(rng, vocab, support, vocab, bitmask=True),  # the whole vocabulary
            make_row(rng, vocab, support, vocab // 2, bitmask=True),
            make_row(rng, vocab, support, 5)]
    # The first and last ids of the vocabulary, in both forms.
    edges = np.array([0, vocab - 1], np.int32)
    rows.append(rows[-1]._replace(ids=edges, logprobs=rows[-1].logprobs[:2 if support else 1]))
    rows.append(rows[-1]._replace(bitmask=True))
    chunk = build(rows, mode, vocab)
    words = -(-vocab // 32)
    assert np.diff(chunk.word_offsets).tolist() == [
        words if r.bitmask else r.ids.size for r in rows]
    check_against_oracle(chunk, rows, mode)


def random_rows(rng, vocab: int, support: bool, count: int) -> list[Row]:
    rows = []
    for kind in rng.integers(0, 4, count):
        if kind == 0:
            rows.append(make_row(rng, vocab, support, int(rng.integers(0, 40))))
        elif kind == 1:
            rows.append(make_row(rng, vocab, support, int(rng.integers(0, vocab + 1)),
                                 bitmask=True))
        else:
            rows.append(make_row(rng, vocab, support, None,
                                 status=ROW_OVERFLOW if kind == 2 else ROW_INVALID))
    return rows


@pytest.mark.parametrize("mode", ["support", "selected"])
@pytest.mark.parametrize("vocab", [70, 1000, 70_001])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_rows_and_every_slice(mode, vocab, seed):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, vocab, mode == "support", 9)
    chunk = build(rows, mode, vocab)
    check_against_oracle(chunk, rows, mode)
    # Every slice where rows are small; a few where bitmask rows run to 70k ids.
    bounds = range(len(rows) + 1) if vocab < 10_000 else (0, 4, len(rows))
    for start in bounds:
        for stop in (b for b in bounds if b >= start):
            piece = chunk.slice(start, stop)
            assert piece.vocab == vocab
            if any(r.status or r.bitmask for r in rows[start:stop]):
                np.testing.assert_array_equal(piece.flags, chunk.flags[start:stop])
            else:
                assert piece.flags is None  # plain rows: the plain fast paths
            check_against_oracle(piece, rows[start:stop], mode)
    with pytest.raises(shmask.ShmaskError):
        chunk.slice(0, 2).release()


@pytest.mark.parametrize("mode", ["support", "selected"])
@pytest.mark.parametrize("width", [3, 300])  # to_json's two paths: split natively, per row
@pytest.mark.parametrize("dropped", [[0], [4], [2, 3], [0, 1, 2, 3, 4]])
def test_json_marks_dropped_rows_null_on_both_paths(mode, width, dropped):
    rng = np.random.default_rng(width)
    support = mode == "support"
    rows = [make_row(rng, 1000, support, None, status=ROW_OVERFLOW if i % 2 else ROW_INVALID)
            if i in dropped else make_row(rng, 1000, support, width, bitmask=i == 1)
            for i in range(5)]
    check_against_oracle(build(rows, mode, 1000), rows, mode)


def test_a_dropped_row_is_never_an_empty_row():
    rng = np.random.default_rng(0)
    rows = [make_row(rng, 100, True, 0), make_row(rng, 100, True, None, status=ROW_OVERFLOW),
            make_row(rng, 100, True, None, status=ROW_INVALID)]
    chunk = build(rows, "support", 100)
    assert chunk.to_lists() == ([[], None, None], [[], None, None])
    assert json.loads(chunk.to_json()) == {"mask_ids": [[], None, None],
                                           "mask_logprobs": [[], None, None],
                                           "mask_lengths": [0, None, None]}
    assert chunk.row(0)[0].size == 0
    with pytest.raises(shmask.RowDroppedError, match=r"row 1 .*OVERFLOW") as raised:
        chunk.row(1)
    assert isinstance(raised.value, shmask.ShmaskError)
    with pytest.raises(shmask.RowDroppedError, match=r"row 2 .*INVALID"):
        chunk.row(-1)
    with pytest.raises(shmask.RowDroppedError, match="row 2"):
        chunk.check_rows(2)
    chunk.check_rows(0, 1)
    again = pickle.loads(pickle.dumps(raised.value))
    assert (str(again), again.row, again.status) == (str(raised.value), 1, ROW_OVERFLOW)


def test_selected_mode_invalid_rows_lose_their_logprob():
    rng = np.random.default_rng(1)
    rows = [make_row(rng, 50, False, 3), make_row(rng, 50, False, None, status=ROW_INVALID),
            make_row(rng, 50, False, None, status=ROW_OVERFLOW)]
    chunk = build(rows, "selected", 50)
    assert np.isnan(chunk.logprobs[1]) and chunk.logprobs[2] == -1.5  # what was sent
    assert chunk.to_lists()[1] == [float(rows[0].logprobs[0]), None, None]
    assert json.loads(chunk.to_json(FIELDS))["logprobs"] == chunk.to_lists()[1]


def test_plain_chunks_keep_their_views():
    ids = np.array([1, 5, 2], np.int32)
    lengths = np.array([2, 1], np.int32)
    for flags in (None, np.zeros(2, np.uint8)):
        chunk = Chunk(MODE_SUPPORT, lengths, ids, np.zeros(3, np.float32), None, flags=flags)
        assert chunk.flags is None
        flat, offsets = chunk.csr()
        assert flat is chunk.ids and offsets is chunk.offsets and chunk.word_offsets is offsets
        assert chunk.status.tolist() == [0, 0] and chunk.nnz == 3
        assert chunk.row(0)[0].base is not None  # a view
        assert chunk.to_json(FIELDS) == orjson.dumps(
            {"ids": [[1, 5], [2]], "logprobs": [[0.0, 0.0], [0.0]], "lengths": [2, 1]})
    # Dropped rows but no bitmask: the ids need no decoding, so no copy either.
    rng = np.random.default_rng(2)
    rows = [make_row(rng, 64, True, 4), make_row(rng, 64, True, None, status=ROW_OVERFLOW)]
    chunk = build(rows, "support", 64)
    assert chunk.csr()[0] is chunk.ids


@pytest.mark.parametrize("rewrite", ["extra_bit", "missing_bit", "bit_past_vocab"])
def test_rows_rewritten_after_validation_fail_cleanly(rewrite):
    """Rows live in shared memory: if they change after the reader checked
    them, decoding raises ShmaskError instead of writing past its buffer or
    pairing ids with the wrong logprobs."""
    rng = np.random.default_rng(3)
    rows = [make_row(rng, 70, True, 5, bitmask=True), make_row(rng, 70, True, 3)]
    chunk = build(rows, "support", 70)
    support = chunk.row(0)[0].tolist()
    ids = chunk.ids.view(np.uint32).copy()  # the bitmask row's 3 words come first
    if rewrite == "extra_bit":
        extra = min(set(range(70)) - set(support))
        ids[extra // 32] |= np.uint32(1 << extra % 32)
    elif rewrite == "missing_bit":
        ids[support[0] // 32] &= ~np.uint32(1 << support[0] % 32)
    else:
        ids[2] |= np.uint32(1 << 10)  # id 74 >= vocab 70
    ids = ids.view(np.int32)
    forged = shmask.Chunk(chunk.mode, chunk.lengths, ids, chunk.logprobs, None,
                          flags=chunk.flags, vocab=70)
    with pytest.raises(shmask.ShmaskError, match="changed after they were checked"):
        forged.csr()
    with pytest.raises(shmask.ShmaskError, match="changed after they were checked"):
        forged.row(0)


class _Record:
    """A ring record that the test reclaims at will."""

    def __init__(self) -> None:
        self.reclaimed = False

    def check(self) -> None:
        if self.reclaimed:
            raise shmask.StaleChunkError("reclaimed (test)")

    def release(self) -> None:
        pass


def test_decoding_a_reclaimed_record_says_so():
    rng = np.random.default_rng(4)
    rows = [make_row(rng, 300, True, 200, bitmask=True), make_row(rng, 300, True, 2)]
    record = _Record()
    chunk = build(rows, "support", 300, record)
    record.reclaimed = True
    for read in (chunk.csr, lambda: chunk.row(0), chunk.to_lists, chunk.to_json):
        with pytest.raises(shmask.StaleChunkError):
            read()
    # Row data overwritten by the next record: a shape the decoder cannot
    # use is reported as the reclaim it is, not as a numpy error.
    record = _Record()
    chunk = build(rows, "support", 300, record)
    chunk.ids = chunk.ids[:5]
    record.reclaimed = True
    with pytest.raises(shmask.StaleChunkError):
        chunk.csr()


# ------------------------------------------------------------ SGLang

def sglang_meta(rows: list[Row], mode: str, start: int = 0) -> bytes:
    ids, logprobs = oracle_lists(rows, mode)
    return orjson.dumps({sglang_adapter.MASK_FIELD: ids[start:],
                         sglang_adapter.LOGPROBS_FIELD: logprobs[start:],
                         sglang_adapter.LENGTH_FIELD: len(ids)})


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_sglang_json_and_lists_of_mixed_chunks(mode):
    rng = np.random.default_rng(5)
    support = mode == "support"
    accumulated = sglang_adapter.SamplingMaskJSON(support)
    every: list[Row] = []
    for emission in range(4):
        rows = random_rows(rng, 500, support, 5)
        if emission == 2:  # one plain emission between mixed ones
            rows = [make_row(rng, 500, support, 4) for _ in range(3)]
        every += rows
        accumulated.extend(build(rows, mode, 500))
        assert orjson.dumps(sglang_adapter.response_meta_info(accumulated)) == sglang_meta(
            every, mode)
        for start in range(len(every) + 1):  # incremental streaming, inside emissions too
            got = orjson.dumps(sglang_adapter.response_meta_info(accumulated, start=start))
            assert got == sglang_meta(every, mode, start), start

    rows = random_rows(rng, 500, support, 6)
    chunk = sglang_adapter.SamplingMaskChunk(b"")
    chunk.rows_ = build(rows, mode, 500)  # opened: what _open() would have read
    np.testing.assert_array_equal(chunk.status, [r.status for r in rows])
    np.testing.assert_array_equal(chunk.token_ids, np.concatenate(
        [np.zeros(0, np.int32)] + [r.ids for r in rows if r.ids is not None]))
    ids_json, logprobs_json, count = sglang_adapter._json_parts(chunk.rows_)
    assert (orjson.loads(ids_json), orjson.loads(logprobs_json)) == oracle_lists(rows, mode)
    assert count == len(rows)
    assert chunk.to_lists(support_logprobs=support) == oracle_lists(rows, mode)
    assert chunk.rows_ is False  # released


def test_sglang_plain_chunks_take_the_uniform_path():
    chunk = Chunk(MODE_SELECTED, np.array([2, 2], np.int32), np.array([1, 2, 3, 4], np.int32),
                  np.array([-1.0, -2.0], np.float32), None)
    assert sglang_adapter._json_parts(chunk) == (b"[[1,2],[3,4]]", b"[-1.0,-2.0]", 2)


# -------------------------------------------------------------- vLLM

class _Reader:
    """Opens the chunks the test built, by ring position."""

    def __init__(self, chunks: dict[int, tuple[list[Row], int]]) -> None:
        self.chunks = chunks
        self.config = shmask.Config()  # the resolver reads SHMASK_MASK_FORMAT from it

    def open(self, ref: ChunkRef) -> Chunk:
        rows, vocab = self.chunks[ref.position]
        return build(rows, "selected", vocab)  # vLLM masks: selected mode, no values

    def copy_rows(self, batch, keep):
        """Copies none at once (its chunks live in no ring): each is opened."""
        n = len(batch)
        return (np.zeros(0, np.int32), np.zeros(n, np.int64), np.zeros(n + 1, np.int64),
                np.zeros(0, np.int32), np.zeros(n, bool))

    def close(self) -> None:
        pass


class _Output:
    def __init__(self, request_id: str, mask) -> None:
        self.request_id = request_id
        self.new_sampling_mask = mask


def vllm_ref(position: int, rows: int, kept: int | None = None):
    ref = ChunkRef(KIND_SHM, MODE_SELECTED, "shmtestforms", 1, position, 4096, rows, 0, None)
    token_ids = np.frombuffer(ref.to_bytes(), vllm_adapter.REF_DTYPE)
    return vllm_adapter._MaskLists(token_ids, None, None if kept is None else [0, kept])


def test_vllm_resolves_bitmask_rows_and_fails_only_a_dropped_rows_output():
    rng = np.random.default_rng(6)
    vocab = 151_936
    whole = make_row(rng, vocab, False, vocab, bitmask=True)  # temperature-only sampling
    wide = make_row(rng, vocab, False, 20_000, bitmask=True)
    narrow = make_row(rng, vocab, False, 30)
    dropped = make_row(rng, vocab, False, None, status=ROW_OVERFLOW)
    chunks = {64: ([whole], vocab), 128: ([narrow, wide, narrow], vocab),
              192: ([narrow, dropped], vocab), 256: ([wide, dropped], vocab)}
    resolver = vllm_adapter.MaskResolver(_Reader(chunks), mask_lists=vllm_adapter._MaskLists)

    got = resolver.resolve(vllm_ref(64, 1))
    assert got.offsets is None and got.token_ids.dtype == np.int32
    np.testing.assert_array_equal(got.token_ids, np.arange(vocab))
    got = resolver.resolve(vllm_ref(128, 3))
    assert got.to_nested_list() == [narrow.ids.tolist(), wide.ids.tolist(), narrow.ids.tolist()]
    assert resolver.resolve(vllm_ref(256, 2, kept=1)).to_nested_list() == [wide.ids.tolist()]
    with pytest.raises(shmask.RowDroppedError, match="row 1 .*OVERFLOW"):
        resolver.resolve(vllm_ref(192, 2))

    outputs = [_Output("a", vllm_ref(128, 3)), _Output("b", vllm_ref(192, 2)),
               _Output("c", vllm_ref(256, 2, kept=1)), _Output("d", vllm_ref(256, 2))]
    assert resolver.resolve_outputs(outputs) == ["b", "d"]  # failed, to be aborted
    assert outputs[0].new_sampling_mask.to_nested_list()[1] == wide.ids.tolist()
    assert outputs[1].new_sampling_mask is None  # its row 1 was never sent: its request fails
    assert outputs[1].finish_reason == 3 and "RowDroppedError" in outputs[1].error.message
    assert outputs[2].new_sampling_mask.to_nested_list() == [wide.ids.tolist()]
    assert outputs[3].new_sampling_mask is None

"""The native response writer (shmask.response_json, native/response_json.c)
against orjson, the writer SGLang uses: every float32 value widened to a
Python float must come out byte for byte as orjson.dumps writes it, and a
chunk's three response arrays as orjson.dumps of to_lists()'s lists.

The sampled sweep here covers a few million float32 bit patterns spread over
all 2^32; `make test-exhaustive` (tests/exhaustive_float_json.py) checks
every one of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from conftest import forked_answer

import shmask
from shmask._native import lib
from shmask.chunk import ROW_INVALID, ROW_OK, ROW_OVERFLOW
from shmask.config import JSON_THREADS_MAX
from shmask.response_json import avx512, float_json, response_arrays

ROOT = Path(__file__).resolve().parent.parent
BITMASK_FORM = 1


def avx512_listed() -> bool:
    """Whether /proc/cpuinfo lists what the eight-at-a-time conversion needs."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512dq", "avx512bw", "avx512cd", "avx512vl"))


@pytest.fixture(params=["one_by_one", "avx512"])
def simd_path(request):
    """Each float and id test runs on both conversions: one value at a
    time, and eight at a time in AVX-512 lanes (where the CPU has it)."""
    before = avx512()
    wanted = request.param == "avx512"
    if avx512(wanted) != wanted:
        pytest.skip("this CPU has no AVX-512: only the one-by-one conversion runs here")
    yield request.param
    avx512(before)


def test_avx512_conversion_is_chosen_where_the_cpu_has_it():
    """Where the CPU lists AVX-512, the writer uses it by default (a
    dispatch that silently stayed scalar would pass every other test);
    SHMASK_JSON_SIMD=off turns it off."""
    code = "from shmask.response_json import avx512; print(avx512())"
    for setting, expected in ((None, avx512_listed()), ("off", False), ("on", avx512_listed())):
        env = {k: v for k, v in os.environ.items() if k != "SHMASK_JSON_SIMD"}
        if setting is not None:
            env["SHMASK_JSON_SIMD"] = setting
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=120, env=env)
        assert out.stdout.strip() == str(expected), setting


def orjson_floats(values: np.ndarray) -> bytes:
    """What SGLang writes: orjson.dumps of the values as Python floats."""
    with np.errstate(invalid="ignore"):  # signalling NaNs widen quietly
        return orjson.dumps(values.astype(np.float32).astype(np.float64).tolist())


def from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)


def assert_same_floats(values: np.ndarray) -> None:
    ours, theirs = float_json(values), orjson_floats(values)
    if ours != theirs:  # name the first value that differs
        mine, want = ours[1:-1].split(b","), theirs[1:-1].split(b",")
        index = next(i for i, (a, b) in enumerate(zip(mine, want, strict=True)) if a != b)
        bits = int(values[index:index + 1].view(np.uint32)[0])
        pytest.fail(f"float32 0x{bits:08x}: wrote {mine[index]!r}, orjson {want[index]!r}")


def special_values() -> np.ndarray:
    """Every class of value, each with its neighbours one ulp away, both signs."""
    bits = [0, 1, 2, 3, 0x007FFFFF, 0x007FFFFE, 0x00800000, 0x00800001, 0x7F7FFFFF, 0x7F7FFFFE,
            0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x3F800000, 0x3DCCCCCD]
    bits += [1 << b for b in range(23)]  # subnormal powers of two
    bits += [e << 23 for e in range(1, 255)]  # normal powers of two
    tens = [np.float32(10.0**e) for e in range(-45, 39)]  # nearest float32 to each 10^e
    # Where orjson switches layout (1e-5 | 1e-6 and 1e15 | 1e16) and every
    # other decade, a few ulps either side; and 2^n - 1 ulp (the gap below a
    # power of two is half the gap above).
    for ten in tens:
        centre = int(np.array([ten], np.float32).view(np.uint32)[0])
        bits += list(range(max(0, centre - 3), centre + 4))
    bits += [(e << 23) - 1 for e in range(1, 256)]
    bits += [int(np.array([v], np.float32).view(np.uint32)[0]) for v in
             (0.1, 0.2, 0.3, 1 / 3, 2 / 3, 1e-5, 9.999999e-6, 1.0000001e-5, 1e16, 9.999999e15,
              1.0000001e16, 123456.78, 16777216.0, 16777215.0, 3.4028235e38, 1.1754944e-38)]
    positive = np.array(sorted(set(bits)), np.uint32)
    return np.concatenate([positive, positive | np.uint32(0x80000000)]).view(np.float32)


def test_special_values_match_orjson(simd_path):
    values = special_values()
    assert_same_floats(values)
    text = float_json(values)
    assert text.startswith(b"[0.0,") and b",-0.0," in text and b"null" in text


@pytest.mark.parametrize("value,expected", [
    (0.0, b"0.0"), (-0.0, b"-0.0"), (1.0, b"1.0"), (-2.5, b"-2.5"), (2.0**49, b"562949953421312.0"),
    (2.0**53, b"9007199254740992.0"), (2.0**54, b"1.8014398509481984e+16"),
    (2.0**-16, b"0.0000152587890625"), (2.0**-17, b"7.62939453125e-6"),
    (2.0**-20, b"9.5367431640625e-7"), (2.0**60, b"1.152921504606847e+18"),
    (float("nan"), b"null"), (float("inf"), b"null"), (float("-inf"), b"null"),
    (np.float32(0.1), b"0.10000000149011612"), (2.0**-149, b"1.401298464324817e-45"),
])
def test_orjson_layouts(value, expected, simd_path):
    """The layouts orjson uses, written out (plain between 1e-5 and 1e16,
    "e+"/"e-" exponents outside; null for NaN and infinities)."""
    values = np.array([value], np.float32)
    assert float_json(values) == b"[" + expected + b"]" == orjson_floats(values)


def test_sampled_float32_bit_patterns_match_orjson(simd_path):
    """Bit patterns at a fixed odd stride over all 2^32 (every exponent and
    sign, mantissas all over), plus random ones: about 3 million values."""
    stride = 2039
    start = int(np.random.default_rng().integers(stride))
    rng = np.random.default_rng(start)
    sweep = np.arange(start, 2**32, stride, dtype=np.uint64)
    random = rng.integers(0, 2**32, 2**19, dtype=np.uint64)
    for part in (*np.array_split(sweep, 8), random):
        values = from_bits(part)
        assert_same_floats(values)
        longest = max(len(v) for v in float_json(values)[1:-1].split(b","))
        assert longest <= lib.SHM_JSON_FLOAT_BYTES


def test_every_length_and_lane_mix_matches_orjson(simd_path):
    """Runs of every length from 0 to 41 (blocks of eight, then the tail),
    starting at every offset, with values that leave the fast lanes (zeros,
    NaN, subnormals, extremes) in random lanes among logprobs."""
    rng = np.random.default_rng()
    specials = special_values()
    logprobs = (rng.standard_normal(4096) * 4 - 5).astype(np.float32)
    mixed = logprobs.copy()
    lanes = rng.choice(mixed.size, 600, replace=False)
    mixed[lanes] = rng.choice(specials, lanes.size)
    for values in (logprobs, mixed):
        for length in range(42):
            for offset in (0, 1, 5, 8):
                assert_same_floats(values[offset:offset + length])
        assert_same_floats(values)


def test_response_json_tables_are_generated_and_current():
    """The constants the C code uses come from the generator, unedited."""
    subprocess.run([sys.executable, str(ROOT / "native" / "gen_response_json_tables.py"),
                    "--check"], check=True, timeout=120)


# ------------------------------------------------------------------ chunks

def expected_arrays(chunk: shmask.Chunk) -> tuple[bytes, bytes, bytes]:
    """orjson.dumps of the lists SGLang builds, lengths null where a row is dropped."""
    ids, logprobs = chunk.to_lists()
    lengths = [None if row is None else len(row) for row in ids]
    return orjson.dumps(ids), orjson.dumps(logprobs), orjson.dumps(lengths)


def publish_rows(writer: shmask.Writer, mode: str, rows: list[dict], vocab: int):
    """One queue's rows, appended one step per row like a decode loop, as a ref."""
    queue = writer.open_queue(mode)
    for row in rows:
        ids = row["ids"]
        data = ids if row["form"] == 0 else bitmask(ids, vocab)
        values = row["values"] if mode == "support" else np.array([row["selected"]], np.float32)
        writer.append_step(np.array([queue.handle], np.int64),
                           np.array([ids.size], np.int32), data, values,
                           status=np.array([row["status"]], np.int32),
                           forms=np.array([row["form"]], np.int32), vocab=vocab)
    ref = writer.take_batch([queue])[0]
    queue.close()
    return ref


def bitmask(ids: np.ndarray, vocab: int) -> np.ndarray:
    words = np.zeros(-(-vocab // 32), np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def random_rows(rng, count: int, vocab: int, width: int, dropped: float = 0.2,
                bitmasks: float = 0.2) -> list[dict]:
    """Rows of 0..width ids with logprobs drawn from every float class (a
    random bit pattern now and then: NaN, infinities, subnormals)."""
    rows = []
    for _ in range(count):
        if rng.random() < dropped:
            status = int(rng.choice([ROW_OVERFLOW, ROW_INVALID]))
            rows.append({"status": status, "form": 0, "ids": np.zeros(0, np.int32),
                         "values": np.zeros(0, np.float32), "selected": np.float32(np.nan)})
            continue
        size = int(rng.integers(0, width + 1))
        ids = np.sort(rng.choice(vocab, size, replace=False)).astype(np.int32)
        values = (rng.standard_normal(size) * 10.0 ** rng.integers(-8, 8)).astype(np.float32)
        odd = rng.random(size) < 0.05
        values[odd] = from_bits(rng.integers(0, 2**32, int(odd.sum()), dtype=np.uint64))
        rows.append({"status": ROW_OK, "form": BITMASK_FORM if rng.random() < bitmasks else 0,
                     "ids": ids, "values": values,
                     "selected": from_bits(rng.integers(0, 2**32, 1, dtype=np.uint64))[0]})
    return rows


@pytest.mark.parametrize("mode", ["support", "selected"])
@pytest.mark.parametrize("shape", ["empty", "one_empty_row", "all_dropped", "short", "long"])
def test_chunks_match_orjson_of_their_lists(writer, reader, mode, shape):
    """Nested rows, null rows, bitmask rows, empty rows and empty chunks,
    through a real ring: json_arrays and to_json as orjson writes the lists."""
    rng = np.random.default_rng(len(shape) + len(mode))
    vocab = 3000
    rows = {"empty": [],
            "one_empty_row": random_rows(rng, 1, vocab, 0, dropped=0),
            "all_dropped": random_rows(rng, 4, vocab, 5, dropped=1),
            "short": random_rows(rng, 40, vocab, 6),
            "long": random_rows(rng, 6, vocab, 400)}[shape]
    with reader.open(publish_rows(writer, mode, rows, vocab)) as chunk:
        assert chunk.rows == len(rows)
        expected = expected_arrays(chunk)
        assert chunk.json_arrays() == expected
        ids, logprobs, lengths = expected
        assert chunk.to_json(("a", "b", "c")) == b'{"a":%s,"b":%s,"c":%s}' % expected
        assert chunk.to_json() == orjson.dumps({"mask_ids": orjson.Fragment(ids),
                                                "mask_logprobs": orjson.Fragment(logprobs),
                                                "mask_lengths": orjson.Fragment(lengths)})


def test_native_response_writer_matches_orjson_with_threads_on_and_off(writer, reader):
    """Issue 18, item 1: a chunk big enough to be split across threads
    (support mode, some rows dropped, random float classes) gives the bytes
    orjson writes for its lists, whatever the number of threads."""
    rng = np.random.default_rng(18)
    rows = random_rows(rng, 150, 151_936, 1000, dropped=0.1, bitmasks=0)
    with reader.open(publish_rows(writer, "support", rows, 151_936)) as chunk:
        assert chunk.nnz > 8 * 4096  # enough work for several threads (4096 entries each)
        expected = expected_arrays(chunk)
        for threads in (1, 2, 3, 4, 7, JSON_THREADS_MAX):
            assert chunk.json_arrays(threads) == expected, threads


def test_threads_split_rows_of_any_size_the_same_way():
    """One huge row among empty ones, and many tiny rows: every split gives
    the same bytes (parts may be empty)."""
    rng = np.random.default_rng(5)
    for lengths in ([0, 0, 200_000, 0, 1], [1] * 70_000, [70_000], [0] * 50_000):
        lengths = np.array(lengths, np.int32)
        ids = rng.integers(0, 2**31, int(lengths.sum()), dtype=np.int64).astype(np.int32)
        logprobs = from_bits(rng.integers(0, 2**32, ids.size, dtype=np.uint64))
        flags = np.zeros(lengths.size, np.uint8)
        flags[(lengths == 0) & (np.arange(lengths.size) % 3 == 0)] = ROW_OVERFLOW
        one = response_arrays(True, lengths, flags, ids, logprobs, threads=1)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        rows_ids = [None if f else ids[a:b].tolist()
                    for f, a, b in zip(flags, bounds, bounds[1:], strict=False)]
        assert one[0] == orjson.dumps(rows_ids)
        for threads in (2, 4, JSON_THREADS_MAX):
            assert response_arrays(True, lengths, flags, ids, logprobs, threads=threads) == one


@pytest.mark.parametrize("case", ["negative", "too_few_ids", "too_many_ids", "logprobs",
                                  "dropped_row_with_ids", "dtype"])
def test_counts_that_disagree_are_refused(case):
    """Nothing is read past what the lengths say: bad counts raise, naming
    the rows, and nothing is written."""
    lengths = np.array([2, 0, 1], np.int32)
    ids = np.array([4, 9, 2], np.int32)
    logprobs = np.zeros(3, np.float32)
    flags = np.array([0, ROW_INVALID, 0], np.uint8)
    if case == "negative":
        lengths = np.array([2, -1, 2], np.int32)
    elif case == "too_few_ids":
        ids = ids[:2]
    elif case == "too_many_ids":
        ids = np.zeros(4, np.int32)
    elif case == "logprobs":
        logprobs = logprobs[:2]
    elif case == "dropped_row_with_ids":
        flags = np.array([ROW_OVERFLOW, 0, 0], np.uint8)
    else:
        logprobs = logprobs.astype(np.float64)
    with pytest.raises(shmask.ShmaskError, match="response JSON"):
        response_arrays(True, lengths, flags, ids, logprobs)
    if case == "negative":
        return
    good = response_arrays(True, np.array([2, 0, 1], np.int32), np.array([0, ROW_INVALID, 0],
                           np.uint8), np.array([4, 9, 2], np.int32), np.zeros(3, np.float32))
    assert good == (b"[[4,9],null,[2]]", b"[[0.0,0.0],null,[0.0]]", b"[2,null,1]")


def test_json_threads_setting():
    assert JSON_THREADS_MAX == lib.SHM_JSON_MAX_THREADS
    assert 1 <= shmask.Config().json_threads <= 4
    assert shmask.Config.from_env({"SHMASK_JSON_THREADS": "1"}).json_threads == 1
    assert shmask.Config.from_env({"SHMASK_JSON_THREADS": "16"}).json_threads == 16


def test_ids_of_every_length_and_digit_group_match_orjson(simd_path):
    """Ids are written from digit words, two at a time (one SSE2 vector for
    both) or eight at a time (AVX-512, one word per id below 10^7):
    0..99_999 covers every 4-digit group in the low half and every length
    to 5, then every length to 10, the 10^7 and 10^8 edges where a word no
    longer holds them, each in every place of a block of eight; then rows
    of every length to 20 (the tail after the blocks). (Negative ids are
    refused: tests/test_api_types.py.)"""
    rng = np.random.default_rng(8)
    edges = [10**e + d for e in range(11) for d in (-1, 0, 1) if 10**e + d < 2**31]
    values = np.concatenate([
        np.arange(100_000), np.arange(0, 10**8, 9_973), np.array(edges),
        rng.integers(0, 2**31, 50_000), [0, 2**31 - 1, 99_999_999, 100_000_000],
    ]).astype(np.int32)
    for offset in range(8):  # each value in every place of a pair and of a block
        row = values[offset:]
        lengths = np.array([row.size], np.int32)
        ids_json, _, lengths_json = response_arrays(True, lengths, None, row,
                                                    np.zeros(row.size, np.float32), threads=1)
        assert ids_json == orjson.dumps([row.tolist()])
        assert lengths_json == orjson.dumps([row.size])
    lengths = np.arange(21, dtype=np.int32)
    rows = rng.choice(values, int(lengths.sum()))
    ids_json, _, _ = response_arrays(True, lengths, None, rows, np.zeros(rows.size, np.float32),
                                     threads=1)
    ends = np.cumsum(lengths)
    assert ids_json == orjson.dumps([rows[e - n:e].tolist() for n, e in zip(lengths, ends, strict=True)])


def test_concurrent_callers_share_the_thread_pool():
    """Python threads calling the writer at once (the GIL released) hand
    parts to the same workers: every caller gets its own bytes."""
    import concurrent.futures

    rng = np.random.default_rng(9)
    jobs = []
    for index in range(8):
        lengths = rng.integers(0, 3000, 30).astype(np.int32)
        ids = rng.integers(0, 151_936, int(lengths.sum())).astype(np.int32)
        logprobs = from_bits(rng.integers(0, 2**32, ids.size, dtype=np.uint64))
        jobs.append((lengths, ids, logprobs, index % 5 + 2))
    expected = [response_arrays(True, lengths, None, ids, logprobs, threads=1)
                for lengths, ids, logprobs, _ in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(3):
            got = list(pool.map(lambda job: response_arrays(True, job[0], None, job[1], job[2],
                                                            threads=job[3]), jobs))
            assert got == expected


def test_thread_pool_works_in_a_forked_child():
    """A child forked after the workers started has none of them: its calls
    must still finish (the caller writes the parts no worker takes)."""
    rng = np.random.default_rng(10)
    lengths = np.full(40, 1000, np.int32)
    ids = rng.integers(0, 151_936, int(lengths.sum())).astype(np.int32)
    logprobs = rng.standard_normal(ids.size).astype(np.float32)
    expected = response_arrays(True, lengths, None, ids, logprobs, threads=8)  # workers started
    answer = forked_answer(lambda: b"same" if response_arrays(
        True, lengths, None, ids, logprobs, threads=8) == expected else b"diff")
    assert answer == b"same"


# ------------------------------------------------------- whole documents

def test_dumps_writes_rows_into_the_document_as_orjson_writes_the_lists(writer, reader):
    """Issue 18, item 1: response_json.dumps places a chunk's arrays where
    its holes are, around the rest of the document as orjson writes it
    (options and a caller's default kept), byte for byte what orjson writes
    with the lists, on one thread and many (the gather splits the copy)."""
    from shmask.response_json import RawJSON, dumps

    rng = np.random.default_rng(181)
    rows = random_rows(rng, 150, 151_936, 1000, dropped=0.1, bitmasks=0.1)
    with reader.open(publish_rows(writer, "support", rows, 151_936)) as chunk:
        ids, logprobs, lengths = expected_arrays(chunk)
        holes = chunk.json_rows()

        class Custom:
            pass

        def document(a, b, c, raw):
            return {"text": "x\u00e9\n", 3: [1.5, None], "meta_info": {
                "mask": a, "logprobs": b, "raw": raw, "lengths": c, "n": chunk.rows,
                "custom": Custom()}}

        def default(value):
            if isinstance(value, Custom):
                return "custom"
            raise TypeError

        expected = orjson.dumps(document(orjson.Fragment(ids), orjson.Fragment(logprobs),
                                         orjson.Fragment(lengths), [1, 2]),
                                option=orjson.OPT_NON_STR_KEYS, default=default)
        for threads in (1, 2, 5, JSON_THREADS_MAX):
            raw = RawJSON(b"[1,", memoryview(b"..2]")[2:])
            got = dumps(document(holes.ids, holes.logprobs, holes.lengths_field, raw),
                        option=orjson.OPT_NON_STR_KEYS, default=default, threads=threads)
            assert got == expected, threads
        assert len(expected) > 4 * (256 << 10)  # the gather is split across threads
        # Two chunks in one document: each written from its own rows.
        other_rows = random_rows(rng, 5, 3000, 7, dropped=0.2, bitmasks=0)
        with reader.open(publish_rows(writer, "selected", other_rows, 3000)) as other:
            theirs = other.json_rows()
            assert dumps([holes.ids, theirs.ids, theirs.logprobs, holes.lengths_field]) == (
                b"[%s,%s,%s,%s]" % (ids, *expected_arrays(other)[:2], lengths))
            assert chunk.to_json(("a", "b", "c")) == b'{"a":%s,"b":%s,"c":%s}' % (
                ids, logprobs, lengths)


def test_dumps_refuses_what_it_cannot_place(writer, reader):
    from shmask.response_json import dumps

    with pytest.raises(shmask.ShmaskError, match="NUL byte"):
        dumps({"a": orjson.Fragment(b'"\x00"')})
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps({"a": object()})
    # A dict cannot hold two fields of one name: to_json refuses rather than drop one.
    chunk = shmask.Chunk(shmask.refs.MODE_SUPPORT, np.zeros(0, np.int32), np.zeros(0, np.int32),
                         np.zeros(0, np.float32), None)
    with pytest.raises(ValueError, match="three distinct field names"):
        chunk.to_json(("a", "a", "c"))


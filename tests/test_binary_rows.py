"""Binary rows (shmask.binary_rows): chunks read out of a real ring, encoded
as the base64 object and decoded back to CSR arrays, compared with
Chunk.to_lists() (the JSON form's oracle) row by row: ids rows, bitmask rows,
dropped rows, both modes, accumulated across emissions with every start
offset; and every malformed field refused with an error naming it."""

from __future__ import annotations

import base64
import warnings

import numpy as np
import orjson
import pytest

import shmask
from shmask import binary_rows
from shmask.binary_rows import (
    BinaryRowsError,
    SamplingMaskBase64,
    decode_rows,
    encode_chunk,
    encode_meta_info,
    loads,
)
from shmask.refs import MODE_SELECTED, MODE_SUPPORT

OK, OVERFLOW, INVALID = 0, 1, 2
VOCAB = 2048 + 17  # bitmask rows of 65 words


def bitmask(ids: np.ndarray, vocab: int) -> np.ndarray:
    words = np.zeros((vocab + 31) // 32, np.uint32)
    for i in ids.tolist():
        words[i // 32] |= np.uint32(1 << (i % 32))
    return words.view(np.int32)


def step(rng: np.random.Generator, mode: str, rows: int) -> dict:
    """One step of `rows` rows: sizes 0..300, some as bitmasks, some dropped."""
    kinds = rng.choice(["ids", "empty", "bitmask", "overflow", "invalid"], rows,
                       p=[0.5, 0.1, 0.2, 0.1, 0.1])
    lengths, data, values, selected, status, forms = [], [], [], [], [], []
    for kind in kinds.tolist():
        size = 0 if kind in ("empty", "overflow", "invalid") else int(rng.integers(1, 300))
        ids = np.sort(rng.choice(VOCAB, size, replace=False)).astype(np.int32)
        lengths.append(size)
        data.append(bitmask(ids, VOCAB) if kind == "bitmask" else ids)
        values.append(rng.standard_normal(size).astype(np.float32))
        selected.append(np.float32(rng.standard_normal()))
        status.append({"overflow": OVERFLOW, "invalid": INVALID}.get(kind, OK))
        forms.append(1 if kind == "bitmask" else 0)
    return {"lengths": np.array(lengths, np.int32), "ids": np.concatenate(data),
            "logprobs": np.concatenate(values) if mode == "support"
            else np.array(selected, np.float32),
            "status": np.array(status, np.int32), "forms": np.array(forms, np.int32)}


def publish(writer: shmask.Writer, mode: str, steps: list[dict]) -> list:
    """One queue, `steps` appended, one emission: its refs."""
    queue = writer.open_queue(mode)
    for arrays in steps:
        rows = [queue] * arrays["lengths"].size  # the request's rows of one step
        writer.append_step(rows, arrays["lengths"], arrays["ids"], arrays["logprobs"],
                           status=arrays["status"], forms=arrays["forms"], vocab=VOCAB)
    batch = writer.take_batch([queue])
    queue.close()
    return list(batch)


def emission(writer, mode: str, rng, tokens: int) -> list:
    return publish(writer, mode, [step(rng, mode, 1) for _ in range(tokens)])


def lists_of(rows: binary_rows.BinaryRows) -> tuple[list, list]:
    """What to_lists gives, rebuilt from the decoded CSR arrays: None for a
    dropped row in both lists."""
    bounds = np.asarray(rows.offsets).tolist()
    flat_ids, flat_values = np.asarray(rows.ids).tolist(), np.asarray(rows.logprobs).tolist()
    dropped = np.asarray(rows.status).tolist()
    ids = [None if dropped[i] else flat_ids[a:b]
           for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    if rows.mode == "support":
        values = [None if dropped[i] else flat_values[a:b]
                  for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    else:
        values = [None if dropped[i] else v for i, v in enumerate(flat_values)]
    return ids, values


@pytest.fixture(params=["pybase64", "stdlib"])
def codec(request, monkeypatch):
    """Both codecs give the same bytes; the stdlib one runs everywhere."""
    if request.param == "stdlib":
        monkeypatch.setattr(binary_rows, "_pybase64", None)
    elif binary_rows._pybase64 is None:
        pytest.skip("pybase64 is not installed")
    return request.param


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_a_chunk_roundtrips_to_its_lists(writer, reader, codec, mode):
    rng = np.random.default_rng(7 if mode == "support" else 8)
    (ref,) = emission(writer, mode, rng, 40)
    with reader.open(ref) as chunk:
        assert chunk.flags is not None  # the mix holds bitmask and dropped rows
        expected, status, lengths = chunk.to_lists(), chunk.status, chunk.lengths.copy()
        obj = encode_chunk(chunk, start=5)
    # Embedded as the server does, parsed as a client does.
    parsed = orjson.loads(orjson.dumps({"a": 1, "output_token_sampling_mask":
                                        orjson.Fragment(obj)}))
    rows = decode_rows(parsed)
    assert (rows.mode, rows.start, rows.rows) == (mode, 5, 40)
    assert lists_of(rows) == expected
    np.testing.assert_array_equal(rows.status, status)
    np.testing.assert_array_equal(rows.lengths, lengths)
    assert rows.ids.dtype == np.int32 and rows.logprobs.dtype == np.float32
    assert rows.offsets.dtype == np.int64 and rows.status.dtype == np.uint8
    assert parsed["output_token_sampling_mask"]["status"]  # sent: some row is dropped


def test_dropped_rows_are_not_empty_rows(writer, reader, codec):
    lengths = np.array([0, 0, 0, 2], np.int32)
    arrays = {"lengths": lengths, "ids": np.array([3, 9], np.int32),
              "logprobs": np.array([-1.0, -2.0, -3.0, -4.0], np.float32),
              "status": np.array([OK, OVERFLOW, INVALID, OK], np.int32),
              "forms": np.zeros(4, np.int32)}
    (ref,) = publish(writer, "selected", [arrays])
    with reader.open(ref) as chunk:
        rows = decode_rows(encode_chunk(chunk))
    assert rows.status.tolist() == [OK, OVERFLOW, INVALID, OK]
    assert rows.lengths.tolist() == [0, 0, 0, 2]
    assert lists_of(rows) == ([[], None, None, [3, 9]], [-1.0, None, None, -4.0])
    assert np.isnan(rows.logprobs[1:3]).all()  # a dropped row's value is NaN, not -2.0


def test_all_ok_rows_send_no_status(writer, reader):
    arrays = {"lengths": np.array([1, 0], np.int32), "ids": np.array([4], np.int32),
              "logprobs": np.array([-0.5], np.float32), "status": np.zeros(2, np.int32),
              "forms": np.zeros(2, np.int32)}
    (ref,) = publish(writer, "support", [arrays])
    with reader.open(ref) as chunk:
        obj = orjson.loads(encode_chunk(chunk))
    assert "status" not in obj
    assert decode_rows(obj).status.tolist() == [0, 0]


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_accumulated_rows_at_every_start(writer, reader, codec, mode):
    """Three emissions of 7, 1 and 11 rows (byte sizes that are not
    multiples of 3, so the cached base64 prefix is cut mid-group); the
    cumulative object is asked for after each emission, and at the end every
    start offset gives rows [start:] of the concatenated lists."""
    rng = np.random.default_rng(11)
    masks = SamplingMaskBase64(mode == "support")
    all_ids: list = []
    all_values: list = []
    for tokens in (7, 1, 11):
        (ref,) = emission(writer, mode, rng, tokens)
        with reader.open(ref) as chunk:
            ids, values = chunk.to_lists()
            masks.extend(chunk)
        all_ids += ids
        all_values += values
        assert lists_of(decode_rows(masks.to_bytes())) == (all_ids, all_values)
    assert len(masks) == 19
    for start in range(0, 21):
        fields = masks.fields(start)
        assert fields["output_token_sampling_mask_length"] == 19
        rows = decode_rows(orjson.loads(orjson.dumps(fields)))
        assert rows.start == min(start, 19)
        assert lists_of(rows) == (all_ids[start:], all_values[start:]), start


def test_accumulator_refuses_another_mode(writer, reader):
    (ref,) = emission(writer, "selected", np.random.default_rng(1), 2)
    with reader.open(ref) as chunk, pytest.raises(BinaryRowsError, match="selected-mode"):
        SamplingMaskBase64(True).extend(chunk)


def test_torch_tensors_share_the_decoded_buffers(writer, reader, codec):
    torch = pytest.importorskip("torch")
    (ref,) = emission(writer, "support", np.random.default_rng(3), 9)
    with reader.open(ref) as chunk:
        obj = encode_chunk(chunk)
    arrays = decode_rows(obj)
    with warnings.catch_warnings():
        # torch.from_numpy warns for a read-only array (bytes-backed): the
        # decoder must hand it writable buffers, not copies.
        warnings.simplefilter("error")
        tensors = decode_rows(obj, torch=True)
    for name in ("lengths", "offsets", "ids", "logprobs", "status"):
        tensor, array = getattr(tensors, name), getattr(arrays, name)
        assert isinstance(tensor, torch.Tensor)
        np.testing.assert_array_equal(tensor.numpy(), array)
    assert tensors.ids.dtype == torch.int32 and tensors.logprobs.dtype == torch.float32


# ------------------------------------------------------------ malformed


def b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


def good() -> dict:
    return {"format": "base64", "version": 1, "mode": "support", "start": 0, "rows": 2, "nnz": 3,
            "lengths": b64(np.array([1, 2], "<i4")), "status": b64(np.array([0, 0], "u1")),
            "ids": b64(np.array([1, 2, 3], "<i4")), "logprobs": b64(np.zeros(3, "<f4"))}


BAD = [
    ("format", "json", "'format'"),
    ("version", 2, "'version'"),
    ("mode", "bitmask", "'mode'"),
    ("rows", -1, "'rows'"),
    ("nnz", True, "'nnz'"),
    ("start", "0", "'start'"),
    ("lengths", "AQAAAAIAA!A=", "'lengths' is not valid base64"),
    ("ids", b64(np.array([1, 2], "<i4")) + "AAAA", "'ids' is not valid base64"),  # data after "="
    ("lengths", b64(np.array([1, 2], "<i4"))[:-4], "'lengths' has 8 base64 characters"),
    ("lengths", b64(np.array([1, 1], "<i4")), "'lengths' sum to 2, 'nnz' is 3"),
    ("lengths", b64(np.array([-1, 4], "<i4")), "'lengths' has a negative length at row 0"),
    ("lengths", 12, "'lengths' must be a base64 string"),
    ("ids", b64(np.array([1, -2, 3], "<i4")), "'ids' has a negative id at 1"),
    ("ids", base64.b64encode(bytes(11)).decode(), "'ids' decodes to 11 bytes"),  # not 3 values
    ("logprobs", b64(np.zeros(2, "<f4")), "'logprobs' has 12 base64 characters"),
    ("logprobs", None, "'logprobs' must be a base64 string"),
    ("status", b64(np.array([0, 3], "u1")), "'status' has an unknown value 3"),
    ("status", b64(np.array([1, 0], "u1")), "row 0 is dropped"),
]


@pytest.mark.parametrize("codec_name", ["pybase64", "stdlib"])
@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_malformed_fields_are_named(monkeypatch, codec_name, field, value, message):
    if codec_name == "stdlib":
        monkeypatch.setattr(binary_rows, "_pybase64", None)
    elif binary_rows._pybase64 is None:
        pytest.skip("pybase64 is not installed")
    decode_rows(good())  # the unmodified object is fine
    obj = good()
    obj[field] = value
    with pytest.raises(BinaryRowsError, match=message.replace("(", r"\(")) as info:
        decode_rows(obj)
    assert isinstance(info.value, ValueError)


def test_not_an_object():
    with pytest.raises(BinaryRowsError, match="not JSON"):
        decode_rows(b"{")
    with pytest.raises(BinaryRowsError, match="expected a JSON object, got list"):
        decode_rows([1, 2])


def test_a_client_decodes_without_the_native_core_or_torch():
    """decode_rows and loads need numpy and orjson only: no compiled core,
    no torch unless tensors are asked for."""
    import subprocess
    import sys

    code = ("import sys, json; sys.modules['shmask._native'] = None; import shmask; "
            f"rows = shmask.decode_rows(json.loads({orjson.dumps(good()).decode()!r})); "
            "from shmask.binary_rows import loads; "
            f"doc = loads({orjson.dumps([good()])!r}); "
            "assert doc[0].ids.tolist() == rows.ids.tolist(); "
            "print(rows.ids.tolist(), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, start_new_session=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[1,", "2,", "3]", "False"]


def test_field_names_are_the_adapters():
    sglang = pytest.importorskip("shmask.adapters.sglang")
    assert (binary_rows.MASK_FIELD, binary_rows.LENGTH_FIELD) == (sglang.MASK_FIELD,
                                                                   sglang.LENGTH_FIELD)


# ------------------------------------------------ the compiled core's paths
# encode_meta_info / encode_chunk / loads run on the compiled core when it is
# built; `numpy_path` switches it off (the client without the core), which
# is the oracle: the same bytes, the same rows, the same refusals.

needs_core = pytest.mark.skipif(binary_rows._native() is None, reason="compiled core not built")


@pytest.fixture
def numpy_path(monkeypatch):
    """A function that runs its argument without the compiled core."""
    def run(function, *args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(binary_rows, "_native_core", False)
            return function(*args, **kwargs)
    return run


def old_meta_info(chunk, start, numpy_path) -> bytes:
    """What a server wrote before encode_meta_info: orjson around the
    numpy path's object."""
    obj = numpy_path(encode_chunk, chunk, start)
    return orjson.dumps({binary_rows.MASK_FIELD: orjson.Fragment(obj),
                         binary_rows.LENGTH_FIELD: start + chunk.rows})


def big_rows(rng, rows: int, width: int) -> tuple:
    """`rows` rows of `width` ids each (support mode): a chunk large enough
    that the encoder splits it across threads and takes its vector path."""
    lengths = np.full(rows, width, np.int32)
    ids = np.concatenate([np.sort(rng.choice(1 << 20, width, replace=False))
                          for _ in range(rows)]).astype(np.int32)
    return lengths, ids, rng.standard_normal(rows * width).astype(np.float32)


@needs_core
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mode", ["support", "selected"])
def test_native_bytes_are_the_numpy_paths(writer, reader, numpy_path, mode, threads):
    """Byte for byte the object and meta_info of the numpy path: bitmask
    and dropped rows (selected mode: NaN logprobs), every start offset
    width (so every digit count), one thread and several."""
    rng = np.random.default_rng(21 if mode == "support" else 22)
    (ref,) = emission(writer, mode, rng, 30)
    with reader.open(ref) as chunk:
        assert chunk.flags is not None and chunk.status.any()
        for start in (0, 7, 12345678901):
            expected = numpy_path(encode_chunk, chunk, start)
            assert encode_chunk(chunk, start, threads) == expected
            assert encode_meta_info(chunk, start, threads) == old_meta_info(chunk, start,
                                                                              numpy_path)
        assert encode_meta_info(chunk, 3, length=99).endswith(b',"output_token_sampling_mask_length":99}')


@needs_core
@pytest.mark.parametrize("threads", [1, 4])
def test_a_large_chunk_is_split_and_still_identical(writer, reader, numpy_path, threads):
    lengths, ids, logprobs = big_rows(np.random.default_rng(5), 40, 1500)
    ref = writer.publish(lengths, ids, logprobs, "support")
    with reader.open(ref) as chunk:
        got = encode_meta_info(chunk, threads=threads)
        assert got == old_meta_info(chunk, 0, numpy_path)
    rows = loads(got)[binary_rows.MASK_FIELD]
    np.testing.assert_array_equal(rows.ids, ids)
    np.testing.assert_array_equal(rows.logprobs.view(np.uint32), logprobs.view(np.uint32))


@needs_core
@pytest.mark.parametrize("use_avx512", [False, True])
def test_base64_of_every_size_and_split(use_avx512):
    """The encoder entry point for assemblers, and the decoder, against
    the stdlib codec: every length 0..200 (every tail, the vector paths'
    edges: 48-byte AVX-512 blocks, then 24-byte AVX2 ones, then scalar)
    and splits into up to 5 parts, and the decoder's sign report; with
    AVX-512 allowed and not."""
    from shmask.response_json import avx512
    before = avx512()
    if avx512(use_avx512) != use_avx512:
        pytest.skip("this CPU has no AVX-512: only the AVX2 and scalar encoders run here")
    try:
        check_base64_sizes()
    finally:
        avx512(before)


def check_base64_sizes():
    ffi, lib = binary_rows._native()
    rng = np.random.default_rng(9)
    for size in [*range(201), 3 * 40000 + 1, 3 * 40000 + 2]:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for threads in (1, 5):
            dst = bytearray(lib.shm_b64_encoded_size(size))
            lib.shm_b64_encode(ffi.from_buffer(data), size, ffi.from_buffer(dst), threads)
            assert bytes(dst) == base64.b64encode(data), (size, threads)
            out = bytearray(size + 1)
            results = np.empty(2, np.int64)
            spans = np.array([0, len(dst), 0, size], np.uint64)
            assert lib.shm_b64_decode(ffi.from_buffer(dst), len(dst),
                                      ffi.from_buffer("uint64_t[]", spans), 1,
                                      ffi.from_buffer(out), len(out),
                                      ffi.from_buffer("int64_t[]", results), threads) == 0
            assert results[0] == -1 and bytes(out[:size]) == data
            words = np.frombuffer(data[:size // 4 * 4], "<i4")
            assert bool(results[1]) == bool((words < 0).any())


@needs_core
@pytest.mark.parametrize("threads", [1, 5])
def test_the_decoder_finds_each_negative_word(threads):
    """The sign report looks at exactly the top byte of every int32 word:
    one negative word anywhere (the first, the last, on either side of a
    vector block's or a task's edge) is found; top bits in the other bytes
    are not a negative word."""
    ffi, lib = binary_rows._native()
    size = 4 * 3000 + 2  # a partial word at the end: never a whole int32
    positive = np.full(size, 0xFF, np.uint8)
    positive[3::4] = 0x7F  # every word's top byte without its sign bit
    text = base64.b64encode(positive.tobytes())
    spans = np.array([0, len(text), 0, size], np.uint64)
    out = bytearray(size)
    results = np.empty(2, np.int64)

    def negative(data):
        encoded = base64.b64encode(data.tobytes())
        assert lib.shm_b64_decode(ffi.from_buffer(encoded), len(encoded),
                                  ffi.from_buffer("uint64_t[]", spans), 1, ffi.from_buffer(out),
                                  size, ffi.from_buffer("int64_t[]", results), threads) == 0
        assert results[0] == -1 and bytes(out) == data.tobytes()
        return bool(results[1])

    assert not negative(positive)
    for word in (0, 1, 7, 8, 15, 16, 17, 31, 32, 63, 64, 375, 599, 600, 1499, 2999):
        data = positive.copy()
        data[4 * word + 3] = 0x80
        assert negative(data), word
    data = positive.copy()
    data[-1] = data[-2] = 0xFF  # the partial word: not an int32
    assert not negative(data)


# ------------------------------------------------------------ loads
def rows_key(rows: binary_rows.BinaryRows) -> tuple:
    """Everything a BinaryRows holds, comparable (floats by their bits)."""
    return (rows.mode, rows.start, *(np.asarray(getattr(rows, name)).tobytes()
                                     for name in ("lengths", "offsets", "ids", "logprobs",
                                                  "status")))


def canonical(tree):
    if isinstance(tree, binary_rows.BinaryRows):
        return ("rows", rows_key(tree))
    if isinstance(tree, dict):
        return {k: canonical(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [canonical(v) for v in tree]
    return tree


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_loads_gives_each_object_as_rows(writer, reader, mode):
    """A response body as the example server writes it, several objects
    deep in it: each comes back decoded in its place, the rest as orjson
    reads it; the same with torch tensors."""
    rng = np.random.default_rng(31)
    objects, expected = [], []
    for tokens, start in ((12, 0), (5, 3), (0, 0)):
        (ref,) = emission(writer, mode, rng, tokens) if tokens else (None,)
        if ref is None:
            chunk = shmask.Chunk.empty(MODE_SUPPORT if mode == "support"
                                       else MODE_SELECTED)
            objects.append(encode_meta_info(chunk, start))
            expected.append(([], []))
            continue
        with reader.open(ref) as chunk:
            objects.append(encode_meta_info(chunk, start))
            expected.append(chunk.to_lists())
    body = orjson.dumps({"id": "r\"1\\", "choices": [
        {"meta_info": orjson.Fragment(obj), "n": i} for i, obj in enumerate(objects)]})
    parsed = loads(body)
    for i, (choice, lists) in enumerate(zip(parsed["choices"], expected, strict=True)):
        rows = choice["meta_info"][binary_rows.MASK_FIELD]
        assert isinstance(rows, binary_rows.BinaryRows) and choice["n"] == i
        assert lists_of(rows) == lists
        assert rows_key(rows) == rows_key(decode_rows(orjson.loads(objects[i])))
    assert parsed["id"] == "r\"1\\"
    assert parsed["choices"][1]["meta_info"][binary_rows.LENGTH_FIELD] == 3 + 5
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # writable buffers: no read-only warning
        tensors = loads(body, torch=True)["choices"][0]["meta_info"][binary_rows.MASK_FIELD]
    assert isinstance(tensors.ids, torch.Tensor)
    np.testing.assert_array_equal(tensors.ids.numpy(), parsed["choices"][0]["meta_info"][
        binary_rows.MASK_FIELD].ids)


def tricky_document() -> bytes:
    """Binary rows among look-alikes: escaped quotes and keys, strings that
    hold binary-rows JSON, members in another order, version 2, a top
    level list, unicode, nesting in lists and objects."""
    obj = good()
    reordered = {k: obj[k] for k in ("ids", "logprobs", "status", "lengths", "nnz", "rows",
                                      "start", "mode", "version", "format")}
    text = orjson.dumps(obj).decode()
    return (
        '[{"a\\"ids":"x\\\\","s":' + orjson.dumps(text).decode() + ','
        ' "rows" : ' + text + ',\n "deep":[[{"x":[' + orjson.dumps(reordered).decode() + ']}]],'
        ' "v2":' + orjson.dumps({**obj, "version": 2}).decode() + ','
        ' "ids":"\\u00e9\\"", "format":"base64", "version":"1", "\\u0069ds":"AAAA",'
        ' "esc":' + orjson.dumps({**obj, "lengths": obj["lengths"].replace("A", "\\u0041")}
                                 ).decode().replace("\\\\u0041", "\\u0041") + '},'
        ' "\u00e9t\u00e9", null, true, -1.5e3, ' + text + ']').encode()


def test_loads_scans_like_a_json_parser(numpy_path):
    body = tricky_document()
    plain = orjson.loads(body)  # valid JSON, whatever the scan makes of it
    got = loads(body)
    assert canonical(got) == canonical(numpy_path(loads, body))
    expected = rows_key(decode_rows(good()))
    assert got[0]["s"] == plain[0]["s"]  # binary rows as a string stay a string
    assert got[0]["a\"ids"] == "x\\"
    assert rows_key(got[0]["rows"]) == expected
    assert rows_key(got[0]["deep"][0][0]["x"][0]) == expected
    assert got[0]["v2"] == plain[0]["v2"]  # version 2: not binary rows, left as parsed
    assert rows_key(got[0]["esc"]) == expected  # JSON escapes in base64: read as JSON
    assert rows_key(got[-1]) == expected
    assert got[1:-1] == plain[1:-1]
    assert got[0]["ids"] == 'AAAA' and got[0]["version"] == "1"  # a look-alike: left as parsed


@needs_core
def test_the_scan_finds_only_real_objects():
    """The native scan itself: which objects it takes for binary rows and
    where their strings are, on the tricky document."""
    ffi, lib = binary_rows._native()
    body = tricky_document()
    found = np.full((8, 8), -7, np.int64)
    error_at = ffi.new("uint64_t *")
    count = lib.shm_b64_scan(ffi.from_buffer(body), len(body),
                             ffi.from_buffer("int64_t[]", found), 8, error_at)
    # "rows", the one in "deep", "esc", the last element; not the string,
    # not version 2, not the outer object (version "1").
    assert count == 4
    ids = [body[b:e] for b, e in found[:count, 4:6].tolist()]
    assert ids == [good()["ids"].encode()] * 4
    lengths = [body[b:e] for b, e in found[:count, 0:2].tolist()]
    assert lengths[2] == good()["lengths"].replace("A", "\\u0041").encode()  # escapes kept
    assert (found[4:] == -7).all()  # nothing written past the objects
    assert lib.shm_b64_scan(ffi.from_buffer(body), len(body),
                            ffi.from_buffer("int64_t[]", found), 2, error_at) == 4  # counted


@needs_core
@pytest.mark.parametrize("body", [b"", b"{", b'{"a":1,}', b'["x]', b'"\\', b"[1 2]", b"{}}",
                                  b'{"a" 1}', b"nul", b"[" * 2000 + b"]" * 2000])
def test_the_scan_refuses_what_is_not_json(body):
    ffi, lib = binary_rows._native()
    error_at = ffi.new("uint64_t *")
    found = np.empty((1, 8), np.int64)
    code = lib.shm_b64_scan(ffi.from_buffer(body), len(body),
                            ffi.from_buffer("int64_t[]", found), 1, error_at)
    assert code in (lib.SHM_B64_E_SYNTAX, lib.SHM_B64_E_DEPTH)
    assert error_at[0] <= len(body)
    with pytest.raises(ValueError):
        loads(body)


def fuzz_document() -> bytes:
    support = good()
    selected = {**good(), "mode": "selected", "rows": 3, "nnz": 1,
                "lengths": b64(np.array([0, 1, 0], "<i4")), "status": b64(np.array([1, 0, 2], "u1")),
                "ids": b64(np.array([5], "<i4")), "logprobs": b64(np.array([np.nan, -1, np.nan],
                                                                          "<f4"))}
    return orjson.dumps({"meta_info": {binary_rows.MASK_FIELD: support, "x": [1, "ids"]},
                         "more": [selected]})


def outcome(function, body):
    """The decoded document, or "error". (Which error may differ: a raw
    control character or a byte that is not UTF-8 in a base64 string is
    bad JSON to orjson, bad base64 to the native decoder, which reads those
    strings instead of orjson.)"""
    try:
        return canonical(function(body))
    except ValueError:  # BinaryRowsError and orjson.JSONDecodeError both
        return "error"


def test_fuzz_truncations_and_flips(numpy_path):
    """Every truncation and 1500 random byte flips of a valid body: loads
    gives what orjson.loads + decode_rows give (the same rows, or an error
    where they raise one), never a crash or a read outside the body."""
    body = fuzz_document()
    assert outcome(loads, body) == outcome(lambda b: numpy_path(loads, b), body)
    assert outcome(loads, body)["more"][0][0] == "rows"
    rng = np.random.default_rng(18)
    cases = [body[:n] for n in range(len(body))]
    alphabet = np.frombuffer(b'AQgw+/=0"\\{}[],:1 \x00\xff\x80u', np.uint8)
    for _ in range(1500):
        data = bytearray(body)
        position = int(rng.integers(len(data)))
        data[position] = int(rng.choice(alphabet)) if rng.random() < 0.7 else int(rng.integers(256))
        cases.append(bytes(data))
    differ = [c for c in cases if outcome(loads, c) != outcome(lambda b: numpy_path(loads, b), c)]
    assert not differ, differ[:3]


def test_loads_without_the_core_is_orjson_and_decode_rows(numpy_path):
    body = fuzz_document()
    parsed = numpy_path(loads, body)
    assert rows_key(parsed["meta_info"][binary_rows.MASK_FIELD]) == rows_key(decode_rows(good()))
    assert parsed["meta_info"]["x"] == [1, "ids"]
    with pytest.raises(BinaryRowsError, match="'nnz'"):
        numpy_path(loads, orjson.dumps([{**good(), "nnz": -1}]))


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_loads_names_each_malformed_field(field, value, message):
    """The malformed objects above, inside a body: loads refuses each,
    naming the field (decode_rows' checks: the native path leaves every
    malformed body to them)."""
    obj = good()
    obj[field] = value
    body = orjson.dumps({"meta_info": {"a": [obj]}})
    if field in ("format", "version"):  # not binary rows then: left as parsed
        assert loads(body) == orjson.loads(body)
        return
    with pytest.raises(BinaryRowsError) as info:
        loads(body)
    assert f"'{field}'" in str(info.value)


def test_an_object_the_parser_does_not_take_keeps_its_strings():
    """The scan reads keys without resolving escapes; the parser does. An
    object whose escaped "format" key overrides "base64" is not binary
    rows: its strings come back as the text they were."""
    text = (b'{"x":{"format":"base64","version":1,"ids":"AAAA","lengths":"A\\u0041==",'
            b'"form\\u0061t":"other"}}')
    assert loads(text) == orjson.loads(text)


def trap(after_ids: str, tail: str = "") -> bytes:
    """good() with its "ids" (16 base64 characters for 3 ids) replaced by
    "AAAA" and `after_ids`, arranged so that the 16th character after the
    opening quote is a quote: where the scan's jump over "ids" lands."""
    obj = good()
    head = orjson.dumps({k: obj[k] for k in ("format", "version", "mode", "start", "rows", "nnz",
                                             "lengths", "status")})[:-1].decode()
    body = f'{head},"ids":"AAAA{after_ids},"logprobs":"{obj["logprobs"]}"{tail}}}'
    at = body.index('"ids":"') + len('"ids":"')
    assert body[at + 16] == '"', body[at:at + 17]
    return body.encode()


TRAPS = {
    # The jump lands on the quote that closes a later string: "x" is hidden
    # from the scan, and "ids" (4 characters for 3 ids) is malformed.
    "closing quote": trap('","x":"BBBBB"'),
    # ... the same, with a later "ids" that is right: the first one, jumped
    # over, is not the one stored (nothing would check it): scanned again.
    "overridden": trap('","x":"BBBBB","ids":"' + good()["ids"] + '"'),
    # ... on a quote that opens a string: what follows reads as bad JSON.
    "opening quote": trap('","xyz":"B"'),
    # ... in an object that is not binary rows after all.
    "not binary rows": trap('","x":"BBBBB"', ',"format":"other"'),
}


@pytest.mark.parametrize("name", TRAPS)
def test_a_wrong_jump_is_never_trusted(numpy_path, name):
    """The scan jumps over a field string whose length the object's counts
    give; where that length leads into other JSON, loads still gives what
    orjson.loads + decode_rows give (here the rows, the error naming 'ids',
    or the object as parsed)."""
    body = TRAPS[name]
    expected = outcome(lambda b: numpy_path(loads, b), body)
    assert outcome(loads, body) == expected
    if expected == "error":
        with pytest.raises(BinaryRowsError, match="'ids'"):
            loads(body)
    elif name == "not binary rows":
        assert loads(body) == orjson.loads(body)
    else:
        assert rows_key(loads(body)) == rows_key(decode_rows(good()))


@needs_core
def test_the_scan_jumps_over_what_it_can_size():
    """Where the jump leads into other JSON, the span stored covers it (the
    decoder then finds the quotes); where nothing would check a jumped
    string, or the jump made the text look malformed, the scan reads every
    string again and stores the true spans."""
    ffi, lib = binary_rows._native()
    found = np.empty((1, 8), np.int64)
    error_at = ffi.new("uint64_t *")

    def ids_span(body):
        count = lib.shm_b64_scan(ffi.from_buffer(body), len(body),
                                 ffi.from_buffer("int64_t[]", found), 1, error_at)
        return count, body[found[0, 4]:found[0, 5]] if count == 1 else None

    assert ids_span(TRAPS["closing quote"]) == (1, b'AAAA","x":"BBBBB')  # jumped
    assert ids_span(TRAPS["overridden"]) == (1, good()["ids"].encode())  # read again
    assert ids_span(TRAPS["opening quote"]) == (1, b"AAAA")  # read again
    assert ids_span(TRAPS["not binary rows"]) == (0, None)
    body = orjson.dumps(good())
    assert ids_span(body) == (1, good()["ids"].encode())


def test_loads_takes_every_kind_of_body():
    """bytes, str, bytearray and memoryviews (a strided one too) give the
    same document."""
    body = fuzz_document()
    expected = canonical(loads(body))
    strided = memoryview(np.repeat(np.frombuffer(body, np.uint8), 2).tobytes())[::2]
    assert not strided.contiguous
    for kind in (body.decode(), bytearray(body), memoryview(body), strided):
        assert canonical(loads(kind)) == expected, type(kind)
    with pytest.raises(ValueError):
        loads(memoryview(body[:-1]))


def test_a_well_formed_body_takes_the_native_path(monkeypatch):
    """The reference path (orjson.loads + decode_rows) decides only for
    bodies the native path cannot vouch for: never for what an encoder
    writes."""
    if binary_rows._native() is None:
        pytest.skip("compiled core not built")
    calls = []
    reference = binary_rows._convert
    monkeypatch.setattr(binary_rows, "_convert",
                        lambda *args: calls.append(args) or reference(*args))
    body = fuzz_document()
    assert canonical(loads(body)) == canonical(reference(orjson.loads(body), False))
    assert not calls
    escaped = body.replace(b'"lengths":"A', b'"lengths":"\\u0041', 1)
    assert canonical(loads(escaped)) == canonical(loads(body))  # escapes: the reference path
    assert len(calls) == 1


@needs_core
def test_every_byte_is_judged_as_the_alphabet_says():
    """Each of the 256 byte values at each of the 32 places of a vector
    block (and in the scalar tail): valid exactly when it is in the base64
    alphabet, and then decoded to its value."""
    ffi, lib = binary_rows._native()
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    base = bytearray((alphabet * 3)[:48])  # 12 quartets: one vector block, then the tail
    spans = np.array([0, 48, 0, 36], np.uint64)
    results = np.empty(2, np.int64)
    out = bytearray(40)
    for place in (*range(32), 40):
        for value in range(256):
            text = bytearray(base)
            text[place] = value
            lib.shm_b64_decode(ffi.from_buffer(text), 48, ffi.from_buffer("uint64_t[]", spans), 1,
                               ffi.from_buffer(out), 40, ffi.from_buffer("int64_t[]", results), 1)
            if value in alphabet:
                assert results[0] == -1 and bytes(out[:36]) == base64.b64decode(bytes(text))
            else:
                assert results[0] == place, (place, value)


# ------------------------------------------------ issue 33: one rule for ids, loads of any str
def test_loads_of_a_str_with_a_lone_surrogate_raises_orjsons_error():
    """Item 11: a str holding a lone surrogate is no JSON text (no UTF-8
    body holds one): orjson's JSONDecodeError, as docs/responses.md says,
    not the UnicodeEncodeError of str.encode."""
    for body in ("\ud800", '{"a": "\udcff"}', '[1, "\ud83d"]'):
        with pytest.raises(orjson.JSONDecodeError, match="surrogates"):
            loads(body)
    assert loads('{"a": "\u00e9"}') == {"a": "\u00e9"}


@pytest.mark.parametrize("version", [1.0, True])
def test_a_version_that_is_not_the_int_1_is_refused(version):
    obj = good()
    obj["version"] = version  # equal to 1 in Python, not version 1 on the wire
    with pytest.raises(BinaryRowsError, match="'version'"):
        decode_rows(obj)


def _hand_built(ids: np.ndarray, width: int) -> shmask.Chunk:
    """Rows handed over in-process (never through a Writer): `width` ids a row."""
    lengths = np.full(ids.size // width, width, np.int32)
    return shmask.Chunk(MODE_SUPPORT, lengths, ids, np.zeros(ids.size, np.float32), None)


@pytest.mark.parametrize("threads", [1, 4])
def test_the_encoders_refuse_a_negative_id_anywhere(numpy_path, threads):
    """Item 9: ids are non-negative int32 wherever rows enter; rows given to
    the encoders in-process are held to it (decode_rows would refuse the
    whole response): a negative id at the first, a vector block's or a
    task's edge, or the last place raises BinaryRowsError naming it, on the
    native path (its check runs in each encoding task) and without the core."""
    width = 1000
    ids = np.tile(np.arange(width, dtype=np.int32), 40)  # 160,000 bytes: several tasks
    # 4 tasks of ~80,040 bytes: the ids' word 19970 straddles the first edge
    for place in (0, 1, 7, 8, 15, 16, 4095, 4096, 13333, *range(19968, 19973), ids.size - 1):
        bad = ids.copy()
        bad[place] = -(place + 1)
        for encode in (lambda c: encode_meta_info(c, threads=threads),
                       lambda c: encode_chunk(c, threads=threads),
                       lambda c: binary_rows.encode_meta_info_many([c], threads=threads)[0],
                       lambda c: numpy_path(encode_chunk, c),
                       lambda c: SamplingMaskBase64(True).extend(c)):
            with pytest.raises(BinaryRowsError, match=f"id {-(place + 1)} .*negative"):
                encode(_hand_built(bad, width))
    good_rows = decode_rows(encode_chunk(_hand_built(ids, width), threads=threads))
    assert np.array_equal(good_rows.ids, ids)

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
from shmask.binary_rows import BinaryRowsError, SamplingMaskBase64, decode_rows, encode_chunk

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
    """decode_rows needs numpy and orjson only: no compiled core, no torch
    unless tensors are asked for."""
    import subprocess
    import sys

    code = ("import sys, json; sys.modules['shmask._native'] = None; import shmask; "
            f"rows = shmask.decode_rows(json.loads({orjson.dumps(good()).decode()!r})); "
            "print(rows.ids.tolist(), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, start_new_session=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[1,", "2,", "3]", "False"]


def test_field_names_are_the_adapters():
    sglang = pytest.importorskip("shmask.adapters.sglang")
    assert (binary_rows.MASK_FIELD, binary_rows.LENGTH_FIELD) == (sglang.MASK_FIELD,
                                                                   sglang.LENGTH_FIELD)

"""shmask.train: the rows of a micro-batch's sequences, published through a
real ring, read back, turned into each response form a server writes (JSON
lists, binary rows, in-process arrays) with the project's own writers, and
packed into one ReplayBatch. Every token's support is compared with the rows
as they were generated (bitmask rows expanded with numpy), and every
malformed input is refused with an error naming it."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
import torch

from shmask import response_json, train
from shmask.adapters.sglang import SamplingMaskCSR, meta_info_rows
from shmask.adapters.vllm import mask_csr
from shmask.binary_rows import encode_meta_info, loads

VOCAB = 1000 + 17  # bitmask rows of 32 words, the last one partly past the vocabulary
WORDS = -(-VOCAB // 32)
WIDE = -(-VOCAB // 32)  # the fewest ids of a bitmask row: 32 L >= V
OK, OVERFLOW, INVALID = 0, 1, 2
# Per sequence, the kind of each token's row: a sequence of every kind (the
# ids/bitmask boundary on both sides), an empty one, one of a single token,
# one of OK rows only (vLLM's masks have no dropped rows).
SEQUENCES = [
    ["ids", "edge_ids", "edge_wide", "wide", "bitmask", "empty", "overflow", "ids", "invalid",
     "bitmask", "top"],
    [],
    ["wide"],
    ["ids", "bitmask", "ids", "empty"],
]


def make_row(rng: np.random.Generator, kind: str) -> tuple[np.ndarray | None, int, int]:
    """(ascending ids or None for a dropped row, status, form as sent)."""
    size = {"ids": int(rng.integers(1, WIDE)), "edge_ids": WIDE - 1, "edge_wide": WIDE,
            "wide": int(rng.integers(WIDE, 200)), "bitmask": int(rng.integers(WIDE, 600)),
            "top": 3, "empty": 0, "overflow": 0, "invalid": 0}[kind]
    ids = np.sort(rng.choice(VOCAB, size, replace=False)).astype(np.int32)
    if kind == "top":  # the vocabulary's last ids: the last word's top bits stay clear
        ids = np.arange(VOCAB - 3, VOCAB, dtype=np.int32)
    status = {"overflow": OVERFLOW, "invalid": INVALID}.get(kind, OK)
    return (None if status else ids), status, int(kind == "bitmask")


def bitmask_words(ids: np.ndarray) -> np.ndarray:
    bits = np.zeros(WORDS * 32, np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view("<i4")


def expand(words: np.ndarray, vocab: int) -> np.ndarray:
    """A bitmask row's ids; its bits at ids >= vocab must be clear."""
    bits = np.unpackbits(words.astype("<i4").view(np.uint8), bitorder="little")
    assert not bits[vocab:].any(), "a bit past the vocabulary is set"
    return np.flatnonzero(bits)


def generate(seed: int) -> list[list[tuple[np.ndarray | None, float]]]:
    """The originals: per sequence, per token (ids or None, selected logprob)."""
    rng = np.random.default_rng(seed)
    out = []
    for kinds in SEQUENCES:
        rows = []
        for kind in kinds:
            ids, _, _ = make_row(rng, kind)
            rows.append((ids, float(np.float32(rng.standard_normal()))))
        out.append(rows)
    return out


def publish(writer, mode: str, seed: int) -> list:
    """Each sequence's rows appended to its own queue, token by token (the
    bitmask kinds sent as bitmasks), taken as one emission: its refs."""
    rng = np.random.default_rng(seed)
    queues = [writer.open_queue(mode) for _ in SEQUENCES]
    for queue, kinds in zip(queues, SEQUENCES, strict=True):
        for kind in kinds:
            ids, status, form = make_row(rng, kind)
            selected = np.float32(rng.standard_normal())
            data = np.zeros(0, np.int32) if ids is None else ids
            length = data.size
            if form:
                data = bitmask_words(data)
            logprobs = (np.linspace(-5, -1, length, dtype=np.float32) if mode == "support"
                        else np.array([selected], np.float32))
            writer.append_step([queue], np.array([length], np.int32), data, logprobs,
                               status=np.array([status], np.int32),
                               forms=np.array([form], np.int32), vocab=VOCAB)
    refs = list(writer.take_batch(queues))
    for queue in queues:
        queue.close()
    return refs


def responses(writer, reader, mode: str, seed: int) -> dict[str, list]:
    """Each sequence's response in every form, as a client receives it."""
    forms: dict[str, list] = {"json": [], "binary": [], "binary_parsed": [], "csr": []}
    for ref in publish(writer, mode, seed):
        with reader.open(ref) as chunk:
            body = response_json.dumps({"text": "", "meta_info": meta_info_rows(chunk)})
            forms["json"].append(orjson.loads(body)["meta_info"])
            body = orjson.dumps({"text": "", "meta_info": orjson.Fragment(encode_meta_info(chunk))})
            forms["binary"].append(loads(body)["meta_info"])
            forms["binary_parsed"].append(orjson.loads(body)["meta_info"])
            csr = SamplingMaskCSR(mode == "support")
            csr.extend(chunk)
            forms["csr"].append(csr)
    return forms


def check_batch(batch: train.ReplayBatch, originals, vocab: int, *, bitmasks: bool = True,
                selected: bool = True) -> None:
    """Every token of `batch` holds exactly its original support, in the
    form the rule gives; offsets, validity and logprobs line up."""
    counts = [len(rows) for rows in originals]
    assert batch.num_sequences == len(originals)
    assert batch.num_tokens == sum(counts)
    assert batch.vocab == vocab
    assert batch.seq_offsets.dtype == torch.int64 and batch.offsets.dtype == torch.int64
    assert batch.ids.dtype == torch.int32 and batch.forms.dtype == torch.int32
    assert batch.valid.dtype == torch.bool
    assert batch.seq_offsets.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
    offsets, data = batch.offsets.numpy(), batch.ids.numpy()
    assert offsets[0] == 0 and offsets[-1] == data.size and (np.diff(offsets) >= 0).all()
    flat = [row for rows in originals for row in rows]
    for t, (ids, _) in enumerate(flat):
        row = data[offsets[t]:offsets[t + 1]]
        form = int(batch.forms[t])
        assert bool(batch.valid[t]) == (ids is not None), f"token {t}"
        if ids is None:
            assert row.size == 0 and form == train.FORM_IDS, f"token {t}"
            continue
        wide = bitmasks and 32 * ids.size >= vocab
        assert form == (train.FORM_BITMASK if wide else train.FORM_IDS), f"token {t}"
        if wide:
            assert row.size == -(-vocab // 32), f"token {t}"
            np.testing.assert_array_equal(expand(row, vocab), ids, err_msg=f"token {t}")
        else:
            np.testing.assert_array_equal(row, ids, err_msg=f"token {t}")
    if not selected:
        assert batch.rollout_logprobs is None
        return
    expected = np.array([np.nan if ids is None else value for ids, value in flat], np.float32)
    assert batch.rollout_logprobs is not None and batch.rollout_logprobs.dtype == torch.float32
    np.testing.assert_array_equal(batch.rollout_logprobs.numpy(), expected)  # NaN == NaN here


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_every_response_form_packs_each_tokens_support_exactly(writer, reader, mode):
    seed = 11 if mode == "support" else 12
    originals = generate(seed)
    forms = responses(writer, reader, mode, seed)
    selected = mode == "selected"
    batches = {"json": train.from_json(forms["json"], VOCAB),
               "binary": train.from_binary(forms["binary"], VOCAB),
               "binary_parsed": train.from_binary(forms["binary_parsed"], VOCAB),
               "csr": train.from_arrays(forms["csr"], VOCAB),
               # the meta_info of SGLang's Engine.generate holds the CSR
               "csr_meta": train.from_arrays([{"output_token_sampling_mask": csr}
                                              for csr in forms["csr"]], VOCAB)}
    for name, batch in batches.items():
        try:
            check_batch(batch, originals, VOCAB, selected=selected)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    # The mix this test relies on: bitmask and ids rows, dropped rows, an
    # empty sequence, a sequence of one token.
    batch = batches["json"]
    assert set(batch.forms.tolist()) == {train.FORM_IDS, train.FORM_BITMASK}
    assert not batch.valid.all()
    assert (batch.seq_offsets.diff() == 0).any() and (batch.seq_offsets.diff() == 1).any()


def test_rows_kept_in_ids_form_when_asked(writer, reader):
    originals = generate(13)
    forms = responses(writer, reader, "selected", 13)
    batch = train.from_json(forms["json"], VOCAB, bitmasks=False)
    check_batch(batch, originals, VOCAB, bitmasks=False)
    assert (batch.forms == train.FORM_IDS).all()


def test_vllm_masks_as_csr_pairs():
    rng = np.random.default_rng(3)
    kinds = [["ids", "wide", "empty"], [], ["bitmask"]]
    originals = [[(make_row(rng, kind)[0], 0.0) for kind in row_kinds] for row_kinds in kinds]
    # CompletionOutput.sampling_mask in arrays mode: one int32 array per position
    masks = [mask_csr(SimpleNamespace(token_ids=[ids for ids, _ in rows])) for rows in originals]
    batch = train.from_arrays(masks, VOCAB)
    check_batch(batch, originals, VOCAB, selected=False)
    assert batch.valid.all()


def test_pack_rows_from_lists_and_arrays():
    vocab = 70  # 3 words; 32 L >= 70 from L = 3
    sequences = [[np.array([1, 5, 9]), None, list(range(0, 70, 2)), [4, 69]], [], [[3]]]
    batch = train.pack_rows(sequences, vocab, rollout_logprobs=[[0.5, None, -1.0, -2.0], [], [3]])
    # by hand: bits 1, 5, 9 = 546; every even id of word 0 and 1; ids 64, 66, 68 = bits 0, 2, 4
    assert batch.ids.tolist() == [546, 0, 0, 0x55555555, 0x55555555, 0b10101, 4, 69, 3]
    assert batch.offsets.tolist() == [0, 3, 3, 6, 8, 9]
    assert batch.forms.tolist() == [1, 0, 1, 0, 0]
    assert batch.valid.tolist() == [True, False, True, True, True]
    assert batch.seq_offsets.tolist() == [0, 4, 4, 5]
    assert batch.num_tokens == 5 and batch.num_sequences == 3
    np.testing.assert_array_equal(batch.rollout_logprobs.numpy(),
                                  np.array([0.5, np.nan, -1, -2, 3], np.float32))
    assert train.pack_rows(sequences, vocab).rollout_logprobs is None
    assert train.pack_rows([], vocab).num_tokens == 0


def test_the_form_rule_at_its_boundary():
    # 32 L >= V: at V = 64 a row of 2 ids is a bitmask (2 words), a row of 1 is not
    batch = train.pack_rows([[[0, 63], [63]]], 64)
    assert batch.forms.tolist() == [train.FORM_BITMASK, train.FORM_IDS]
    assert batch.ids.tolist() == [1, -2**31, 63]  # bit 0 of word 0; bit 31 of word 1
    assert batch.offsets.tolist() == [0, 2, 3]


def test_binary_rows_without_a_vocabulary(writer, reader):
    originals = generate(14)
    forms = responses(writer, reader, "support", 14)
    batch = train.from_binary(forms["binary"])
    largest = max(int(ids.max()) for rows in originals for ids, _ in rows
                  if ids is not None and ids.size)
    check_batch(batch, originals, largest + 1, bitmasks=False, selected=False)


def test_to_the_cpu_and_pinning():
    batch = train.pack_rows([[[1, 2, 3], None], [[7]]], 100, rollout_logprobs=[[0, 1], [2]])
    moved = batch.to("cpu")
    assert isinstance(moved, train.ReplayBatch) and moved.vocab == 100
    for name in ("seq_offsets", "offsets", "ids", "forms", "valid", "rollout_logprobs"):
        tensor = getattr(moved, name)
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor.nan_to_num(), getattr(batch, name).nan_to_num()), name
    if not torch.cuda.is_available():
        assert batch.pin_memory() is batch
    else:
        pinned = batch.pin_memory()
        assert pinned.ids.is_pinned() and pinned.valid.is_pinned()
        on_gpu = batch.to("cuda")
        assert on_gpu.ids.device.type == "cuda"
        assert torch.equal(on_gpu.ids.cpu(), batch.ids)
        # and back, read at once: the copy has landed (a batch large enough
        # that an unsynchronized read would see it half copied)
        big = train.pack_rows([[list(range(k, k + 1000)) for k in range(4000)]], 200_000)
        back = big.to("cuda").to("cpu")
        assert torch.equal(back.ids, big.ids) and torch.equal(back.offsets, big.offsets)


def test_the_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import shmask.train\n"
            "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _json_meta(rows, logprobs, length=None):
    meta = {train.MASK_FIELD: rows, train.LOGPROBS_FIELD: logprobs}
    meta[train.LENGTH_FIELD] = len(rows) if length is None else length
    return meta


BAD_INPUTS = [
    (lambda: train.pack_rows([[[1, 1]]], 10), "sequence 0, token 0: ids not strictly ascending"),
    (lambda: train.pack_rows([[[5, 2]]], 100), "ids not strictly ascending: 5 then 2"),
    (lambda: train.pack_rows([[[1], [2, 10]]], 10), "sequence 0, token 1: id 10 is outside [0, 10)"),
    (lambda: train.pack_rows([[], [[-1]]], 10), "sequence 1, token 0: id -1 is outside"),
    (lambda: train.pack_rows([[[1]], [[2], [3, -1]]], 10), "sequence 1, token 1: id -1 is outside"),
    (lambda: train.pack_rows([[[1.5]]], 10), "sequence 0: ids must be integers"),
    (lambda: train.pack_rows([[[[1, 2]]]], 10), "a row must be 1-D"),
    (lambda: train.pack_rows([[[1]]], 0), "vocab must be an int in [1, 2**31]"),
    (lambda: train.pack_rows([[[1]]], True), "vocab must be an int"),
    (lambda: train.pack_rows([[[1]]], 10, rollout_logprobs=[[1, 2]]),
     "sequence 0: rollout_logprobs has 2 values for 1 tokens"),
    (lambda: train.pack_rows([[[1]]], 10, rollout_logprobs=[]), "rollout_logprobs has 0 items"),
    (lambda: train.from_json([_json_meta([[1], [2]], [0.5])], 10),
     "'output_token_sampling_logprobs' has 1 rows, 'output_token_sampling_mask' 2"),
    (lambda: train.from_json([_json_meta([[1], [2, 3]], [[0.5], [0.5]])], 10),
     "sequence 0, token 1: 1 logprobs for 2 ids"),
    (lambda: train.from_json([_json_meta([[1]], [[0.5]], length=4)], 10),
     "sequence 0: the response holds rows 0..1 of 4"),
    (lambda: train.from_json([{"text": ""}], 10), "holding 'output_token_sampling_mask'"),
    (lambda: train.from_json([_json_meta([[1]], [[0.5], 0.5])], 10), "has 2 rows"),
    (lambda: train.from_json([_json_meta([[1], [2]], [[0.5], 0.5])], 10),
     "mixes support-mode lists with selected-mode values"),
    (lambda: train.from_binary([{"format": "base64", "version": 2}]),
     "sequence 0: binary rows: 'version' 2 is not supported"),
    (lambda: train.from_arrays([(np.array([1, 2], np.int32), np.array([0, 3]))], 10),
     "sequence 0: offsets must rise from 0 to 2"),
    (lambda: train.from_arrays([(np.array([1, 2], np.int32), np.array([0, 2, 1, 2]))], 10),
     "falling at row 1"),
    (lambda: train.from_arrays([[1, 2]], 10), "expected a SamplingMaskCSR"),
]


@pytest.mark.parametrize("call, says", BAD_INPUTS, ids=[says for _, says in BAD_INPUTS])
def test_bad_inputs_are_refused_by_name(call, says):
    with pytest.raises(ValueError) as caught:
        call()
    assert says in str(caught.value)


def test_streamed_binary_increments_and_vocabulary_bounds_are_refused(writer, reader):
    refs = publish(writer, "support", 15)
    with reader.open(refs[0]) as chunk:  # the first sequence's 11 rows
        increment = orjson.loads(encode_meta_info(chunk, 3))  # rows from 3 on, as streamed
        whole = loads(orjson.dumps({"m": orjson.Fragment(encode_meta_info(chunk))}))["m"]
    reader.discard_batch(refs[1:])
    with pytest.raises(ValueError, match=r"sequence 0: the response holds rows 3\.\.14 of 14"):
        train.from_binary([increment], VOCAB)
    # the first id past a vocabulary of 1000 (the "top" row has some, if no earlier row has)
    rows = [ids for ids, _ in generate(15)[0]]
    token = next(t for t, ids in enumerate(rows) if ids is not None and ids.size and ids[-1] >= 1000)
    first = int(rows[token][rows[token] >= 1000][0])
    with pytest.raises(ValueError, match=rf"sequence 0, token {token}: id {first} is outside "
                                         r"\[0, 1000\)"):
        train.from_binary([whole], 1000)


def test_a_dropped_row_with_ids_is_refused():
    csr = SimpleNamespace(token_ids=np.array([4], np.int32), offsets=np.array([0, 0, 1]),
                          status=np.array([0, 2], np.uint8), logprobs=np.zeros(2, np.float32),
                          support=False)
    with pytest.raises(ValueError, match="sequence 0, token 1: a row that is not OK has 1 ids"):
        train.from_arrays([csr], 10)

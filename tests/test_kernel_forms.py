"""Both exact forms (ids, bitmask) of compact/capture/sample against a plain
numpy oracle written here, independent of the kernels' torch references.

Every row is decoded from the raw Rows arrays (id_offsets, forms, ids,
offsets, values), not through Rows.row, so the layout itself is under test:
supports of 0 and 1 ids, the ids/bitmask crossover (32 L = V) -1/0/+1,
max_tokens -1/0/+1, half and all of the vocabulary, ties at every capture
cutoff, V not a multiple of 32 and V > 65536, both overflow policies.
Compaction values are the inputs, so they must match bit for bit; capture
logprobs are log(w / Z) from the device's log, so they match to 2e-5 while
their ids (and Z: dyadic probabilities sum exactly) match exactly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shmask.kernels import Status, capture, compact, sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OK, OVERFLOW, INVALID, SKIPPED = 0, 1, 2, 3


# ------------------------------------------------------------------ oracle


def oracle_form(size: int, max_tokens: int, vocab: int) -> int:
    """1 (bitmask) iff past max_tokens or 32 L >= V, else 0 (ids)."""
    return int(size > max_tokens or 32 * size >= vocab)


def oracle_status(size: int, opted: bool, max_tokens: int, overflow: str, invalid=False) -> int:
    if invalid:
        return INVALID
    if not opted:
        return SKIPPED
    return OVERFLOW if overflow == "status" and size > max_tokens else OK


def oracle_compact_row(x: np.ndarray, keep: str) -> np.ndarray:
    """Kept ids of one row (x as float32)."""
    kept = np.isfinite(x) if keep == "finite" else x > 0
    return np.flatnonzero(kept)


def oracle_support(w: np.ndarray, top_k: int, top_p: float, min_p: float, order: str):
    """Kept ids of one probability row, by the documented thresholds (float64
    masses, a full sort), or None when the row holds a NaN/inf/negative."""
    vocab = w.size
    if not (np.all(np.isfinite(w)) and np.all(w >= 0)):
        return None
    desc = np.sort(w)[::-1]
    cutoff = np.float32(0)
    k_on = 1 <= top_k < vocab
    if k_on:
        cutoff = max(cutoff, desc[top_k - 1])
    if top_p < 1:
        mass = w.astype(np.float64).sum()
        if order == "sequential" and k_on:
            mass = w[w >= desc[top_k - 1]].astype(np.float64).sum()
        reached = np.cumsum(desc.astype(np.float64)) >= np.float64(np.float32(top_p)) * mass
        if reached.any():
            cutoff = max(cutoff, desc[int(np.argmax(reached))])
    if min_p > 0:
        cutoff = max(cutoff, np.float32(min_p) * w.max())
    return np.flatnonzero((w >= cutoff) & (w > 0))


# ------------------------------------------------------------ decoding


def decode(rows, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Row b's ids and values from the raw arrays, checking the layout."""
    vocab = rows.vocab
    id_offsets = rows.id_offsets.cpu().numpy()
    offsets = rows.offsets.cpu().numpy()
    data = rows.ids[int(id_offsets[b]):int(id_offsets[b + 1])].cpu().numpy()
    values = rows.values[int(offsets[b]):int(offsets[b + 1])].cpu().numpy()
    if int(rows.forms[b]) == 1:
        assert data.size == -(-vocab // 32), f"row {b}: {data.size} words for V={vocab}"
        bits = np.unpackbits(data.astype("<i4").view(np.uint8), bitorder="little")
        assert not bits[vocab:].any(), f"row {b}: bits set at ids >= V"
        ids = np.flatnonzero(bits)
    else:
        ids = data.astype(np.int64)
    assert ids.size == values.size == int(rows.lengths[b]), f"row {b}"
    return ids, values


def check_rows(rows, want: list[dict], max_tokens: int, exact_values: bool) -> None:
    """Compare every row with the oracle's {status, size, ids, values}."""
    batch = len(want)
    status = rows.status.cpu().tolist()
    for b, row in enumerate(want):
        assert status[b] == row["status"], (b, status[b], row["status"])
        assert int(rows.sizes[b]) == row["size"], (b, int(rows.sizes[b]), row["size"])
        ok = row["status"] == OK
        form = oracle_form(row["size"], max_tokens, rows.vocab) if ok else 0
        assert int(rows.forms[b]) == form, (b, int(rows.forms[b]), form)
        ids, values = decode(rows, b)
        if not ok:
            assert ids.size == 0 and int(rows.lengths[b]) == 0, b
            continue
        np.testing.assert_array_equal(ids, row["ids"], err_msg=f"row {b}")
        if exact_values:
            np.testing.assert_array_equal(values.view(np.uint32),
                                          row["values"].astype(np.float32).view(np.uint32),
                                          err_msg=f"row {b}")
        else:
            np.testing.assert_allclose(values, row["values"], rtol=0, atol=2e-5,
                                       err_msg=f"row {b}")
    # id_offsets and offsets are the running sums of what each row carries
    words = -(-rows.vocab // 32)
    id_lengths = [words if int(rows.forms[b]) else int(rows.lengths[b]) for b in range(batch)]
    assert rows.id_offsets.cpu().tolist() == np.concatenate([[0], np.cumsum(id_lengths)]).tolist()
    assert rows.offsets.cpu().tolist() == np.concatenate(
        [[0], np.cumsum(rows.lengths.cpu().numpy())]).tolist()


# ---------------------------------------------------------- compaction


def support_sizes(vocab: int, max_tokens: int) -> list[int]:
    """0, 1, the crossover -1/0/+1, max_tokens -1/0/+1, half, all."""
    cross = -(-vocab // 32)  # smallest L with 32 L >= V
    return [0, 1, cross - 1, cross, cross + 1, max_tokens - 1, max_tokens, max_tokens + 1,
            vocab // 2, vocab]


@pytest.mark.parametrize("vocab,max_tokens,dtype", [
    (1024, 40, torch.float32),  # 32 L = V exactly at L = 32
    (1000, 20, torch.bfloat16),  # max_tokens below the crossover (L = 32; V/32 = 31.25)
    (1000, 33, torch.float16),  # max_tokens one past the crossover
    (70001, 2500, torch.float32),  # V > 65536, crossover at L = 2188
])
@pytest.mark.parametrize("overflow", ["exact", "status"])
def test_compaction_forms_match_numpy(vocab: int, max_tokens: int, dtype, overflow: str) -> None:
    rng = np.random.default_rng(vocab + max_tokens)
    sizes = support_sizes(vocab, max_tokens)
    batch = len(sizes) + 1  # and one row that is not opted in
    keep = "finite" if dtype != torch.float16 else "positive"
    x = rng.standard_normal((batch, vocab)).astype(np.float32)
    if keep == "positive":
        x = np.abs(x) + np.float32(1e-3)
    x = torch.from_numpy(x).to(dtype).float().numpy()  # values the dtype can hold
    dropped = np.float32("-inf") if keep == "finite" else np.float32(0)
    for b, size in enumerate(sizes):
        out = np.ones(vocab, dtype=bool)
        out[rng.choice(vocab, size, replace=False)] = False
        x[b, out] = dropped
    x[-1] = np.nan  # not opted in: never read
    opted = np.ones(batch, dtype=bool)
    opted[-1] = False
    rows = compact(torch.from_numpy(x).to(dtype).to(DEVICE), max_tokens, keep=keep,
                   rows=torch.from_numpy(opted).to(DEVICE), overflow=overflow)
    want = []
    for b in range(batch):
        ids = oracle_compact_row(x[b], keep) if opted[b] else np.zeros(0, dtype=np.int64)
        want.append({"status": oracle_status(ids.size, bool(opted[b]), max_tokens, overflow),
                     "size": ids.size, "ids": ids, "values": x[b, ids]})
    assert [row["size"] for row in want[:-1]] == sizes
    check_rows(rows, want, max_tokens, exact_values=True)
    forms = rows.forms.cpu().tolist()
    assert forms[:2] == [0, 0]  # empty and one-id rows travel as ids
    if overflow == "exact":
        assert forms[-3:] == [1, 1, 0]  # half, all, the skipped row
    else:
        assert rows.status.cpu().tolist()[-4:] == [OVERFLOW, OVERFLOW, OVERFLOW, SKIPPED]
    if max_tokens > -(-vocab // 32):  # crossover -1/0/+1 within max_tokens
        assert forms[2:5] == [0, 1, 1]


# -------------------------------------------------------------- capture

A = 2.0**-12  # value of the support group
B = 2.0**-20  # value of everything else that is positive


def group_row(vocab: int, size: int, rng: np.random.Generator, zeros: int = 3) -> np.ndarray:
    """`size` ids at A (the support to be), `zeros` ids at 0, the rest at B:
    a tie group at every cutoff, dyadic, so every mass sum is exact."""
    w = np.full(vocab, B, dtype=np.float32)
    perm = rng.permutation(vocab)
    w[perm[:size]] = A
    w[perm[size:size + zeros]] = 0
    return w


def capture_cases(vocab: int, max_tokens: int, rng: np.random.Generator):
    """(probs row, top_k, top_p, min_p, sampled) per row: each support size
    of support_sizes cut by top-k inside its tie group, top-p with the target
    inside the group, or min-p exactly at its value; then the whole
    vocabulary, a zero row (INVALID), a token outside the support (INVALID),
    and min-p exactly at B (the whole positive row)."""
    cases = []
    for i, size in enumerate(s for s in support_sizes(vocab, max_tokens) if 0 < s < vocab):
        w = group_row(vocab, size, rng)
        token = int(rng.choice(np.flatnonzero(w == A)))
        kind = i % 3
        if kind == 0:
            cases.append((w, max(1, size // 2 + 1), 1.0, 0.0, token))
        elif kind == 1:
            mass = float(w.astype(np.float64).sum())
            cases.append((w, 0, float(np.float32((size - 0.5) * A / mass)), 0.0, token))
        else:
            cases.append((w, 0, 1.0, 1.0, token))
    whole = np.full(vocab, B, dtype=np.float32)
    cases.append((whole, 0, 1.0, 0.0, vocab - 1))
    cases.append((np.zeros(vocab, dtype=np.float32), 0, 1.0, 0.0, 0))
    outside = group_row(vocab, 5, rng)
    cases.append((outside, 5, 1.0, 0.0, int(np.flatnonzero(outside == B)[0])))
    ratio = group_row(vocab, 7, rng)
    cases.append((ratio, 0, 1.0, B / A, int(np.flatnonzero(ratio == B)[0])))
    return cases


def oracle_capture(cases, order, max_tokens, overflow, opted) -> list[dict]:
    want = []
    for b, (w, top_k, top_p, min_p, token) in enumerate(cases):
        ids = oracle_support(w, top_k, top_p, min_p, order)
        if ids is None:  # a bad value: INVALID, size of nothing
            ids = np.zeros(0, dtype=np.int64)
        z = w[ids].astype(np.float64).sum()
        invalid = ids is None or z == 0 or token not in set(ids.tolist())
        status = oracle_status(ids.size, bool(opted[b]), max_tokens, overflow, invalid)
        logprobs = np.log(w[ids].astype(np.float64) / z) if not invalid else None
        want.append({"status": status, "size": int(ids.size), "ids": ids, "values": logprobs})
    return want


def as_device(cases, opted):
    probs = torch.from_numpy(np.stack([c[0] for c in cases])).to(DEVICE)
    settings = {
        "top_k": torch.tensor([c[1] for c in cases], dtype=torch.int32, device=DEVICE),
        "top_p": torch.tensor([c[2] for c in cases], dtype=torch.float32, device=DEVICE),
        "min_p": torch.tensor([c[3] for c in cases], dtype=torch.float32, device=DEVICE),
        "rows": torch.from_numpy(opted).to(DEVICE),
    }
    sampled = torch.tensor([c[4] for c in cases], device=DEVICE)
    return probs, sampled, settings


@pytest.mark.parametrize("vocab,max_tokens", [(1000, 40), (1024, 20), (70001, 2500)])
@pytest.mark.parametrize("overflow", ["exact", "status"])
def test_capture_forms_match_numpy(vocab: int, max_tokens: int, overflow: str) -> None:
    rng = np.random.default_rng(vocab)
    cases = capture_cases(vocab, max_tokens, rng)
    opted = np.ones(len(cases), dtype=bool)
    opted[1] = False  # a SKIPPED row still gets its size
    probs, sampled, settings = as_device(cases, opted)
    # (order matters only where top-k and top-p are both on; the 70001-column
    # rows, the slow ones under the interpreter, run one order)
    for order in ("joint", "sequential") if vocab < 65536 else ("joint",):
        rows = capture(probs, sampled, max_tokens=max_tokens, order=order, overflow=overflow,
                       **settings)
        want = oracle_capture(cases, order, max_tokens, overflow, opted)
        check_rows(rows, want, max_tokens, exact_values=False)
        statuses = [row["status"] for row in want]
        assert statuses[-3:-1] == [INVALID, INVALID] and statuses[1] == SKIPPED
        assert want[-4]["size"] == vocab and want[-1]["size"] == vocab - 3


def test_sample_support_matches_numpy_given_its_token() -> None:
    """sample() draws the token and captures its support in one kernel: the
    support is the oracle's for the drawn token, in either form."""
    vocab, max_tokens = 70001, 2500
    rng = np.random.default_rng(5)
    cases = [c for c in capture_cases(vocab, max_tokens, rng) if c[0].any()][:6]
    opted = np.ones(len(cases), dtype=bool)
    probs, _, settings = as_device(cases, opted)
    rows = sample(probs, torch.arange(len(cases), device=DEVICE) + 11,
                  max_tokens=max_tokens, **settings)
    tokens = rows.tokens.cpu().tolist()
    drawn = [(w, k, p, m, token) for (w, k, p, m, _), token in zip(cases, tokens, strict=True)]
    want = oracle_capture(drawn, "joint", max_tokens, "exact", opted)
    assert all(row["status"] == Status.OK for row in want)
    check_rows(rows, want, max_tokens, exact_values=False)
    assert set(rows.forms.cpu().tolist()) == {0, 1}

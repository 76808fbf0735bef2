"""Compaction kernel against its torch reference, random and hand-made rows."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shmask.kernels import Status, compact, reference_compact  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


def assert_same(got, want) -> None:
    for field in ("offsets", "lengths", "status", "sizes", "forms", "id_offsets"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field
    assert got.vocab == want.vocab
    assert torch.equal(got.ids[:int(want.id_offsets[-1])].cpu(), want.ids.cpu())
    assert torch.equal(got.values[:int(want.offsets[-1])].cpu(), want.values.cpu())
    for b in range(got.lengths.numel()):
        ids, values = got.row(b)
        assert ids.numel() == values.numel() == int(got.lengths[b]), f"row {b}"
        assert bool((ids[1:] > ids[:-1]).all()), f"row {b} ids not ascending"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [300, 4097, 70001])
@pytest.mark.parametrize("overflow", ["exact", "status"])
def test_random_rows_match_reference(seed: int, dtype: torch.dtype, vocab: int,
                                     overflow: str) -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + vocab)
    batch = 3 if vocab > 65536 else 6
    x = torch.randn(batch, vocab, generator=gen)
    density = torch.rand(batch, 1, generator=gen) * 0.2
    dropped = torch.rand(batch, vocab, generator=gen) > density
    keep = "finite" if seed % 2 == 0 else "positive"
    if keep == "finite":
        x[dropped] = NEG_INF
    else:
        x = x.abs() + 1e-3
        x[dropped] = 0.0
    sizes = (~dropped).sum(1)
    max_tokens = max(1, int(sizes.float().median()))  # some rows overflow, some fit
    rows = torch.rand(batch, generator=gen) > 0.25
    x = x.to(dtype).to(DEVICE)
    rows = rows.to(DEVICE)
    # scan_rows (a launch parameter): one scan step, or 3 or 2 of them
    got = compact(x, max_tokens, keep=keep, rows=rows, overflow=overflow,
                  scan_rows=(None, 2, 4)[seed])
    want = reference_compact(x, max_tokens, keep=keep, rows=rows, overflow=overflow)
    assert_same(got, want)


def edge_rows(vocab: int = 300, max_tokens: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.full((8, vocab), NEG_INF)
    # row 0: empty support
    x[1, 123] = 0.5  # one id
    x[2, torch.arange(max_tokens) * 7] = 1.0  # exactly max_tokens
    x[3, torch.arange(max_tokens + 1) * 7] = -2.0  # one past max_tokens
    x[4, :max_tokens - 1] = 3.0  # one below
    x[5] = float("nan")  # not opted in: must not matter
    x[6, vocab - 1] = 0.0  # last column only
    x[7] = torch.linspace(-1, 1, vocab)  # whole vocabulary
    rows = torch.tensor([True, True, True, True, True, False, True, True])
    return x, rows


def test_edge_rows_status_policy() -> None:
    x, rows = edge_rows()
    got = compact(x.to(DEVICE), 40, rows=rows.to(DEVICE), overflow="status")
    assert_same(got, reference_compact(x, 40, rows=rows, overflow="status"))
    assert got.status.cpu().tolist() == [
        Status.OK, Status.OK, Status.OK, Status.OVERFLOW, Status.OK, Status.SKIPPED, Status.OK,
        Status.OVERFLOW,
    ]
    assert got.lengths.cpu().tolist() == [0, 1, 40, 0, 39, 0, 1, 0]
    assert got.sizes.cpu().tolist() == [0, 1, 40, 41, 39, 0, 1, 300]
    assert got.row(1)[0].tolist() == [123]
    assert got.row(2)[0].tolist() == list(range(0, 280, 7))
    assert got.row(6)[0].tolist() == [299]
    # The overflowing row wrote nothing: row 4 starts right after row 2.
    assert int(got.offsets[4]) == int(got.offsets[3]) == 41
    assert int(got.id_offsets[4]) == int(got.id_offsets[3])


def test_edge_rows_exact_policy_drops_nothing() -> None:
    x, rows = edge_rows()
    got = compact(x.to(DEVICE), 40, rows=rows.to(DEVICE))
    assert_same(got, reference_compact(x, 40, rows=rows))
    assert got.status.cpu().tolist() == [Status.OK] * 5 + [Status.SKIPPED] + [Status.OK] * 2
    # V = 300: ids while 32 L < 300 (L <= 9) and L <= 40, else the 10-word bitmask
    assert got.forms.cpu().tolist() == [0, 0, 1, 1, 1, 0, 0, 1]
    assert got.lengths.cpu().tolist() == [0, 1, 40, 41, 39, 0, 1, 300]
    assert got.row(3)[0].cpu().tolist() == list(range(0, 287, 7))
    assert torch.equal(got.row(7)[1].cpu(), x[7])
    assert got.id_offsets.cpu().tolist() == [0, 0, 1, 11, 21, 31, 31, 32, 42]

def test_whole_vocabulary_fits_when_max_tokens_is_vocab() -> None:
    x, rows = edge_rows()
    got = compact(x.to(DEVICE), 300, rows=rows.to(DEVICE), overflow="status")
    assert_same(got, reference_compact(x, 300, rows=rows, overflow="status"))
    assert got.status[7].item() == Status.OK
    assert got.row(7)[0].cpu().tolist() == list(range(300))
    assert torch.equal(got.row(7)[1].cpu(), x[7])


def test_positive_weights_drop_zero_and_nan() -> None:
    w = torch.tensor([[0.0, 2.0, float("nan"), 1e-30, -1.0, float("inf")]])
    got = compact(w.to(DEVICE), 8, keep="positive")
    assert got.row(0)[0].cpu().tolist() == [1, 3, 5]
    assert_same(got, reference_compact(w, 8, keep="positive"))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="2-D"):
        compact(torch.zeros(3, device=DEVICE), 4)
    with pytest.raises(TypeError, match="dtype"):
        compact(torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), 4)
    with pytest.raises(ValueError, match="max_tokens"):
        compact(torch.zeros(2, 3, device=DEVICE), 0)
    with pytest.raises(ValueError, match="keep"):
        compact(torch.zeros(2, 3, device=DEVICE), 4, keep="nonzero")
    with pytest.raises(ValueError, match="rows"):
        compact(torch.zeros(2, 3, device=DEVICE), 4, rows=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="overflow"):
        compact(torch.zeros(2, 3, device=DEVICE), 4, overflow="drop")
    with pytest.raises(ValueError, match="scan_rows"):
        compact(torch.zeros(2, 3, device=DEVICE), 4, scan_rows=3)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        compact(torch.zeros(1, 151936, device=DEVICE).expand(15000, -1), 8)  # B * V

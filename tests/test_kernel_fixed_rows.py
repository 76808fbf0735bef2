"""fixed_rows (Rows -> an engine's fixed-capacity matrices) against its
row-by-row reference, in both orders and both row forms."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shmask.kernels import Form, Status, capture, launch_plan  # noqa: E402
from shmask.kernels.fixed_rows import (  # noqa: E402
    SMALL_SORT,
    SORT_LIMIT,
    fixed_rows,
    reference_fixed_rows,
    reference_spill_rows,
    spill_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(vocab: int, gen: torch.Generator, *, ties: bool = False):
    """Captured rows of every kind: ids rows, a bitmask row (top_p close to
    1 at a small vocabulary), an INVALID row (sampled outside its support),
    an OVERFLOW row and a row not opted in."""
    batch = 6
    logits = torch.randn(batch, vocab, generator=gen) * 2
    probs = torch.softmax(logits, -1)
    if ties:  # pairs of equal weights: the order among them is by id
        probs[:, 1::2] = probs[:, 0::2][:, : probs[:, 1::2].shape[1]]
        probs = probs / probs.sum(-1, keepdim=True)
    top_k = torch.tensor([20, 0, 5, 4, 100, 7], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.8, 1.0, 1.0, 1.0, 1.0])
    sampled = probs.argmax(-1).to(torch.int32)
    sampled[2] = int(probs[2].argmin())  # outside its top-5: INVALID
    opted = torch.tensor([True, True, True, True, True, False])
    rows = capture(probs.to(DEVICE), sampled.to(DEVICE), top_k=top_k.to(DEVICE),
                   top_p=top_p.to(DEVICE), max_tokens=64, overflow="status",
                   rows=opted.to(DEVICE))
    # rows 0 and 1 travel as bitmasks (32 L >= V), row 3 as ids
    assert rows.forms.tolist()[:2] == [1, 1] and rows.forms.tolist()[3] == 0
    return probs.to(DEVICE), rows


@pytest.mark.parametrize("order", ["engine", "ascending"])
@pytest.mark.parametrize("ties", [False, True])
def test_fixed_rows_match_reference(order: str, ties: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    probs, rows = _rows(320, gen, ties=ties)
    status = rows.status.cpu().tolist()
    assert status == [Status.OK, Status.OK, Status.INVALID, Status.OK, Status.OVERFLOW,
                      Status.SKIPPED], status
    batch_rows = torch.tensor([4, 0, 1, 2, 3], device=DEVICE)
    cap = 64
    ids, values, lengths = fixed_rows(rows, probs, batch_rows, cap, order)
    want_ids, want_values, want_lengths = reference_fixed_rows(rows, probs, batch_rows, cap,
                                                               order)
    assert torch.equal(lengths.cpu(), want_lengths)
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.equal(values.cpu(), want_values)
    assert lengths.tolist()[0] == 0 and lengths.tolist()[3] == 0  # OVERFLOW, INVALID
    for r, b in enumerate(batch_rows.tolist()):
        n = int(lengths[r])
        if not n:
            continue
        row_ids = ids[r, :n].long().cpu()
        weight = probs[b].cpu()[row_ids]
        if order == "engine":
            assert bool((weight[:-1] >= weight[1:]).all())
        else:
            assert bool((row_ids[:-1] < row_ids[1:]).all())
        assert torch.equal(ids[r, n:].cpu(), torch.zeros(cap - n, dtype=torch.int32))


def test_engine_order_breaks_ties_by_id() -> None:
    gen = torch.Generator().manual_seed(3)
    probs, rows = _rows(320, gen, ties=True)
    ids, _, lengths = fixed_rows(rows, probs, torch.tensor([0], device=DEVICE), 64)
    row = ids[0, : int(lengths[0])].cpu().tolist()
    weight = probs[0].cpu()
    tied = [(a, b) for a, b in zip(row[:-1], row[1:], strict=True) if weight[a] == weight[b]]
    assert tied, "the row has tied weights"
    assert all(a < b for a, b in tied)


def test_wide_capacity_sorts_with_torch() -> None:
    """Past SORT_LIMIT the sort runs in torch, with the kernel's keys."""
    gen = torch.Generator().manual_seed(11)
    probs, rows = _rows(320, gen)
    batch_rows = torch.tensor([0, 1, 3], device=DEVICE)
    wide = SORT_LIMIT + 1
    ids, values, lengths = fixed_rows(rows, probs, batch_rows, wide)
    narrow_ids, narrow_values, narrow_lengths = fixed_rows(rows, probs, batch_rows, 64)
    assert torch.equal(lengths, narrow_lengths)
    assert torch.equal(ids[:, :64], narrow_ids) and not ids[:, 64:].any()
    assert torch.equal(values[:, :64], narrow_values)


def test_bad_arguments_are_named() -> None:
    gen = torch.Generator().manual_seed(1)
    probs, rows = _rows(320, gen)
    with pytest.raises(ValueError, match="order"):
        fixed_rows(rows, probs, torch.tensor([0], device=DEVICE), 8, "descending")
    with pytest.raises(ValueError, match="cap"):
        fixed_rows(rows, probs, torch.tensor([0], device=DEVICE), 0)
    with pytest.raises(ValueError, match="weights"):
        fixed_rows(rows, probs[:, :50], torch.tensor([0], device=DEVICE), 8)
    with pytest.raises(ValueError, match="batch_rows"):
        fixed_rows(rows, probs, torch.tensor([0.0], device=DEVICE), 8)


@pytest.mark.parametrize("cap", [2048, 4096])
def test_long_rows_sort_in_the_block_they_fit(monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    """A row longer than twice SMALL_SORT sorts in parts (two launches
    after the first), one longer than SMALL_SORT (up to twice it) in twice
    SMALL_SORT's block, a short one in the small block, each in the
    engine's order; at a capacity of twice SMALL_SORT the middle block is
    the capacity's and there are no parts."""
    gen = torch.Generator().manual_seed(5)
    vocab = 4096
    probs = torch.softmax(torch.randn(4, vocab, generator=gen), -1).to(DEVICE)
    want_lengths = [SMALL_SORT + 1, 2 * SMALL_SORT, min(2 * SMALL_SORT + 300, cap), 50]
    top_k = torch.tensor(want_lengths, dtype=torch.int32, device=DEVICE)
    rows = capture(probs, probs.argmax(-1).to(torch.int32), top_k=top_k, max_tokens=cap,
                   overflow="status")
    batch_rows = torch.tensor([0, 1, 2, 3], device=DEVICE)
    # Triton's path, so the launches are recorded (a plan replays unrecorded)
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")
    with launch_plan.recording() as made:
        ids, values, lengths = fixed_rows(rows, probs, batch_rows, cap)
    assert made[0].kwargs["MIDDLE_BLOCK"] == 2 * SMALL_SORT
    # past the middle block the long rows sort in parts, then merge
    assert [launch.kernel.__name__ for launch in made[1:]] == (
        ["_part_sort_kernel", "_part_merge_kernel"] if cap > 2 * SMALL_SORT else [])
    assert all(launch.kwargs["SORT_BLOCK"] == cap for launch in made[1:])
    want = reference_fixed_rows(rows, probs, batch_rows, cap)
    assert lengths.tolist() == want_lengths
    assert torch.equal(ids.cpu(), want[0]) and torch.equal(values.cpu(), want[1])


@pytest.mark.parametrize("vocab,form", [(1024, Form.BITMASK), (16384, Form.IDS)])
def test_parts_merge_into_the_engine_order(monkeypatch: pytest.MonkeyPatch, vocab: int,
                                           form: Form) -> None:
    """Long rows sorted in many small parts and merged (the blocks shrunk so
    the interpreter's rows are small): a row whose equal weights span
    every part (their order is by id across the parts), a row that ends
    inside a part, a row of parts whole, a row one past the middle block;
    every entry in the reference's place; a capacity that is no power of
    two (the output rows and the parts' scratch rows of other strides).
    Both forms: bitmask rows (expanded by the first kernel) and ids rows
    (the parts read them from the rows' CSR). A merge that forgets one
    other part's count fails, and so do parts that read an ids row's
    matrix row the first kernel left unwritten."""
    from shmask.kernels import fixed_rows as module

    monkeypatch.setattr(module, "SMALL_SORT", 32)
    monkeypatch.setattr(module, "SORT_PART", 64)
    gen = torch.Generator().manual_seed(8)
    cap = 480  # parts of a 512-entry sort block
    probs = torch.softmax(torch.randn(4, vocab, generator=gen), -1)
    probs[0, 40:1000:4] = probs[0].max() / 2  # 240 equal weights, all kept, across the row
    probs = (probs / probs.sum(-1, keepdim=True)).to(DEVICE)
    top_k = torch.tensor([300, 2 * 32 + 1, 400, cap], dtype=torch.int32, device=DEVICE)
    rows = capture(probs, probs.argmax(-1).to(torch.int32), top_k=top_k, max_tokens=cap,
                   overflow="status")
    assert rows.forms.tolist() == [form] * 4
    batch_rows = torch.tensor([3, 0, 2, 1], device=DEVICE)
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")  # Triton's path: recorded
    with launch_plan.recording() as made:
        ids, values, lengths = fixed_rows(rows, probs, batch_rows, cap)
    assert made[1].grid == (4, 512 // 64)
    want = reference_fixed_rows(rows, probs, batch_rows, cap)
    assert lengths.tolist() == want[2].tolist()
    assert lengths.tolist()[0] == cap and lengths.tolist()[3] == 2 * 32 + 1
    assert min(lengths.tolist()) > 2 * 32 and lengths.tolist()[2] % 64 != 0
    assert torch.equal(ids.cpu(), want[0]) and torch.equal(values.cpu(), want[1])


def test_spill_rows_carry_rows_past_the_cap_whole() -> None:
    """Rows longer than an engine's capacity (capture with overflow="exact"
    and max_tokens = the capacity makes them bitmask rows) in fixed-size
    form: their words, lengths and, for support-mode slots, their values;
    every other candidate zeros and length 0."""
    gen = torch.Generator().manual_seed(5)
    vocab, cap = 300, 24
    logits = torch.randn(5, vocab, generator=gen) * torch.tensor([[0.3], [3.0], [0.2], [1.0], [0.5]])
    probs = torch.softmax(logits, -1)
    sampled = probs.argmax(-1).to(torch.int32)
    sampled[4] = int(probs[4].argmin())  # outside its top-p: INVALID, never spilled
    top_p = torch.tensor([0.9, 0.9, 0.95, 0.5, 0.3])
    rows = capture(probs.to(DEVICE), sampled.to(DEVICE), top_p=top_p.to(DEVICE), max_tokens=cap,
                   overflow="exact")
    lengths = rows.lengths.cpu().tolist()
    assert lengths[0] > cap and lengths[2] > cap and lengths[1] <= cap, lengths
    assert int(rows.status[4]) == Status.INVALID
    batch_rows = torch.tensor([2, 1, 0, 4], device=DEVICE)
    slots = torch.tensor([0, -1, -1, 1], dtype=torch.int32, device=DEVICE)
    bits, spilled, values = spill_rows(rows, batch_rows, cap, slots, 2)
    want_bits, want_lengths, want_values = reference_spill_rows(rows, batch_rows, cap, slots, 2)
    assert spilled.cpu().tolist() == [lengths[2], 0, lengths[0], 0]
    assert torch.equal(spilled.cpu(), want_lengths)
    assert torch.equal(bits.cpu(), want_bits)
    assert values is not None and want_values is not None
    assert torch.equal(values.cpu(), want_values)
    # the bits are the row's support exactly, and the values its logprobs
    decoded = ((bits[0].cpu().long()[:, None] >> torch.arange(32)) & 1).reshape(-1).nonzero()[:, 0]
    ids, row_values = rows.row(2)
    assert torch.equal(decoded, ids.cpu().long())
    assert torch.equal(values[0, :lengths[2]].cpu(), row_values.cpu())
    assert not values[0, lengths[2]:].any() and not values[1].any()
    with pytest.raises(ValueError, match="max_tokens"):
        spill_rows(rows, batch_rows, cap - 1, slots, 2)

"""Capture's sampled bounds (issue 20) against the sort-based reference.

The bound kernel sets each row's candidate range from a sample of the row;
resolve checks it exactly and reads the whole row when it was wrong, and a
top-p row with a large support (a window row) has its cutoff bracketed by
exact masses above pivots the sample places, and its support written from
one read of each chunk (the window write). These tests hold the rows exact
through all three: tied cutoffs from bf16 logits (the k-th value tied with
many others), window rows, and rows whose sampled bound is wrong on purpose.
Small vocabularies in Triton's interpreter, and top-p-only rows at the full
vocabulary (V = 151936); the full vocabulary's other tests on CUDA only
(SHMASK_TEST_GPU=1 on the H200, as `make test-gpu` runs it).
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from launcher_spy import LauncherSpy  # noqa: E402  (tests/launcher_spy.py)
from row_bits import bits  # noqa: E402  (tests/row_bits.py)
from shmask.kernels import (  # noqa: E402
    Status,
    capture,
    capture_bound,
    capture_mark,
    capture_resolve,
    capture_window,
    capture_workspace,
    compact,
    reference_capture,
    reference_compact,
    sample,
    top_p_within_rounding,
    tuning,
)
from test_kernel_capture import assert_same, dyadic_probs  # noqa: E402
from test_kernel_compact import assert_same as assert_same_compact  # noqa: E402

# the module (the package's `capture` is the function): the launchers run_capture calls
capture_module = importlib.import_module("shmask.kernels.capture")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL_VOCAB = 151936
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="full vocabulary: CUDA only (SHMASK_TEST_GPU=1)")


def bf16_probs(batch: int, vocab: int, hidden: int, sigma: float, seed: int) -> torch.Tensor:
    """softmax of (hidden @ head).float() with bf16 hidden and head, the way
    engines produce logits: the logits have bf16 precision, so many
    probabilities are exactly equal."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, hidden, generator=gen).to(torch.bfloat16)
    head = (torch.randn(hidden, vocab, generator=gen) * (sigma / hidden ** 0.5)).to(torch.bfloat16)
    if DEVICE == "cuda":
        h, head = h.cuda(), head.cuda()
    return torch.softmax((h @ head).float(), -1)


def WindowRows(monkeypatch: pytest.MonkeyPatch) -> LauncherSpy:  # noqa: N802 (reads as a class)
    """Which rows the window write wrote (window rows), read from the
    workspace's window_ok mask capture hands to launch_window_write."""
    return LauncherSpy(monkeypatch, "launch_window_write",
                       lambda probs, ws, *_: ws.window_ok.cpu().tolist())


def BracketSizes(monkeypatch: pytest.MonkeyPatch) -> LauncherSpy:  # noqa: N802
    """Each window row's candidates (its bracket's ids, plus bad values),
    read from the counts capture hands to launch_expand_local."""
    return LauncherSpy(monkeypatch, "launch_expand_local",
                       lambda probs, bits, counts, n_chunks, *_:
                       counts.view(probs.shape[0], n_chunks).sum(1).cpu())


def on_device(kwargs: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def run_both(probs, sampled, **kwargs):
    got = capture(probs.to(DEVICE), sampled.to(DEVICE), **on_device(kwargs))
    want = reference_capture(probs, sampled, **kwargs)
    assert_same(got, want)
    return got


def first_tie_inside(ordered: torch.Tensor, start: int) -> int:
    """The first k >= start whose k-th largest value is tied with the next."""
    k = start
    while ordered[k - 1] != ordered[k]:
        k += 1
    return k


def ties_at_kth(probs: torch.Tensor, k: int) -> torch.Tensor:
    """How many entries of each row equal its k-th largest value."""
    kth = probs.topk(k, dim=1).values[:, -1:]
    return (probs == kth).sum(1)


@pytest.mark.parametrize("order", ["joint", "sequential"])
def test_bf16_logits_tied_kth_value(order: str) -> None:
    """top-k on bf16-derived probabilities: every id tied with the k-th
    value is kept, exactly as the reference keeps it."""
    probs = bf16_probs(4, 3000, 64, 1.0, seed=1).cpu()
    ordered = probs.sort(1, descending=True).values
    # each k lies inside a tie group that continues past it
    top_k = torch.tensor([first_tie_inside(ordered[b], start) for b, start in
                          enumerate((50, 200, 777, 1))], dtype=torch.int32)
    sampled = probs.argmax(1)
    got = run_both(probs, sampled, top_k=top_k, top_p=torch.tensor([1.0, 0.9, 1.0, 1.0]),
                   min_p=torch.tensor([0.0, 0.0, 0.0, 0.3]), max_tokens=300, order=order)
    sizes = got.sizes.cpu()
    assert sizes[0] > top_k[0] and sizes[2] > top_k[2]  # the ties past k are kept


def test_bf16_logits_sample_draws_inside_tied_support() -> None:
    probs = bf16_probs(4, 3000, 64, 1.0, seed=2).cpu()
    got = sample(probs.to(DEVICE), torch.arange(4, device=DEVICE) + 11, top_k=500,
                 max_tokens=3000)
    assert (got.status.cpu() == Status.OK).all()
    want = reference_capture(probs, got.tokens.cpu().long(), top_k=500, max_tokens=3000)
    assert_same(got, want)


def test_window_rows_top_p_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-p-only rows past the window threshold: the support comes from the
    window write, its bitmask straight from the read; rows with top-k,
    greedy or min-p rows in the same batch keep the candidate path."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    window = WindowRows(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    vocab = 4000
    probs = dyadic_probs(6, vocab, gen, scale=1.0)
    top_k = torch.tensor([0, 0, 0, 40, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.5, 0.97, 0.9, 0.9, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.0])
    greedy = torch.tensor([False] * 5 + [True])
    rows = torch.tensor([True, True, False, True, True, True])
    sampled = probs.argmax(1)
    got = run_both(probs, sampled, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy,
                   rows=rows, max_tokens=100)
    # rows 0 and 1 are window rows; 2 is not opted in, 3 has top-k, 4's min-p
    # floor leaves few candidates, 5 is greedy
    assert window.calls == [[1, 1, 0, 0, 0, 0]]
    sizes = got.sizes.cpu().tolist()
    assert sizes[0] > 100 and got.forms[0].item() == 1  # a large support: the bitmask form
    assert got.status[2].item() == Status.SKIPPED and got.lengths[2].item() == 0


def test_window_rows_min_p_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Min-p-only rows (top-k and top-p off) past the window threshold take
    the window path too: their cutoff, min_p x the row's max, from the
    candidate mark's max, their support from one read of each chunk; rows
    with top-k, top-p, greedy or a bad value beside them keep their paths.
    sample() draws a min-p window row by inverse transform (a token in its
    support, the row OK), the others by the race, as with no window rows."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    window = WindowRows(monkeypatch)
    gen = torch.Generator().manual_seed(13)
    vocab = 3000
    probs = torch.softmax(torch.randn(6, vocab, generator=gen), -1)  # flat: no heavy value
    probs[5, 321] = float("nan")
    top_k = torch.tensor([0, 0, 40, 0, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.05, 0.3, 0.05, 0.05, 0.05, 0.05])
    greedy = torch.tensor([False, False, False, True, False, False])
    settings = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "greedy": greedy}
    got = run_both(probs, probs.argmax(1), **settings, max_tokens=vocab)
    # rows 0 and 4 are min-p window rows; 1's floor keeps few ids (the
    # candidate path), 2 has top-k, 3 is greedy, 5 a NaN
    assert window.calls == [[1, 0, 0, 0, 1, 0]]
    sizes = got.sizes.cpu().tolist()
    assert sizes[0] > 64 >= sizes[1] and got.forms[0].item() == 1
    assert got.status[5].item() == Status.INVALID
    # sample(): a min-p window row is drawn in its support (by inverse
    # transform), its rows capture's for the token; the other rows draw
    # the race's token, as they do with no window rows in the call
    seeds = torch.arange(6, device=DEVICE) + 5
    drawn = sample(probs.to(DEVICE), seeds, **on_device(settings), max_tokens=vocab)
    assert_same(drawn, reference_capture(probs, drawn.tokens.cpu().long(), **settings,
                                         max_tokens=vocab))
    monkeypatch.setattr(tuning, "WINDOW_MIN", vocab)  # no window rows
    plain = sample(probs.to(DEVICE), seeds, **on_device(settings), max_tokens=vocab)
    assert len(window.calls) == 3 and window.calls[2] == [0] * 6, window.calls
    candidates = [1, 2, 3, 5]
    assert drawn.tokens.cpu()[candidates].tolist() == plain.tokens.cpu()[candidates].tolist()
    for b in (0, 4):  # the min-p window rows: drawn, OK, in their support
        assert drawn.status[b].item() == Status.OK
        assert int(drawn.tokens[b]) in drawn.row(b)[0].cpu().tolist()


def test_window_rows_overflow_status_and_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    probs = dyadic_probs(4, vocab, gen, scale=1.0)
    sampled = probs.argmax(1)
    sampled[1] = int(probs[1].argmin())  # outside its support: INVALID
    got = run_both(probs, sampled, top_p=0.9, max_tokens=50, overflow="status")
    assert got.status.cpu().tolist() == [Status.OVERFLOW, Status.INVALID, Status.OVERFLOW,
                                         Status.OVERFLOW]
    got = run_both(probs, sampled, top_p=0.9, max_tokens=vocab)  # exact: 32 L >= V, bitmasks
    assert got.forms.cpu().tolist() == [1, 0, 1, 1]


def test_window_rows_with_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN, an inf or a negative value in a window row (whose candidates
    are its bracket's ids: the bad values' bits lie outside it) is a
    candidate all the same, and the row comes out INVALID; -0.0 is a zero."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    window = WindowRows(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    vocab = 3000
    probs = dyadic_probs(4, vocab, gen, scale=1.0)
    probs[1, 1234] = float("nan")
    probs[2, vocab - 1] = float("inf")
    probs[3, 7] = -0.25
    probs[0, 11] = -0.0  # not bad: a zero
    got = run_both(probs, probs.argmax(1), top_p=0.9, max_tokens=vocab)
    assert got.status.cpu().tolist() == [Status.OK] + [Status.INVALID] * 3
    assert window.calls == [[1, 0, 0, 0]]  # row 0 took the window path


@triton.jit
def _bracket_search_kernel(vals_ptr, n, targets_ptr, lo_ptr, hi_ptr, bisected_ptr, searched_ptr,
                           BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """Program i: resolve's search over bracket i both ways, the bisection
    over all 31 bits clamped into the bracket (what resolve did before) and
    the search over the bracket's keys alone."""
    i = tl.program_id(0)
    base = tl.zeros([], dtype=tl.int64)
    idx = tl.arange(0, BLOCK)
    live = idx < n
    v = tl.load(vals_ptr + idx, mask=live, other=0.0)
    key = v.to(tl.int32, bitcast=True)
    target = tl.load(targets_ptr + i)
    lo = tl.load(lo_ptr + i)
    hi = tl.load(hi_ptr + i)
    bisected = capture_resolve._largest_key_reaching(vals_ptr, base, n, v, key, live, target,
                                                    True, BLOCK)
    tl.store(bisected_ptr + i, tl.minimum(tl.maximum(bisected, lo), hi))
    tl.store(searched_ptr + i, capture_resolve._largest_key_between(
        vals_ptr, base, n, v, key, live, target, lo, hi, BLOCK, WAYS))


@pytest.mark.parametrize("ways", [2, 4])
def test_bracket_search_is_the_clamped_bisection(ways: int) -> None:
    """A window row's cutoff searched over its bracket [lo, hi] alone is
    the 31-bit bisection's clamped into the bracket, for candidates in
    registers and past them (BLOCK 32), ties, brackets of 1 to 4 keys and
    of the whole key range, and targets at 0, below 0, NaN, the total, past
    it and tiny."""
    gen = torch.Generator().manual_seed(19)
    for n, ties in ((5, False), (40, True), (70, False)):
        vals = torch.rand(n, generator=gen) ** 4
        if ties:
            vals[:n // 2] = vals[0]
        keys = vals.view(torch.int32).sort().values
        total = float(vals.sum())
        targets = torch.cat([torch.rand(40, generator=gen) * total * 1.1,
                             torch.tensor([0.0, -1.0, total, 2 * total, float(vals.min()),
                                           1e-38, math.nan, float(vals.max())])])
        near = torch.cat([keys, keys - 1, keys + 1])
        lo = near[torch.randint(0, near.numel(), (48,), generator=gen)].clamp(1, 0x7F800000)
        hi = torch.maximum(near[torch.randint(0, near.numel(), (48,), generator=gen)], lo)
        for width, rows in ((0, slice(0, 4)), (1, slice(4, 8)), (2, slice(8, 10)),
                            (3, slice(10, 12))):
            hi[rows] = lo[rows] + width
        lo[12], hi[12] = 1, 0x7F800000
        hi = hi.clamp(max=0x7F800000)
        bisected, searched = (torch.zeros(48, dtype=torch.int32, device=DEVICE)
                              for _ in range(2))
        _bracket_search_kernel[(48,)](vals.to(DEVICE), n, targets.to(DEVICE),
                                      lo.to(DEVICE, torch.int32), hi.to(DEVICE, torch.int32),
                                      bisected, searched, BLOCK=32, WAYS=ways)
        assert torch.equal(searched, bisected), (n, (searched != bisected).nonzero()[:4])


@triton.jit
def _row_floor_kernel(w_ptr, vocab, targets_ptr, start_ptr, hi_ptr, mass_ptr, out_ptr,
                      FIT: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr,
                      LOADS: tl.constexpr):
    """Program i: resolve's whole-row narrowing (_row_floor) over row i."""
    i = tl.program_id(0)
    tl.store(out_ptr + i, capture_resolve._row_floor(
        w_ptr + i * vocab, vocab, tl.load(targets_ptr + i), tl.load(start_ptr + i),
        tl.load(hi_ptr + i), tl.load(mass_ptr + i) != 0, FIT, BLOCK, WAYS, LOADS))


@pytest.mark.parametrize("tile", ["window", "no_window"])
def test_whole_row_floor_never_passes_the_cutoff(tile: str) -> None:
    """The whole-row passes of a row the sample misled (_row_floor: counts
    and sums above 7 probes a pass over the whole row, FLOOR_LOADS blocks
    loaded a step; both tiles, a window call's and the other calls') end at
    a floor at or under the exact cutoff t (the largest key
    whose count, or mass, of the row's finite w > 0 at or above it reaches
    the target) and narrow it: over the row's two steps of blocks and its
    partial one, bad values left out, counts and masses, targets halfway
    between two cumulative sums (away from float32's rounding)."""
    gen = torch.Generator().manual_seed(38)
    rows, fit = 24, 64
    loads, block = ((tuning.FLOOR_LOADS, tuning.FLOOR_BLOCK) if tile == "window" else
                    (tuning.FLOOR_LOADS_NO_WINDOW, tuning.FLOOR_BLOCK_NO_WINDOW))
    vocab = 2 * loads * block + 904  # two steps and a partial one
    w = torch.rand(rows, vocab, generator=gen) ** 6
    w[3, 100], w[4, vocab - 1], w[5, 2050] = float("nan"), float("inf"), -1.0  # bad: left out
    good = torch.isfinite(w) & (w > 0)
    keys = torch.where(good, w, 0.0).view(torch.int32)
    targets, cutoffs, starts, his, mass = [], [], [], [], []
    for r in range(rows):
        k = keys[r][good[r]].sort(descending=True).values
        v = k.view(torch.float32).double()
        use_mass = r % 2 == 0
        reach = v.cumsum(0) if use_mass else torch.arange(1, k.numel() + 1).double()
        # (a mass target among the row's larger values: the gap between two
        # cumulative sums, w ~ 0.6 there, stands well above float32's rounding)
        at = int(torch.randint(40, 400 if use_mass else k.numel() - 40, (1,), generator=gen))
        while k[at] == k[at - 1]:  # a position where the key changes: t is k[at]
            at += 1
        targets.append(float((reach[at - 1] + reach[at]) / 2))
        cutoffs.append(int(k[at]))
        his.append(int(k[int(torch.randint(0, 30, (1,), generator=gen))]))
        starts.append(1 if r % 3 else int(k[-1]))
        mass.append(int(use_mass))
    device_args = [torch.tensor(x, dtype=dt, device=DEVICE) for x, dt in
                   ((targets, torch.float32), (starts, torch.int32), (his, torch.int32),
                    (mass, torch.int32))]
    out = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    _row_floor_kernel[(rows,)](w.to(DEVICE), vocab, *device_args, out, FIT=fit,
                               BLOCK=block, WAYS=tuning.FLOOR_WAYS, LOADS=loads)
    floors = out.cpu()
    for r in range(rows):
        t, f = cutoffs[r], int(floors[r])
        assert starts[r] <= f <= t, (r, f, t)
        # at least one pass narrowed [start, hi) by WAYS: the floor sits in
        # the eighth of the span that holds t
        assert t - f <= (his[r] - starts[r]) // tuning.FLOOR_WAYS + 1, (r, f, t)
        # and exactly where the passes' probes put it: a block left out or
        # summed twice moves a probe's count or mass, and with it the floor
        k = keys[r][good[r]]
        assert f == _floor_by_passes(k.long(), k.view(torch.float32).double(), targets[r],
                                     starts[r], his[r], mass[r] == 1, fit), (r, f)


def _floor_by_passes(keys: torch.Tensor, values: torch.Tensor, target: float, lo: int, hi: int,
                     use_mass: bool, fit: int) -> int:
    """_row_floor's passes over exact counts and float64 masses: the probes
    lo + span j / WAYS, the last reaching kept, until the ids above it fit."""
    ways = tuning.FLOOR_WAYS
    for _ in range(4):
        if hi - lo <= 1:
            break
        probes = [lo + ((hi - lo) * j) // ways for j in range(ways)]
        counts = [int((keys >= p).sum()) for p in probes]
        reach = [float(values[keys >= p].sum()) if use_mass else float(c)
                 for p, c in zip(probes, counts, strict=True)]
        last = max(j for j in range(ways) if j == 0 or reach[j] >= target)
        hi = min([hi] + [p for j, p in enumerate(probes) if j > 0 and reach[j] < target])
        lo = probes[last]
        if counts[last] <= fit:
            break
    return lo


def test_window_rows_bracketed_by_pivots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Window rows whose bracket (the ids between the two pivots around the
    top-p cutoff) holds more ids than the resolve program keeps in registers
    (shrunk here to 128, with 4 pivots), over rows spanning three chunks
    (the support's count per chunk places the window write): a row of one
    value throughout (ties at every pivot), a row whose sampled blocks hold
    only its small values (its cutoff lies above the sampled range, in the
    bracket above the top pivot), and a row whose min-p floor lies above its
    top-p cutoff."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    monkeypatch.setattr(tuning, "RESOLVE_BLOCK", 128)
    monkeypatch.setattr(tuning, "WINDOW_PIVOTS", 4)
    window = WindowRows(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    vocab = 2 * tuning.CHUNK + 1500
    probs = dyadic_probs(5, vocab, gen, scale=0.7)
    probs[2] = 1 / 2**14  # one value throughout (a power of two: sums exact)
    probs[2, vocab - 1024:] = 0.0
    # the bound's sampled blocks (as _bound_kernel spreads them) see 2^-16,
    # the rest of the row is 2^-13
    cols = tuning.SAMPLE_COLS
    blocks = tuning.SAMPLE_BLOCKS
    probs[3] = 1 / 2**13
    for b in range(blocks):
        start = b * (vocab - cols) // (blocks - 1)
        probs[3, start:start + cols] = 1 / 2**16
    # top-p 0.75 needs the first two values; min-p's floor (0.751 x the
    # first) lies just above the second, in the sampled range's top bucket
    probs[4] = 0.0
    probs[4, :6000] = 1 / 2**14
    probs[4, 6000:12000] = 0.75 / 2**14
    probs[4, 12000:18000] = 0.5 / 2**14
    top_p = torch.tensor([0.9, 0.5, 0.6, 0.5, 0.75])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.751])
    sampled = probs.argmax(1)
    got = run_both(probs, sampled, top_p=top_p, min_p=min_p, max_tokens=vocab)
    assert window.calls == [[1] * 5]
    sizes = got.sizes.cpu()
    assert (sizes > 128 * 4).all() and (got.forms.cpu() == 1).all()
    assert sizes[2] == vocab - 1024  # ties: every id of the value is kept
    assert sizes[3] == vocab - blocks * cols  # the ids outside the sample
    assert sizes[4] == 6000  # row 4's min-p floor binds
    ids_form = run_both(probs[:2], sampled[:2], top_p=0.9, max_tokens=vocab // 2)
    assert (ids_form.forms.cpu() == 1).all()


@pytest.mark.parametrize("layout", [(1, 150, 100), (1, 2, 2)], ids=["outer", "squeezed"])
def test_wide_brackets_refined(monkeypatch: pytest.MonkeyPatch, layout) -> None:
    """Window rows whose top-p cutoff lies outside the inner pivots (squeezed
    here to +-1% of the sampled range around its estimate, so that every
    row's does: a sample that missed): the bracket reaching out to an outer
    pivot, or past the outermost ones (all pivots squeezed: the refining
    keys then lie a pivots' width beyond), is narrowed by the exact masses
    above WINDOW_REFINE keys inside it before its ids are marked. Every row
    equals the reference; with the outer pivots in place, 8 refining keys
    leave each row fewer candidates than 1."""
    inner, below, above = layout
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    monkeypatch.setattr(tuning, "WINDOW_INNER_MIN", inner)
    monkeypatch.setattr(tuning, "WINDOW_INNER_MAX", inner)
    monkeypatch.setattr(tuning, "WINDOW_BELOW", below)
    monkeypatch.setattr(tuning, "WINDOW_ABOVE", above)
    window = WindowRows(monkeypatch)
    brackets = BracketSizes(monkeypatch)
    gen = torch.Generator().manual_seed(21)
    vocab = 2 * tuning.CHUNK + 1500
    probs = dyadic_probs(4, vocab, gen, scale=0.7)
    top_p = torch.tensor([0.9, 0.5, 0.75, 0.95])
    for refine in (8, 1):
        monkeypatch.setattr(tuning, "WINDOW_REFINE", refine)
        got = run_both(probs, probs.argmax(1), top_p=top_p, max_tokens=vocab)
        assert (got.sizes.cpu() > 64).all()
    assert window.calls == [[1] * 4] * 2
    if below > inner:
        assert (brackets.calls[0] < brackets.calls[1]).all(), brackets.calls


@pytest.mark.parametrize("scale, inner_max", [(100, 40), (150, 60)])
def test_inner_pivots_follow_the_estimates_standard_error(monkeypatch: pytest.MonkeyPatch,
                                                          scale: int, inner_max: int) -> None:
    """A window row's inner pivots span +-h hundredths of its sampled range,
    h the standard error of the sample's top-p share, sqrt(p (1 - p) / n)
    with n = (sum w)^2 / sum w^2, in hundredths of 2 x P_MARGIN of mass,
    within [WINDOW_INNER_MIN, WINDOW_INNER_MAX]: a flat row (n ~ V) takes
    the least, a row of ten heavy ids a wider one, a row of twenty heavier
    ones the most; WINDOW_INNER_SCALE percent of it (the middle row's h
    19 at 100, 28 at 150). h is read back from the pivots the bound stored
    (the inner pivots' spread against the outer ones'); rows equal the
    reference."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    monkeypatch.setattr(tuning, "WINDOW_INNER_SCALE", scale)
    monkeypatch.setattr(tuning, "WINDOW_INNER_MAX", inner_max)
    gen = torch.Generator().manual_seed(23)
    vocab = 6000  # under the sample's 8 x 1024 columns: the whole row is the sample
    body = torch.rand(3, vocab, generator=gen, dtype=torch.float64) + 0.5
    for row, (heavy, share) in enumerate([(0, 0.0), (10, 0.2), (20, 0.6)]):
        if heavy:
            ids = torch.randperm(vocab, generator=gen)[:heavy]
            body[row] *= (1 - share) / body[row].sum()
            body[row, ids] = share / heavy
    probs = (body / body.sum(1, keepdim=True)).float()
    top_p = 0.9
    settings = capture_workspace.CaptureSettings.of(
        3, vocab, torch.device(DEVICE), top_k=None, top_p=top_p, min_p=None, greedy=None,
        rows=None, sequential=False)
    ws = capture_workspace.CaptureWorkspace.allocate(3, vocab, torch.device(DEVICE),
                                                     settings.window)
    capture_bound.launch_bound(probs.to(DEVICE), settings, ws, False)
    assert ws.window.cpu().tolist() == [1, 1, 1]
    pivots = ws.pivots.view(3, tuning.WINDOW_PIVOTS).cpu().double()
    ratio = (pivots[:, -2] - pivots[:, 1]) / (pivots[:, -1] - pivots[:, 0])
    got = (ratio * (tuning.WINDOW_BELOW + tuning.WINDOW_ABOVE) / 2).tolist()
    w = probs.double()
    n = w.sum(1) ** 2 / (w * w).sum(1)
    scaled = (top_p * (1 - top_p) / n).sqrt() * 50 / tuning.P_MARGIN
    scaled = scaled * tuning.WINDOW_INNER_SCALE / 100
    want = scaled.clamp(tuning.WINDOW_INNER_MIN, tuning.WINDOW_INNER_MAX).floor().tolist()
    assert want[0] == tuning.WINDOW_INNER_MIN < want[1] < want[2] == tuning.WINDOW_INNER_MAX
    assert all(abs(g - h) < 1 for g, h in zip(got, want, strict=True)), (got, want)
    run_both(probs, probs.argmax(1), top_p=top_p, max_tokens=vocab)


def test_a_row_its_sample_places_loosely_is_a_window_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A top-p-only row that its count floor leaves unsettled, whose sample
    places its top-p share with a standard error of WINDOW_UNSURE
    thousandths or more (20 heavy ids holding 60% of its mass, a sample of
    41% of the row), is a window row though its floor keeps fewer ids than
    WINDOW_MIN: its mass floor could lie above the cutoff of a row the
    sample misjudged, and a window row never falls back to the whole-row
    passes. A flat row with a like floor (error ~3) is not; with the rule
    off neither is; nor is the heavy row in a vocabulary the sample holds
    whole (its estimates are exact). The rows equal the reference."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 4096)
    monkeypatch.setattr(tuning, "P_KEEP", 256)
    window = WindowRows(monkeypatch)
    gen = torch.Generator().manual_seed(31)

    def rows(vocab: int, flat: int) -> torch.Tensor:
        """A row whose 20 heavy ids hold 60% of its mass over a flat body,
        then ``flat`` rows of the body alone."""
        body = torch.rand(1 + flat, vocab, generator=gen, dtype=torch.float64) + 0.5
        body[0] *= 0.4 / body[0].sum()
        body[0, torch.randperm(vocab, generator=gen)[:20]] = 0.6 / 20
        return (body / body.sum(1, keepdim=True)).float()

    vocab = 20000  # the sample (8 x 1024 columns) is 41% of the row
    probs = rows(vocab, 1)
    top_p = torch.tensor([0.6, 0.1])
    for unsure, flags in ((tuning.WINDOW_UNSURE, [1, 0]), (10**6, [0, 0])):
        monkeypatch.setattr(tuning, "WINDOW_UNSURE", unsure)
        got = run_both(probs, probs.argmax(1), top_p=top_p, max_tokens=vocab)
        assert window.calls[-1] == flags, (unsure, window.calls)
        # neither floor keeps WINDOW_MIN ids: both rows' supports lie under it
        assert (got.sizes.cpu() < tuning.WINDOW_MIN).all(), got.sizes
    monkeypatch.setattr(tuning, "WINDOW_UNSURE", 25)
    whole = 6000  # under the sample's 8 x 1024 columns: the whole row is the sample
    probs = rows(whole, 0)
    run_both(probs, probs.argmax(1), top_p=0.6, max_tokens=whole)
    assert window.calls[-1] == [0], window.calls


def test_window_rows_top_p_near_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Window rows with top_p + P_MARGIN >= 1: the sampled range has no lower
    end (its floor's target is the sample's whole mass), so the pivots are
    spread by twice the width of [estimate, hi): the rows equal the
    reference and each bracket holds a small part of its support, not the
    whole of it (the spread of [lo, hi) there: ~13 binades)."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    window = WindowRows(monkeypatch)
    brackets = BracketSizes(monkeypatch)
    gen = torch.Generator().manual_seed(22)
    vocab = 2 * tuning.CHUNK + 1500
    probs = dyadic_probs(3, vocab, gen, scale=0.7)
    top_p = torch.tensor([0.95, 0.97, 0.99])
    got = run_both(probs, probs.argmax(1), top_p=top_p, max_tokens=vocab)
    assert window.calls == [[1] * 3]
    sizes = got.sizes.cpu()
    assert (brackets.calls[0] < sizes // 4).all(), (brackets.calls, sizes)


@pytest.mark.parametrize("squeezed", [False, True], ids=["narrow", "wide"])
def test_window_mark_in_either_chunk_order_keeps_the_rows(monkeypatch: pytest.MonkeyPatch,
                                                          squeezed: bool) -> None:
    """The window mark taking each row's chunks last to first
    (WINDOW_MARK_REVERSED, for the chunks the candidate mark left in L2)
    marks the same ids, counts and sums as first to last, the window
    refine's orders (REFINE_ORDER) refine the same brackets, and the
    interleaved mark (MARK_INTERLEAVE; groups of one and two rows, second
    reads one and two groups behind, so that more than one group waits)
    marks them too: rows of three chunks, flat and mid-size, and one that
    is not a window row (top-p off, min-p off: a top-k row), equal bit for
    bit, and the reference; with the inner pivots squeezed most brackets
    are wide (refined, after the interleaved mark)."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    if squeezed:  # test_wide_brackets_refined's "outer" layout
        monkeypatch.setattr(tuning, "WINDOW_INNER_MIN", 1)
        monkeypatch.setattr(tuning, "WINDOW_INNER_MAX", 1)
    window = WindowRows(monkeypatch)
    workspaces = LauncherSpy(monkeypatch, "launch_window",
                             lambda probs, settings, ws, pdl, interleaved=False: ws)
    interleaved = LauncherSpy(monkeypatch, "launch_interleaved_mark",
                              lambda probs, settings, ws, pdl: tuning.INTERLEAVE_GROUP)
    # the scratch is kept from call to call: what the marks write is
    # poisoned first (and what the bound clears), so that each call's rows
    # are its own stages' work
    LauncherSpy(monkeypatch, "launch_bound", lambda probs, settings, ws, pdl: [
        array.fill_(value) for array, value in ((ws.bits, -1), (ws.counts, 7), (ws.done, 5),
                                                (ws.above_count, 3), (ws.above_mass, 0.25),
                                                (ws.wide_count, 9), (ws.bracket, 2))])
    gen = torch.Generator().manual_seed(43)
    vocab = 2 * tuning.CHUNK + 900
    probs = torch.softmax(torch.randn(4, vocab, generator=gen)
                          * torch.tensor([[0.5], [2.5], [1.0], [1.5]]), -1)
    top_p = torch.tensor([0.9, 0.6, 0.99, 1.0])
    top_k = torch.tensor([0, 0, 0, 50], dtype=torch.int32)
    written = {}
    # (reversed, refine order, interleaved, group, lag)
    settings = ((0, 0, 0, 8, 1), (1, 2, 0, 8, 1), (1, 1, 0, 8, 1), (1, 2, 1, 1, 1),
                (1, 2, 1, 2, 1), (0, 0, 1, 1, 2))
    for reverse, order, interleave, group, lag in settings:
        monkeypatch.setattr(tuning, "WINDOW_MARK_REVERSED", reverse)
        monkeypatch.setattr(tuning, "REFINE_ORDER", order)
        monkeypatch.setattr(tuning, "MARK_INTERLEAVE", interleave)
        monkeypatch.setattr(tuning, "INTERLEAVE_GROUP", group)
        monkeypatch.setattr(tuning, "INTERLEAVE_LAG", lag)
        written[reverse, order, interleave, group, lag] = bits(
            run_both(probs, probs.argmax(1), top_k=top_k, top_p=top_p, max_tokens=vocab))
        wide = int(workspaces.calls[-1].wide_count.item())
        assert wide >= 2 if squeezed else wide == 0
    assert window.calls == [[1, 1, 1, 0]] * len(settings)
    assert interleaved.calls == [1, 2, 1]
    for key in settings[1:]:
        assert written[key] == written[settings[0]], key


def test_window_row_in_the_ids_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window row whose exact support turns out small (its large values
    all outside the sampled blocks, so the sample expects thousands of ids):
    the window write stores its ids (32 L < V), not bitmask words."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    window = WindowRows(monkeypatch)
    vocab = 2 * tuning.CHUNK + 900
    probs = torch.full((2, vocab), 1 / 2**20)
    probs[0, 5000:5040] = 1 / 2**6  # 40 ids between the sampled blocks
    got = run_both(probs, probs.argmax(1), top_p=0.5, max_tokens=vocab)
    assert window.calls == [[1, 1]]
    assert got.sizes[0].item() == 40 and got.forms[0].item() == 0
    assert got.forms[1].item() == 1  # the flat row: every id (ties), a bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_write_one_column_a_lane_writes_the_same_rows(monkeypatch: pytest.MonkeyPatch,
                                                              dtype: torch.dtype) -> None:
    """The window write's step read one column a lane (WINDOW_WRITE_LANES,
    _window_write_lanes) writes the rows the [words, 32] tile writes, bit for
    bit, and the reference's: bitmask rows (flat, ids in every word, a last
    word of 4 columns), a row in the ids form, and zeros and -0.0 kept out
    of the support (a bad value makes its row INVALID: no window write)."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    window = WindowRows(monkeypatch)
    gen = torch.Generator().manual_seed(45)
    vocab = 2 * tuning.CHUNK + 900  # 17284 = 540 words and 4 columns
    probs = torch.softmax(torch.randn(4, vocab, generator=gen)
                          * torch.tensor([[0.5], [1.5], [1.0], [0.0]]), -1)
    probs[3] = 1 / 2**20
    probs[3, 5000:5040] = 1 / 2**6  # 40 ids between the sampled blocks: the ids form
    probs[2, 77] = -0.0
    probs[2, 9000:9100] = 0.0
    probs = probs.to(dtype)
    top_p = torch.tensor([0.9, 0.6, 0.95, 0.5])
    written = {}
    for lanes in (0, 1):
        monkeypatch.setattr(tuning, "WINDOW_WRITE_LANES", lanes)
        got = run_both(probs, probs.argmax(1), top_p=top_p, max_tokens=vocab)
        written[lanes] = bits(got)
    assert window.calls == [[1, 1, 1, 1]] * 2
    assert got.forms.tolist() == [1, 1, 1, 0]
    assert written[1] == written[0]


@pytest.mark.parametrize("window_min, block", [(64, None), (1 << 30, None), (1 << 30, 64)])
def test_wrong_sampled_bounds_are_resolved_from_the_row(monkeypatch: pytest.MonkeyPatch,
                                                        kept: dict, window_min: int,
                                                        block: int | None) -> None:
    """Bounds that are wrong on purpose (too few ids asked above the top-k
    floor, top-p margins of the wrong sign): resolve notices and reads the
    whole row; every row still equals the reference. With ``block``, the
    rows resolved from the whole row keep more candidates (up to FLOOR_FIT)
    than resolve holds in registers, and its searches read the rest from
    memory."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", window_min)
    if block is not None:
        monkeypatch.setattr(tuning, "RESOLVE_BLOCK", block)
        monkeypatch.setattr(tuning, "FLOOR_FIT", 8 * block)
    monkeypatch.setattr(tuning, "K_SLACK", 0.2)
    monkeypatch.setattr(tuning, "P_MARGIN", -0.04)
    gen = torch.Generator().manual_seed(5)
    vocab = 2500
    probs = dyadic_probs(6, vocab, gen, scale=1.5)
    top_k = torch.tensor([700, 0, 0, 300, 1, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.6, 0.95, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05])
    for order in ("joint", "sequential"):
        run_both(probs, probs.argmax(1), top_k=top_k, top_p=top_p, min_p=min_p,
                 max_tokens=200, order=order)
    got = sample(probs.to(DEVICE), torch.arange(6, device=DEVICE), top_k=top_k.to(DEVICE),
                 top_p=top_p.to(DEVICE), min_p=min_p.to(DEVICE), max_tokens=200)
    assert_same(got, reference_capture(probs, got.tokens.cpu().long(), top_k=top_k,
                                       top_p=top_p, min_p=min_p, max_tokens=200))
    ws = kept["ws"]
    from_the_row = ws.cutoff.cpu() < ws.lo.cpu()
    assert from_the_row.any()
    if block is not None:  # and some kept more candidates than the registers hold
        assert (ws.n_cand.cpu()[from_the_row] > block).any(), ws.n_cand.tolist()



@pytest.mark.parametrize("order", ["joint", "sequential"])
def test_wrong_top_k_bounds_in_a_call_without_window_rows(monkeypatch: pytest.MonkeyPatch,
                                                          kept: dict, order: str) -> None:
    """A call with top-k on every row (scalar settings) cannot have window
    rows: its resolve is compiled without them, with the smaller whole-row
    tile (FLOOR_LOADS_NO_WINDOW x FLOOR_BLOCK_NO_WINDOW). Top-k floors wrong
    on purpose (too few ids asked above them) send rows to the whole row:
    in joint order through _row_floor's passes over that tile (two steps
    and a partial one), in sequential order through top-k's own search over
    the row; every row, with top-p and min-p beside top-k, equals the
    reference."""
    resolves = LauncherSpy(monkeypatch, "launch_resolve", lambda *args: args[1].window)
    monkeypatch.setattr(tuning, "K_SLACK", 0.2)
    gen = torch.Generator().manual_seed(6)
    vocab = 2 * tuning.FLOOR_LOADS_NO_WINDOW * tuning.FLOOR_BLOCK_NO_WINDOW + 700
    probs = dyadic_probs(4, vocab, gen, scale=1.5)
    got = run_both(probs, probs.argmax(1), top_k=600, top_p=0.95, min_p=0.01,
                   max_tokens=vocab, order=order)
    assert resolves.calls == [False]  # the call's kernels compiled without window rows
    ws = kept["ws"]
    assert (ws.cutoff.cpu() < ws.lo.cpu()).any(), (ws.cutoff.tolist(), ws.lo.tolist())
    assert (got.status.cpu() == Status.OK).all()

def test_sampled_rows_spread_over_a_long_row() -> None:
    """V past the sample's 8192 columns: the bound sees part of the row; a
    row whose large values all sit outside the sampled blocks still comes out
    exact (through the whole-row fallback)."""
    gen = torch.Generator().manual_seed(6)
    vocab = 20000
    probs = dyadic_probs(3, vocab, gen, scale=1.0)
    probs[2] = 0.0
    probs[2, 7100:7164] = 1 / 64  # between the 1st and 2nd sampled blocks
    sampled = probs.argmax(1)
    run_both(probs, sampled, top_k=torch.tensor([100, 1000, 10], dtype=torch.int32),
             top_p=torch.tensor([1.0, 0.9, 1.0]), max_tokens=vocab)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bad_values_outside_a_sample_of_zeros(dtype: torch.dtype) -> None:
    """A top-p row whose sampled blocks hold only zeros: the sample's mass is
    0, so its top-p floor (the largest key reaching 0) lies above +inf's and
    the NaNs' float bits. A NaN or inf outside the sampled blocks is a
    candidate all the same, and the row is INVALID (not resolved from its
    finite values by the whole-row fallback)."""
    vocab = 20000
    probs = torch.zeros(3, vocab)
    probs[:, 7100:7164] = 1 / 64  # between the 3rd and 4th sampled blocks
    probs[0, 7200] = float("nan")
    probs[1, 7200] = float("inf")
    probs = probs.to(dtype)
    got = run_both(probs, probs.float().nan_to_num(0.0, 0.0).argmax(1), top_p=0.9,
                   max_tokens=vocab)
    assert got.status.cpu().tolist() == [Status.INVALID, Status.INVALID, Status.OK]


def assert_top_p_rows(got, probs: torch.Tensor, top_p: float) -> int:
    """Each row (captured with probs.argmax(1) as the sampled tokens) equals
    the reference, or (counted and returned) is the top-p
    support of a target within fp32 rounding of a cumulative mass
    (top_p_within_rounding), with its logprobs over its own support."""
    want = reference_capture(probs, probs.argmax(1), top_p=top_p, max_tokens=probs.shape[1])
    flipped = 0
    for b in range(probs.shape[0]):
        ids, values = (x.cpu() for x in got.row(b))
        want_ids, want_values = want.row(b)
        if torch.equal(ids, want_ids):
            torch.testing.assert_close(values, want_values, atol=2e-5, rtol=0)
            continue
        support = torch.zeros(1, probs.shape[1], dtype=torch.bool)
        support[0, ids] = True
        assert top_p_within_rounding(probs[b:b + 1], support, top_p).item(), (
            b, ids.numel(), want_ids.numel())
        w = probs[b, ids].double()
        torch.testing.assert_close(values.double(), w.log() - w.sum().log(), atol=2e-5, rtol=0)
        flipped += 1
    return flipped


def test_full_vocab_top_p_only_rows_in_the_interpreter() -> None:
    """top_p 0.9 at V = 151936 (supports of ~15-18k ids: window rows, the
    bitmask form) on fp32 softmax(randn x 2.5) rows, whose mass a sample
    of 8 blocks estimates poorly (the sampled range often misses the
    cutoff), and on bf16-derived rows (ties at the cutoff). Rounding
    flips are counted: at most one row in four."""
    gen = torch.Generator().manual_seed(14)
    probs = torch.softmax(torch.randn(4, FULL_VOCAB, generator=gen) * 2.5, -1)
    probs = torch.cat([probs, bf16_probs(2, FULL_VOCAB, 64, 1.9, seed=15).cpu()])
    got = capture(probs.to(DEVICE), probs.argmax(1).to(DEVICE), top_p=0.9,
                  max_tokens=FULL_VOCAB)
    assert (got.sizes.cpu() > 4096).all() and (got.forms.cpu() == 1).all()
    assert assert_top_p_rows(got, probs, 0.9) <= 1


def heavy_token_rows(gen: torch.Generator) -> torch.Tensor:
    """Peaked rows at V = 151936 whose heaviest token sits in the bound's
    first sampled block (column 5): the sample weighs it ~18 times its
    share, so its top-p floor lies far above the row's cutoff. A tail of
    scale 3, 5 and 8 under a token of 40%, 30% and 50% of the mass (top_p
    0.9 supports from a few to thousands of ids), and a plain scale-5 row."""
    rows = []
    for scale, heavy in ((3.0, 0.4), (5.0, 0.3), (8.0, 0.5), (5.0, None)):
        w = torch.softmax(torch.randn(FULL_VOCAB, generator=gen) * scale, -1)
        top = int(w.argmax())
        w[[5, top]] = w[[top, 5]]
        if heavy is not None:
            w[5] = 0.0
            w = w / w.sum() * (1 - heavy)
            w[5] = heavy
        rows.append(w)
    return torch.stack(rows)


@pytest.mark.parametrize("top_p", [0.6, 0.9])
def test_peaked_rows_whose_sample_holds_the_heavy_token(monkeypatch: pytest.MonkeyPatch,
                                                       top_p: float) -> None:
    """The sampled floor lies above the cutoff (the sample over-weights the
    heavy token: SAMPLE_HEAVY off here): resolve narrows the cutoff over the
    whole row in a few passes and rewrites the candidates; capture's and
    sample()'s rows equal the reference (top-k 50 on the last row: both
    cutoffs missed)."""
    monkeypatch.setattr(tuning, "SAMPLE_HEAVY", False)
    probs = heavy_token_rows(torch.Generator().manual_seed(16))
    top_k = torch.tensor([0, 0, 0, 50], dtype=torch.int32)
    got = capture(probs.to(DEVICE), probs.argmax(1).to(DEVICE), top_p=top_p,
                  max_tokens=FULL_VOCAB)
    assert assert_top_p_rows(got, probs, top_p) == 0
    drawn = sample(probs.to(DEVICE), torch.arange(4, device=DEVICE), top_k=top_k.to(DEVICE),
                   top_p=top_p, max_tokens=FULL_VOCAB)
    assert_same(drawn, reference_capture(probs, drawn.tokens.cpu().long(), top_k=top_k,
                                         top_p=top_p, max_tokens=FULL_VOCAB))
    assert int(drawn.sizes.cpu()[0]) > 50  # a support of many ids under the heavy token


@pytest.mark.parametrize("heavy", [True, False], ids=["counted-once", "counted-1/share"])
def test_a_lone_heavy_sampled_token_counts_once(monkeypatch: pytest.MonkeyPatch, kept: dict,
                                               heavy: bool) -> None:
    """The bound counts the sample's largest value, when no sampled id ties
    it, once in its mass estimates (as the row's only one of its size), not
    1/share times: a row whose first sampled block holds its heavy token
    (3000 a, against 6000 ids of a: 33% of the mass, 56% of the sample's)
    gets a top-p floor under its cutoff and no whole-row search; counted
    1/share times (SAMPLE_HEAVY off), the same row's floor lies above the
    cutoff. The mass floor alone decides (P_KEEP 1, no window rows); both
    rows equal the reference."""
    monkeypatch.setattr(tuning, "SAMPLE_HEAVY", heavy)
    monkeypatch.setattr(tuning, "P_KEEP", 1)
    monkeypatch.setattr(tuning, "WINDOW_MIN", 1 << 30)
    vocab, a = 20000, 2.0**-14
    probs = torch.zeros(1, vocab)
    probs[0, 1:18000:3] = a  # in and out of the sampled blocks
    probs[0, 0] = 3000 * a
    got = run_both(probs, probs.argmax(1), top_p=0.4, max_tokens=vocab)
    assert int(got.sizes.cpu()[0]) == 6001  # the heavy token and every tie of a
    ws = kept["ws"]
    resolved_from_the_row = bool((ws.cutoff.cpu() < ws.lo.cpu()).any())
    assert resolved_from_the_row != heavy


def test_top_p_of_a_subnormal_mass() -> None:
    """Rows whose whole mass is subnormal (below float32's smallest normal,
    1.2e-38): the top-p target is top_p x mass, met by the row's own largest
    values as in the reference, and their logprobs are finite (a target
    floored at 1e-38 lay above the whole mass and kept every positive id;
    the GPU's log, flush-to-zero, took a subnormal for 0 and made the row
    INVALID). Row 1's target, 0.1 x 3 x 2^-149, rounds to 0 in float32: it
    is the smallest positive float instead, not 0 (which every key reaches:
    an empty support). Row 3 is a window row's size with a subnormal tail."""
    vocab = 8192
    probs = torch.zeros(4, vocab)
    probs[0, [3, 10, 20]] = torch.tensor([2e-40, 1e-40, 1e-41])
    probs[1, [5, 6]] = torch.tensor([1, 2], dtype=torch.int32).view(torch.float32)
    probs[2, :100] = torch.linspace(1e-39, 5e-39, 100)
    gen = torch.Generator().manual_seed(31)
    probs[3] = torch.softmax(torch.randn(vocab, generator=gen) * 0.5, -1)
    probs[3, 7000:] = torch.linspace(1e-41, 1e-39, vocab - 7000)
    top_p = torch.tensor([0.9, 0.1, 0.5, 0.9])
    tokens = probs.argmax(1)
    got = capture(probs.to(DEVICE), tokens.to(DEVICE), top_p=top_p.to(DEVICE), max_tokens=vocab)
    want = reference_capture(probs, tokens, top_p=top_p, max_tokens=vocab)
    assert (got.status.cpu() == Status.OK).all() and (want.status == Status.OK).all()
    assert torch.equal(got.sizes.cpu(), want.sizes)
    assert got.sizes[0] == 2 and got.sizes[1] == 1  # not every positive id
    for b in range(4):
        ids, logprobs = got.row(b)
        assert ids.cpu().tolist() == want.row(b)[0].tolist()
        assert torch.isfinite(logprobs).all()
        torch.testing.assert_close(logprobs.cpu(), want.row(b)[1], atol=2e-5, rtol=0)


def test_top_p_within_rounding_refuses_wrong_supports() -> None:
    """The rounding check itself: the reference's support passes; one more
    or one fewer id than a boundary far from the target fails, and so does
    a support that skips a larger value."""
    gen = torch.Generator().manual_seed(16)
    probs = torch.softmax(torch.randn(1, 500, generator=gen), -1)
    want = reference_capture(probs, probs.argmax(1), top_p=0.9, max_tokens=500)
    ids = want.row(0)[0]
    support = torch.zeros(1, 500, dtype=torch.bool)
    support[0, ids] = True
    assert top_p_within_rounding(probs, support, 0.9).item()
    order = probs[0].argsort(descending=True)
    more, fewer, skip = support.clone(), support.clone(), support.clone()
    more[0, order[ids.numel()]] = True
    fewer[0, order[ids.numel() - 1]] = False
    skip[0, order[0]] = False
    for wrong in (more, fewer, skip):
        assert not top_p_within_rounding(probs, wrong, 0.9).item()


# ------------------------------------------------------- full vocabulary, CUDA


@gpu_only
def test_full_vocab_bf16_top_k_ties() -> None:
    probs = bf16_probs(8, FULL_VOCAB, 4096, 1.9, seed=7)
    ties = ties_at_kth(probs, 1000)
    assert (ties > 1).any(), "bf16 logits must tie at the 1000th value"
    sampled = probs.argmax(1)
    got = capture(probs, sampled, top_k=1000, max_tokens=8192)
    assert_same(got, reference_capture(probs, sampled, top_k=1000, max_tokens=8192))
    assert (got.sizes > 1000).any()
    drawn = sample(probs, torch.arange(8, device=DEVICE), top_k=1000, max_tokens=8192)
    assert_same(drawn, reference_capture(probs, drawn.tokens.long(), top_k=1000,
                                         max_tokens=8192))


@gpu_only
def test_full_vocab_top_p_only_window_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """top_p 0.9 at V = 151936 (supports of tens of thousands of ids, the
    bitmask form through the window path). fp32 masses in the kernel, fp64
    in the reference: a row may differ only where top_p's target is within
    rounding of a cumulative mass (then it equals the reference at
    top_p * (1 +- 1e-5))."""
    window = WindowRows(monkeypatch)
    probs = bf16_probs(8, FULL_VOCAB, 4096, 1.9, seed=8)
    support = reference_capture(probs, probs.argmax(1), top_p=0.9, max_tokens=8192)
    sampled = probs.argmax(1)
    got = capture(probs, sampled, top_p=0.9, max_tokens=8192)
    assert window.calls == [[1] * 8]
    assert (support.sizes > 10000).all() and (got.forms == 1).all()
    nearby = [reference_capture(probs, sampled, top_p=0.9 * f, max_tokens=8192)
              for f in (1.0, 1 - 1e-5, 1 + 1e-5)]
    for b in range(8):
        ids, values = got.row(b)
        options = [r.row(b) for r in nearby]
        match = [o for o in options if torch.equal(ids, o[0])]
        assert match, f"row {b}: {ids.numel()} ids, reference {options[0][0].numel()}"
        torch.testing.assert_close(values, match[0][1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("order", [0, 1, 2])
def test_refine_sums_each_wide_chunk_in_any_order(order: int) -> None:
    """The window refine (a fixed grid sharing out the listed wide rows'
    chunks; REFINE_ORDER row by row, or chunk by chunk from the first or
    the last) stores each chunk's mass at or above each of its row's keys
    in that chunk's slot, and nothing in the slots of rows not listed:
    three chunks a row, every chunk holding mass above the keys."""
    chunk, refine, batch = tuning.CHUNK, tuning.WINDOW_REFINE, 3
    vocab = 2 * chunk + 700
    n_chunks = triton.cdiv(vocab, chunk)
    gen = torch.Generator().manual_seed(47)
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen), -1)
    # keys between the rows' quantiles, so that every chunk counts
    quantiles = torch.quantile(probs, torch.linspace(0.2, 0.95, refine), dim=1).T
    keys = quantiles.contiguous().view(torch.int32)
    wide_rows = torch.tensor([2, 0], dtype=torch.int32)
    # one row of slots past the batch's: a chunk index out of range lands
    # there (checked below), not past the tensor
    refine_mass = torch.full(((batch + 1) * n_chunks * refine,), -1.0, device=DEVICE)
    capture_window._window_refine_kernel[(3,)](
        probs.to(DEVICE), vocab, vocab, torch.tensor([2], dtype=torch.int32, device=DEVICE),
        wide_rows.to(DEVICE), keys.flatten().to(DEVICE), refine_mass, n_chunks, CHUNK=chunk,
        REFINE=refine, ORDER=order, PDL=False, num_warps=4)
    got = refine_mass.cpu().view(batch + 1, n_chunks, refine)
    for row in (0, 2):
        for c in range(n_chunks):
            part = probs[row, c * chunk:(c + 1) * chunk]
            want = torch.stack([part[part.view(torch.int32) >= k].sum() for k in keys[row]])
            assert torch.allclose(got[row, c], want, rtol=1e-5), (row, c)
            assert (want > 0).all()
    assert (got[1] == -1.0).all() and (got[batch] == -1.0).all()  # row 1 is not listed


@pytest.mark.parametrize("window", [False, True])
def test_mark_predicate_on_every_half_precision_pattern(window: bool) -> None:
    """The candidate mark's one integer test of the float bits keeps exactly
    what the float tests define: finite w > 0 with lo <= bits, and every bad
    value (NaN, inf, negative; -0.0 is a zero), for lo at its edges, lo
    above +inf's bits among them. A window row's candidates are left to the
    window mark (the candidate mark writes none), which keeps its bad values
    and the finite w > 0 in its bracket [b_lo, b_hi), and both sum the mass
    the bracket comes from. Every float32 value an fp16 can hold (all 65,536
    patterns) plus float32-only NaN payloads and extremes, run through the
    kernels themselves."""
    extra = torch.tensor([0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800000 - 2**32,
                          0x80000000 - 2**32, 0x80000001 - 2**32, 1, 0x7F7FFFFF],
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    half = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = torch.cat([half.float(), extra])
    vocab = values.numel()  # not a multiple of CHUNK: padding lanes too
    inf_key = 0x7F800000
    bounds = [1, 0x3A800000, 0x7F7FFFFF, inf_key, 0x7FFF8000, 0x46000000]
    batch = len(bounds)
    probs = values.repeat(batch, 1)
    if window:
        # float32's largest value would outweigh the rest of rows 0, 1 and 5
        # (their brackets would end at +inf's bits, not at a value)
        probs[[0, 1, 5], 65536 + len(extra) - 1] = 0.0
    probs = probs.to(DEVICE)
    w = probs.cpu()
    lo = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    chunk = tuning.CHUNK
    pivots = 8
    # pivots from lo up to fp16's largest value, within [1, +inf's bits] and
    # on keys an fp16 value has (low 13 bits zero), so that a bracket's ends
    # fall on values (the bound kernel places them; here they only need to
    # split the values)
    base = (lo.cpu().long()[:, None] + 0x1FFF) & ~0x1FFF
    step = ((0x47800000 - base).clamp(min=1 << 21) // (pivots - 1)) & ~0x1FFF
    piv = (base + step * torch.arange(pivots)).clamp(1, inf_key)
    # row 5: inner pivots on values 4 fp16 steps apart around its top-p 0.5
    # cutoff, so that its bracket lies between two of them (not refined)
    sorted_w = probs[5].double().nan_to_num(0.0, 0.0, 0.0).clamp(min=0).sort(descending=True)[0]
    first = int((sorted_w.cumsum(0) < 0.5 * sorted_w.sum()).sum())
    cut = int(sorted_w[first].float().view(torch.int32)) & ~0x1FFF
    inner = cut + (torch.arange(1, pivots - 1) - pivots // 2) * 4 * 0x2000
    piv[5] = torch.cat([inner[:1] - (1 << 24), inner, inner[-1:] + (1 << 24)])
    n_chunks = -(-vocab // chunk)
    bits = torch.full((batch * n_chunks * (chunk // 32),), 7, dtype=torch.int32, device=DEVICE)
    counts = torch.full((batch * n_chunks,), 7, dtype=torch.int32, device=DEVICE)
    sums, maxes = (torch.zeros(batch * n_chunks, device=DEVICE) for _ in range(2))
    pivot_mass = torch.zeros(batch * n_chunks * pivots, device=DEVICE)
    settings = torch.zeros(batch, dtype=torch.float32, device=DEVICE)
    top_p = settings + (0.5 if window else 1.0)
    is_window = torch.full((batch,), int(window), dtype=torch.int32, device=DEVICE)
    pivots_in = piv.to(DEVICE, torch.int32).flatten()
    record = capture_workspace.BRACKET.value
    bracket = torch.zeros(record * batch, dtype=torch.int32, device=DEVICE)
    refine = 8
    refine_keys = torch.zeros(batch * refine, dtype=torch.int32, device=DEVICE)
    # the wide rows' list and their count
    wide_rows, wide_count = (torch.zeros(n, dtype=torch.int32, device=DEVICE) for n in (batch, 1))
    chunks_pad = triton.next_power_of_2(n_chunks)
    capture_mark._cand_mark_kernel[(batch, n_chunks)](
        probs, probs.stride(0), vocab, lo, is_window, pivots_in, top_p, settings,
        settings.to(torch.int8), bits, counts, sums, maxes, pivot_mass, n_chunks, CHUNK=chunk,
        MASS=window, TOP=False, WINDOW=window, PIVOTS=pivots, PDL=False, num_warps=4)
    key = w.view(torch.int32)
    good = (w >= 0) & (w < math.inf)
    in_range = good & (w > 0) & (key >= lo.cpu()[:, None])
    want = in_range | ~good
    if window:
        assert (bits.cpu() == 7).all() and (counts.cpu() == 7).all()  # left to the window mark
        above_mass = torch.zeros(batch * n_chunks, device=DEVICE)
        above_count = torch.zeros(batch * n_chunks, dtype=torch.int32, device=DEVICE)
        refine_mass = torch.zeros(batch * n_chunks * refine, device=DEVICE)
        capture_window._window_bracket_kernel[(batch,)](
            is_window, pivots_in, top_p, settings, sums, maxes, pivot_mass, bracket, refine_keys,
            wide_count, wide_rows, n_chunks, CHUNKS_PAD=chunks_pad, PIVOTS=pivots, REFINE=refine,
            PDL=False, num_warps=4)
        # the wide rows (rows 0 and 1 among them, below) are listed for the
        # refine, in any order
        wide = bracket.cpu().view(batch, record)[:, capture_workspace.B_WIDE.value].nonzero()[:, 0]
        assert {0, 1} <= set(wide.tolist())
        assert sorted(wide_rows.cpu()[:int(wide_count)].tolist()) == wide.tolist()
        capture_window._window_refine_kernel[(3,)](
            probs, probs.stride(0), vocab, wide_count, wide_rows, refine_keys, refine_mass,
            n_chunks, CHUNK=chunk, REFINE=refine, ORDER=tuning.REFINE_ORDER, PDL=False,
            num_warps=4)
        capture_window._window_mark_kernel[(batch, n_chunks)](
            probs, probs.stride(0), vocab, is_window, bracket, refine_keys, refine_mass, bits,
            counts, above_mass, above_count, n_chunks, CHUNK=chunk, CHUNKS_PAD=chunks_pad,
            REFINE=refine, REVERSED=tuning.WINDOW_MARK_REVERSED, WIDE_ONLY=False, PDL=False,
            num_warps=4)
        final = capture_workspace.B_FINAL_LO.value
        b_lo, b_hi = bracket.cpu().view(batch, record)[:, final:final + 2].long().unbind(1)
        assert (b_lo >= 1).all() and (b_hi <= inf_key).all()
        # rows 0 and 1: the cutoff lies between the top two pivots, outside
        # the inner ones: the bracket was refined to an eighth of that or less
        assert ((b_hi - b_lo)[:2] <= (piv[:2, -1] - piv[:2, -2]) // 8 + 1).all()
        assert (refine_mass.cpu() != 0).any()
        # brackets whose two ends are values of the row: each end on its side
        ends = (good & (key == b_lo[:, None])).any(1) & (good & (key == b_hi[:, None])).any(1)
        assert ends[5] and b_hi[5] - b_lo[5] == 4 * 0x2000
        in_bracket = (key >= b_lo[:, None]) & (key < b_hi[:, None])
        want = (good & (w > 0) & in_bracket) | ~good
    words = bits.cpu().view(batch, -1).to(torch.int64) & 0xFFFFFFFF
    kept = ((words[:, :, None] >> torch.arange(32)) & 1).bool().view(batch, -1)[:, :vocab]
    for b in range(batch):
        wrong = (kept[b] != want[b]).nonzero()[:, 0]
        assert wrong.numel() == 0, (bounds[b], [hex(int(key[b, i]) & 0xFFFFFFFF)
                                                for i in wrong[:8]])
    assert torch.equal(counts.cpu().view(batch, n_chunks).sum(1), want.sum(1).to(torch.int32))
    if window:
        # the mass at or above each pivot, bad values as zeros
        w_good = torch.where(good, w, 0.0).double()
        want_mass = ((key.long()[:, None, :] >= piv[:, :, None]) * w_good[:, None, :]).sum(2)
        got_mass = pivot_mass.cpu().view(batch, n_chunks, pivots).double().sum(1)
        torch.testing.assert_close(got_mass, want_mass, rtol=1e-5, atol=1e-30)
        assert (want_mass[:, 0] > want_mass[:, -1]).any()  # pivots that split the values


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> dict:
    """{"ws": the workspace of the test's last capture call}: the stages'
    per-row results (lo, cutoff, n_cand) the rows alone do not show."""
    kept: dict = {}
    allocate = capture_workspace.CaptureWorkspace.allocate.__func__
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")  # each call's own launches, never a replay

    def keep(cls, *args, **kwargs):
        kept["ws"] = allocate(cls, *args, **kwargs)
        return kept["ws"]

    monkeypatch.setattr(capture_module.CaptureWorkspace, "allocate", classmethod(keep))
    return kept


def test_a_window_row_past_its_count_floor_gets_its_pivots(kept: dict) -> None:
    """The bound skips a top-p-only row's mass searches when the mass above
    its count floor (P_KEEP ids) reaches top-p's floor share, unless that
    floor makes it a window row: a row of three heavy ids and 7,997 tied
    light ones (whose tie puts past WINDOW_MIN ids at the count floor) is a
    window row, and its pivots are the mass searches' (the cutoff between
    the inner ones: a bracket that is not wide), not the skip's defaults."""
    vocab = 8000  # the sample is the whole row
    probs = torch.full((2, vocab), 0.04 / (vocab - 3))
    probs[:, :3] = torch.tensor([0.5, 0.3, 0.16])
    probs[1] = probs[1].flip(0)
    got = run_both(probs, probs.argmax(1), top_p=0.9, max_tokens=100)
    ws = kept["ws"]
    assert got.sizes.cpu().tolist() == [3, 3]
    assert ws.window.cpu().tolist() == [1, 1]
    record = capture_workspace.BRACKET.value
    wide = ws.bracket.cpu().view(2, record)[:, capture_workspace.B_WIDE.value]
    assert wide.tolist() == [0, 0]


def assert_no_whole_row_search(ws) -> None:
    """Every row's cutoff at or above its sampled floor (none needed the
    whole-row search) and its candidates within resolve's registers."""
    assert (ws.cutoff.cpu() >= ws.lo.cpu()).all(), (ws.cutoff.tolist(), ws.lo.tolist())
    assert (ws.n_cand.cpu() <= tuning.RESOLVE_BLOCK).all()


@pytest.mark.parametrize("order", ["joint", "sequential"])
def test_top_k_with_top_p_keeps_top_k_floor(kept: dict, order: str) -> None:
    """top_k 1000 with top_p 0.9 (and min_p 0.3 on the last row) on rows
    whose sample holds the heavy token: the candidates are top-k's floor's
    (about 1.25 k ids, in resolve's registers), never a top-p floor the
    sample put above the row's cutoff (nor, in sequential order, whose
    top-p target is a share of the top-k mass, min-p's), so no row takes
    the whole-row search (cutoff >= lo in every row); the rows equal the
    reference."""
    probs = heavy_token_rows(torch.Generator().manual_seed(17))
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.3])
    got = capture(probs.to(DEVICE), probs.argmax(1).to(DEVICE), top_k=1000, top_p=0.9,
                  min_p=min_p.to(DEVICE), max_tokens=FULL_VOCAB, order=order)
    ws = kept["ws"]
    assert_no_whole_row_search(ws)
    # the candidates are still top-k's floor's, more than the support (the
    # whole-row search would have rewritten them as the support itself);
    # in joint order min-p's floor may bound the last row's exactly
    more = ws.n_cand.cpu() > got.sizes.cpu()
    assert (more if order == "sequential" else more[:3]).all(), (ws.n_cand.tolist(),
                                                                 got.sizes.tolist())
    want = reference_capture(probs, probs.argmax(1), top_k=1000, top_p=0.9, min_p=min_p,
                             max_tokens=FULL_VOCAB, order=order)
    assert_same(got, want)


@pytest.mark.parametrize("top_p", [0.6, 0.9, 0.99])
def test_peaked_top_p_rows_keep_enough_candidates(kept: dict, top_p: float) -> None:
    """Peaked top-p-only rows (supports of a few to a few hundred ids) whose
    sample holds the heaviest token: the floor keeps P_KEEP ids by the
    sample's count, so none of them needs the whole-row search (cutoff >= lo)
    and their candidates fit in resolve's registers; rows as the reference."""
    gen = torch.Generator().manual_seed(18)
    probs = torch.softmax(torch.randn(4, FULL_VOCAB, generator=gen)
                          * torch.tensor([5.0, 6.0, 8.0, 14.0])[:, None], -1)
    for row in probs:  # the heaviest token into the first sampled block
        top = int(row.argmax())
        row[[5, top]] = row[[top, 5]]
    got = capture(probs.to(DEVICE), probs.argmax(1).to(DEVICE), top_p=top_p,
                  max_tokens=FULL_VOCAB)
    ws = kept["ws"]
    assert (got.sizes.cpu() < tuning.P_KEEP).all()
    assert_no_whole_row_search(ws)
    assert assert_top_p_rows(got, probs, top_p) == 0


def test_a_smaller_chunk_set_at_run_time_reaches_every_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/tuning.py's values are read at each call (benchmarks set them
    with --tuning): CHUNK shrunk to 1024 reaches the candidate mark, the
    window stages, the expand and the window write alike (one that kept the
    import-time 8192 would read the bitmask in another layout), so window
    rows, top-k rows and compact's rows still equal the reference."""
    monkeypatch.setattr(tuning, "CHUNK", 1024)
    monkeypatch.setattr(tuning, "WINDOW_WRITE_SUB", 512)  # a chunk in whole steps
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")
    gen = torch.Generator().manual_seed(44)
    vocab = 5000  # five chunks of 1024, the last partial
    probs = torch.softmax(torch.randn(3, vocab, generator=gen)
                          * torch.tensor([0.4, 2.0, 6.0])[:, None], -1)
    run_both(probs, probs.argmax(1), top_p=0.9, max_tokens=vocab)
    run_both(probs, probs.argmax(1), top_k=300, max_tokens=vocab)
    masked = torch.where(probs > 1e-4, torch.log(probs), float("-inf"))
    assert_same_compact(compact(masked.to(DEVICE), vocab), reference_compact(masked, vocab))

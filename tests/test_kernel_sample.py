"""Sample with capture: the token always lies in the support captured with
it, draws are deterministic per seed, and frequencies follow w / Z."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from launcher_spy import LauncherSpy  # noqa: E402  (tests/launcher_spy.py)
from row_bits import bits  # noqa: E402  (tests/row_bits.py)
from shmask.kernels import Status, capture, reference_capture, reference_sample, sample, tuning  # noqa: E402
from shmask.kernels.capture_workspace import B_FINAL_HI, BRACKET  # noqa: E402
from shmask.kernels.sample_draw import _uniform53  # noqa: E402

capture_module = importlib.import_module("shmask.kernels.capture")
reference_support = capture_module.reference_support

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def settings(batch: int, vocab: int, gen: torch.Generator) -> dict:
    return {
        "top_k": torch.randint(0, 60, (batch,), generator=gen, dtype=torch.int32),
        "top_p": torch.rand(batch, generator=gen) * 0.9 + 0.1,
        "min_p": torch.where(torch.rand(batch, generator=gen) < 0.3, 0.02, 0.0),
    }


def on_device(kwargs: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["joint", "sequential"])
def test_token_in_support_and_support_matches_capture(seed, dtype, order) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 6, 3001
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 3, -1).to(dtype)
    kwargs = dict(max_tokens=vocab, order=order, **settings(batch, vocab, gen))
    seeds = torch.randint(0, 2**40, (batch,), generator=gen)
    got = sample(probs.to(DEVICE), seeds.to(DEVICE), **on_device(kwargs))
    tokens = got.tokens.cpu()
    assert (got.status.cpu() == Status.OK).all()
    for b in range(batch):
        ids, logprobs = got.row(b)
        assert int(tokens[b]) in ids.cpu().tolist()
        selected = logprobs[ids == tokens[b]].item()
        assert got.selected_logprob[b].item() == pytest.approx(selected, abs=1e-6)
    # The support drawn from is exactly capture's support for that token.
    want = reference_capture(probs, tokens.long(), **kwargs)
    for b in range(batch):
        assert got.row(b)[0].cpu().tolist() == want.row(b)[0].tolist()


def test_rows_past_the_resolve_and_draw_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Supports that fill several resolve blocks (held in registers: the
    first only) and draw blocks: the size, the mass and the draw cover every
    candidate, and the drawn token depends on the seed and ids only, not on
    how the candidates were blocked."""
    gen = torch.Generator().manual_seed(8)
    batch, vocab = 4, 1500
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen), -1)
    kwargs = dict(top_k=torch.tensor([300, 0, 900, 5], dtype=torch.int32),
                  top_p=torch.tensor([1.0, 0.9, 1.0, 1.0]), max_tokens=vocab)
    seeds = torch.arange(batch) + 5
    tokens = []
    for block, draw in ((4096, 1024), (64, 16), (128, 128)):
        monkeypatch.setattr(tuning, "RESOLVE_BLOCK", block)
        monkeypatch.setattr(tuning, "DRAW_BLOCK", draw)
        got = sample(probs.to(DEVICE), seeds.to(DEVICE), **on_device(kwargs))
        want = reference_capture(probs, got.tokens.cpu().long(), **kwargs)
        assert (got.status.cpu() == Status.OK).all()
        assert torch.equal(got.sizes.cpu(), want.sizes)
        assert torch.allclose(got.selected_logprob.cpu(), want.selected_logprob, atol=1e-5)
        for b in range(batch):
            ids, logprobs = got.row(b)
            assert ids.cpu().tolist() == want.row(b)[0].tolist()
            assert torch.allclose(logprobs.cpu(), want.row(b)[1], atol=1e-5)
        tokens.append(got.tokens.cpu())
    assert all(torch.equal(t, tokens[0]) for t in tokens)


def test_same_seed_same_draws_and_batch_independence() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(5, 500, generator=gen), -1).to(DEVICE)
    seeds = torch.tensor([1, 2, 3, 4, 5], device=DEVICE)
    first = sample(probs, seeds, top_p=0.95, max_tokens=500)
    again = sample(probs, seeds, top_p=0.95, max_tokens=500)
    assert torch.equal(first.tokens, again.tokens)
    alone = sample(probs[3:4], seeds[3:4], top_p=0.95, max_tokens=500)
    assert alone.tokens.item() == first.tokens[3].item()  # a row's draw ignores its batch
    other = sample(probs, seeds + 1000, top_p=0.95, max_tokens=500)
    assert not torch.equal(first.tokens, other.tokens)


def test_frequencies_follow_renormalised_probs() -> None:
    """Many draws of one row (one seed each) against w / Z over the top-4
    support; with fixed seeds the result is fixed, and a 6-sigma band per token
    cannot be missed by a correct sampler except with negligible probability.
    (400 draws under the interpreter, 20000 on a GPU.)"""
    draws = 20000 if DEVICE == "cuda" else 400
    row = torch.tensor([0.05, 0.3, 0.02, 0.25, 0.2, 0.15, 0.03])
    probs = row.repeat(draws, 1).to(DEVICE)
    got = sample(probs, torch.arange(draws, device=DEVICE) * 7919 + 17, top_k=4,
                 max_tokens=7, rows=torch.zeros(draws, dtype=torch.bool, device=DEVICE))
    assert (got.status == Status.SKIPPED).all() and int(got.offsets[-1]) == 0
    counts = torch.bincount(got.tokens.cpu().long(), minlength=7).double()
    support = torch.tensor([1, 3, 4, 5])
    expect = torch.zeros(7, dtype=torch.float64)
    expect[support] = row[support].double() / row[support].sum()
    assert counts[[0, 2, 6]].sum() == 0
    sigma = (draws * expect * (1 - expect)).sqrt()
    assert ((counts - draws * expect).abs() <= 6 * sigma + 1e-9).all(), counts
    # the torch reference follows the same law
    ref = reference_sample(row.repeat(400, 1), torch.arange(400), top_k=4, max_tokens=7)
    ref_counts = torch.bincount(ref.tokens.long(), minlength=7).double()
    assert ref_counts[[0, 2, 6]].sum() == 0
    ref_sigma = (400 * expect * (1 - expect)).sqrt()
    assert ((ref_counts - 400 * expect).abs() <= 6 * ref_sigma + 1e-9).all(), ref_counts


def test_greedy_rows_take_the_first_maximum() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.1, 0.4], [0.7, 0.1, 0.1, 0.1]], device=DEVICE)
    got = sample(probs, torch.tensor([5, 6], device=DEVICE), max_tokens=4,
                 greedy=torch.tensor([True, True], device=DEVICE))
    assert got.tokens.cpu().tolist() == [1, 0]
    assert got.selected_logprob.cpu().tolist() == [0.0, 0.0]
    assert got.row(0)[0].cpu().tolist() == [1] and got.row(0)[1].cpu().tolist() == [0.0]
    ref = reference_sample(probs.cpu(), torch.tensor([5, 6]), max_tokens=4, greedy=True)
    assert ref.tokens.tolist() == [1, 0]


def test_invalid_rows_get_token_minus_one() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.0], [0.2, float("nan"), 0.8], [0.5, 0.25, 0.25]])
    got = sample(probs.to(DEVICE), 9, max_tokens=3)
    assert got.status.cpu().tolist() == [Status.INVALID, Status.INVALID, Status.OK]
    assert got.tokens.cpu().tolist()[:2] == [-1, -1]
    ref = reference_sample(probs, 9, max_tokens=3)
    assert ref.status.tolist() == got.status.cpu().tolist() and ref.tokens.tolist()[:2] == [-1, -1]


def window_rows(probs, ws, *_) -> dict:
    """What the window write is handed (after resolve): the bound's window
    flag of each row, so a test knows its rows were window rows, and each
    row's cutoff, final bracket and chunks' mass above it, what a window
    row's draw read."""
    batch = probs.shape[0]
    return {"window": ws.window.cpu().tolist(), "cutoff": ws.cutoff.cpu().clone(),
            "b_hi": ws.bracket.view(batch, BRACKET.value)[:, B_FINAL_HI.value].cpu().clone(),
            "above_mass": ws.above_mass.view(batch, ws.n_chunks).cpu().clone()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_rows_draw_in_their_support_and_capture_agrees(monkeypatch: pytest.MonkeyPatch,
                                                              dtype: torch.dtype) -> None:
    """Top-p-only rows of thousands of ids as window rows (candidates only
    the ids around the cutoff; a row under 20,000 ids spans three chunks):
    resolve draws each token by inverse transform over the bracket's part
    and the chunks' masses above it. The token lies in the support; capture()
    of those tokens gives the same rows, bit for bit, with the same selected
    logprobs; the same seeds draw the same tokens, other seeds others."""
    gen = torch.Generator().manual_seed(21)
    batch, vocab = 3, 20000
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 1.5, -1).to(dtype)
    top_p = torch.tensor([0.95, 0.6, 0.9])
    # min-p's floor holds the last row's support to a few ids: not a window
    # row, drawn by the race over its candidates beside the window rows
    min_p = torch.tensor([0.0, 0.0, 0.3])
    seeds = torch.randint(0, 2**40, (batch,), generator=gen).to(DEVICE)
    kwargs = {"top_p": top_p.to(DEVICE), "min_p": min_p.to(DEVICE), "max_tokens": 64}
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    flags = LauncherSpy(monkeypatch, "launch_window_write", window_rows)
    drawn = sample(probs.to(DEVICE), seeds, **kwargs)
    assert [call["window"] for call in flags.calls] == [[1, 1, 0]]
    assert (drawn.status.cpu() == Status.OK).all() and (drawn.sizes.cpu()[:2] > 1000).all()
    want = reference_capture(probs, drawn.tokens.cpu().long(), top_p=top_p, min_p=min_p,
                             max_tokens=64)
    for b in range(batch):
        assert drawn.row(b)[0].cpu().tolist() == want.row(b)[0].tolist()
    captured = capture(probs.to(DEVICE), drawn.tokens, **kwargs)
    assert bits(captured) == bits(drawn)
    assert sample(probs.to(DEVICE), seeds, **kwargs).tokens.tolist() == drawn.tokens.tolist()
    others = [sample(probs.to(DEVICE), seeds + k, **kwargs).tokens for k in (1, 2)]
    assert not all(torch.equal(t[:2], drawn.tokens[:2]) for t in others)  # the window rows


def test_window_rows_draw_by_their_mass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many window rows of one distribution, a seed each (20,000 on a GPU,
    120 in the interpreter): each token lies in the support, is the token
    of the draw's layout walked in float64 torch from the same uniform
    (reference_window_draw), and both parts, the bracket's and the mass
    above it in each chunk, are drawn from; the draws follow w / Z within a
    6-sigma band for every id, and for each level's ids in each chunk (a
    test with power on the GPU only). The row: three heavy ids (one a chunk) above four
    levels of values over the other ids, the top-p cutoff inside the third
    level, so its tied ids (in the support: ties are kept) are the
    bracket's part and the ids above it each chunk's part; chunks of 1024
    ids and walks of 256 ids a block here, so the draw crosses both."""
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    monkeypatch.setattr(tuning, "CHUNK", 1024)
    monkeypatch.setattr(tuning, "WINDOW_WRITE_SUB", 512)  # a chunk in whole steps
    monkeypatch.setattr(tuning, "DRAW_BLOCK", 256)  # the walks cross blocks
    # a count floor under the row's length (P_KEEP 3072 of 3000 ids would
    # put the bound's floor, and so the pivots' spread, at every key: the
    # bracket the whole support, nothing above it)
    monkeypatch.setattr(tuning, "P_KEEP", 1024)
    draws = 20000 if DEVICE == "cuda" else 120
    gen = torch.Generator().manual_seed(12)
    vocab = 3000
    level = torch.randint(0, 4, (vocab,), generator=gen)
    row = (4.0 - level).double()  # values 4, 3, 2, 1
    heavy = torch.tensor([100, 1500, 2900])
    row[heavy] = row.sum() * 0.1
    row = row / row.sum()
    body = torch.ones(vocab, dtype=torch.bool)
    body[heavy] = False
    # top_p halfway through the third level's mass: the heavy ids, the two
    # levels above, half of it
    top_p = float(row[heavy].sum() + row[body & (level < 2)].sum()
                  + row[body & (level == 2)].sum() / 2)
    probs = row.float().repeat(draws, 1).to(DEVICE)
    seeds = torch.arange(draws, device=DEVICE) * 7919 + 17
    flags = LauncherSpy(monkeypatch, "launch_window_write", window_rows)
    got = sample(probs, seeds, top_p=top_p, max_tokens=vocab,
                 rows=torch.zeros(draws, dtype=torch.bool, device=DEVICE))
    assert [call["window"] for call in flags.calls] == [[1] * draws]
    assert (got.status.cpu() == Status.SKIPPED).all()
    support = reference_support(row.float()[None], None, top_p, None, "joint")[0][0]
    assert torch.equal(support, body & (level <= 2) | ~body)  # the cutoff at the third level
    tokens = got.tokens.cpu().long()
    assert support[tokens].all()
    # token by token: the draw's layout walked in float64 from the same
    # uniforms (Philox's, read through the kernels' own _uniform53)
    inputs = flags.calls[0]
    uniforms = torch.empty(draws, dtype=torch.float64, device=DEVICE)
    _uniforms_kernel[(draws,)](seeds, uniforms)
    want = [reference_window_draw(row.float(), int(inputs["cutoff"][b]), int(inputs["b_hi"][b]),
                                  inputs["above_mass"][b], float(uniforms[b]), 1024)
            for b in range(draws)]
    assert tokens.tolist() == want
    # both parts drawn from: the bracket's (the tied third level) and the
    # mass above it, in every chunk
    above = row.float().view(torch.int32)[tokens] >= inputs["b_hi"][0]
    assert 0 < int(above.sum()) < draws
    assert sorted(set((tokens[above] // 1024).tolist())) == [0, 1, 2]
    counts = torch.bincount(tokens, minlength=vocab).double()
    expect = torch.where(support, row, 0.0)
    expect = expect / expect.sum() * draws

    def within(n, e):
        return abs(float(n) - float(e)) <= 6 * (float(e) * (1 - float(e) / draws)) ** 0.5 + 3

    assert all(within(n, e) for n, e in zip(counts.tolist(), expect.tolist(), strict=True))
    for first in range(0, vocab, 1024):
        for value in range(3):
            part = body & (level == value)
            part[:first] = False
            part[first + 1024:] = False
            assert within(counts[part].sum(), expect[part].sum()), (first, value)


def test_window_rows_not_written_draw_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window row that the window write does not write (SKIPPED: opted
    out; OVERFLOW as a status: past max_tokens) is still drawn, in
    resolve: the same token as when the row is written, and its selected
    logprob the same."""
    gen = torch.Generator().manual_seed(33)
    batch, vocab = 4, 20000
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 1.5, -1).to(DEVICE)
    seeds = torch.randint(0, 2**40, (batch,), generator=gen).to(DEVICE)
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    written = sample(probs, seeds, top_p=0.9, max_tokens=vocab)
    rows = torch.tensor([True, False, True, False], device=DEVICE)
    apart = sample(probs, seeds, top_p=0.9, max_tokens=1000, rows=rows, overflow="status")
    assert apart.status.cpu().tolist() == [Status.OVERFLOW, Status.SKIPPED] * 2
    assert (written.status.cpu() == Status.OK).all() and (written.sizes.cpu() > 1000).all()
    assert apart.tokens.tolist() == written.tokens.tolist()
    assert torch.equal(apart.selected_logprob.cpu(), written.selected_logprob.cpu())


@triton.jit
def _uniforms_kernel(seed_ptr, out_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, _uniform53(tl.load(seed_ptr + i)))


def reference_window_draw(w: torch.Tensor, cutoff: int, b_hi: int, above_mass: torch.Tensor,
                          u: float, chunk: int) -> int:
    """A window row's draw (kernels/sample_draw.py) in float64 torch: t = u x
    (the bracket's support mass + the chunks' masses above the bracket, as
    the window mark summed them); the bracket's ids at or above the cutoff
    first, then each chunk's ids at or above b_hi, the chosen chunk's t
    rescaled to its own float64 sum; the first id whose running mass passes
    t, else the part's last id."""
    keys = w.view(torch.int32)
    good = (w > 0) & torch.isfinite(w)
    values = w.double()

    def walk(ids: torch.Tensor, t: float) -> int:
        passed = (values[ids].cumsum(0) > t).nonzero()
        return int(ids[passed[0, 0]] if len(passed) else ids[-1])

    bracket = (good & (keys >= cutoff) & (keys < b_hi)).nonzero()[:, 0]
    above = above_mass.double()
    t = u * (float(values[bracket].sum()) + float(above.sum()))
    if t < float(values[bracket].sum()) or float(above.sum()) == 0:
        return walk(bracket, t)
    t -= float(values[bracket].sum())
    through = above.cumsum(0)
    hits = ((through > t) & (above > 0)).nonzero()
    c = int(hits[0, 0]) if len(hits) else int((above > 0).nonzero()[-1, 0])
    ids = (good & (keys >= b_hi)).nonzero()[:, 0]
    ids = ids[(ids >= c * chunk) & (ids < (c + 1) * chunk)]
    t = (t - float(through[c] - above[c])) * float(values[ids].sum()) / float(above[c])
    return walk(ids, t)

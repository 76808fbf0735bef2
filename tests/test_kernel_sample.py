"""Sample with capture: the token always lies in the support captured with
it, draws are deterministic per seed, and frequencies follow w / Z."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shmask.kernels import Status, reference_capture, reference_sample, sample, tuning  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_rows_draw_the_token_the_candidates_draw(monkeypatch: pytest.MonkeyPatch,
                                                        dtype: torch.dtype) -> None:
    """Top-p-only rows of thousands of ids: as window rows (their candidates
    only the ids around the cutoff) the window draw races over the whole
    support, one chunk a program, and the write kernel finishes the token
    and selected logprob; as candidate rows resolve draws. Same seeds, same
    tokens, the same selected logprob, and the support is capture's for
    the token (a row under 20,000 ids spans three chunks)."""
    gen = torch.Generator().manual_seed(21)
    batch, vocab = 3, 20000
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 1.5, -1).to(dtype)
    top_p = torch.tensor([0.95, 0.6, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.3])  # min-p's floor holds the last row's support
    seeds = torch.randint(0, 2**40, (batch,), generator=gen).to(DEVICE)
    kwargs = {"top_p": top_p.to(DEVICE), "min_p": min_p.to(DEVICE), "max_tokens": 64}
    monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
    windowed = sample(probs.to(DEVICE), seeds, **kwargs)
    monkeypatch.setattr(tuning, "WINDOW_MIN", 1 << 30)
    candidates = sample(probs.to(DEVICE), seeds, **kwargs)
    assert windowed.tokens.tolist() == candidates.tokens.tolist()
    assert torch.equal(windowed.selected_logprob.cpu(), candidates.selected_logprob.cpu())
    assert (windowed.status.cpu() == Status.OK).all() and (windowed.sizes.cpu()[:2] > 1000).all()
    want = reference_capture(probs, windowed.tokens.cpu().long(), top_p=top_p, min_p=min_p,
                             max_tokens=64)
    for b in range(batch):
        assert windowed.row(b)[0].cpu().tolist() == want.row(b)[0].tolist()


def test_window_rows_not_written_draw_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window row that the window write does not write (SKIPPED: opted
    out; OVERFLOW as a status: past max_tokens) is still drawn by the
    window draw: the same token as when the row is written, and its
    selected logprob the same."""
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

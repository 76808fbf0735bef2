"""Capture kernel against its sort-based torch reference.

Random rows use dyadic probabilities (integers over 2**24 summing to exactly
1, representable in fp32, bf16 and fp16), so every mass sum is exact in any
order and kernel and reference must agree id for id, even at a top-p target
that lands exactly on a cumulative mass.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from row_bits import bits  # noqa: E402  (tests/row_bits.py)
from shmask.kernels import Status, capture, reference_capture  # noqa: E402
from shmask.kernels.capture import reference_support  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE = 1 << 24


def dyadic_probs(batch: int, vocab: int, gen: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """Rows of n_i / 2**24 with 8 significant bits per n_i and sum exactly 1."""
    logits = torch.randn(batch, vocab, generator=gen, dtype=torch.float64) * scale
    raw = torch.softmax(logits, -1) * (ONE - (1 << 20))
    bits = torch.floor(torch.log2(raw.clamp(min=1.0)))
    step = torch.exp2((bits - 7).clamp(min=0))
    counts = (torch.floor(raw / step) * step).to(torch.int64)
    for b in range(batch):
        spots = torch.randperm(vocab, generator=gen)[:24]
        counts[b, spots] = 0  # each spot takes one power of two of the rest
        rest = ONE - int(counts[b].sum())
        for i, bit in enumerate(range(24)):
            if rest >> bit & 1:
                counts[b, spots[i]] += 1 << bit
        assert int(counts[b].sum()) == ONE
    probs = counts.to(torch.float64) / ONE
    assert torch.equal(probs.to(torch.bfloat16).double(), probs)
    assert torch.equal(probs.to(torch.float16).double(), probs)
    return probs.float()


def assert_same(got, want) -> None:
    for field in ("offsets", "lengths", "status", "sizes", "forms", "id_offsets"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), (
            field, getattr(got, field).cpu(), getattr(want, field).cpu())
    total = int(want.offsets[-1])
    assert torch.equal(got.ids[:int(want.id_offsets[-1])].cpu(), want.ids.cpu())
    torch.testing.assert_close(got.values[:total].cpu(), want.values.cpu(), atol=2e-5, rtol=0)
    torch.testing.assert_close(got.selected_logprob.cpu(), want.selected_logprob.cpu(),
                               atol=2e-5, rtol=0, equal_nan=True)


def random_settings(batch: int, vocab: int, gen: torch.Generator) -> dict:
    pick = lambda options: torch.tensor(  # noqa: E731
        [options[int(i)] for i in torch.randint(len(options), (batch,), generator=gen)])
    top_k = pick([0, 1, 5, 50, 700, vocab, -1, int(torch.randint(1, vocab, (1,), generator=gen))])
    top_p = pick([1.0, 0.5, 0.9, 0.95, 0.25, float(torch.rand(1, generator=gen))])
    min_p = pick([0.0, 0.0, 0.01, 0.1, 0.5])
    return {"top_k": top_k.to(torch.int32), "top_p": top_p.float(), "min_p": min_p.float()}


def draw_from_support(probs, settings, order, gen) -> torch.Tensor:
    support, _, _ = reference_support(probs, settings["top_k"], settings["top_p"],
                                      settings["min_p"], order)
    tokens = torch.empty(probs.shape[0], dtype=torch.int64)
    for b in range(probs.shape[0]):
        ids = support[b].nonzero()[:, 0]
        tokens[b] = ids[torch.randint(ids.numel(), (1,), generator=gen)] if ids.numel() else 0
    # a few rows name a token outside the support (INVALID)
    outside = torch.rand(probs.shape[0], generator=gen) < 0.15
    return torch.where(outside, torch.randint(probs.shape[1], tokens.shape, generator=gen), tokens)


def run_both(probs, sampled, **kwargs):
    on_device = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = capture(probs.to(DEVICE), sampled.to(DEVICE), **on_device)
    want = reference_capture(probs, sampled, **kwargs)
    assert_same(got, want)
    return got


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("order", ["joint", "sequential"])
def test_random_rows_match_reference(seed: int, dtype: torch.dtype, order: str) -> None:
    """Random max_tokens: some rows past it (bitmask rows, or OVERFLOW under
    overflow="status", which the bf16 cases use)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, batch = (70001, 3) if seed == 2 else (1000 + 37 * seed, 8)
    probs = dyadic_probs(batch, vocab, gen, scale=1.0 + 2.0 * seed).to(dtype)
    settings = random_settings(batch, vocab, gen)
    sampled = draw_from_support(probs, settings, order, gen)
    rows = torch.rand(batch, generator=gen) > 0.2
    greedy = torch.rand(batch, generator=gen) > 0.85
    max_tokens = int(torch.randint(20, 800, (1,), generator=gen))
    overflow = "status" if dtype == torch.bfloat16 else "exact"
    run_both(probs, sampled, max_tokens=max_tokens, order=order, rows=rows, greedy=greedy,
             overflow=overflow, **settings)


@pytest.mark.parametrize("order", ["joint", "sequential"])
def test_softmax_rows_match_reference_up_to_rounding(order: str) -> None:
    """Non-dyadic fp32 input: kernel masses are fp32 sums, the reference's
    fp64, so a row may differ only where top-p's target is within rounding
    of a cumulative mass: then it equals the reference at top_p * (1 +- 1e-5)."""
    gen = torch.Generator().manual_seed(7)
    batch, vocab = 8, 5000
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 2.5, -1)
    settings = random_settings(batch, vocab, gen)
    sampled = draw_from_support(probs, settings, order, gen)
    kwargs = dict(max_tokens=vocab, order=order, **settings)
    got = capture(probs.to(DEVICE), sampled.to(DEVICE),
                  **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                     for k, v in kwargs.items()})
    nearby = [reference_capture(probs, sampled, **{**kwargs, "top_p": (settings["top_p"] * f)
                                                   .clamp(max=1.0)})
              for f in (1.0, 1 - 1e-5, 1 + 1e-5)]
    mismatched = 0
    for b in range(batch):
        ids = got.row(b)[0].cpu().tolist()
        options = [r.row(b)[0].tolist() for r in nearby]
        assert ids in options, f"row {b}"
        mismatched += ids != options[0]
    assert mismatched <= 1


def test_worked_example() -> None:
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]])
    sampled = torch.tensor([2])
    joint = run_both(probs, sampled, top_k=2, top_p=0.45, max_tokens=8, order="joint")
    assert joint.row(0)[0].cpu().tolist() == [0, 1, 2]  # the tie at 0.2 is kept: 3 > top_k
    torch.testing.assert_close(joint.row(0)[1].cpu(), torch.log(torch.tensor([0.5, 0.25, 0.25])))
    assert joint.selected_logprob.item() == pytest.approx(math.log(0.25), abs=1e-6)
    # sequential: top-k keeps {0,1,2} (mass 0.8), top-p 0.45 of 0.8 = 0.36 -> {0}
    seq = run_both(probs, torch.tensor([0]), top_k=2, top_p=0.45, max_tokens=8,
                   order="sequential")
    assert seq.row(0)[0].cpu().tolist() == [0]
    assert seq.selected_logprob.item() == pytest.approx(0.0, abs=1e-6)


def test_ties_at_every_cutoff() -> None:
    # value 2**-4 x4, 2**-5 x8, 2**-6 x16, 2**-7 x32: each tie group holds a
    # quarter of the mass, so cumulative masses are 1/4, 1/2, 3/4, 1 exactly.
    group = [(1 / 16, 4), (1 / 32, 8), (1 / 64, 16), (1 / 128, 32)]
    values = torch.cat([torch.full((n,), v) for v, n in group])
    perm = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(3))
    row = values[perm]
    probs = row.repeat(6, 1)
    top_k = torch.tensor([2, 5, 12, 0, 0, 0], dtype=torch.int32)  # inside tie groups
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.25, 0.5, 0.51])  # on / just past a group's end
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    sampled = perm.argsort()[:6] * 0 + int(perm.argsort()[0])  # a token of value 1/16
    got = run_both(probs, sampled, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=64)
    assert got.sizes.cpu().tolist() == [4, 12, 12, 4, 12, 28]
    # min_p exactly at a value keeps that value's ties
    got = run_both(probs[:1], sampled[:1], min_p=0.25, max_tokens=64)  # 0.25 / 16 = 1/64
    assert got.sizes.item() == 28


@pytest.mark.parametrize("top_k", [1000, None])
def test_rows_with_more_bad_values_than_the_resolve_block(top_k) -> None:
    """Every bad value (NaN, inf, negative) is a candidate, so a row full of
    them has more candidates than the resolve program holds (4096; 16384
    when window rows may occur, as with top_k None): still INVALID, in one
    program's first block, and its neighbours' rows as the reference has
    them. Bad values placed last (past the first block of 4096: top_k 1000)
    count too."""
    vocab = 6000
    gen = torch.Generator().manual_seed(5)
    probs = dyadic_probs(5, vocab, gen)
    probs[0] = float("nan")
    probs[1, :] = -probs[1, :]  # all negative
    probs[3] = 1.0 / vocab  # all tied: every id a candidate, more than a block of 4096
    probs[3, vocab - 1] = float("inf")  # one bad value, the row's last id: past the first block
    # A negative value there too: unlike inf or NaN (which make Z non-finite
    # and the row INVALID anyway) only the scan for bad values catches it.
    tied = torch.full((1, vocab), 1.0 / vocab, dtype=probs.dtype)
    tied[0, vocab - 1] = -1.0 / vocab
    probs = torch.cat([probs, tied])
    sampled = probs.clamp(min=0).nan_to_num(0.0).argmax(1)
    got = run_both(probs, sampled, top_k=top_k, top_p=0.9, max_tokens=vocab)
    assert got.status.cpu().tolist() == [Status.INVALID, Status.INVALID, Status.OK,
                                         Status.INVALID, Status.OK, Status.INVALID]
    assert got.lengths.cpu().tolist()[:2] == [0, 0] and got.lengths[3].item() == 0


def test_scalar_settings_are_broadcast_once_per_setting() -> None:
    """A scalar setting becomes its [B] tensor once per (value, batch, dtype,
    device, stream) and is reused (no fill launch per call); 1, 1.0 and True
    stay apart, and past the cache's size every answer is still right."""
    from shmask.kernels.checks import constant_rows
    first = constant_rows(1000, 4, torch.int32, torch.device(DEVICE))
    assert constant_rows(1000, 4, torch.int32, torch.device(DEVICE)) is first
    assert first.cpu().tolist() == [1000] * 4
    assert constant_rows(1000, 5, torch.int32, torch.device(DEVICE)) is not first
    assert constant_rows(1, 3, torch.float32, torch.device(DEVICE)) is not constant_rows(
        True, 3, torch.float32, torch.device(DEVICE))
    for value in range(100):
        assert constant_rows(value, 2, torch.int32, torch.device(DEVICE)).cpu().tolist() == [value] * 2


def test_settings_of_a_known_stream_and_settings_tensors_taken_as_they_are() -> None:
    """An eager call that knows its stream hands it down (no query per
    setting): the broadcast tensor is the one kept for that stream, another
    stream's is another; a [B] setting already of the kernels' dtype, device
    and layout is the caller's own tensor (a later in-place update is what
    the kernels read), any other is converted; a wrong shape is refused."""
    from shmask.kernels.checks import constant_rows, per_row
    device = torch.device(DEVICE)
    # (no broadcast made between a lookup and the one kept before it: the
    # cache is emptied when full, and other tests fill it)
    kept = constant_rows(0.5, 4, torch.float32, device, 7001)
    assert constant_rows(0.5, 4, torch.float32, device, 7001) is kept
    assert per_row(0.5, 4, torch.float32, device, "top_p", 1.0, stream=7001) is kept
    assert constant_rows(0.5, 4, torch.float32, device, 7002) is not kept
    assert kept.cpu().tolist() == [0.5] * 4
    own = torch.full((4,), 0.9, device=device)
    assert per_row(own, 4, torch.float32, device, "top_p", 1.0) is own
    as_int64 = torch.full((4,), 20, dtype=torch.int64, device=device)
    converted = per_row(as_int64, 4, torch.int32, device, "top_k", 0)
    assert converted.dtype == torch.int32 and converted.tolist() == [20] * 4
    strided = torch.zeros(8, device=device)[::2]
    assert per_row(strided, 4, torch.float32, device, "top_p", 1.0).is_contiguous()
    with pytest.raises(ValueError, match=r"top_p must have shape \(4,\)"):
        per_row(torch.zeros(5, device=device), 4, torch.float32, device, "top_p", 1.0)


def test_edge_rows() -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(11)
    base = dyadic_probs(1, vocab, gen)[0]
    probs = base.repeat(10, 1)
    probs[0] = 0.0  # zero mass -> INVALID
    probs[1, 5] = float("nan")  # non-finite input -> INVALID
    top = int(base.argmax())
    sampled = torch.full((10,), top)
    sampled[2] = int(base.argmin())  # outside a top-k 3 support -> INVALID
    sampled[3] = vocab  # out of range -> INVALID
    top_k = torch.tensor([0, 0, 3, 0, 1, 0, 0, 0, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.9, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0])
    rows = torch.tensor([True] * 8 + [False, True])
    greedy = torch.tensor([False] * 7 + [True, False, False])
    positive = int((base > 0).sum())
    got = run_both(probs, sampled, top_k=top_k, top_p=top_p, min_p=min_p, rows=rows,
                   greedy=greedy, max_tokens=positive)
    status = got.status.cpu().tolist()
    assert status[:4] == [Status.INVALID] * 4
    assert status[4:8] == [Status.OK] * 4 and status[8] == Status.SKIPPED
    assert got.row(4)[0].cpu().tolist() == [top]  # one id (top_k 1)
    assert got.row(5)[0].cpu().tolist() == (base > 0).nonzero()[:, 0].tolist()  # top_p 1.0
    assert got.row(7)[0].cpu().tolist() == [top] and got.row(7)[1].item() == 0.0  # greedy
    assert got.lengths[8].item() == 0 and math.isfinite(got.selected_logprob[8].item())
    # around max_tokens: the whole vocabulary fits at max_tokens = its size, not one less
    over = run_both(probs[5:6], sampled[5:6], max_tokens=positive - 1, overflow="status")
    assert over.status.item() == Status.OVERFLOW and over.lengths.item() == 0
    assert over.sizes.item() == positive and int(over.offsets[-1]) == 0
    assert int(over.id_offsets[-1]) == 0
    # by default the same row travels whole, as a bitmask
    exact = run_both(probs[5:6], sampled[5:6], max_tokens=positive - 1)
    assert exact.status.item() == Status.OK and exact.forms.item() == 1
    assert exact.row(0)[0].cpu().tolist() == (base > 0).nonzero()[:, 0].tolist()


def test_min_p_only_and_opted_out_rows_untouched() -> None:
    gen = torch.Generator().manual_seed(5)
    probs = dyadic_probs(4, 2000, gen, scale=4.0)
    sampled = probs.argmax(1)
    rows = torch.tensor([True, False, True, False])
    got = run_both(probs, sampled, min_p=0.05, rows=rows, max_tokens=2000)
    for b in range(4):
        expect = (probs[b] >= 0.05 * probs[b].max()).nonzero()[:, 0].tolist()
        assert got.sizes[b].item() == len(expect)
        assert got.row(b)[0].cpu().tolist() == (expect if rows[b] else [])


def test_engine_dtypes_read_as_they_are() -> None:
    """Engines hand the sampler's tensors as they have them: int32 drawn
    tokens (SGLang), int64 top_k, bool greedy and opt-in masks. The kernels
    read those as they are (no cast launched a call: CaptureSettings and
    the sampled tokens are the caller's own tensors) and give the same bits
    as the canonical dtypes; an int64 token past 2**31 is INVALID (as the
    reference says), not wrapped to a valid id."""
    from shmask.kernels import sample
    from shmask.kernels.capture import _tokens_and_seeds
    from shmask.kernels.capture_workspace import CaptureSettings
    gen = torch.Generator().manual_seed(23)
    batch, vocab = 8, 700
    probs = dyadic_probs(batch, vocab, gen, scale=2.0).to(DEVICE)
    top_k = torch.tensor([0, 5, 50, 0, 700, 20, 0, 3], dtype=torch.int64, device=DEVICE)
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.5, 0.9, 1.0, 0.95, 1.0], device=DEVICE)
    greedy = torch.tensor([False, False, True, False, False, False, False, True], device=DEVICE)
    rows = torch.tensor([True, True, True, False, True, True, True, True], device=DEVICE)
    sampled = probs.argmax(1).to(torch.int32)
    sampled[6] = 3  # maybe outside its support
    settings = CaptureSettings.of(batch, vocab, probs.device, top_k=top_k, top_p=top_p,
                                  min_p=None, greedy=greedy, rows=rows, sequential=False)
    assert settings.top_k is top_k and settings.greedy is greedy and settings.opt_in is rows
    assert _tokens_and_seeds(sampled, None, batch, probs.device, None)[0] is sampled
    canonical = dict(top_k=top_k.to(torch.int32), top_p=top_p, greedy=greedy.to(torch.int8),
                     max_tokens=64)
    got = capture(probs, sampled, top_k=top_k, top_p=top_p, greedy=greedy, rows=rows,
                  max_tokens=64)
    want = capture(probs, sampled.to(torch.int64), rows=rows, **canonical)
    assert bits(got) == bits(want)
    assert_same(got, reference_capture(probs.cpu(), sampled.cpu(), top_k=top_k.cpu(),
                                       top_p=top_p.cpu(), greedy=greedy.cpu(), rows=rows.cpu(),
                                       max_tokens=64))
    drawn = sample(probs, 7, top_k=top_k, top_p=top_p, greedy=greedy, rows=rows, max_tokens=64)
    again = sample(probs, 7, rows=rows, **canonical)
    assert bits(drawn) == bits(again) and torch.equal(drawn.tokens, again.tokens)
    wide = sampled.to(torch.int64)
    wide[0] += 1 << 32  # a valid id once wrapped to 32 bits
    wide[1] -= 1 << 32
    beyond = capture(probs, wide, top_k=top_k, top_p=top_p, max_tokens=64)
    assert beyond.status[:2].cpu().tolist() == [Status.INVALID] * 2
    assert_same(beyond, reference_capture(probs.cpu(), wide.cpu(), top_k=top_k.cpu(),
                                          top_p=top_p.cpu(), max_tokens=64))


def test_bad_arguments_are_named() -> None:
    probs = torch.rand(2, 5, device=DEVICE)
    sampled = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="order"):
        capture(probs, sampled, max_tokens=4, order="nested")
    with pytest.raises(ValueError, match="top_p"):
        capture(probs, sampled, max_tokens=4, top_p=1.5)
    with pytest.raises(ValueError, match="top_k must have shape"):
        capture(probs, sampled, max_tokens=4, top_k=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="sampled"):
        capture(probs, sampled[:1], max_tokens=4)
    with pytest.raises(TypeError, match="sampled"):
        capture(probs, sampled.float(), max_tokens=4)
    with pytest.raises(ValueError, match="overflow"):
        capture(probs, sampled, max_tokens=4, overflow="truncate")
    # settings are numbers (numpy's too) or [B] tensors; anything else is named
    with pytest.raises(TypeError, match="min_p must be a number or a tensor of shape"):
        capture(probs, sampled, max_tokens=4, min_p=np.array(0.5))
    with pytest.raises(TypeError, match="top_k must be a number.*got str"):
        capture(probs, sampled, max_tokens=4, top_k="5")
    got = capture(probs, sampled, max_tokens=4, top_k=np.int64(5), top_p=np.float32(1.0))
    assert got.status.shape == (2,)

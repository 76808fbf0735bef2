"""Capture's first stage, the bound (program per row): from a sample of
each row, the floor key of its candidates, or for a window row the pivot
keys around its top-p cutoff (kernels/capture.py says where it stands
among the stages).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .capture_workspace import CaptureSettings, CaptureWorkspace
from .float_bits import INF_KEY
from .launch import after_previous, compiled_for_nvidia, launch, launch_options
from .tuning import BOUND_BITS, BOUND_STEP


def launch_bound(probs: torch.Tensor, settings: CaptureSettings, ws: CaptureWorkspace,
                 pdl: bool) -> None:
    """_bound_kernel over the rows: ws.lo, ws.window, a window row's
    ws.pivots, and ws.wide_count and ws.done cleared for the window
    bracket and the interleaved mark."""
    batch = probs.shape[0]
    launch(_bound_kernel, (batch,),
        probs, probs.stride(0), probs.shape[1], settings.top_k, settings.top_p, settings.min_p,
        settings.greedy, ws.lo, ws.window, ws.pivots, ws.wide_count, ws.done,
        SEQUENTIAL=settings.sequential, WINDOW=settings.window, BLOCKS=tuning.SAMPLE_BLOCKS,
        COLS=tuning.SAMPLE_COLS, K_SLACK=tuning.K_SLACK, P_MARGIN=tuning.P_MARGIN,
        WINDOW_MIN=tuning.WINDOW_MIN, PIVOTS=tuning.WINDOW_PIVOTS,
        INNER_MIN=tuning.WINDOW_INNER_MIN, INNER_MAX=tuning.WINDOW_INNER_MAX,
        INNER_SCALE=tuning.WINDOW_INNER_SCALE, UNSURE=tuning.WINDOW_UNSURE,
        BELOW=tuning.WINDOW_BELOW, ABOVE=tuning.WINDOW_ABOVE, K_FLOOR_ONLY=tuning.K_FLOOR_ONLY,
        P_KEEP=tuning.P_KEEP, HEAVY=tuning.SAMPLE_HEAVY,
        ONE_REDUCE=compiled_for_nvidia(probs), PDL=pdl,
        num_warps=tuning.BOUND_WINDOW_WARPS if settings.window else tuning.BOUND_WARPS,
        **launch_options(pdl),
    )


@triton.jit
def _bound_kernel(
    probs_ptr, stride_row, vocab, top_k_ptr, top_p_ptr, min_p_ptr, greedy_ptr,
    lo_ptr, window_ptr, pivots_ptr, wide_count_ptr, done_ptr,
    SEQUENTIAL: tl.constexpr, WINDOW: tl.constexpr, BLOCKS: tl.constexpr, COLS: tl.constexpr,
    K_SLACK: tl.constexpr, P_MARGIN: tl.constexpr, WINDOW_MIN: tl.constexpr,
    PIVOTS: tl.constexpr, INNER_MIN: tl.constexpr, INNER_MAX: tl.constexpr,
    INNER_SCALE: tl.constexpr, UNSURE: tl.constexpr, BELOW: tl.constexpr, ABOVE: tl.constexpr,
    K_FLOOR_ONLY: tl.constexpr, P_KEEP: tl.constexpr, HEAVY: tl.constexpr,
    ONE_REDUCE: tl.constexpr, PDL: tl.constexpr,
):
    """Program per row: from a sample of the row (BLOCKS x COLS columns),
    the candidates' floor lo and whether the row is a window row.

    lo lies under every cutoff (top-k: the sample's key with K_SLACK x its
    share of k above it; top-p: the key whose sampled mass share reaches
    top_p + P_MARGIN; min-p: min_p x the sample's max), so the candidates
    (every key >= lo) are the support plus a little. A window row (top-k
    off, top-p on, a support the sample puts past WINDOW_MIN ids) gets
    instead PIVOTS keys around the sampled estimate of its cutoff, spread by
    the width of [lo, hi) (hi: the key whose sampled mass share reaches
    top_p - P_MARGIN; _window_pivots), whose exact masses the candidate mark
    sums (the window bracket and mark bracket the cutoff by them). A
    min-p-only row (top-k and top-p off) whose sample puts past WINDOW_MIN
    ids above lo is a window row too, with no pivots: its cutoff is min_p x
    the row's max, exact once the candidate mark has the max, and the
    window mark, resolve and the window write take its support from the
    whole row as a top-p window row's above its bracket. A top-p-only row
    whose count floor does not settle it is a window row too when its
    sample places the top-p share loosely (a standard error of at least
    UNSURE thousandths of mass, corrected for the share of the row sampled:
    none when the sample is the whole row): its floors may lie above its
    cutoff, and a window row never falls back to the whole-row passes."""
    after_previous(PDL)  # the kernel before may have written probs
    row = tl.program_id(0)
    idx = tl.arange(0, BLOCKS * COLS)
    block = idx // COLS
    spread = vocab > BLOCKS * COLS
    start = tl.where(spread, (block * (vocab - COLS)) // (BLOCKS - 1), block * COLS)
    cols = start + idx % COLS
    inside = cols < vocab
    w = tl.load(probs_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=0.0)
    w = w.to(tl.float32)
    good = inside & (w > 0.0) & (w < float("inf"))  # false for NaN
    w = tl.where(good, w, 0.0)
    key = tl.where(good, w.to(tl.int32, bitcast=True), 0)
    n = tl.sum(inside.to(tl.float32), axis=0)
    share = n / vocab  # the sample's share of the row
    top = tl.max(key, axis=0)
    # The sample's largest value, when no other sampled id ties it, is taken
    # as the only one of its size in the row (HEAVY): it weighs its own
    # value in the mass estimates, not 1/share times it. A sample that holds
    # one of a row's few heavy tokens otherwise puts top-p's floor above the
    # cutoff (and a mid-size support under WINDOW_MIN): the whole-row
    # search. A tied top value is common in the row: weighed as before.
    w_mass = w
    if HEAVY:
        lone = (key == top) & (tl.sum((key == top).to(tl.int32), axis=0) == 1) & (top > 0)
        w_mass = tl.where(lone, w * share, w)
    total = tl.sum(w_mass, axis=0)

    # A greedy row's floor is its max (below): it needs none of the searches.
    greedy = tl.load(greedy_ptr + row) != 0
    top_k = tl.load(top_k_ptr + row)
    k_on = (top_k >= 1) & (top_k < vocab)
    expect = top_k.to(tl.float32) * share
    need = K_SLACK * expect + 3.0 * tl.sqrt(expect) + 4.0
    floor_k = tl.zeros([], dtype=tl.int32)
    if k_on & ~greedy:
        floor_k = _sample_key_reaching(key, w, need, False)
    top_p = tl.load(top_p_ptr + row)
    p_on = top_p < 1.0
    floor_p = tl.zeros([], dtype=tl.int32)
    hi = tl.full([], INF_KEY, tl.int32)
    center = tl.zeros([], dtype=tl.int32)
    # a window row needs top-p on, top-k off and room for top_p - P_MARGIN,
    # or min-p alone (its cutoff, min_p x the row's max, is exact once the
    # candidate mark has the max: no pivots)
    min_p = tl.load(min_p_ptr + row)
    may_be_window = False
    p_window = False
    if WINDOW:
        p_window = p_on & ~k_on & (top_p > P_MARGIN)
        may_be_window = p_window | (~p_on & ~k_on & (min_p > 0.0))
    # The floor's share: top_p + P_MARGIN, or half the way to 1 where that
    # reaches 1 (top_p 0.99): a share of 1 is the sample's whole mass, whose
    # floor, its smallest key, keeps nearly every id of the row
    above = tl.minimum(top_p + P_MARGIN, (1.0 + top_p) * 0.5)
    floor_m = tl.where(min_p > 0.0, (min_p * top.to(tl.float32, bitcast=True))
                       .to(tl.int32, bitcast=True), 0)
    # A top-k of at most K_FLOOR_ONLY ids: its floor alone, whose candidates
    # (the support plus a little, whatever top-p keeps) fit in resolve's
    # registers; a top-p floor above it would come from a sample that can
    # over-weigh a heavy token, and a floor above the cutoff costs the
    # whole-row search. In sequential order top-p's target is a share of
    # the top-k mass: every w >= t_k is needed whatever k.
    # (min-p's floor may lie above t_k: in sequential order it is left out)
    only_k = k_on & (top_k <= K_FLOOR_ONLY)
    floor_km = tl.maximum(tl.maximum(floor_k, floor_m), 1)
    if SEQUENTIAL:
        only_k = k_on
        floor_km = tl.maximum(floor_k, 1)
    # a top-p-only row that its count floor leaves unsettled, whose sample
    # places the top-p share loosely: a window row (below)
    unsure = tl.zeros([], dtype=tl.int1)
    error = tl.zeros([], dtype=tl.float32)  # the top-p share's standard error (_share_error)
    if p_on & ~only_k & ~greedy:  # (a row that takes top-k's floor alone needs no top-p floor)
        # A top-p-only row's floor is also low enough to keep P_KEEP ids by
        # the sample's count (floor_c): a heavy token in the sample, weighed
        # ~1/share times its share (HEAVY off, or a tied top value), puts
        # the mass floor above a peaked row's cutoff (the whole-row search);
        # P_KEEP candidates are in resolve's registers.
        floor_c = tl.full([], INF_KEY, tl.int32)
        settled = tl.zeros([], dtype=tl.int1)
        if ~k_on:
            floor_c = _sample_key_reaching(key, w, P_KEEP * share, False)
            # Where the mass at or above floor_c already reaches the mass
            # floor's share, the mass floor (the largest such key) lies at
            # or above floor_c, so the floor is floor_c; and a row whose
            # floor keeps too few ids to be a window row needs no pivots.
            # Then the mass searches (most of the bound's time) are skipped,
            # with the floor and window flag they would give: peaked rows.
            settled = tl.sum(tl.where(key >= floor_c, w_mass, 0.0), axis=0) >= above * total
            if p_window:
                lo_c = tl.maximum(floor_c, tl.maximum(floor_m, 1))
                settled = settled & ~_keeps_window_rows(key, lo_c, share, WINDOW_MIN)
        if settled:
            floor_p = floor_c
        else:
            if p_window:
                error = _share_error(w_mass, total, top_p)
                # (times sqrt(1 - share): a sample of the whole row is exact)
                unsure = error * tl.sqrt(1.0 - share) * 1000.0 >= UNSURE
                floor_p, hi, center = _sample_keys_reaching3(
                    key, w_mass, above * total, (top_p - P_MARGIN) * total, top_p * total,
                    ONE_REDUCE)
                hi += BOUND_STEP  # the top of the key's bucket: at least the exact key + 1
            else:
                floor_p = _sample_key_reaching(key, w_mass, above * total, True)
            floor_p = tl.minimum(floor_p, floor_c)
    lo = tl.maximum(tl.maximum(floor_k, floor_p), tl.maximum(floor_m, 1))
    lo = tl.where(only_k, floor_km, lo)
    lo = tl.where(greedy, tl.maximum(top, 1), lo)
    window = tl.zeros([], dtype=tl.int32)
    if WINDOW:
        many = _keeps_window_rows(key, lo, share, WINDOW_MIN) | unsure
        window = (may_be_window & ~greedy & many & (hi > lo)).to(tl.int32)
        if (window != 0) & p_window:
            # The pivots' spread: the width of [lo, hi), or twice that of
            # [center, hi) when top_p + P_MARGIN reaches 1 (lo's share is
            # then half the way to 1, and [lo, hi) can span binades). lo
            # holds the count floor too: a row whose mass floor, center and
            # hi share a heavy id's bucket keeps a spread wider than the
            # bound's resolution (BOUND_STEP); a row of fewer than P_KEEP
            # ids (a small vocabulary) has lo 1, pivots over every key. (A
            # top-p window row was never settled: its error is set above.)
            span = tl.where(top_p + P_MARGIN < 1.0, hi.to(tl.int64) - lo,
                            2 * (hi.to(tl.int64) - center))
            half = _inner_span(error, P_MARGIN, INNER_MIN, INNER_MAX, INNER_SCALE)
            j = tl.arange(0, PIVOTS)
            tl.store(pivots_ptr + row * PIVOTS + j,
                     _window_pivots(center, span, j, PIVOTS, half, INNER_MAX, BELOW, ABOVE))
    tl.store(lo_ptr + row, lo)
    tl.store(window_ptr + row, window)
    if WINDOW:
        tl.store(done_ptr + row, 0)  # the interleaved mark counts a row's programs
        if row == 0:
            tl.store(wide_count_ptr, 0)  # _window_bracket_kernel counts the wide rows


@triton.jit
def _keeps_window_rows(key, lo, share, WINDOW_MIN: tl.constexpr):
    """Whether the sample puts more than WINDOW_MIN ids of the row at or above lo."""
    return tl.sum((key >= lo).to(tl.float32), axis=0) > WINDOW_MIN * share


@triton.jit
def _sample_key_reaching(key, w, target, USE_MASS: tl.constexpr):
    """Largest key t whose low 31 - BOUND_BITS bits are zero with (count or
    mass of the sample's keys >= t) >= target, by bisection over bits 30..
    (31 - BOUND_BITS) of a register tile; 0 when none reaches. The exact key
    lies in [t, t + BOUND_STEP): the bound is an estimate with margins, so
    its first BOUND_BITS bits (the exponent and 8 of the mantissa: within
    0.4% of the value) are all it needs, in half the steps of all 31."""
    found = tl.zeros([], dtype=tl.int32)
    for step in range(BOUND_BITS):
        probe = found | (1 << (30 - step))
        hit = key >= probe
        if USE_MASS:
            reach = tl.sum(tl.where(hit, w, 0.0), axis=0)
        else:
            reach = tl.sum(hit.to(tl.float32), axis=0)
        found = tl.where(reach >= target, probe, found)
    return found


@triton.jit
def _sample_keys_reaching3(key, w, target1, target2, target3, ONE_REDUCE: tl.constexpr):
    """_sample_key_reaching (of the mass) for three targets at once: the
    three searches' sums at each step are independent. ONE_REDUCE (compiled
    kernels): one reduction of three operands a step, whose warps meet once
    (decision 64: the bound 0.984-0.992x on the top-p paths' worst cases);
    Triton's interpreter runs such a reduction element by element in
    Python, so there three sums."""
    found1 = tl.zeros([], dtype=tl.int32)
    found2 = tl.zeros([], dtype=tl.int32)
    found3 = tl.zeros([], dtype=tl.int32)
    for step in range(BOUND_BITS):
        bit = 1 << (30 - step)
        reach1, reach2, reach3 = _sums3(tl.where(key >= (found1 | bit), w, 0.0),
                                        tl.where(key >= (found2 | bit), w, 0.0),
                                        tl.where(key >= (found3 | bit), w, 0.0), ONE_REDUCE)
        found1 = tl.where(reach1 >= target1, found1 | bit, found1)
        found2 = tl.where(reach2 >= target2, found2 | bit, found2)
        found3 = tl.where(reach3 >= target3, found3 | bit, found3)
    return found1, found2, found3


@triton.jit
def _sums3(a, b, c, ONE_REDUCE: tl.constexpr):
    """The sums of three blocks (the bound's three searches, resolve's three
    probes): one reduction of three operands, whose warps meet once
    (ONE_REDUCE, compiled kernels), or three sums (Triton's interpreter,
    where a reduction of several operands runs element by element in
    Python)."""
    if ONE_REDUCE:
        sa, sb, sc = tl.reduce((a, b, c), 0, _add3)
    else:
        sa = tl.sum(a, axis=0)
        sb = tl.sum(b, axis=0)
        sc = tl.sum(c, axis=0)
    return sa, sb, sc


@triton.jit
def _add3(a1, a2, a3, b1, b2, b3):
    """tl.reduce's combine for three sums at once."""
    return a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _inner_span(error, P_MARGIN: tl.constexpr, INNER_MIN: tl.constexpr,
                INNER_MAX: tl.constexpr, INNER_SCALE: tl.constexpr):
    """A window row's inner pivots' half-width in hundredths of its sampled
    range (which spans about 2 x P_MARGIN of the row's mass): INNER_SCALE
    percent of the standard error of the sample's estimate of the top-p
    share (``error``, _share_error's), within [INNER_MIN, INNER_MAX]. A
    flat row's thousands of like-sized sampled ids place its cutoff closely
    (a narrow bracket: fewer candidates for the expand and resolve); a row
    whose mass sits in a few sampled ids is placed loosely (wide: fewer
    brackets missed, each a refine's read)."""
    tl.static_assert((0 <= INNER_MIN) & (INNER_MIN <= INNER_MAX))
    scaled = error * (50.0 / P_MARGIN * INNER_SCALE / 100)
    # (a NaN, from a row with no sampled mass, takes INNER_MIN)
    return tl.where(scaled > INNER_MIN, tl.minimum(scaled, INNER_MAX), INNER_MIN).to(tl.int32)


@triton.jit
def _share_error(w, total, top_p):
    """The standard error of the sample's estimate of a top-p share,
    sqrt(top_p (1 - top_p) / n), n the sample's effective size
    (sum w)^2 / sum w^2: about 1/sqrt(ids) for a flat row, far more for a
    row whose mass sits in a few sampled ids. NaN for a row with no sampled
    mass."""
    share = w / total  # (the weights' own scale would under- or overflow w * w)
    n = 1.0 / tl.sum(share * share, axis=0)
    return tl.sqrt(top_p * (1.0 - top_p) / n)


@triton.jit
def _window_pivots(center, span, j, PIVOTS: tl.constexpr, half, INNER_MAX: tl.constexpr,
                   BELOW: tl.constexpr, ABOVE: tl.constexpr):
    """Pivot j (a block of indices) of a window row, ascending, within
    [1, +inf's bits]: PIVOTS - 2 evenly over center +- half/100 x span, one
    at center - BELOW/100 x span and one at center + ABOVE/100 x span."""
    tl.static_assert(PIVOTS >= 4, "two inner pivots and two outer ones at least")
    tl.static_assert((INNER_MAX < BELOW) & (INNER_MAX < ABOVE),
                     "the outer pivots lie outside the inner")
    inner = (center - (span * half) // 100
             + (span * (2 * half) * tl.maximum(j - 1, 0)) // (100 * (PIVOTS - 3)))
    keys = tl.where(j == 0, center - (span * BELOW) // 100,
                    tl.where(j == PIVOTS - 1, center + (span * ABOVE) // 100, inner))
    return tl.minimum(tl.maximum(keys, 1), INF_KEY).to(tl.int32)

"""Capture: the support a sampler drew from, with its logprobs, per row.

Semantics (every comparison on the float32 value of the probability ``w``)
---------------------------------------------------------------------------
Cutoffs are thresholds: every token whose ``w`` ties the value at a cutoff is
kept, so the support can be larger than ``top_k``.

* top-k (active when ``1 <= top_k < V``): ``t_k`` = the k-th largest ``w``.
* top-p (active when ``top_p < 1``): with ``w`` sorted descending and
  cumulative mass ``c``, ``t_p`` = the value at the first position where
  ``c >= top_p * M``; ``M`` is the row's total mass (joint) or the mass kept
  by top-k (sequential). Equivalently the largest ``t`` with
  ``mass(w >= t) >= top_p * M``.
* min-p (active when ``min_p > 0``): ``t_m = min_p * max(w)`` (the same in both
  orders, since renormalising does not change ratios to the maximum).
* support = ``{i : w_i > 0 and w_i >= max(t_k, t_p, t_m)}``.
* order ``"joint"``: every cutoff on the same probabilities. ``"sequential"``:
  top-k, renormalise, top-p, renormalise, min-p; only top-p's target mass
  differs.
* ``logprob_i = log(w_i / Z)``, ``Z = sum of w over the support``; the
  selected logprob is ``log(w_y / Z)`` from the same ``Z``.
* greedy rows: support = ``{y}``, logprob 0.
* status, first match wins: INVALID (a NaN, inf or negative ``w`` in the row,
  ``y`` outside ``[0, V)`` or outside the support, ``Z == 0``, a non-finite
  logprob), SKIPPED (row not opted in: thresholds and the selected logprob are
  still computed, no id is written), OVERFLOW (``overflow="status"`` only:
  support larger than ``max_tokens``, no id written), OK.
* an OK row travels in the cheaper exact form (see :class:`._common.Form`):
  its ids while ``32 L < V`` and ``L <= max_tokens``, else its bitmask; its
  logprobs in both forms.

Masses are float32 sums in the kernel and float64 in the reference; a top-p
target within rounding (about 1e-6 relative) of a cumulative mass may fall on
either side.

Kernels:
1. bound (program per row): reads a sample of the row (8 blocks of 1024
   columns spread over it; the whole row when V <= 8192) and sets the
   candidates' floor lo, under every cutoff (top-k: the sampled
   key with 1.25x its share of k above it, plus slack; top-p: the key whose
   sampled mass share reaches top_p + P_MARGIN; min-p: min_p x the sampled
   max). A window row (top-k off, top-p on, a support the sample puts past
   WINDOW_MIN ids, capture without ``into=``) gets 8 pivots instead, around
   the key whose sampled share reaches top_p, spread by the width of [lo, hi)
   (hi: the key whose sampled share reaches top_p - P_MARGIN;
   _window_pivots).
2. candidate mark (program per 8192-column chunk): one read of ``probs``:
   the candidates as a bitmask and their count (every bad value, NaN, inf
   or negative, is a candidate: resolve finds them there; a window row's
   are left to 2d), and only the exact sums a row's settings need (mass for
   top-p, max for min-p/greedy; a window row's mass above each pivot).
2b. window bracket (launched, like 2c and 2d, only when some row may be
   top-p only; program per row): the exact masses above a window row's 8
   pivots place its top-p cutoff between two of them (the bracket); a
   bracket outside the inner pivots (a sample that missed) is wide, and
   gets 8 refining keys inside it; the wide rows are listed.
2c. window refine (a fixed grid of programs sharing out the listed rows'
   chunks): the mass above 8 keys inside each wide bracket.
2d. window mark (program per chunk, window rows only): a wide bracket
   narrowed by those masses, min-p's key a floor, one read rewrites the
   row's candidates as its bad values and the ids in the bracket, and sums
   the count and mass of those above it.
3. expand (as in compaction): ascending candidate ids and values, row-local.
4. resolve (program per row): exact cutoffs by bisection over the float bits
   of the candidates (held in registers when they fit), then a check that
   the sampled range held them (a cutoff at or above lo). A row that fails
   the check is resolved from its whole row (31 passes over it, one program:
   slow, exact) and its candidates rewritten as its support. A window row's
   candidates are the ids of its bracket (2d), so its cutoff is exact, never
   a fallback; resolve also counts its support in each chunk. Then ``Z``, the
   selected logprob or, in :mod:`.sample`, the Gumbel-max draw; status,
   length, form.
5. write (program per row): the support's logprobs at offsets[b] and its
   ids or bitmask words at id_offsets[b], both computed from the lengths and
   forms of the rows before (a bitmask row is zeroed, then each run of
   support ids in one word is OR-ed by a segmented scan and stored once).
   A window row gets only its offsets here:
6. window write (launched only when some row may be top-p only; program per
   chunk): one contiguous read of a window row's chunk writes its support's
   bitmask words (or ids) and ``log(w) - log(Z)`` at the row's offsets plus
   the counts of the chunks before, which resolve found.

On sm90+ GPUs every kernel is launched as a programmatic dependent of the
one before (after_previous): it starts while that one ends and waits for it
before reading what it wrote; reads of ``probs``, and from L2 of what a
kernel two or more launches back wrote, may come first.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._common import (
    CHUNK,
    WORD_BITS,
    Rows,
    Status,
    _interpreted,
    after_previous,
    bitmask_words,
    check_matrix,
    check_max_tokens,
    is_bitmask,
    launch_expand_local,
    launch_options,
    log_any,
    pack_rows,
    pdl_default,
    per_row,
    popcount,
    row_mask,
    tl,
    triton,
    values_capacity,
)
from .direct import claim_step, launching, publish_into
from .host import check_into
from .ring import ring_arrive, ring_claim, ring_commit

__all__ = ["ORDERS", "capture", "reference_capture", "top_p_within_rounding"]

ORDERS = ("joint", "sequential")
# The bound kernel samples SAMPLE_BLOCKS blocks of SAMPLE_COLS contiguous
# columns spread evenly over each row (the whole row when V is at most
# their total) and sets, per row, the key range of the candidates the mark
# pass collects. Its estimates have margins; resolve verifies them exactly
# and a row whose estimate was wrong is resolved from the whole row (slow,
# exact).
SAMPLE_BLOCKS = 8
SAMPLE_COLS = 1024
# top-k: sample ids above the floor >= K_SLACK * k / scale + 3 sqrt(k / scale) + 4
K_SLACK = 1.25
# top-p: the window holds the ids whose sampled mass share above them lies
# within top_p +- P_MARGIN
P_MARGIN = 0.05
# a top-p row (top-k off) takes the window form when the sample says its
# candidates would be more than this many ids: more than resolve holds in
# registers (RESOLVE_BLOCK), where a full row's candidates get slow and a
# sample that missed its cutoff costs the whole-row fallback (31 passes);
# a window row's cutoff never falls back (H200, fp32 inputs, top_p 0.9:
# 1,957 us a call with 16384 here, 1,815 with every top-p row a window row)
WINDOW_MIN = 4096
# H200, top_p 0.9 only, bf16: the bound 25.2 us at 8 warps, 27.4 at 16, 24.1 at 4;
# a call that may have window rows launches it at 4 (23.6 us)
BOUND_WARPS = 8
BOUND_WINDOW_WARPS = 4
CAND_MARK_WARPS = 16  # H200, bf16 top_k 1000: 105.9 us at 4 warps, 81.7 at 8, 75.0 at 16
# with window rows (8 pivot sums an element): 91 us at 16 warps, 82 at 8, 90 at 4
CAND_MARK_WINDOW_WARPS = 8
RESOLVE_BLOCK = 4096  # candidates held in registers by the resolve program
RESOLVE_WARPS = 8  # H200, capture top_k 1000: 18.3 us at 4 warps, 16.4 at 8, 31.3 at 16
DRAW_BLOCK = 1024  # candidates per step of the sampler's draw in the resolve program
# Window rows: the candidate mark sums the mass above WINDOW_PIVOTS keys
# placed around the row's sampled estimate of its top-p cutoff (the key whose
# sampled mass share reaches top_p), in hundredths of the width s of its
# sampled range [lo, hi): PIVOTS - 2 evenly over the estimate +- WINDOW_INNER,
# one WINDOW_BELOW under it and one WINDOW_ABOVE over it. The top-p cutoff's
# bracket lies between two of them, and every id in it is a candidate of
# resolve. Over 1,024 rows of each benchmark input (B = 256 x 4 sets, top_p
# 0.9, benchmarks/capture_bf16.py), the cutoff lay within +-0.25 s of the
# estimate in every bf16 row and +-0.46 s in all but 6 fp32 rows (down to
# -1.33 s: a heavy token in or out of the sample). On the H200 (inner
# +-0.30 s) the brackets hold 2,870 ids on average (bf16; 3,638 at most) and
# 1,930 (fp32; 3,109), all within resolve's registers, where 8 pivots evenly
# over [lo - s, hi + s] (the layout before) gave 12,250 and 7,800 (up to
# 14,306 / 12,587). The outer two keep a sample that missed bounded; such a
# bracket (a few fp32 rows a set, ~35,000 ids) is refined (WINDOW_REFINE):
# unrefined, resolve took 146-156 us for those batches instead of 27.
WINDOW_PIVOTS = 8
WINDOW_INNER = 30
WINDOW_BELOW = 150
WINDOW_ABOVE = 100
# A bracket outside the inner pivots is narrowed by the exact masses above
# WINDOW_REFINE keys inside it before its ids are marked (_window_mark_kernel)
WINDOW_REFINE = 8
WINDOW_MARK_WARPS = 8  # H200, bf16 top_p 0.9: 61.4 us at 8 warps, 75.1 at 16
WINDOW_WRITE_WARPS = 8  # 216.9 us at 8 warps, 225.8 at 16 (with tl.log)
# H200, bf16 top_p 0.9 (window write us): the whole chunk at once 136, SUB
# 4096 113, 2048 150, 1024 132; 4096 at 4 warps 131, at 16 190
WINDOW_WRITE_SUB = 4096  # columns per step of the window write
# the window write's registers a thread (maxnreg). H200, bf16 top_p 0.9 only:
# 112.3 us at the compiler's 107 (two programs an SM), 96.3 at 80 (three; no
# spills), 104.5 at 64 (four, a few spills); capping the window mark's did
# not pay (57.0 us at its 74, 63.5 at 64, 83.5 at 56)
WINDOW_WRITE_REGISTERS = 80
# resolve's search over a window row's bracket: 4 ways 87.3 us (bf16) / 68.9
# (fp32), 2 ways 92.8 / 78.4, the bisection over 31 bits 114 / 93
WINDOW_SEARCH_WAYS = 4
WRITE_BLOCK = 4096  # candidates per step of the write program
ROW_BLOCK = 4096  # columns per step of a resolve program that reads its whole row
SMALLEST_POSITIVE = tl.constexpr(1.401298464324817e-45)  # float32 bits 1, a subnormal
INF_KEY = tl.constexpr(0x7F800000)  # float bits of +inf: a floor no candidate reaches
NEG_ZERO_KEY = tl.constexpr(-0x80000000)  # float bits of -0.0 as an int32
# The bound kernel's bisection settles the first BOUND_BITS of bits 30..0 of
# a key (exponent and 8 mantissa bits); BOUND_STEP is one unit of the last.
BOUND_BITS = tl.constexpr(16)
BOUND_STEP = tl.constexpr(1 << (31 - 16))


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
def _sample_keys_reaching3(key, w, target1, target2, target3):
    """_sample_key_reaching (of the mass) for three targets at once: the
    three searches' reductions at each step are independent, so their
    latencies overlap (a window row's bound searches three keys)."""
    found1 = tl.zeros([], dtype=tl.int32)
    found2 = tl.zeros([], dtype=tl.int32)
    found3 = tl.zeros([], dtype=tl.int32)
    for step in range(BOUND_BITS):
        bit = 1 << (30 - step)
        reach1 = tl.sum(tl.where(key >= (found1 | bit), w, 0.0), axis=0)
        reach2 = tl.sum(tl.where(key >= (found2 | bit), w, 0.0), axis=0)
        reach3 = tl.sum(tl.where(key >= (found3 | bit), w, 0.0), axis=0)
        found1 = tl.where(reach1 >= target1, found1 | bit, found1)
        found2 = tl.where(reach2 >= target2, found2 | bit, found2)
        found3 = tl.where(reach3 >= target3, found3 | bit, found3)
    return found1, found2, found3


@triton.jit
def _bound_kernel(
    probs_ptr, stride_row, vocab, top_k_ptr, top_p_ptr, min_p_ptr, greedy_ptr,
    lo_ptr, window_ptr, pivots_ptr, wide_count_ptr,
    SEQUENTIAL: tl.constexpr, WINDOW: tl.constexpr, BLOCKS: tl.constexpr, COLS: tl.constexpr,
    K_SLACK: tl.constexpr, P_MARGIN: tl.constexpr, WINDOW_MIN: tl.constexpr,
    PIVOTS: tl.constexpr, INNER: tl.constexpr, BELOW: tl.constexpr, ABOVE: tl.constexpr,
    PDL: tl.constexpr,
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
    sums (the window bracket and mark bracket the cutoff by them)."""
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
    total = tl.sum(w, axis=0)
    top = tl.max(key, axis=0)

    top_k = tl.load(top_k_ptr + row)
    k_on = (top_k >= 1) & (top_k < vocab)
    expect = top_k.to(tl.float32) * share
    need = K_SLACK * expect + 3.0 * tl.sqrt(expect) + 4.0
    floor_k = tl.zeros([], dtype=tl.int32)
    if k_on:
        floor_k = _sample_key_reaching(key, w, need, False)
    top_p = tl.load(top_p_ptr + row)
    p_on = top_p < 1.0
    floor_p = tl.zeros([], dtype=tl.int32)
    hi = tl.full([], INF_KEY, tl.int32)
    center = tl.zeros([], dtype=tl.int32)
    # a window row needs top-p on, top-k off and room for top_p - P_MARGIN
    may_be_window = False
    if WINDOW:
        may_be_window = p_on & ~k_on & (top_p > P_MARGIN)
    if p_on:
        if may_be_window:
            floor_p, hi, center = _sample_keys_reaching3(
                key, w, (top_p + P_MARGIN) * total, (top_p - P_MARGIN) * total, top_p * total)
            hi += BOUND_STEP  # the top of the key's bucket: at least the exact key + 1
        else:
            floor_p = _sample_key_reaching(key, w, (top_p + P_MARGIN) * total, True)
    min_p = tl.load(min_p_ptr + row)
    floor_m = tl.where(min_p > 0.0, (min_p * top.to(tl.float32, bitcast=True))
                       .to(tl.int32, bitcast=True), 0)
    lo = tl.maximum(tl.maximum(floor_k, floor_p), tl.maximum(floor_m, 1))
    if SEQUENTIAL:
        # top-p's target is a share of the top-k mass: every w >= t_k is needed
        lo = tl.where(k_on, tl.maximum(floor_k, 1), lo)
    greedy = tl.load(greedy_ptr + row) != 0
    lo = tl.where(greedy, tl.maximum(top, 1), lo)
    window = tl.zeros([], dtype=tl.int32)
    if WINDOW:
        many = tl.sum((key >= lo).to(tl.float32), axis=0) > WINDOW_MIN * share
        window = (may_be_window & ~greedy & many & (hi > lo)).to(tl.int32)
        if window != 0:
            # The pivots' spread: the width of [lo, hi), or twice that of
            # [center, hi) when top_p + P_MARGIN leaves no lower end (the
            # floor's target is the sample's whole mass: lo falls to its
            # smallest key, and the width to ~13 binades; simulated on the
            # benchmark's rows, top_p 0.95: brackets of 97k ids a bf16 row
            # against 4.3k, 0.99: 148k against 10.5k)
            span = tl.where(top_p + P_MARGIN < 1.0, hi.to(tl.int64) - lo,
                            2 * (hi.to(tl.int64) - center))
            j = tl.arange(0, PIVOTS)
            tl.store(pivots_ptr + row * PIVOTS + j,
                     _window_pivots(center, span, j, PIVOTS, INNER, BELOW, ABOVE))
    tl.store(lo_ptr + row, lo)
    tl.store(window_ptr + row, window)
    if WINDOW:
        if row == 0:
            tl.store(wide_count_ptr, 0)  # _window_bracket_kernel counts the wide rows


@triton.jit
def _cand_mark_kernel(
    probs_ptr, stride_row, vocab, lo_ptr, window_ptr, pivots_ptr, top_p_ptr, min_p_ptr, greedy_ptr,
    bits_ptr, counts_ptr, sum_ptr, max_ptr, pivot_mass_ptr, n_chunks,
    CHUNK: tl.constexpr, MASS: tl.constexpr, TOP: tl.constexpr, WINDOW: tl.constexpr,
    PIVOTS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, c): one read of columns [c*CHUNK, (c+1)*CHUNK) of row b:
    the candidates key >= lo as a bitmask (CHUNK/32 words) and their count
    (every bad value, NaN, inf or negative, among them), and the exact sums
    the row's cutoffs need: its mass (top-p), its max (min-p, greedy). Each
    reduction over the chunk costs about as much as the read (H200,
    2026-12-02), so a row gets only the ones its settings need. A window row
    (WINDOW) sums, besides its mass, the mass at or above each of its PIVOTS
    pivots (_bound_kernel placed them), and writes no candidates:
    _window_mark_kernel writes them all, its bad values among them (skipping
    the words here: the H200's mark 118.7 -> 90.9 us for top_p 0.9, bf16).

    MASS, TOP and WINDOW say whether any row of the call may need the mass,
    the max or a window (known from the call's arguments, no host sync):
    a reduction a call cannot need is not compiled in at all (H200, bf16,
    2026-12-02: 39.8 us for top_k 1000 alone, 48.5 with top_p's mass on)."""
    WORDS: tl.constexpr = CHUNK // 32
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    word_idx, bit_idx, _, w, key = _chunk_tile(probs_ptr, stride_row, vocab, row, chunk, CHUNK)
    # the chunk's read is issued first: it overlaps the bound's end
    after_previous(PDL)
    # lo can lie above +inf's bits (a top-p floor from a sample of zero
    # mass: the largest key reaching 0); no finite key reaches either.
    lo = tl.minimum(tl.load(lo_ptr + row), INF_KEY)
    window = False
    if WINDOW:
        window = tl.load(window_ptr + row) != 0
    # A bad value (NaN, inf, negative) is a candidate whatever its key: the
    # resolve program finds it among the candidates and the row is INVALID.
    # All of it is one unsigned comparison of the float bits: lo >= 1 lies
    # below +inf's bits, which lie below every NaN's and every negative
    # value's (sign bit set), and 0.0 (padding too) lies below lo; only -0.0
    # (the sign bit alone) is not bad and is left out. Written as float
    # tests (w >= 0, w < inf, or-ed with the range) the kernel took 97 us
    # instead of 44 (H200, bf16, top_k 1000, 2026-12-02).
    slot = row * n_chunks + chunk
    if not window:
        # (a window row's candidates, its bracket and bad values, are all
        # written by _window_mark_kernel)
        keep = (key.to(tl.uint32, bitcast=True) >= lo.to(tl.uint32)) & (key != NEG_ZERO_KEY)
        words = tl.sum(keep.to(tl.int32) << bit_idx[None, :], axis=1)  # distinct bits: an OR
        tl.store(bits_ptr + slot.to(tl.int64) * WORDS + word_idx, words)
        tl.store(counts_ptr + slot, tl.sum(popcount(words.to(tl.uint32, bitcast=True)), axis=0))
    # The whole-chunk sums and maxima reduce the chunk as one flat vector in
    # whatever order its elements sit (can_reorder: no data moves), not row
    # by row then across rows: with 16 warps 7% less time for the kernel on
    # the H200 (bf16, top_k 1000: 81.7 -> 74.2 us; top_p 0.9: 106.6 -> 91.8
    # us). A float sum's rounding depends on its order, which was Triton's
    # to choose before as well.
    flat = _good_flat(w, CHUNK)
    total = tl.zeros([], dtype=tl.float32)
    if MASS:
        if tl.load(top_p_ptr + row) < 1.0:
            total = tl.sum(flat, axis=0)
    tl.store(sum_ptr + slot, total)
    top = tl.zeros([], dtype=tl.float32)
    if TOP:
        if (tl.load(min_p_ptr + row) > 0.0) | (tl.load(greedy_ptr + row) != 0):
            top = tl.max(flat, axis=0)
    tl.store(max_ptr + slot, top)
    if WINDOW:
        if window:
            _masses_above(flat, pivots_ptr + row * PIVOTS,
                          pivot_mass_ptr + slot.to(tl.int64) * PIVOTS, PIVOTS)


@triton.jit
def _good_flat(w, CHUNK: tl.constexpr):
    """A chunk's tile of w as one flat vector in whatever order its elements
    sit (can_reorder: no data moves), bad values (NaN, inf, negative) as 0."""
    # One unsigned test of the bits, as the candidate mark's predicate: the
    # finite w >= 0 lie below +inf's bits, NaNs and negative values (sign
    # bit set) above; -0.0 (the sign bit alone) counts as a zero either way.
    # The float tests (w >= 0, w < inf) took the window rows' candidate
    # mark 87 us instead of 70 (H200, bf16 top_p 0.9, 2026-12-02).
    good = w.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True) < INF_KEY
    return tl.reshape(tl.where(good, w, 0.0), [CHUNK], can_reorder=True)


@triton.jit
def _masses_above(flat, keys_ptr, out_ptr, N: tl.constexpr):
    """out[j] = the chunk's mass at or above key j, for N keys: one flat
    reduction a key (H200, bf16, top_p 0.9: the candidate mark 117 us with 8
    pivots, against 134 as one [CHUNK, N] tile summed over its rows)."""
    fkey = flat.to(tl.int32, bitcast=True)
    for j in tl.static_range(N):
        tl.store(out_ptr + j, tl.sum(tl.where(fkey >= tl.load(keys_ptr + j), flat, 0.0), axis=0))


@triton.jit
def _window_pivots(center, span, j, PIVOTS: tl.constexpr, INNER: tl.constexpr,
                   BELOW: tl.constexpr, ABOVE: tl.constexpr):
    """Pivot j (a block of indices) of a window row, ascending, within
    [1, +inf's bits]: PIVOTS - 2 evenly over center +- INNER/100 x span, one
    at center - BELOW/100 x span and one at center + ABOVE/100 x span."""
    tl.static_assert(PIVOTS >= 4, "two inner pivots and two outer ones at least")
    tl.static_assert((INNER < BELOW) & (INNER < ABOVE), "the outer pivots lie outside the inner")
    inner = (center - (span * INNER) // 100
             + (span * (2 * INNER) * tl.maximum(j - 1, 0)) // (100 * (PIVOTS - 3)))
    keys = tl.where(j == 0, center - (span * BELOW) // 100,
                    tl.where(j == PIVOTS - 1, center + (span * ABOVE) // 100, inner))
    return tl.minimum(tl.maximum(keys, 1), INF_KEY).to(tl.int32)


@triton.jit
def _reach(vals_ptr, base, n, v0, key0, live0, probe, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Count (or mass) of candidates whose key is >= probe. The first BLOCK
    candidates come from registers, the rest (rare) from memory."""
    hit = live0 & (key0 >= probe)
    if USE_MASS:
        acc = tl.sum(tl.where(hit, v0, 0.0), axis=0)
    else:
        acc = tl.sum(hit.to(tl.float32), axis=0)
    for start in range(BLOCK, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        live = idx < n
        v = tl.load(vals_ptr + base + idx, mask=live, other=0.0)
        hit = live & (v.to(tl.int32, bitcast=True) >= probe)
        if USE_MASS:
            acc += tl.sum(tl.where(hit, v, 0.0), axis=0)
        else:
            acc += tl.sum(hit.to(tl.float32), axis=0)
    return acc


@triton.jit
def _largest_key_reaching(
    vals_ptr, base, n, v0, key0, live0, target, USE_MASS: tl.constexpr, BLOCK: tl.constexpr
):
    """Largest key t with reach(t) >= target, by bisection over bits 30..0.
    0 when even the smallest positive key does not reach the target."""
    found = tl.zeros([], dtype=tl.int32)
    for step in range(31):
        probe = found | (1 << (30 - step))
        reach = _reach(vals_ptr, base, n, v0, key0, live0, probe, USE_MASS, BLOCK)
        found = tl.where(reach >= target, probe, found)
    return found


@triton.jit
def _largest_key_between(vals_ptr, base, n, v0, key0, live0, target, lo, hi, BLOCK: tl.constexpr,
                         WAYS: tl.constexpr):
    """Largest key t in [lo, hi] whose candidates' mass at or above it
    reaches target, lo when none does: a search over the bracket's keys
    alone, not all 31 bits (a window row's bracket spans about 2^22 keys).
    WAYS 4: each pass over the candidates sums the mass above three probes
    (a quarter of the interval apart) and keeps a quarter, half the passes
    of a binary search (WAYS 2)."""
    hi = hi + 1  # the search keeps lo (reaching, or the floor) below hi (not reaching)
    for _step in range(32):  # a binary search takes 31 at most, 4 ways 16
        if hi - lo > 1:
            q = hi - lo
            if WAYS == 4:
                p1 = lo + q // 4
                p2 = lo + q // 2
                p3 = p2 + q // 4
                r1, r2, r3 = _reach3(vals_ptr, base, n, v0, key0, live0, p1, p2, p3, BLOCK)
                # reach falls as the probe rises: the last probe reaching
                # is the new lo, the first one not reaching the new hi
                new_lo = tl.where(r3 >= target, p3,
                                  tl.where(r2 >= target, p2, tl.where(r1 >= target, p1, lo)))
                hi = tl.where(r1 < target, p1,
                              tl.where(r2 < target, p2, tl.where(r3 < target, p3, hi)))
                lo = new_lo
            else:
                probe = lo + q // 2
                reach = _reach(vals_ptr, base, n, v0, key0, live0, probe, True, BLOCK)
                lo = tl.where(reach >= target, probe, lo)
                hi = tl.where(reach >= target, hi, probe)
    return lo


@triton.jit
def _reach3(vals_ptr, base, n, v0, key0, live0, p1, p2, p3, BLOCK: tl.constexpr):
    """The candidates' mass at or above each of three keys, from one pass
    (the first BLOCK candidates from registers, the rest from memory)."""
    r1 = tl.sum(tl.where(live0 & (key0 >= p1), v0, 0.0), axis=0)
    r2 = tl.sum(tl.where(live0 & (key0 >= p2), v0, 0.0), axis=0)
    r3 = tl.sum(tl.where(live0 & (key0 >= p3), v0, 0.0), axis=0)
    for start in range(BLOCK, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        v = tl.load(vals_ptr + base + idx, mask=idx < n, other=0.0)
        key = v.to(tl.int32, bitcast=True)
        r1 += tl.sum(tl.where(key >= p1, v, 0.0), axis=0)
        r2 += tl.sum(tl.where(key >= p2, v, 0.0), axis=0)
        r3 += tl.sum(tl.where(key >= p3, v, 0.0), axis=0)
    return r1, r2, r3


@triton.jit
def _row_reach(row_ptr, vocab, probe, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Count (or mass) of the row's finite w > 0 whose key is >= probe, read
    from the whole row (the fallback of a row whose sampled bound was wrong)."""
    acc = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        w = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
        hit = (w > 0.0) & (w < float("inf")) & (w.to(tl.int32, bitcast=True) >= probe)
        if USE_MASS:
            acc += tl.sum(tl.where(hit, w, 0.0), axis=0)
        else:
            acc += tl.sum(hit.to(tl.float32), axis=0)
    return acc


@triton.jit
def _row_key_reaching(row_ptr, vocab, target, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """_largest_key_reaching over the whole row."""
    found = tl.zeros([], dtype=tl.int32)
    for step in range(31):
        probe = found | (1 << (30 - step))
        reach = _row_reach(row_ptr, vocab, probe, USE_MASS, BLOCK)
        found = tl.where(reach >= target, probe, found)
    return found


@triton.jit
def _narrow(piv, masses, target, b_lo, b_hi):
    """The bracket [b_lo, b_hi) holding the largest key whose mass reaches
    target, narrowed by pivots whose masses are known: b_lo rises to the
    highest pivot that reaches, b_hi falls to the lowest pivot above it (a
    pivot above b_lo does not reach, whatever the rounding of the sums)."""
    b_lo = tl.maximum(b_lo, tl.max(tl.where(masses >= target, piv, 0), axis=0))
    b_hi = tl.minimum(b_hi, tl.min(tl.where(piv > b_lo, piv, INF_KEY), axis=0))
    return b_lo, b_hi


@triton.jit
def _prefetch_chunk(probs_ptr, stride_row, limit, row, chunk, CHUNK: tl.constexpr):
    """Bring the 128-byte lines of _chunk_tile's columns below limit into L2
    (NVIDIA's compiled kernels only): no registers held, unlike a load."""
    cols = tl.minimum(chunk * CHUNK + tl.arange(0, CHUNK // 32) * 32, tl.maximum(limit - 1, 0))
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [probs_ptr + row.to(tl.int64) * stride_row + cols],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_tile(probs_ptr, stride_row, limit, row, chunk, CHUNK: tl.constexpr):
    """Columns [chunk*CHUNK, (chunk+1)*CHUNK) of row as CHUNK/32 words of 32
    bits (the mark's layout): word and bit indices, columns, float32 values
    (0 from column limit on: the row's length, or 0 to read nothing) and
    their float bits."""
    word_idx = tl.arange(0, CHUNK // 32)
    bit_idx = tl.arange(0, 32)
    cols = chunk * CHUNK + word_idx[:, None] * 32 + bit_idx[None, :]
    w = tl.load(probs_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < limit,
                other=0.0).to(tl.float32)
    return word_idx, bit_idx, cols, w, w.to(tl.int32, bitcast=True)


# A window row's bracket record (_window_bracket_kernel, _window_mark_kernel,
# resolve): BRACKET int32 values a row; the refined bracket with min-p's floor
# (B_FINAL_LO, B_FINAL_HI) is what resolve searches
BRACKET = tl.constexpr(7)
B_LO, B_HI, B_TARGET, B_FLOOR, B_WIDE, B_FINAL_LO, B_FINAL_HI = (tl.constexpr(k)
                                                                  for k in range(7))


@triton.jit
def _window_bracket_kernel(
    window_ptr, pivots_ptr, top_p_ptr, min_p_ptr, sum_ptr, max_ptr, pivot_mass_ptr,
    bracket_ptr, refine_keys_ptr, wide_count_ptr, wide_rows_ptr, n_chunks,
    CHUNKS_PAD: tl.constexpr, PIVOTS: tl.constexpr, REFINE: tl.constexpr, PDL: tl.constexpr,
):
    """Program per row, window rows only: the candidate mark's exact masses
    above the row's pivots place its top-p cutoff in the bracket
    [b_lo, b_hi) between two of them (_narrow); stored with the target, the
    min-p floor and whether the bracket is wide (outside the inner pivots:
    a sample that missed the cutoff by more than WINDOW_INNER, tens of
    thousands of ids that resolve's one program a row would search slowly).
    A wide bracket also gets REFINE keys evenly inside it, whose masses
    _window_refine_kernel sums and _window_mark_kernel narrows it by (the
    row is listed for the refine's programs); an end that no pivot set
    (below the lowest, above the highest) lies the width of all the pivots
    further out. Computed once a row here, not in each of the window mark's
    programs (H200: 15 us of their time). Measured and not kept: the
    candidate mark's last program of each row doing it (an atomic count of
    the row's programs, no launch here): the mark 87 us instead of 82 (75
    registers a thread against 64)."""
    after_previous(PDL)
    row = tl.program_id(0)
    if tl.load(window_ptr + row) != 0:
        chunk_idx = tl.arange(0, CHUNKS_PAD)
        in_row = chunk_idx < n_chunks
        slots = row * n_chunks + chunk_idx
        pivot_idx = tl.arange(0, PIVOTS)
        masses = tl.sum(tl.load(pivot_mass_ptr + slots.to(tl.int64)[:, None] * PIVOTS
                                + pivot_idx[None, :], mask=in_row[:, None], other=0.0), axis=0)
        total = tl.sum(tl.load(sum_ptr + slots, mask=in_row, other=0.0), axis=0)
        rowmax = tl.max(tl.load(max_ptr + slots, mask=in_row, other=0.0), axis=0)
        target = _top_p_target(tl.load(top_p_ptr + row), total)
        pivots = pivots_ptr + row * PIVOTS
        b_lo, b_hi = _narrow(tl.load(pivots + pivot_idx), masses, target,
                             tl.full([], 1, tl.int32), tl.full([], INF_KEY, tl.int32))
        wide = (b_lo < tl.load(pivots + 1)) | (b_hi > tl.load(pivots + PIVOTS - 2))
        min_p = tl.load(min_p_ptr + row)
        floor = tl.where(min_p > 0.0, (min_p * rowmax).to(tl.int32, bitcast=True), 1)
        record = bracket_ptr + row * BRACKET
        tl.store(record + B_LO, b_lo)
        tl.store(record + B_HI, b_hi)
        tl.store(record + B_TARGET, target.to(tl.int32, bitcast=True))
        tl.store(record + B_FLOOR, floor)
        tl.store(record + B_WIDE, wide.to(tl.int32))
        if wide:
            # listed (in any order) for _window_refine_kernel's programs
            tl.store(wide_rows_ptr + tl.atomic_add(wide_count_ptr, 1), row)
            first = tl.load(pivots).to(tl.int64)
            last = tl.load(pivots + PIVOTS - 1).to(tl.int64)
            r_lo = tl.where(b_lo < first, first - (last - first), b_lo.to(tl.int64))
            r_hi = tl.where(b_hi > last, last + (last - first), b_hi.to(tl.int64))
            k = tl.arange(0, REFINE)
            keys = r_lo + (r_hi - r_lo) * (k + 1) // (REFINE + 1)  # r_hi >= r_lo
            tl.store(refine_keys_ptr + row * REFINE + k,
                     tl.minimum(tl.maximum(keys, 1), INF_KEY).to(tl.int32))


@triton.jit
def _top_p_target(top_p, mass):
    """top_p x mass, the mass a top-p support reaches, at least the smallest
    positive float32 (a subnormal, key 1): a product that underflows to 0
    would be reached by every key, and a floor any larger (1e-38 before)
    lies above the whole mass of a row whose mass is subnormal. The
    constant, below float32's normals, is typed float64: the max is exact
    in float64, and the cast brings it back."""
    return tl.maximum(top_p * mass, SMALLEST_POSITIVE).to(tl.float32)


@triton.jit
def _window_refine_kernel(
    probs_ptr, stride_row, vocab, wide_count_ptr, wide_rows_ptr, refine_keys_ptr,
    refine_mass_ptr, n_chunks, CHUNK: tl.constexpr, REFINE: tl.constexpr, PDL: tl.constexpr,
):
    """The chunks of the rows with a wide bracket (listed by
    _window_bracket_kernel), shared out over the programs: each chunk's
    mass at or above each of its row's REFINE refining keys. A fixed grid
    of a few programs an SM, not one a chunk of every row: wide rows are
    rare, and 4,864 programs that only found their row narrow took 6 us
    (H200, B = 256)."""
    after_previous(PDL)
    items = tl.load(wide_count_ptr) * n_chunks
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        row = tl.load(wide_rows_ptr + item // n_chunks)
        chunk = item % n_chunks
        _, _, _, w, _ = _chunk_tile(probs_ptr, stride_row, vocab, row, chunk, CHUNK)
        slot = row * n_chunks + chunk
        _masses_above(_good_flat(w, CHUNK), refine_keys_ptr + row * REFINE,
                      refine_mass_ptr + slot.to(tl.int64) * REFINE, REFINE)


@triton.jit
def _window_mark_kernel(
    probs_ptr, stride_row, vocab, window_ptr, bracket_ptr, refine_keys_ptr, refine_mass_ptr,
    bits_ptr, counts_ptr, above_mass_ptr, above_count_ptr, n_chunks,
    CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, REFINE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, c), window rows only (top-p without top-k, a support of
    thousands of ids), after _window_bracket_kernel (and, for a wide
    bracket, _window_refine_kernel, whose masses narrow it first): one read
    of the chunk rewrites its candidates as the ids in the row's bracket
    [b_lo, b_hi), min-p's key a floor under it, plus its bad values, and
    sums the count and mass of the ids at or above b_hi (all in the
    support). The row's first program stores the final bracket for
    resolve."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # A window row's chunk is read before the wait for the kernels before,
    # overlapping their end: its flag is the bound's, which finished before
    # the kernel before this one began (read from L2: ".cg")
    window = tl.load(window_ptr + row, cache_modifier=".cg") != 0
    word_idx, bit_idx, cols, w, key = _chunk_tile(probs_ptr, stride_row,
                                                  tl.where(window, vocab, 0), row, chunk, CHUNK)
    after_previous(PDL)
    if window:
        WORDS: tl.constexpr = CHUNK // 32
        record = bracket_ptr + row * BRACKET
        b_lo = tl.load(record + B_LO)
        b_hi = tl.load(record + B_HI)
        if tl.load(record + B_WIDE) != 0:
            chunk_idx = tl.arange(0, CHUNKS_PAD)
            refine_idx = tl.arange(0, REFINE)
            slots = row * n_chunks + chunk_idx
            sub_mass = tl.sum(tl.load(refine_mass_ptr + slots.to(tl.int64)[:, None] * REFINE
                                      + refine_idx[None, :],
                                      mask=(chunk_idx < n_chunks)[:, None], other=0.0), axis=0)
            b_lo, b_hi = _narrow(tl.load(refine_keys_ptr + row * REFINE + refine_idx), sub_mass,
                                 tl.load(record + B_TARGET).to(tl.float32, bitcast=True),
                                 b_lo, b_hi)
        b_lo = tl.maximum(b_lo, tl.load(record + B_FLOOR))  # nothing below min-p's key
        b_hi = tl.maximum(b_hi, b_lo)
        if chunk == 0:
            tl.store(record + B_FINAL_LO, b_lo)
            tl.store(record + B_FINAL_HI, b_hi)
        # integer tests of the bits, as in the candidate mark: bad values
        # (sign bit set, or at least +inf's bits; -0.0 is a zero), the
        # bracket (b_lo >= 1: no zero, no negative; b_hi <= +inf's bits: no
        # NaN, no inf) and the ids above it (finite, positive)
        bad = (key.to(tl.uint32, bitcast=True) >= INF_KEY) & (key != NEG_ZERO_KEY)
        keep = bad | ((key >= b_lo) & (key < b_hi))
        words = tl.sum(keep.to(tl.int32) << bit_idx[None, :], axis=1)  # distinct bits: an OR
        slot = row * n_chunks + chunk
        tl.store(bits_ptr + slot.to(tl.int64) * WORDS + word_idx, words)
        tl.store(counts_ptr + slot, tl.sum(popcount(words.to(tl.uint32, bitcast=True)), axis=0))
        up = (key >= b_hi) & (key < INF_KEY)
        tl.store(above_count_ptr + slot, tl.sum(tl.sum(up.to(tl.int32), axis=1), axis=0))
        tl.store(above_mass_ptr + slot, tl.sum(tl.sum(tl.where(up, w, 0.0), axis=1), axis=0))


@triton.jit
def _candidates(vals_ptr, ids_ptr, base, start, n, cutoff, BLOCK: tl.constexpr):
    """Candidates [start, start + BLOCK) of a row (of n): values, ids,
    which are real, and which lie at or above the cutoff."""
    idx = start + tl.arange(0, BLOCK)
    live = idx < n
    v = tl.load(vals_ptr + base + idx, mask=live, other=0.0)
    ids = tl.load(ids_ptr + base + idx, mask=live, other=0)
    return v, ids, live, live & (v.to(tl.int32, bitcast=True) >= cutoff)


@triton.jit
def _draw(v, ids, live, hit, seed, rowmax, vocab, best_score, best_id, first_id):
    """One block of the sampler's draw (ids ascending, after the blocks
    before): the exponential race's best score and id so far, and the
    smallest id at the row's max (greedy)."""
    score = tl.where(hit, v / -tl.log(tl.rand(seed, ids)), float("-inf"))
    block_best = tl.max(score, axis=0)
    block_id = tl.min(tl.where(score == block_best, ids, vocab), axis=0)
    # ids ascend: a later block's tie never beats an earlier id
    best_id = tl.where(block_best > best_score, block_id, best_id)
    best_score = tl.maximum(best_score, block_best)
    # greedy: the smallest id among the maxima (all of them are candidates)
    first_id = tl.minimum(first_id, tl.min(tl.where(live & (v == rowmax), ids, vocab), axis=0))
    return best_score, best_id, first_id


@triton.jit
def _resolve_kernel(
    probs_ptr, stride_row, vocab,
    cand_ids_ptr, cand_vals_ptr, counts_ptr, n_chunks,
    sum_ptr, max_ptr, lo_ptr, window_ptr,
    top_k_ptr, top_p_ptr, min_p_ptr, greedy_ptr, opt_in_ptr, token_ptr, seed_ptr,
    max_tokens,
    cutoff_ptr, logz_ptr, sizes_ptr, lengths_ptr, status_ptr, forms_ptr, selected_ptr,
    n_cand_ptr, window_ok_ptr, above_mass_ptr, above_count_ptr, bracket_ptr, before_ptr,
    SEQUENTIAL: tl.constexpr, SAMPLE: tl.constexpr, STATUS_ON_OVERFLOW: tl.constexpr,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, ROW_BLOCK: tl.constexpr,
    DRAW_BLOCK: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
    SEARCH_WAYS: tl.constexpr, PDL: tl.constexpr,
):
    after_previous(PDL)
    row = tl.program_id(0)
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    in_row = chunk_idx < n_chunks
    slots = row * n_chunks + chunk_idx
    n = tl.sum(tl.load(counts_ptr + slots, mask=in_row, other=0), axis=0)
    total = tl.sum(tl.load(sum_ptr + slots, mask=in_row, other=0.0), axis=0)
    rowmax = tl.max(tl.load(max_ptr + slots, mask=in_row, other=0.0), axis=0)
    lo = tl.load(lo_ptr + row)
    window = tl.zeros([], dtype=tl.int1)
    if WINDOW:
        window = tl.load(window_ptr + row) != 0
    base = row.to(tl.int64) * vocab
    idx0 = tl.arange(0, BLOCK)
    live0 = idx0 < n
    v0 = tl.load(cand_vals_ptr + base + idx0, mask=live0, other=0.0)
    key0 = v0.to(tl.int32, bitcast=True)
    # The row's bad values (NaN, inf, negative) are all among its candidates
    # (the mark pass keeps them whatever their key): any makes it INVALID.
    bad = tl.max((live0 & ~((v0 >= 0.0) & (v0 < float("inf")))).to(tl.int32), axis=0) > 0
    for start in range(BLOCK, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        v = tl.load(cand_vals_ptr + base + idx, mask=idx < n, other=0.0)
        bad = bad | (tl.max((~((v >= 0.0) & (v < float("inf")))).to(tl.int32), axis=0) > 0)
    # A bad row's result is INVALID whatever its cutoffs: the searches and the
    # sweep below take only its first block (a NaN row's candidates are all
    # of its ids: read from memory at every bisection step, they would cost
    # the whole batch milliseconds).
    n = tl.where(bad, tl.minimum(n, BLOCK), n)

    # Exact cutoffs over the candidates. Each is exact when the candidates
    # hold it (the search finds 0 otherwise); the checks below say whether
    # the sampled bound let them.
    top_k = tl.load(top_k_ptr + row)
    k_on = (top_k >= 1) & (top_k < vocab)
    cut_k = tl.zeros([], dtype=tl.int32)
    if k_on:
        cut_k = _largest_key_reaching(cand_vals_ptr, base, n, v0, key0, live0,
                                      top_k.to(tl.float32), False, BLOCK)
    top_p = tl.load(top_p_ptr + row)
    p_on = top_p < 1.0
    cut_p = tl.zeros([], dtype=tl.int32)
    # A window row's candidates are the ids in its bracket [b_lo, b_hi) (and
    # its bad values); the ids at or above b_hi, all in its support, are
    # counted apart (_window_mark_kernel).
    above_count = tl.zeros([], dtype=tl.int32)
    above_mass = tl.zeros([], dtype=tl.float32)
    b_lo = tl.zeros([], dtype=tl.int32)
    b_hi = tl.full([], INF_KEY, tl.int32)
    if WINDOW:
        if window:
            above_count = tl.sum(tl.load(above_count_ptr + slots, mask=in_row, other=0), axis=0)
            above_mass = tl.sum(tl.load(above_mass_ptr + slots, mask=in_row, other=0.0), axis=0)
            b_lo = tl.load(bracket_ptr + row * BRACKET + B_FINAL_LO)
            b_hi = tl.load(bracket_ptr + row * BRACKET + B_FINAL_HI)
    if p_on:
        mass = total
        if SEQUENTIAL & k_on:
            # the top-k mass: all of it lies among the candidates when cut_k was found
            mass = _reach(cand_vals_ptr, base, n, v0, key0, live0, tl.maximum(cut_k, 1), True,
                          BLOCK)
        target = _top_p_target(top_p, mass)
        if WINDOW:
            # the window mark's target, bit for bit (its bracket came from it)
            target = tl.where(window, tl.load(bracket_ptr + row * BRACKET + B_TARGET)
                              .to(tl.float32, bitcast=True), target)
        if window:
            cut_p = _largest_key_between(cand_vals_ptr, base, n, v0, key0, live0,
                                         target - above_mass, b_lo, b_hi, BLOCK, SEARCH_WAYS)
        else:
            cut_p = _largest_key_reaching(cand_vals_ptr, base, n, v0, key0, live0, target, True,
                                          BLOCK)
    min_p = tl.load(min_p_ptr + row)
    cut_m = tl.where(min_p > 0.0, (min_p * rowmax).to(tl.int32, bitcast=True), 0)
    cutoff = tl.maximum(tl.maximum(cut_k, cut_p), cut_m)
    # A window row's cutoff lies in its bracket (whose floor holds min-p's
    # key); it is 0 when the bracket's mass falls short of the target and
    # above every key when the mass above b_hi reaches it, both only by the
    # rounding of the sums: clamped to the bracket's ends.
    cutoff = tl.where(window, tl.minimum(tl.maximum(cut_p, b_lo), b_hi), cutoff)
    greedy = tl.load(greedy_ptr + row) != 0
    # A full row's candidates are every id at or above lo: a cutoff found at or
    # above lo is exact (lo <= 1: every positive id is a candidate). A window
    # row's is exact by construction.
    ok = (cutoff >= lo) | (lo <= 1) | window
    if SEQUENTIAL:
        # top-p's target is a share of the top-k mass: only right once t_k was found
        ok = ok & (~k_on | (cut_k >= lo) | (lo <= 1))
    if (~ok) & (~bad) & (~greedy):
        # The sampled bound was wrong for this row: its exact cutoffs from the
        # whole row, then its candidates rewritten as every w >= cutoff.
        row_ptr = probs_ptr + row.to(tl.int64) * stride_row
        cut_k = tl.zeros([], dtype=tl.int32)
        if k_on:
            cut_k = _row_key_reaching(row_ptr, vocab, top_k.to(tl.float32), False, ROW_BLOCK)
        cut_p = tl.zeros([], dtype=tl.int32)
        if p_on:
            mass = total
            if SEQUENTIAL & k_on:
                mass = _row_reach(row_ptr, vocab, tl.maximum(cut_k, 1), True, ROW_BLOCK)
            cut_p = _row_key_reaching(row_ptr, vocab, _top_p_target(top_p, mass), True,
                                      ROW_BLOCK)
        cutoff = tl.maximum(tl.maximum(cut_k, cut_p), cut_m)
        n = tl.zeros([], dtype=tl.int32)
        for start in range(0, vocab, ROW_BLOCK):
            cols = start + tl.arange(0, ROW_BLOCK)
            w = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            keep = ((w > 0.0) & (w < float("inf"))
                    & (w.to(tl.int32, bitcast=True) >= tl.maximum(cutoff, 1)))
            keep_i = keep.to(tl.int32)
            rank = n + tl.cumsum(keep_i, axis=0) - 1
            tl.store(cand_ids_ptr + base + rank, cols, mask=keep)
            tl.store(cand_vals_ptr + base + rank, w, mask=keep)
            n += tl.sum(keep_i, axis=0)
        tl.debug_barrier()  # the rewritten candidates, before they are read back
        live0 = idx0 < n
        v0 = tl.load(cand_vals_ptr + base + idx0, mask=live0, other=0.0)
        key0 = v0.to(tl.int32, bitcast=True)
    cutoff = tl.maximum(cutoff, 1)  # zeros are never in the support

    # Support size and mass (the candidates past the first BLOCK: in the
    # sampler's draw, which reads them anyway); a window row adds the ids
    # above its bracket.
    hit0 = live0 & (key0 >= cutoff)
    size = above_count + tl.sum(hit0.to(tl.int32), axis=0)
    z = above_mass + tl.sum(tl.where(hit0, v0, 0.0), axis=0)
    if not SAMPLE:  # the sampler's draw sums the candidates past the first BLOCK itself
        for start in range(BLOCK, n, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            live = idx < n
            v = tl.load(cand_vals_ptr + base + idx, mask=live, other=0.0)
            hit = live & (v.to(tl.int32, bitcast=True) >= cutoff)
            size += tl.sum(hit.to(tl.int32), axis=0)
            z += tl.sum(tl.where(hit, v, 0.0), axis=0)
    if WINDOW:
        if window & ~bad:
            # the support's ids in each chunk (above the bracket, then the
            # candidates at or above the cutoff) and, for the window write,
            # the exclusive scan of those counts
            bins = tl.arange(0, BINS)
            per_chunk = tl.load(above_count_ptr + row * n_chunks + bins, mask=bins < n_chunks,
                                other=0)
            for start in range(0, n, BLOCK):
                v, ids, live, hit = _candidates(cand_vals_ptr, cand_ids_ptr, base, start, n,
                                                cutoff, BLOCK)
                per_chunk += tl.histogram(tl.where(hit, ids // CHUNK, BINS - 1), BINS)
            per_chunk = tl.where(bins < n_chunks, per_chunk, 0)
            tl.store(before_ptr + row * n_chunks + bins, tl.cumsum(per_chunk, axis=0) - per_chunk,
                     mask=bins < n_chunks)

    if SAMPLE:
        # Exponential race: argmax w / E with E = -log(u), u ~ U[0, 1) (one
        # log a candidate: as logs, log w - log E took three, 29 us of 46).
        # The draw reads the candidates again (L2-hot) DRAW_BLOCK at a time:
        # a Philox state for each of BLOCK lanes held at once took the
        # program to 196 registers, one program per SM instead of two, and
        # the batch two waves (resolve 43 us against capture's 16.5; H200,
        # 2026-12-02). A row of tens of thousands of candidates (top-p
        # only: no window rows in sample) was then read twice, by the sweep
        # above and here (per-row tensor settings with such rows, bf16: 953
        # us a call against 885); the draw now sums those past the first
        # BLOCK itself. Measured and not kept: each lane keeping its own
        # best, reduced once at the end (996 us).
        seed = tl.load(seed_ptr + row)
        best_score = tl.full([], float("-inf"), tl.float32)
        best_id = tl.zeros([], dtype=tl.int32) + vocab
        first_id = tl.zeros([], dtype=tl.int32) + vocab
        for start in range(0, tl.minimum(n, BLOCK), DRAW_BLOCK):  # summed from registers
            v, ids, live, hit = _candidates(cand_vals_ptr, cand_ids_ptr, base, start, n, cutoff,
                                            DRAW_BLOCK)
            best_score, best_id, first_id = _draw(v, ids, live, hit, seed, rowmax, vocab,
                                                  best_score, best_id, first_id)
        # the size and mass past the first BLOCK, a lane at a time, reduced
        # once after the loop (summed a block at a time, two block-wide
        # reductions a step made the draw slower than reading twice: bf16
        # top-p rows 1,754 us a call against 1,636)
        lane_size = tl.zeros([DRAW_BLOCK], dtype=tl.int32)
        lane_mass = tl.zeros([DRAW_BLOCK], dtype=tl.float32)
        for start in range(BLOCK, n, DRAW_BLOCK):
            v, ids, live, hit = _candidates(cand_vals_ptr, cand_ids_ptr, base, start, n, cutoff,
                                            DRAW_BLOCK)
            lane_size += hit.to(tl.int32)
            lane_mass += tl.where(hit, v, 0.0)
            best_score, best_id, first_id = _draw(v, ids, live, hit, seed, rowmax, vocab,
                                                  best_score, best_id, first_id)
        size += tl.sum(lane_size, axis=0)
        z += tl.sum(lane_mass, axis=0)
        token = tl.where(greedy, first_id, best_id)
    else:
        token = tl.load(token_ptr + row).to(tl.int32)
    token_ok = (token >= 0) & (token < vocab)
    w_y = tl.load(probs_ptr + row.to(tl.int64) * stride_row + token,
                  mask=token_ok, other=0.0).to(tl.float32)
    in_support = token_ok & (w_y > 0.0) & (w_y.to(tl.int32, bitcast=True) >= cutoff)
    selected = log_any(w_y) - log_any(z)
    invalid = bad | ~in_support | ~(z > 0.0) | ~(tl.abs(selected) < float("inf"))
    # Greedy: the support is the token itself, logprob 0.
    invalid = tl.where(greedy, bad | ~token_ok, invalid)
    selected = tl.where(greedy, 0.0, selected)
    size = tl.where(bad, 0, size)  # a bad row's w count as zeros: no support
    size = tl.where(greedy, 1, size)
    z = tl.where(greedy, w_y, z)
    opted = tl.load(opt_in_ptr + row) != 0
    over = (size > max_tokens) & STATUS_ON_OVERFLOW
    status = tl.where(invalid, 2, tl.where(~opted, 3, tl.where(over, 1, 0)))
    length = tl.where(status == 0, size, 0)
    # A window row's support is written by _window_write_kernel from the row,
    # not from its candidates.
    window_ok = window & (status == 0)
    tl.store(cutoff_ptr + row, cutoff)
    tl.store(logz_ptr + row, log_any(z))
    tl.store(sizes_ptr + row, size)
    tl.store(lengths_ptr + row, length)
    tl.store(status_ptr + row, status)
    tl.store(forms_ptr + row, is_bitmask(length, status, max_tokens, vocab).to(tl.int32))
    tl.store(selected_ptr + row, tl.where(invalid, float("nan"), selected))
    tl.store(n_cand_ptr + row, n)
    tl.store(window_ok_ptr + row, window_ok.to(tl.int32))
    if SAMPLE:
        tl.store(token_ptr + row, tl.where(invalid, -1, token))


@triton.jit
def _or_in_word(word_a, bits_a, word_b, bits_b):
    """Scan step of a segmented OR over candidates sorted by id: the bits of
    the trailing run of equal words (ids ascend, so a run never resumes)."""
    return word_b, tl.where(word_a == word_b, bits_a | bits_b, bits_b)


@triton.jit
def _write_kernel(
    cand_ids_ptr, cand_vals_ptr, n_cand_ptr, window_ok_ptr, vocab, batch,
    cutoff_ptr, logz_ptr, lengths_ptr, status_ptr, forms_ptr, greedy_ptr, token_ptr,
    offsets_ptr, id_offsets_ptr, out_ids_ptr, out_vals_ptr, selected_ptr, table, arrivals,
    BLOCK: tl.constexpr, ROWS_BLOCK: tl.constexpr,
    DIRECT: tl.constexpr, SUPPORT: tl.constexpr, PDL: tl.constexpr,
):
    """Program b places row b's support: values at offsets[b], and at
    id_offsets[b] its ids (ids form) or its bitmask words (bitmask form).
    Both offsets are sums over the rows before b of what resolve decided.
    A window row (window_ok) gets its offsets only: _window_write_kernel
    writes its data.

    DIRECT (``into=`` on the GPU-direct path, kernels/direct.py): every store
    of the row's data is made a second time into its queue's buffer in the
    ring (where it fits: ``ring_claim``), then its length, flags and counts
    (``ring_commit``), and the program arrives (``ring_arrive``); SUPPORT
    says whether the ring gets the values or the selected logprob."""
    after_previous(PDL)
    row = tl.program_id(0)
    n_words = (vocab + 31) // 32
    offset = tl.zeros([], dtype=tl.int32)
    id_offset = tl.zeros([], dtype=tl.int32)
    for start in range(0, row, ROWS_BLOCK):
        r = start + tl.arange(0, ROWS_BLOCK)
        earlier = r < row
        length_r = tl.load(lengths_ptr + r, mask=earlier, other=0)
        bitmask_r = tl.load(forms_ptr + r, mask=earlier, other=0) != 0
        offset += tl.sum(length_r, axis=0)
        id_offset += tl.sum(tl.where(bitmask_r, n_words, length_r), axis=0)
    length = tl.load(lengths_ptr + row)
    bitmask = tl.load(forms_ptr + row) != 0
    status = tl.load(status_ptr + row)
    tl.store(offsets_ptr + row, offset)
    tl.store(id_offsets_ptr + row, id_offset)
    if row == batch - 1:
        tl.store(offsets_ptr + batch, offset + length)
        tl.store(id_offsets_ptr + batch, id_offset + tl.where(bitmask, n_words, length))
    if DIRECT:
        # (Block masks are tl.where(fits, mask, False): Triton's interpreter
        # refuses a block mask and-ed with a scalar.)
        row_words = tl.where(bitmask, n_words, length).to(tl.int64)
        fits, entry, q_rows, q_words, q_nnz, ring_ids, ring_vals = ring_claim(
            table, row, status, bitmask.to(tl.int32), length.to(tl.int64), row_words, vocab,
            SUPPORT)
        if not SUPPORT:
            tl.store(ring_vals, tl.load(selected_ptr + row), mask=fits)
    if (status == 0) & (tl.load(window_ok_ptr + row) == 0):
        words_ptr = out_ids_ptr + id_offset
        if bitmask:
            # Words with no support id are written only here; the barrier
            # orders these stores before the ones below that set bits.
            for start in range(0, n_words, BLOCK):
                w = start + tl.arange(0, BLOCK)
                tl.store(words_ptr + w, tl.zeros([BLOCK], dtype=tl.int32), mask=w < n_words)
                if DIRECT:
                    tl.store(ring_ids + w, tl.zeros([BLOCK], dtype=tl.int32),
                             mask=tl.where(fits, w < n_words, False))
            tl.debug_barrier()
        if tl.load(greedy_ptr + row) != 0:
            token = tl.load(token_ptr + row).to(tl.int32)
            if bitmask:
                tl.store(words_ptr + token // 32, 1 << (token % 32))
                if DIRECT:
                    tl.store(ring_ids + token // 32, 1 << (token % 32), mask=fits)
            else:
                tl.store(out_ids_ptr + id_offset, token)
                if DIRECT:
                    tl.store(ring_ids, token, mask=fits)
            tl.store(out_vals_ptr + offset, 0.0)
            if DIRECT:
                if SUPPORT:
                    tl.store(ring_vals, 0.0, mask=fits)
        else:
            n = tl.load(n_cand_ptr + row)
            cutoff = tl.load(cutoff_ptr + row)
            logz = tl.load(logz_ptr + row)
            base = row.to(tl.int64) * vocab
            # the bits of the word that the previous block's last run was in
            carry_word = tl.full([], -1, tl.int32)
            carry_bits = tl.zeros([], dtype=tl.int32)
            written = tl.zeros([], dtype=tl.int32)
            for start in range(0, n, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                live = idx < n
                v = tl.load(cand_vals_ptr + base + idx, mask=live, other=0.0)
                hit = live & (v.to(tl.int32, bitcast=True) >= cutoff)
                hit_i = hit.to(tl.int32)
                rank = written + tl.cumsum(hit_i, axis=0) - 1
                ids = tl.load(cand_ids_ptr + base + idx, mask=live, other=0)
                tl.store(out_vals_ptr + offset + rank, log_any(v) - logz, mask=hit)
                if DIRECT:
                    if SUPPORT:
                        tl.store(ring_vals + rank, log_any(v) - logz,
                                 mask=tl.where(fits, hit, False))
                if bitmask:
                    # Padding sorts after every id, so the runs stay contiguous.
                    word = tl.where(live, ids // 32, n_words)
                    bits = tl.where(hit, 1 << (ids % 32), 0)
                    _, run_bits = tl.associative_scan((word, bits), 0, _or_in_word)
                    run_bits |= tl.where(word == carry_word, carry_bits, 0)
                    # a run ends where the next candidate (maybe the next
                    # block's first) lies in another word
                    next_id = tl.load(cand_ids_ptr + base + idx + 1, mask=idx + 1 < n, other=-32)
                    run_end = live & (next_id // 32 != word)
                    tl.store(words_ptr + word, run_bits, mask=run_end)
                    if DIRECT:
                        tl.store(ring_ids + word, run_bits, mask=tl.where(fits, run_end, False))
                    last = tl.minimum(n - start, BLOCK) - 1
                    carry_word = tl.max(tl.where(live, word, -1), axis=0)
                    carry_bits = tl.sum(tl.where(idx - start == last, run_bits, 0), axis=0)
                else:
                    tl.store(out_ids_ptr + id_offset + rank, ids, mask=hit)
                    if DIRECT:
                        tl.store(ring_ids + rank, ids, mask=tl.where(fits, hit, False))
                written += tl.sum(hit_i, axis=0)
    if DIRECT:
        ring_commit(table, entry, fits, q_rows, q_words, q_nnz, status, bitmask.to(tl.int32),
                    length.to(tl.int64), row_words, vocab)
        ring_arrive(table, arrivals)


@triton.jit
def _window_write_kernel(
    probs_ptr, stride_row, vocab, window_ok_ptr, cutoff_ptr, logz_ptr, forms_ptr, before_ptr,
    n_chunks, offsets_ptr, id_offsets_ptr, out_ids_ptr, out_vals_ptr, CHUNK: tl.constexpr,
    SUB: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, c), window rows only: the support in columns
    [c*CHUNK, (c+1)*CHUNK) of row b, every finite w at or above the row's
    cutoff, from one read laid out as the mark's (words of 32 bits), SUB
    columns at a time: its bitmask words (bitmask form) or ids (ids form)
    at id_offsets[b], and ``log(w) - log(Z)`` at offsets[b] + before[b, c] +
    the rank in the chunk (the set bits of the words before and below it).
    before, the support's ids in the chunks before c, comes from resolve,
    so no pass counts them first."""
    tl.static_assert(CHUNK % SUB == 0, "the window write takes a chunk in whole steps")
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if FAST & PDL:
        # A window row's chunk is brought into L2 before the wait for the
        # write kernel, overlapping its end (H200: 2 us a call): window_ok
        # is resolve's, which finished before the write kernel began (read
        # from L2: ".cg")
        on = tl.load(window_ok_ptr + row, cache_modifier=".cg") != 0
        _prefetch_chunk(probs_ptr, stride_row, tl.where(on, vocab, 0), row, chunk, CHUNK)
    after_previous(PDL)
    if tl.load(window_ok_ptr + row) != 0:
        cutoff = tl.load(cutoff_ptr + row)
        logz = tl.load(logz_ptr + row)
        dst = tl.load(offsets_ptr + row).to(tl.int64)
        id_dst = tl.load(id_offsets_ptr + row).to(tl.int64)
        bitmask = tl.load(forms_ptr + row) != 0
        base = tl.load(before_ptr + row * n_chunks + chunk)
        # SUB columns a step, not the whole chunk at once: a thread holds 16
        # values instead of 32 (128 registers instead of 211), so two
        # programs share a multiprocessor instead of one.
        for part in tl.range(0, CHUNK // SUB):
            word_idx, bit_idx, cols, w, key = _chunk_tile(
                probs_ptr, stride_row, vocab, row, chunk * (CHUNK // SUB) + part, SUB)
            # cutoff >= 1: no zero, no negative; +inf's bits and NaNs' excluded
            keep = (key >= cutoff) & (key < INF_KEY)
            words = tl.sum(keep.to(tl.int32) << bit_idx[None, :], axis=1)  # distinct bits: an OR
            below = words[:, None] & ((1 << bit_idx[None, :]) - 1)
            if FAST:
                per_word = _popc(words)
                in_word = _popc(below)
            else:
                per_word = popcount(words.to(tl.uint32, bitcast=True))
                in_word = popcount(below.to(tl.uint32, bitcast=True))
            rank = base + (tl.cumsum(per_word, axis=0) - per_word)[:, None] + in_word
            base += tl.sum(per_word, axis=0)
            if FAST:
                logw = _log_approx(w)
            else:
                logw = log_any(w)
            # The scattered stores as flat vectors, in the tile's own order:
            # the compiler keeps the load's layout (lanes along a word's 32
            # columns, whose kept values land side by side). Stored as the
            # [words, 32] tile, they went through shared memory into lanes
            # running down 32 words (Triton 3.6; ncu on the H200: 32 KiB of
            # shared memory and 180 registers a program, 12.5% occupancy,
            # 54% of the sectors excess; the kernel 193 us).
            rank = tl.reshape(rank, [SUB])
            keep = tl.reshape(keep, [SUB])
            tl.store(out_vals_ptr + dst + rank, tl.reshape(logw - logz, [SUB]), mask=keep)
            if bitmask:
                word = (chunk * CHUNK + part * SUB) // 32 + word_idx
                tl.store(out_ids_ptr + id_dst + word, words, mask=word < (vocab + 31) // 32)
            else:
                tl.store(out_ids_ptr + id_dst + rank, tl.reshape(cols, [SUB]), mask=keep)


@triton.jit
def _popc(x):
    """Set bits of each int32, the GPU's own instruction (compiled kernels only)."""
    return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _log_approx(x):
    """ln x as lg2.approx x ln 2 (compiled kernels only): within 2^-21 of
    log2 for normal x, one special-function instruction where tl.log's
    accurate libdevice form takes about twenty."""
    lg2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                    is_pure=True, pack=1)
    return lg2 * 0.6931471805599453


def launch_window_write(
    probs: torch.Tensor, window_ok: torch.Tensor, cutoff: torch.Tensor, logz: torch.Tensor,
    forms: torch.Tensor, before: torch.Tensor, n_chunks: int, offsets: torch.Tensor,
    id_offsets: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, pdl: bool = False,
) -> None:
    """_window_write_kernel over every (row, chunk); rows with window_ok 0
    return at once (``pdl``: launched as a programmatic dependent of the
    kernel before, which began after the one that wrote window_ok ended)."""
    batch, vocab = probs.shape
    # popc and lg2.approx are PTX: NVIDIA's compiled kernels only
    nvidia = compiled_for_nvidia(probs)
    _window_write_kernel[(batch, n_chunks)](
        probs, probs.stride(0), vocab, window_ok, cutoff, logz, forms, before, n_chunks,
        offsets, id_offsets, ids, values, CHUNK=CHUNK, SUB=WINDOW_WRITE_SUB, FAST=nvidia, PDL=pdl,
        num_warps=WINDOW_WRITE_WARPS, **register_cap(nvidia, WINDOW_WRITE_REGISTERS),
        **launch_options(pdl),
    )


def refine_programs(device: torch.device) -> int:
    """_window_refine_kernel's grid: 8 programs an SM, more than the few
    wide rows' chunks need (a wave or two when every row is wide); 2 in
    Triton's interpreter (a program at a time, so that few programs loop
    over the chunks)."""
    if device.type != "cuda" or _interpreted():
        return 2
    return 8 * multiprocessors(device)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def compiled_for_nvidia(x: torch.Tensor) -> bool:
    """Whether kernels on x run compiled for an NVIDIA GPU (PTX and its
    launch options), not in Triton's interpreter or on ROCm."""
    return x.is_cuda and torch.version.hip is None and not _interpreted()


def register_cap(nvidia: bool, registers: int) -> dict[str, int]:
    """The launch option capping a kernel's registers a thread (NVIDIA's
    compiled kernels only): more programs resident on each multiprocessor."""
    return {"maxnreg": registers} if nvidia else {}


def may_be_on(setting: Any, on: Any) -> bool:
    """Whether a setting may turn its cutoff on in some row: ``on(value)``
    for a scalar, always for a [B] tensor (no host sync), never for None."""
    if setting is None:
        return False
    return isinstance(setting, torch.Tensor) or bool(on(setting))


def may_be_window(top_k: Any, top_p: Any, vocab: int) -> bool:
    """Whether some row may be top-p only (top-k off, top-p on): known from
    scalars, assumed for [B] tensors (no host sync)."""
    k_may_be_off = top_k is None or isinstance(top_k, torch.Tensor) or not 1 <= top_k < vocab
    return bool(k_may_be_off and may_be_on(top_p, lambda p: p < 1.0))


def run_capture(
    probs: torch.Tensor,
    *,
    sampled: torch.Tensor | None,
    seeds: torch.Tensor | None,
    top_k,
    top_p,
    min_p,
    max_tokens: int,
    order: str,
    rows: torch.Tensor | None,
    greedy: torch.Tensor | None,
    overflow: str,
    into: tuple[Any, ...] | None = None,
) -> Rows:
    """Shared launcher of capture() and sample(); exactly one of sampled/seeds."""
    probs = check_matrix(probs, "probs")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    batch, vocab = probs.shape
    device = probs.device
    check_max_tokens(max_tokens, batch, vocab, overflow)
    target = check_into(into, True, max_tokens, vocab)  # refused before any kernel runs
    top_k_arg, top_p_arg, min_p_arg = top_k, top_p, min_p
    top_k = per_row(top_k, batch, torch.int32, device, "top_k", 0)
    top_p = per_row(top_p, batch, torch.float32, device, "top_p", 1.0, low=0.0, high=1.0)
    min_p = per_row(min_p, batch, torch.float32, device, "min_p", 0.0, low=0.0, high=1.0)
    greedy_i8 = per_row(greedy, batch, torch.int8, device, "greedy", False)
    opt_in = row_mask(rows, batch, device)
    sample_mode = seeds is not None
    if sample_mode:
        seeds = per_row(seeds, batch, torch.int64, device, "seeds", 0)
        tokens = torch.empty(batch, dtype=torch.int32, device=device)
    else:
        if not isinstance(sampled, torch.Tensor) or sampled.shape != (batch,):
            raise ValueError(f"sampled must be an integer tensor of shape ({batch},)")
        if sampled.dtype.is_floating_point or sampled.dtype == torch.bool:
            raise TypeError(f"sampled must hold integer token ids, got {sampled.dtype}")
        tokens = sampled.to(device=device, dtype=torch.int64).contiguous()
        seeds = tokens  # unused by the kernel in capture mode
    sequential = order == "sequential"

    # Window rows (a top-p support of thousands of ids, bracketed by pivot
    # masses and written by the window write) only in capture without
    # into=: the sampler's draw and the ring stores need every support id
    # among the candidates.
    window_on = (not sample_mode and target is None and may_be_window(top_k_arg, top_p_arg, vocab))
    # lo, window and (window rows) each row's bracket record, pivots and
    # refining keys, and the wide rows and their count
    i32 = torch.empty(
        (3 + BRACKET.value + WINDOW_PIVOTS + WINDOW_REFINE if window_on else 2) * batch + 1,
        dtype=torch.int32, device=device)
    lo, window = i32[:batch], i32[batch:2 * batch]
    pivots_at = (2 + BRACKET.value) * batch
    bracket = i32[2 * batch:pivots_at]
    pivots = i32[pivots_at:pivots_at + WINDOW_PIVOTS * batch]
    refine_at = pivots_at + WINDOW_PIVOTS * batch
    refine_keys = i32[refine_at:refine_at + WINDOW_REFINE * batch]
    wide_rows = i32[refine_at + WINDOW_REFINE * batch:-1]
    wide_count = i32[-1:]
    # Every kernel of the call is a programmatic dependent of the one
    # before (sm90+, compiled): it launches while that one ends, issues its
    # reads of probs, then waits for it (after_previous).
    pdl = pdl_default(device)
    launch = launch_options(pdl)
    _bound_kernel[(batch,)](
        probs, probs.stride(0), vocab, top_k, top_p, min_p, greedy_i8, lo, window, pivots,
        wide_count, SEQUENTIAL=sequential, WINDOW=window_on, BLOCKS=SAMPLE_BLOCKS, COLS=SAMPLE_COLS,
        K_SLACK=K_SLACK, P_MARGIN=P_MARGIN, WINDOW_MIN=WINDOW_MIN, PIVOTS=WINDOW_PIVOTS,
        INNER=WINDOW_INNER, BELOW=WINDOW_BELOW, ABOVE=WINDOW_ABOVE, PDL=pdl,
        num_warps=BOUND_WINDOW_WARPS if window_on else BOUND_WARPS, **launch,
    )
    n_chunks = triton.cdiv(vocab, CHUNK)
    chunks_pad = triton.next_power_of_2(n_chunks)
    bits = torch.empty(batch * n_chunks * (CHUNK // WORD_BITS), dtype=torch.int32,
                       device=device)
    # per chunk: counts, sums, maxes; for window rows also the support's
    # count before the chunk, the count and mass above the bracket, and the
    # mass above each pivot and each refining pivot
    slices = (6 + WINDOW_PIVOTS + WINDOW_REFINE) if window_on else 3
    per_chunk = torch.empty(slices * batch * n_chunks, dtype=torch.int32, device=device)
    counts, before, above_count = (per_chunk[i * batch * n_chunks:(i + 1) * batch * n_chunks]
                                   for i in (0, 3, 4))
    sums, maxes, above_mass = (per_chunk[i * batch * n_chunks:(i + 1) * batch * n_chunks]
                               .view(torch.float32) for i in (1, 2, 5))
    refined = (6 + WINDOW_PIVOTS) * batch * n_chunks
    pivot_mass = per_chunk[6 * batch * n_chunks:refined].view(torch.float32)
    refine_mass = per_chunk[refined:].view(torch.float32)
    if not window_on:  # not read: any int32 / float32 pointer of the call
        before = above_count = counts
        above_mass = pivot_mass = refine_mass = sums
    _cand_mark_kernel[(batch, n_chunks)](
        probs, probs.stride(0), vocab, lo, window, pivots, top_p, min_p, greedy_i8, bits, counts,
        sums, maxes, pivot_mass, n_chunks, CHUNK=CHUNK,
        MASS=may_be_on(top_p_arg, lambda p: p < 1.0),
        TOP=may_be_on(min_p_arg, lambda m: m > 0.0) or may_be_on(greedy, bool),
        WINDOW=window_on, PIVOTS=WINDOW_PIVOTS, PDL=pdl,
        num_warps=CAND_MARK_WINDOW_WARPS if window_on else CAND_MARK_WARPS, **launch,
    )
    if window_on:
        _window_bracket_kernel[(batch,)](
            window, pivots, top_p, min_p, sums, maxes, pivot_mass, bracket, refine_keys,
            wide_count, wide_rows, n_chunks, CHUNKS_PAD=chunks_pad, PIVOTS=WINDOW_PIVOTS,
            REFINE=WINDOW_REFINE, PDL=pdl, num_warps=4, **launch,
        )
        _window_refine_kernel[(min(batch * n_chunks, refine_programs(device)),)](
            probs, probs.stride(0), vocab, wide_count, wide_rows, refine_keys, refine_mass,
            n_chunks, CHUNK=CHUNK, REFINE=WINDOW_REFINE, PDL=pdl, num_warps=WINDOW_MARK_WARPS,
            **launch,
        )
        _window_mark_kernel[(batch, n_chunks)](
            probs, probs.stride(0), vocab, window, bracket, refine_keys, refine_mass, bits, counts,
            above_mass, above_count, n_chunks, CHUNK=CHUNK, CHUNKS_PAD=chunks_pad,
            REFINE=WINDOW_REFINE, PDL=pdl, num_warps=WINDOW_MARK_WARPS, **launch,
        )
    # Candidates of row b: cand[b * V : b * V + n_b], ascending ids.
    cand_ids = torch.empty(batch * vocab, dtype=torch.int32, device=device)
    cand_vals = torch.empty(batch * vocab, dtype=torch.float32, device=device)
    launch_expand_local(probs, bits, counts, n_chunks, cand_ids, cand_vals, pdl=pdl)
    per_row_out = torch.empty(9 * batch, dtype=torch.int32, device=device)
    (cutoff, sizes, lengths, status, forms, n_cand, window_ok) = (
        per_row_out[i * batch:(i + 1) * batch] for i in range(7))
    logz, selected = (per_row_out[i * batch:(i + 1) * batch].view(torch.float32)
                      for i in range(7, 9))
    _resolve_kernel[(batch,)](
        probs, probs.stride(0), vocab, cand_ids, cand_vals, counts, n_chunks,
        sums, maxes, lo, window,
        top_k, top_p, min_p, greedy_i8, opt_in, tokens, seeds, max_tokens,
        cutoff, logz, sizes, lengths, status, forms, selected, n_cand, window_ok,
        above_mass, above_count, bracket, before,
        SEQUENTIAL=sequential, SAMPLE=sample_mode, STATUS_ON_OVERFLOW=overflow == "status",
        BLOCK=RESOLVE_BLOCK, CHUNKS_PAD=chunks_pad, ROW_BLOCK=ROW_BLOCK, DRAW_BLOCK=DRAW_BLOCK,
        WINDOW=window_on, CHUNK=CHUNK, BINS=triton.next_power_of_2(n_chunks + 1),
        SEARCH_WAYS=WINDOW_SEARCH_WAYS, PDL=pdl,
        num_warps=RESOLVE_WARPS, **launch,
    )
    offsets = torch.empty(batch + 1, dtype=torch.int32, device=device)
    id_offsets = torch.empty_like(offsets)
    ids = torch.empty(batch * bitmask_words(vocab), dtype=torch.int32, device=device)
    values = torch.empty(values_capacity(batch, vocab, max_tokens, overflow),
                         dtype=torch.float32, device=device)
    # into= on the GPU-direct path: the table is prepared for this step now
    # and the write kernel stores each row into the ring as it computes it.
    direct = claim_step(target, batch, vocab)
    with launching(direct, "capture's write kernel"):
        _write_kernel[(batch,)](
            cand_ids, cand_vals, n_cand, window_ok, vocab, batch,
            cutoff, logz, lengths, status, forms, greedy_i8, tokens, offsets, id_offsets, ids,
            # A program walks its row's candidates one block at a time, so a
            # row past max_tokens (tens of thousands of candidates) sets the
            # kernel's duration: blocks of 4096 over 16 warps (110 registers, no
            # spills; on the H200, 2026-11-30, blocks of 1024 made a batch with
            # 10% such rows 450 us slower than with overflow="status").
            values, selected, 0 if direct is None else direct.publisher.table,
            counts if direct is None else direct.publisher.arrivals,
            BLOCK=WRITE_BLOCK, ROWS_BLOCK=min(1024, triton.next_power_of_2(batch)),
            num_warps=16, DIRECT=direct is not None,
            SUPPORT=target is None or target[2] == "support",
            # without PDL on the GPU-direct path, as before (its ring stores
            # and arrival have not been measured chained)
            PDL=pdl and direct is None, **launch_options(pdl and direct is None),
        )
    if window_on:
        # Window rows: the support written from one read of each chunk, at
        # the offsets the write kernel set and the chunk counts resolve found.
        launch_window_write(probs, window_ok, cutoff, logz, forms, before, n_chunks, offsets,
                            id_offsets, ids, values, pdl=pdl)
    rows_out = Rows(offsets, lengths, status, sizes, forms, id_offsets, ids, values, vocab,
                    selected, tokens if sample_mode else None, max_tokens)
    if direct is not None:
        direct.launched(rows_out)
        return rows_out
    return publish_into(target, rows_out)


def capture(
    probs: torch.Tensor,
    sampled: torch.Tensor,
    *,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    max_tokens: int,
    order: str = "joint",
    rows: torch.Tensor | None = None,
    greedy: torch.Tensor | bool | None = None,
    overflow: str = "exact",
    into: tuple[Any, ...] | None = None,
) -> Rows:
    """Support, support logprobs and selected logprob of each row.

    ``probs`` [B, V] float32/bf16/fp16 (the sampler's probabilities after
    temperature; need not sum to 1), ``sampled`` int[B] the drawn tokens.
    ``top_k`` int (<= 0 or >= V: off), ``top_p`` float in [0, 1] (1: off),
    ``min_p`` float in [0, 1] (0: off), each a scalar or a [B] tensor.
    ``rows`` bool[B] opts rows in for materialisation; ``greedy`` bool[B].
    ``overflow`` and the output capacity as in :func:`.compact.compact`.
    Returns :class:`Rows` with ``values`` = support logprobs and
    ``selected_logprob`` (NaN for INVALID rows).
    ``into=(writer, handles)`` (or ``(writer, handles, mode)``, mode
    "support" by default) also publishes the rows to those RowQueues, row b
    to ``handles[b]``: GPU-direct where CUDA is present (``kernels.publish``).
    """
    return run_capture(probs, sampled=sampled, seeds=None, top_k=top_k, top_p=top_p,
                       min_p=min_p, max_tokens=max_tokens, order=order, rows=rows,
                       greedy=greedy, overflow=overflow, into=into)


# ---------------------------------------------------------------- reference


def reference_support(
    probs: torch.Tensor, top_k, top_p, min_p, order: str, compute_dtype=torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort-based support: (support bool[B, V], bad bool[B], w float32[B, V])."""
    batch, vocab = probs.shape
    device = probs.device
    k = per_row(top_k, batch, torch.int64, device, "top_k", 0)
    p = per_row(top_p, batch, torch.float32, device, "top_p", 1.0, low=0.0, high=1.0)
    mp = per_row(min_p, batch, torch.float32, device, "min_p", 0.0, low=0.0, high=1.0)
    w = probs.float()
    bad = ~((w >= 0) & torch.isfinite(w)).all(1)
    w = torch.where(bad[:, None], torch.zeros_like(w), w)
    vals = w.sort(dim=1, descending=True).values
    k_on = (k >= 1) & (k < vocab)
    t_k = torch.where(k_on, vals.gather(1, (k - 1).clamp(0, vocab - 1)[:, None])[:, 0], 0.0)
    wd = w.to(compute_dtype)
    mass = wd.sum(1)
    if order == "sequential":
        mass = torch.where(k_on, (wd * (w >= t_k[:, None])).sum(1), mass)
    target = p.to(compute_dtype) * mass
    cums = vals.to(compute_dtype).cumsum(1)
    first = (cums < target[:, None]).sum(1)  # first position with cums >= target
    t_p = vals.gather(1, first.clamp(max=vocab - 1)[:, None])[:, 0]
    t_p = torch.where((p < 1) & (first < vocab), t_p, 0.0)
    t_m = torch.where(mp > 0, mp * w.max(1).values, 0.0)
    cutoff = torch.maximum(torch.maximum(t_k, t_p), t_m)
    support = (w >= cutoff[:, None]) & (w > 0)
    return support, bad, w


def reference_capture(
    probs: torch.Tensor,
    sampled: torch.Tensor,
    *,
    top_k=None,
    top_p=None,
    min_p=None,
    max_tokens: int,
    order: str = "joint",
    rows: torch.Tensor | None = None,
    greedy: torch.Tensor | bool | None = None,
    overflow: str = "exact",
    compute_dtype: torch.dtype = torch.float64,
) -> Rows:
    """Plain-torch capture (full sort per row) with the semantics of :func:`capture`."""
    probs = check_matrix(probs, "probs")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    batch, vocab = probs.shape
    device = probs.device
    check_max_tokens(max_tokens, batch, vocab, overflow)
    support, bad, w = reference_support(probs, top_k, top_p, min_p, order, compute_dtype)
    is_greedy = per_row(greedy, batch, torch.bool, device, "greedy", False)
    opted = torch.ones(batch, dtype=torch.bool, device=device) if rows is None else rows
    y = sampled.to(device=device, dtype=torch.int64)
    y_ok = (y >= 0) & (y < vocab)
    y_safe = y.clamp(0, vocab - 1)[:, None]
    w_y = w.gather(1, y_safe)[:, 0].to(compute_dtype)
    wd = w.to(compute_dtype)
    z = (wd * support).sum(1)
    in_support = y_ok & support.gather(1, y_safe)[:, 0]
    selected = torch.log(w_y) - torch.log(z)
    invalid = bad | ~in_support | ~(z > 0) | ~torch.isfinite(selected)
    invalid = torch.where(is_greedy, bad | ~y_ok, invalid)
    selected = torch.where(is_greedy, 0.0, selected)
    sizes = torch.where(is_greedy, 1, support.sum(1))
    over = (sizes > max_tokens) & (overflow == "status")
    status = torch.where(over, Status.OVERFLOW, Status.OK)
    status = torch.where(opted, status, Status.SKIPPED)
    status = torch.where(invalid, Status.INVALID, status).to(torch.int32)
    greedy_mask = torch.zeros_like(support)
    greedy_mask.scatter_(1, y_safe, True)
    kept = torch.where(is_greedy[:, None], greedy_mask, support)
    logprobs = torch.log(wd) - torch.log(z)[:, None]
    logprobs = torch.where(is_greedy[:, None], 0.0, logprobs)
    selected = torch.where(invalid, float("nan"), selected).float()
    return pack_rows(kept, logprobs, status, sizes, max_tokens, selected)


def top_p_within_rounding(
    probs: torch.Tensor, support: torch.Tensor, top_p, rel: float = 1e-6
) -> torch.Tensor:
    """bool[B]: whether each row's support (bool [B, V]) is the top-p support
    (top-p only, joint) of its row for some target within ``rel`` x the
    row's mass of ``top_p`` x its mass, in float64: every w at or above its
    smallest kept value is kept (ties too), the mass with that value reaches
    ``target - rel M`` and the mass above it falls short of ``target + rel M``.
    The kernel sums masses in float32, so a target that close to a
    cumulative mass may fall on either side of it (the module docstring)."""
    batch = probs.shape[0]
    p = per_row(top_p, batch, torch.float32, probs.device, "top_p", 1.0, low=0.0, high=1.0)
    w = probs.double()
    w = torch.where(torch.isfinite(w) & (w > 0), w, 0.0)
    mass = w.sum(1)
    target = p.double() * mass
    smallest = torch.where(support, w, float("inf")).min(1).values[:, None]
    prefix = ((w >= smallest) & (w > 0)) == support
    with_it = (w * (w >= smallest)).sum(1)
    above = (w * (w > smallest)).sum(1)
    return (prefix.all(1) & support.any(1) & (with_it >= target - rel * mass)
            & (above < target + rel * mass))


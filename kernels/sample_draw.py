"""Sample's device code: the two draws that resolve makes for
:func:`.sample.sample` (the resolve kernel compiled with SAMPLE,
kernels/capture_resolve.py), each row's token depending only on its
seed, probabilities and settings, never on the batch.

* A row whose support lies among its candidates: an exponential race
  (equivalent to Gumbel-max), token = argmax ``w_i / E_i`` with ``E_i =
  -log(u_i)`` and ``u_i`` component ``i mod 4`` of Philox4x32-10 at (seed,
  ``i div 4``) (:func:`_uniforms`, :func:`_draw`): one log an id, over the
  candidates (a few thousand at most).
* A window row, whose support (up to the whole vocabulary) reaches past its
  candidates (only the ids of its bracket): inverse transform sampling
  (:func:`_window_row_draw`), one 53-bit uniform of Philox at (seed,
  DRAW_COUNTER) placed in the support's mass, laid out as the bracket's
  part and then each chunk's ids above the bracket; only the chosen part
  is read. A race there would need a uniform, a log and a division for
  every support id (the whole row, read again: ~110-150 us a call of flat
  rows on the H100), this a few microseconds a row.

Both give ``w_i / Z`` as each token's probability. It lives apart from
sample.py, which launches through capture's stages, so that resolve can
import it without an import cycle.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .float_bits import INF_KEY

# The Philox counter of a window row's draw: past every id's (the race's
# counters are ids div 4 < 2^29), so the two draws never share a uniform.
DRAW_COUNTER = tl.constexpr(1 << 30)


@triton.jit
def _candidates(vals_ptr, ids_ptr, base, start, n, cutoff, BLOCK: tl.constexpr):
    """Candidates [start, start + BLOCK) of a row (of n): values, ids,
    which are real, and which lie at or above the cutoff (resolve's blocks
    and the draws'; here so that resolve imports it without a cycle)."""
    idx = start + tl.arange(0, BLOCK)
    live = idx < n
    v = tl.load(vals_ptr + base + idx, mask=live, other=0.0)
    ids = tl.load(ids_ptr + base + idx, mask=live, other=0)
    return v, ids, live, live & (v.to(tl.int32, bitcast=True) >= cutoff)


@triton.jit
def _uniforms(seed, ids):
    """u_i for each id: component i mod 4 of Philox4x32-10 at (seed, i div 4).
    Philox computes four 32-bit words at once; an id takes its own, so
    every path draws the same u for an id, however its candidates are
    blocked."""
    u0, u1, u2, u3 = tl.rand4x(seed, ids // 4)
    lane = ids % 4
    return tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))


@triton.jit
def _draw(v, ids, live, hit, seed, rowmax, vocab, best_score, best_id, first_id):
    """One block of the sampler's draw (ids ascending, after the blocks
    before): the exponential race's best score and id so far, and the
    smallest id at the row's max (greedy)."""
    score = tl.where(hit, v / -tl.log(_uniforms(seed, ids)), float("-inf"))
    block_best = tl.max(score, axis=0)
    block_id = tl.min(tl.where(score == block_best, ids, vocab), axis=0)
    # ids ascend: a later block's tie never beats an earlier id
    best_id = tl.where(block_best > best_score, block_id, best_id)
    best_score = tl.maximum(best_score, block_best)
    # greedy: the smallest id among the maxima (all of them are candidates)
    first_id = tl.minimum(first_id, tl.min(tl.where(live & (v == rowmax), ids, vocab), axis=0))
    return best_score, best_id, first_id


@triton.jit
def _uniform53(seed):
    """A uniform in [0, 1) with 53 random bits (float64), from two words of
    Philox4x32-10 at (seed, DRAW_COUNTER): a float32 uniform's 2^-24 steps
    would round away the ids of a long row's tail."""
    hi, lo, _, _ = tl.randint4x(seed, tl.full([], DRAW_COUNTER, tl.int32))
    return ((hi >> 5).to(tl.float64) * 67108864.0 + (lo >> 6).to(tl.float64)) \
        * (1.0 / 9007199254740992.0)


@triton.jit
def _crossing(w, ids, eligible, run, t, found, last, NONE: tl.constexpr):
    """One block of an inverse transform's walk (ids ascending, after the
    blocks before, whose eligible mass is ``run``): the first eligible id
    whose running mass passes ``t`` (kept in ``found``, NONE until then),
    the last eligible id, and the running mass after the block. float64:
    exact enough that each id keeps its own share of the walk."""
    mass = tl.where(eligible, w, 0.0).to(tl.float64)
    passes = eligible & (run + tl.cumsum(mass, axis=0) > t)
    found = tl.minimum(found, tl.min(tl.where(passes, ids, NONE), axis=0))
    last = tl.maximum(last, tl.max(tl.where(eligible, ids, -1), axis=0))
    return found, last, run + tl.sum(mass, axis=0)


@triton.jit
def _window_row_draw(probs_ptr, row_start, vocab, cand_vals_ptr, cand_ids_ptr, base, n,
                     cutoff, b_hi, above_mass_ptr, slots, in_row, seed,
                     CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, DRAW_BLOCK: tl.constexpr):
    """A window row's token, by inverse transform sampling over its support.

    The support is the bracket's candidates at or above ``cutoff`` (in
    ``cand_*`` from ``base``, n of them, ids ascending) and, in each chunk,
    the ids at or above ``b_hi`` (finite; the window mark summed their mass
    a chunk, ``above_mass``). t = u x (their total mass), in that order:
    the bracket's part, then chunk 0, 1, ...; the part t falls in is walked
    id by id (for a chunk: its DRAW_BLOCK-id parts summed in float64 from
    ``probs``, 32 KiB, t rescaled from the chunk's float32 sum to theirs,
    then the one part t falls in walked, read again from L2), and the
    token is the first id whose running mass passes t. A t past a part's
    walked mass (by the last rounding) takes its last id. -1 when the
    support has no mass (the row is then INVALID)."""
    NONE: tl.constexpr = 2147483647
    u = _uniform53(seed)
    # the bracket's part: its mass first, then (if t falls in it) the walk
    bracket = tl.zeros([], dtype=tl.float64)
    for start in range(0, n, DRAW_BLOCK):
        v, _, _, hit = _candidates(cand_vals_ptr, cand_ids_ptr, base, start, n, cutoff,
                                   DRAW_BLOCK)
        bracket += tl.sum(tl.where(hit, v, 0.0).to(tl.float64), axis=0)
    above = tl.load(above_mass_ptr + slots, mask=in_row, other=0.0).to(tl.float64)
    above_total = tl.sum(above, axis=0)
    t = u * (bracket + above_total)
    found = tl.full([], NONE, tl.int32)
    last = tl.full([], -1, tl.int32)
    run = tl.zeros([], dtype=tl.float64)
    # (u x a total can round up to the bracket's mass when nothing lies above it)
    if (t < bracket) | (above_total == 0.0):
        for start in range(0, n, DRAW_BLOCK):
            v, ids, _, hit = _candidates(cand_vals_ptr, cand_ids_ptr, base, start, n, cutoff,
                                         DRAW_BLOCK)
            found, last, run = _crossing(v, ids, hit, run, t, found, last, NONE)
    else:
        # the chunk t falls in, by the chunks' masses above the bracket (a
        # chunk with none is never taken)
        t = t - bracket
        chunk_idx = tl.arange(0, CHUNKS_PAD)
        through = tl.cumsum(above, axis=0)
        first = tl.min(tl.where((through > t) & (above > 0.0), chunk_idx, CHUNKS_PAD), axis=0)
        chunk = tl.where(first < CHUNKS_PAD, first,
                         tl.max(tl.where(above > 0.0, chunk_idx, -1), axis=0))
        if chunk >= 0:
            t = t - tl.sum(tl.where(chunk_idx == chunk, through - above, 0.0), axis=0)
            # t is uniform over the window mark's float32 sum of the chunk;
            # rescaled to the walk's float64 sum, so that their rounding
            # difference does not all fall on the chunk's last id. One pass
            # sums each part of the chunk (DRAW_BLOCK ids) in float64; only
            # the part t falls in is walked id by id (a cumulative sum of
            # one block, not of all CHUNK / DRAW_BLOCK).
            tl.static_assert(CHUNK % DRAW_BLOCK == 0, "a chunk's walk takes whole parts")
            PARTS: tl.constexpr = CHUNK // DRAW_BLOCK
            part_idx = tl.arange(0, PARTS)
            sums = tl.zeros([PARTS], dtype=tl.float64)
            befores = tl.zeros([PARTS], dtype=tl.float64)
            walked = tl.zeros([], dtype=tl.float64)
            for part in range(PARTS):
                _, w, up = _above_bracket(probs_ptr, row_start, vocab, chunk, part * DRAW_BLOCK,
                                          b_hi, CHUNK, DRAW_BLOCK)
                befores = tl.where(part_idx == part, walked, befores)
                s = tl.sum(tl.where(up, w, 0.0).to(tl.float64), axis=0)
                sums = tl.where(part_idx == part, s, sums)
                walked += s
            t = t * (walked / tl.sum(tl.where(chunk_idx == chunk, above, 0.0), axis=0))
            # the first part whose mass passes t (by the same running sums
            # the walk continues), else the last part with any
            chosen = tl.min(tl.where((befores + sums > t) & (sums > 0.0), part_idx, PARTS),
                            axis=0)
            chosen = tl.where(chosen < PARTS, chosen,
                              tl.max(tl.where(sums > 0.0, part_idx, 0), axis=0))
            run = tl.sum(tl.where(part_idx == chosen, befores, 0.0), axis=0)
            cols, w, up = _above_bracket(probs_ptr, row_start, vocab, chunk, chosen * DRAW_BLOCK,
                                         b_hi, CHUNK, DRAW_BLOCK)
            found, last, run = _crossing(w, cols, up, run, t, found, last, NONE)
    return tl.where(found < NONE, found, last)


@triton.jit
def _above_bracket(probs_ptr, row_start, vocab, chunk, part, b_hi, CHUNK: tl.constexpr,
                   DRAW_BLOCK: tl.constexpr):
    """DRAW_BLOCK columns of a chunk (from ``part``), their w, and which are
    above the bracket (at or above b_hi and finite: in the support)."""
    cols = chunk * CHUNK + part + tl.arange(0, DRAW_BLOCK)
    w = tl.load(probs_ptr + row_start + cols, mask=cols < vocab, other=0.0).to(tl.float32)
    key = w.to(tl.int32, bitcast=True)
    # b_hi >= 1: no zero, no negative; +inf's bits and NaNs' excluded
    return cols, w, (cols < vocab) & (key >= b_hi) & (key < INF_KEY)

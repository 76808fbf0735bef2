"""Capture's second stage, the candidate mark (program per chunk): one read
of each chunk of ``probs``, the candidates at or above the bound's floor as
a bitmask and their count, and the exact sums the rows' cutoffs need; for a
window row, the mass above each of its pivots instead of candidates. Also
the chunk's tile (the mark's layout) that the window stage and the window
write read too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .capture_workspace import CaptureSettings, CaptureWorkspace
from .float_bits import INF_KEY, NEG_ZERO_KEY, popcount
from .launch import after_previous, launch, launch_options


def launch_candidate_mark(probs: torch.Tensor, settings: CaptureSettings, ws: CaptureWorkspace,
                          pdl: bool) -> None:
    """_cand_mark_kernel over every (row, chunk): ws.bits and ws.counts
    (not for window rows), ws.sums, ws.maxes, ws.pivot_mass."""
    launch(_cand_mark_kernel, (probs.shape[0], ws.n_chunks),
        probs, probs.stride(0), probs.shape[1], ws.lo, ws.window, ws.pivots, settings.top_p,
        settings.min_p, settings.greedy, ws.bits, ws.counts, ws.sums, ws.maxes, ws.pivot_mass,
        ws.n_chunks, CHUNK=tuning.CHUNK, MASS=settings.need_mass, TOP=settings.need_max,
        WINDOW=settings.window, PIVOTS=tuning.WINDOW_PIVOTS, PDL=pdl,
        num_warps=tuning.CAND_MARK_WINDOW_WARPS if settings.window else tuning.CAND_MARK_WARPS,
        **launch_options(pdl),
    )


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
    reduction over the chunk costs about as much as the read, so a row gets
    only the ones its settings need. A window row (WINDOW) sums, besides its
    mass, the mass at or above each of its PIVOTS pivots (_bound_kernel
    placed them), and writes no candidates: _window_mark_kernel writes them
    all, its bad values among them.

    MASS, TOP and WINDOW say whether any row of the call may need the mass,
    the max or a window (known from the call's arguments, no host sync):
    a reduction a call cannot need is not compiled in at all."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    word_idx, bit_idx, _, w, key = _chunk_tile(probs_ptr, stride_row, vocab, row, chunk, CHUNK)
    # the chunk's read is issued first: it overlaps the bound's end
    after_previous(PDL)
    _cand_mark_chunk(row, chunk, word_idx, bit_idx, w, key, lo_ptr, window_ptr, pivots_ptr,
                     top_p_ptr, min_p_ptr, greedy_ptr, bits_ptr, counts_ptr, sum_ptr, max_ptr,
                     pivot_mass_ptr, n_chunks, CHUNK, MASS, TOP, WINDOW, PIVOTS)


@triton.jit
def _cand_mark_chunk(row, chunk, word_idx, bit_idx, w, key, lo_ptr, window_ptr, pivots_ptr,
                     top_p_ptr, min_p_ptr, greedy_ptr, bits_ptr, counts_ptr, sum_ptr, max_ptr,
                     pivot_mass_ptr, n_chunks, CHUNK: tl.constexpr, MASS: tl.constexpr,
                     TOP: tl.constexpr, WINDOW: tl.constexpr, PIVOTS: tl.constexpr):
    """The candidate mark's work on chunk ``chunk`` of ``row``, read as
    _chunk_tile's tile (_cand_mark_kernel; the interleaved mark's first
    phase, capture_interleave.py)."""
    WORDS: tl.constexpr = CHUNK // 32
    # Every value of the row's settings is loaded here, before the first
    # store: a load after a store that may alias it waits for the store,
    # so a load between the sums below would add its latency to each.
    # lo can lie above +inf's bits (a top-p floor from a sample of zero
    # mass: the largest key reaching 0); no finite key reaches either.
    lo = tl.minimum(tl.load(lo_ptr + row), INF_KEY)
    window = False
    if WINDOW:
        window = tl.load(window_ptr + row) != 0
    top_p = 1.0
    if MASS or WINDOW:
        top_p = tl.load(top_p_ptr + row)
    wants_max = False
    if TOP:
        wants_max = (tl.load(min_p_ptr + row) > 0.0) | (tl.load(greedy_ptr + row) != 0)
    if WINDOW:
        pivots = _load_keys(pivots_ptr + row * PIVOTS, PIVOTS)
    # A bad value (NaN, inf, negative) is a candidate whatever its key: the
    # resolve program finds it among the candidates and the row is INVALID.
    # All of it is one unsigned comparison of the float bits: lo >= 1 lies
    # below +inf's bits, which lie below every NaN's and every negative
    # value's (sign bit set), and 0.0 (padding too) lies below lo; only -0.0
    # (the sign bit alone) is not bad and is left out.
    slot = row * n_chunks + chunk
    if not window:
        # (a window row's candidates, its bracket and bad values, are all
        # written by _window_mark_kernel)
        keep = (key.to(tl.uint32, bitcast=True) >= lo.to(tl.uint32)) & (key != NEG_ZERO_KEY)
        words = tl.sum(keep.to(tl.int32) << bit_idx[None, :], axis=1)  # distinct bits: an OR
        tl.store(bits_ptr + slot.to(tl.int64) * WORDS + word_idx, words)
        tl.store(counts_ptr + slot, tl.sum(popcount(words.to(tl.uint32, bitcast=True)), axis=0))
    # The whole-chunk sums and maxima reduce the tile over both axes at once
    # (axis=None: Triton reduces it as one flat vector in whatever order its
    # elements sit, no data moves): a float sum's rounding depends on an
    # order that is Triton's to choose.
    good = _good_tile(w)
    total = tl.zeros([], dtype=tl.float32)
    if MASS:
        if top_p < 1.0:
            total = tl.sum(good, axis=None)
    tl.store(sum_ptr + slot, total)
    top = tl.zeros([], dtype=tl.float32)
    if TOP:
        if wants_max:
            top = tl.max(good, axis=None)
    tl.store(max_ptr + slot, top)
    if WINDOW:
        # (a min-p-only window row, top-p off, has no pivots)
        if window & (top_p < 1.0):
            _masses_above(good, pivots, pivot_mass_ptr + slot.to(tl.int64) * PIVOTS, PIVOTS)


@triton.jit
def _good_tile(w):
    """A chunk's tile of w with bad values (NaN, inf, negative) as 0."""
    # One unsigned test of the bits, as the candidate mark's predicate: the
    # finite w >= 0 lie below +inf's bits, NaNs and negative values (sign
    # bit set) above; -0.0 (the sign bit alone) counts as a zero either way.
    good = w.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True) < INF_KEY
    return tl.where(good, w, 0.0)


@triton.jit
def _load_keys(keys_ptr, N: tl.constexpr):
    """keys_ptr[0..N) as a tuple of N scalars: loaded together, before the
    sums that use them (see _masses_above)."""
    keys = ()  # one key a step below
    for j in tl.static_range(N):
        keys = keys + (tl.load(keys_ptr + j),)  # type: ignore[assignment]
    return keys


@triton.jit
def _masses_above(good, keys, out_ptr, N: tl.constexpr):
    """out[j] = the chunk's mass at or above keys[j], for the N keys of a
    tuple (_load_keys): one whole-tile reduction a key (good:
    _good_tile's). The keys come loaded: a key loaded after the store of
    the sum before it would wait for that store, a load's latency a key."""
    fkey = good.to(tl.int32, bitcast=True)
    for j in tl.static_range(N):
        tl.store(out_ptr + j, tl.sum(tl.where(fkey >= keys[j], good, 0.0), axis=None))


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

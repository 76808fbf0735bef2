"""Capture's window stage (launched only when some row may be top-p only):
a window row's top-p cutoff bracketed between two of its pivots by their
exact masses (the window bracket, program per row), a wide bracket narrowed
by the masses above keys inside it (the window refine, a fixed grid), and
the row's candidates rewritten as the ids in its bracket (the window mark,
program per chunk). Also the top-p target, which resolve shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .capture_mark import _chunk_tile, _good_tile, _load_keys, _masses_above
from .capture_workspace import (
    B_FINAL_HI,
    B_FINAL_LO,
    B_FLOOR,
    B_HI,
    B_LO,
    B_TARGET,
    B_WIDE,
    BRACKET,
    CaptureSettings,
    CaptureWorkspace,
)
from .float_bits import INF_KEY, NEG_ZERO_KEY, SMALLEST_POSITIVE, popcount
from .launch import after_previous, launch, launch_options, launches_interpreted, multiprocessors


def launch_window(probs: torch.Tensor, settings: CaptureSettings, ws: CaptureWorkspace,
                  pdl: bool, interleaved: bool = False) -> None:
    """The window bracket, refine and mark, after the candidate mark:
    ws.bracket (with the final bracket), ws.refine_keys and ws.wide_rows,
    ws.refine_mass, and a window row's ws.bits, ws.counts, ws.above_count
    and ws.above_mass. ``interleaved``: after the interleaved mark
    (capture_interleave.py), which did the bracket and marked the window
    rows whose bracket is not wide: the refine and the mark of the wide
    rows only."""
    batch, vocab = probs.shape
    chunks_pad = triton.next_power_of_2(ws.n_chunks)
    if not interleaved:
        launch(_window_bracket_kernel, (batch,),
            ws.window, ws.pivots, settings.top_p, settings.min_p, ws.sums, ws.maxes,
            ws.pivot_mass, ws.bracket, ws.refine_keys, ws.wide_count, ws.wide_rows, ws.n_chunks,
            CHUNKS_PAD=chunks_pad, PIVOTS=tuning.WINDOW_PIVOTS, REFINE=tuning.WINDOW_REFINE,
            PDL=pdl, num_warps=tuning.BRACKET_WARPS, **launch_options(pdl),
        )
    launch(_window_refine_kernel, (min(batch * ws.n_chunks, refine_programs(probs.device)),),
        probs, probs.stride(0), vocab, ws.wide_count, ws.wide_rows, ws.refine_keys,
        ws.refine_mass, ws.n_chunks, CHUNK=tuning.CHUNK, REFINE=tuning.WINDOW_REFINE,
        ORDER=tuning.REFINE_ORDER, PDL=pdl,
        num_warps=tuning.WINDOW_MARK_WARPS, **launch_options(pdl),
    )
    launch(_window_mark_kernel, (batch, ws.n_chunks),
        probs, probs.stride(0), vocab, ws.window, ws.bracket, ws.refine_keys, ws.refine_mass,
        ws.bits, ws.counts, ws.above_mass, ws.above_count, ws.n_chunks, CHUNK=tuning.CHUNK,
        CHUNKS_PAD=chunks_pad, REFINE=tuning.WINDOW_REFINE, REVERSED=tuning.WINDOW_MARK_REVERSED,
        WIDE_ONLY=interleaved, PDL=pdl,
        num_warps=tuning.WINDOW_MARK_WARPS, **launch_options(pdl),
    )


def refine_programs(device: torch.device) -> int:
    """_window_refine_kernel's grid: REFINE_PROGRAMS_PER_SM programs an SM,
    more than the few wide rows' chunks need (a wave or two when every row
    is wide); a few in Triton's interpreter (a program at a time, so that
    few programs loop over the chunks)."""
    if device.type != "cuda" or launches_interpreted():
        return tuning.REFINE_PROGRAMS_INTERPRETED
    return tuning.REFINE_PROGRAMS_PER_SM * multiprocessors(device)


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
    a sample that missed the cutoff by more than its inner span, tens of
    thousands of ids that resolve's one program a row would search slowly).
    A wide bracket also gets REFINE keys evenly inside it, whose masses
    _window_refine_kernel sums and _window_mark_kernel narrows it by (the
    row is listed for the refine's programs); an end that no pivot set
    (below the lowest, above the highest) lies the width of all the pivots
    further out. Computed once a row here, not in each of the window mark's
    programs."""
    after_previous(PDL)
    row = tl.program_id(0)
    if tl.load(window_ptr + row) != 0:
        _window_bracket_row(row, pivots_ptr, top_p_ptr, min_p_ptr, sum_ptr, max_ptr,
                            pivot_mass_ptr, bracket_ptr, refine_keys_ptr, wide_count_ptr,
                            wide_rows_ptr, n_chunks, CHUNKS_PAD, PIVOTS, REFINE)


@triton.jit
def _window_bracket_row(row, pivots_ptr, top_p_ptr, min_p_ptr, sum_ptr, max_ptr, pivot_mass_ptr,
                        bracket_ptr, refine_keys_ptr, wide_count_ptr, wide_rows_ptr, n_chunks,
                        CHUNKS_PAD: tl.constexpr, PIVOTS: tl.constexpr, REFINE: tl.constexpr):
    """The window bracket of window row ``row`` (_window_bracket_kernel; the
    interleaved mark's last first-phase program of the row). The chunks'
    sums are read from L2 (".cg"): in the interleaved mark other programs
    of the same kernel wrote them, and L1 is not coherent across SMs."""
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    in_row = chunk_idx < n_chunks
    slots = row * n_chunks + chunk_idx
    total = tl.sum(tl.load(sum_ptr + slots, mask=in_row, other=0.0, cache_modifier=".cg"),
                   axis=0)
    rowmax = tl.max(tl.load(max_ptr + slots, mask=in_row, other=0.0, cache_modifier=".cg"),
                    axis=0)
    top_p = tl.load(top_p_ptr + row)
    target = _top_p_target(top_p, total)
    pivots = pivots_ptr + row * PIVOTS
    # A min-p-only row (top-p off) has no pivots: an empty bracket at
    # key 1, which the window mark raises to min-p's floor, so that its
    # whole support lies at or above the bracket
    b_lo = tl.full([], 1, tl.int32)
    b_hi = tl.full([], 1, tl.int32)
    wide = tl.zeros([], dtype=tl.int1)
    if top_p < 1.0:
        pivot_idx = tl.arange(0, PIVOTS)
        masses = tl.sum(tl.load(pivot_mass_ptr + slots.to(tl.int64)[:, None] * PIVOTS
                                + pivot_idx[None, :], mask=in_row[:, None], other=0.0,
                                cache_modifier=".cg"), axis=0)
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
def _narrow(piv, masses, target, b_lo, b_hi):
    """The bracket [b_lo, b_hi) holding the largest key whose mass reaches
    target, narrowed by pivots whose masses are known: b_lo rises to the
    highest pivot that reaches, b_hi falls to the lowest pivot above it (a
    pivot above b_lo does not reach, whatever the rounding of the sums)."""
    b_lo = tl.maximum(b_lo, tl.max(tl.where(masses >= target, piv, 0), axis=0))
    b_hi = tl.minimum(b_hi, tl.min(tl.where(piv > b_lo, piv, INF_KEY), axis=0))
    return b_lo, b_hi


@triton.jit
def _top_p_target(top_p, mass):
    """top_p x mass, the mass a top-p support reaches, at least the smallest
    positive float32 (a subnormal, key 1): a product that underflows to 0
    would be reached by every key, and a floor any larger would lie above
    the whole mass of a row whose mass is subnormal. The
    constant, below float32's normals, is typed float64: the max is exact
    in float64, and the cast brings it back."""
    return tl.maximum(top_p * mass, SMALLEST_POSITIVE).to(tl.float32)


@triton.jit
def _window_refine_kernel(
    probs_ptr, stride_row, vocab, wide_count_ptr, wide_rows_ptr, refine_keys_ptr,
    refine_mass_ptr, n_chunks, CHUNK: tl.constexpr, REFINE: tl.constexpr, ORDER: tl.constexpr,
    PDL: tl.constexpr,
):
    """The chunks of the rows with a wide bracket (listed by
    _window_bracket_kernel), shared out over the programs: each chunk's
    mass at or above each of its row's REFINE refining keys. A fixed grid
    of a few programs an SM (refine_programs), not one a chunk of every
    row: wide rows are rare.

    ORDER (tuning.REFINE_ORDER), the order the programs take the items
    in: 0 row by row (each row's chunks in turn), 1 chunk by chunk from
    the first (every wide row's first chunk, then their second, ...), 2
    chunk by chunk from the last (where the candidate mark ended: its
    last chunks may still be in L2). 1 and 2 measured alike, both faster
    than 0 (tuning.REFINE_ORDER)."""
    after_previous(PDL)
    wide = tl.load(wide_count_ptr)
    items = wide * n_chunks
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        if ORDER == 0:
            row = tl.load(wide_rows_ptr + item // n_chunks)
            chunk = item % n_chunks
        else:
            row = tl.load(wide_rows_ptr + item % wide)
            chunk = item // wide
            if ORDER == 2:
                chunk = n_chunks - 1 - chunk
        keys = _load_keys(refine_keys_ptr + row * REFINE, REFINE)
        _, _, _, w, _ = _chunk_tile(probs_ptr, stride_row, vocab, row, chunk, CHUNK)
        slot = row * n_chunks + chunk
        _masses_above(_good_tile(w), keys, refine_mass_ptr + slot.to(tl.int64) * REFINE, REFINE)


@triton.jit
def _window_mark_kernel(
    probs_ptr, stride_row, vocab, window_ptr, bracket_ptr, refine_keys_ptr, refine_mass_ptr,
    bits_ptr, counts_ptr, above_mass_ptr, above_count_ptr, n_chunks,
    CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, REFINE: tl.constexpr,
    REVERSED: tl.constexpr, WIDE_ONLY: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, c), window rows only (top-p without top-k, a support of
    thousands of ids), after _window_bracket_kernel (and, for a wide
    bracket, _window_refine_kernel, whose masses narrow it first): one read
    of the chunk rewrites its candidates as the ids in the row's bracket
    [b_lo, b_hi), min-p's key a floor under it, plus its bad values, and
    sums the count and mass of the ids at or above b_hi (all in the
    support). The program of the row's chunk 0 stores the final bracket
    for resolve.

    REVERSED: program (b, c) takes chunk n_chunks - 1 - c. Programs start
    in the order of their index, rows fastest, so the candidate mark read
    the rows' last chunks last: taken first here, they may still be in L2
    (and this kernel's own last reads, the first chunks, are the window
    write's first).

    WIDE_ONLY: the wide rows only (after the interleaved mark,
    capture_interleave.py, which marked the others)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if REVERSED:
        chunk = n_chunks - 1 - chunk
    # A window row's chunk is read before the wait for the kernels before,
    # overlapping their end: its flag is the bound's, which finished before
    # the kernel before this one began (read from L2: ".cg")
    window = tl.load(window_ptr + row, cache_modifier=".cg") != 0
    if WIDE_ONLY:
        # after the interleaved mark, which marked the other window rows
        # (and finished before the refine, the kernel before, began)
        window = window & (tl.load(bracket_ptr + row * BRACKET + B_WIDE,
                                   cache_modifier=".cg") != 0)
    word_idx, bit_idx, _, w, key = _chunk_tile(probs_ptr, stride_row,
                                               tl.where(window, vocab, 0), row, chunk, CHUNK)
    after_previous(PDL)
    if window:
        _window_mark_chunk(row, chunk, word_idx, bit_idx, w, key, bracket_ptr, refine_keys_ptr,
                           refine_mass_ptr, bits_ptr, counts_ptr, above_mass_ptr,
                           above_count_ptr, n_chunks, CHUNK, CHUNKS_PAD, REFINE)


@triton.jit
def _window_mark_chunk(row, chunk, word_idx, bit_idx, w, key, bracket_ptr, refine_keys_ptr,
                       refine_mass_ptr, bits_ptr, counts_ptr, above_mass_ptr, above_count_ptr,
                       n_chunks, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                       REFINE: tl.constexpr):
    """The window mark's work on chunk ``chunk`` of window row ``row``, read
    as _chunk_tile's tile (_window_mark_kernel; the interleaved mark's
    second phase, capture_interleave.py, which reads the bracket record
    that a program of the same kernel wrote: from L2, ".cg")."""
    WORDS: tl.constexpr = CHUNK // 32
    record = bracket_ptr + row * BRACKET
    b_lo = tl.load(record + B_LO, cache_modifier=".cg")
    b_hi = tl.load(record + B_HI, cache_modifier=".cg")
    if tl.load(record + B_WIDE, cache_modifier=".cg") != 0:
        chunk_idx = tl.arange(0, CHUNKS_PAD)
        refine_idx = tl.arange(0, REFINE)
        slots = row * n_chunks + chunk_idx
        sub_mass = tl.sum(tl.load(refine_mass_ptr + slots.to(tl.int64)[:, None] * REFINE
                                  + refine_idx[None, :],
                                  mask=(chunk_idx < n_chunks)[:, None], other=0.0), axis=0)
        b_lo, b_hi = _narrow(tl.load(refine_keys_ptr + row * REFINE + refine_idx), sub_mass,
                             tl.load(record + B_TARGET, cache_modifier=".cg").to(tl.float32,
                                                                            bitcast=True),
                             b_lo, b_hi)
    # nothing below min-p's key
    b_lo = tl.maximum(b_lo, tl.load(record + B_FLOOR, cache_modifier=".cg"))
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

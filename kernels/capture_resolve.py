"""Capture's resolve stage (program per row): the exact cutoffs over each
row's candidates (the bound's floor checked; a row it failed is resolved
from its whole row), the support's size and mass, the selected logprob or,
for sample(), the drawn token (kernels/sample_draw.py), and each row's
status, length and form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .capture_bound import _sums3
from .capture_window import _top_p_target
from .capture_workspace import B_FINAL_HI, B_FINAL_LO, B_TARGET, BRACKET, CaptureSettings, CaptureWorkspace
from .float_bits import INF_KEY, log_any
from .launch import after_previous, compiled_for_nvidia, launch, launch_options
from .rows import Rows, is_bitmask
from .sample_draw import _candidates, _draw, _window_row_draw


def launch_resolve(probs: torch.Tensor, settings: CaptureSettings, ws: CaptureWorkspace,
                   tokens: torch.Tensor, seeds: torch.Tensor | None, rows: Rows,
                   max_tokens: int, overflow: str, pdl: bool) -> None:
    """_resolve_kernel over the rows, after expand: ws.cutoff, ws.logz,
    rows.sizes .. rows.selected_logprob (and ws.before for window rows);
    ``seeds`` (sample) draws each row's token into ``tokens``, else
    ``tokens`` holds the sampled ones."""
    batch, vocab = probs.shape
    # the whole-row passes' tile: a call that cannot have window rows (top-k
    # on every row) gets a smaller one, which its other rows' resolve runs
    # faster beside (kernels/tuning.py, FLOOR_LOADS_NO_WINDOW)
    floor_loads, floor_block = ((tuning.FLOOR_LOADS, tuning.FLOOR_BLOCK) if settings.window else
                                (tuning.FLOOR_LOADS_NO_WINDOW, tuning.FLOOR_BLOCK_NO_WINDOW))
    launch(_resolve_kernel, (batch,),
        probs, probs.stride(0), vocab, ws.cand_ids, ws.cand_vals, ws.counts, ws.n_chunks,
        ws.sums, ws.maxes, ws.lo, ws.window,
        settings.top_k, settings.top_p, settings.min_p, settings.greedy, settings.opt_in, tokens,
        tokens if seeds is None else seeds,  # not read in capture
        max_tokens, ws.cutoff, ws.logz, rows.sizes, rows.lengths, rows.status, rows.forms,
        rows.selected_logprob,
        ws.n_cand, ws.window_ok, ws.above_mass, ws.above_count, ws.bracket, ws.before,
        SEQUENTIAL=settings.sequential, SAMPLE=seeds is not None,
        STATUS_ON_OVERFLOW=overflow == "status", BLOCK=tuning.RESOLVE_BLOCK,
        CHUNKS_PAD=triton.next_power_of_2(ws.n_chunks), ROW_BLOCK=tuning.ROW_BLOCK,
        DRAW_BLOCK=tuning.DRAW_BLOCK, WINDOW=settings.window, CHUNK=tuning.CHUNK,
        BINS=triton.next_power_of_2(ws.n_chunks + 1), SEARCH_WAYS=tuning.WINDOW_SEARCH_WAYS,
        FLOOR_FIT=tuning.FLOOR_FIT, FLOOR_WAYS=tuning.FLOOR_WAYS,
        FLOOR_BLOCK=floor_block, FLOOR_LOADS=floor_loads, ONE_REDUCE=compiled_for_nvidia(probs),
        PDL=pdl, num_warps=tuning.RESOLVE_WARPS, **launch_options(pdl),
    )


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
    SEARCH_WAYS: tl.constexpr, FLOOR_FIT: tl.constexpr, FLOOR_WAYS: tl.constexpr,
    FLOOR_BLOCK: tl.constexpr, FLOOR_LOADS: tl.constexpr, ONE_REDUCE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program per row: the row's exact cutoff over its candidates (or,
    where the bound's floor did not hold it, over its whole row), its
    support's size and mass Z, the selected logprob (capture) or the drawn
    token (SAMPLE), and its status, length and form. A window row
    (WINDOW) searches its final bracket for the rest of the target above
    it, and counts its support in each chunk for the window write."""
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
    target = tl.zeros([], dtype=tl.float32)
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
                                         target - above_mass, b_lo, b_hi, BLOCK, SEARCH_WAYS,
                                         ONE_REDUCE)
        else:
            cut_p = _mass_key_reaching(cand_vals_ptr, base, n, v0, key0, live0, target, BLOCK,
                                       SEARCH_WAYS, ONE_REDUCE)
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
        # The sampled bound was wrong for this row: a cutoff (k or p) the
        # candidates did not hold lies below lo. A few passes over the whole
        # row narrow each such cutoff to a floor under it with few ids above
        # (_row_floor), one pass rewrites the candidates as every id at or
        # above the floors, and the searches over them are exact again.
        row_ptr = probs_ptr + row.to(tl.int64) * stride_row
        need_k = k_on & (cut_k < lo)
        need_p = p_on & (cut_p < lo)
        floor = tl.maximum(cut_m, 1)
        if SEQUENTIAL & need_k:
            # top-p's target is a share of the exact top-k mass: that row's
            # cutoffs one bit at a time from the whole row (rare: top-k's
            # count estimate holds but for a sample that is far off)
            cut_k = _row_key_reaching(row_ptr, vocab, top_k.to(tl.float32), False, ROW_BLOCK)
            cut_p = tl.zeros([], dtype=tl.int32)
            if p_on:
                mass = _row_reach(row_ptr, vocab, tl.maximum(cut_k, 1), True, ROW_BLOCK)
                cut_p = _row_key_reaching(row_ptr, vocab, _top_p_target(top_p, mass), True,
                                          ROW_BLOCK)
            floor = tl.maximum(tl.maximum(cut_k, cut_p), floor)
        else:
            # every id under eps = (mass - target) / V together holds less
            # than mass - target: top-p's cutoff lies at or above eps (a
            # quarter of it, for the rounding of the sums)
            eps = (total - target) / vocab.to(tl.float32) * 0.25
            eps_key = tl.maximum(tl.where(eps > 0.0, eps.to(tl.int32, bitcast=True), 1), 1)
            # one loop over the two searches (top-k's count, then top-p's
            # mass), so the search's code is in the kernel once
            for which in range(2):
                on_p = which == 1
                if tl.where(on_p, need_p, need_k):
                    start = tl.where(on_p, tl.minimum(eps_key, lo), 1)
                    goal = tl.where(on_p, target, top_k.to(tl.float32))
                    floor = tl.maximum(floor, _row_floor(row_ptr, vocab, goal, start, lo, on_p,
                                                         FLOOR_FIT, FLOOR_BLOCK, FLOOR_WAYS,
                                                         FLOOR_LOADS))
        n = tl.zeros([], dtype=tl.int32)
        for start in range(0, vocab, ROW_BLOCK):
            cols = start + tl.arange(0, ROW_BLOCK)
            w = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            keep = ((w > 0.0) & (w < float("inf"))
                    & (w.to(tl.int32, bitcast=True) >= floor))
            keep_i = keep.to(tl.int32)
            rank = n + tl.cumsum(keep_i, axis=0) - 1
            tl.store(cand_ids_ptr + base + rank, cols, mask=keep)
            tl.store(cand_vals_ptr + base + rank, w, mask=keep)
            n += tl.sum(keep_i, axis=0)
        tl.debug_barrier()  # the rewritten candidates, before they are read back
        live0 = idx0 < n
        v0 = tl.load(cand_vals_ptr + base + idx0, mask=live0, other=0.0)
        key0 = v0.to(tl.int32, bitcast=True)
        if need_k & (not SEQUENTIAL):
            cut_k = _largest_key_reaching(cand_vals_ptr, base, n, v0, key0, live0,
                                          top_k.to(tl.float32), False, BLOCK)
        if need_p & ~(SEQUENTIAL & need_k):
            cut_p = _mass_key_reaching(cand_vals_ptr, base, n, v0, key0, live0, target, BLOCK,
                                       SEARCH_WAYS, ONE_REDUCE)
            # the floor reached the target by _row_floor's sums; the
            # candidates' own sums may put it a rounding short (then no
            # candidate key reaches): the support is every id at or above it
            cut_p = tl.maximum(cut_p, floor)
        cutoff = tl.maximum(tl.maximum(cut_k, cut_p), cut_m)
    cutoff = tl.maximum(cutoff, 1)  # zeros are never in the support

    # Support size and mass (the candidates past the first BLOCK: in the
    # same blocks in capture and sample, below); a window row adds the ids
    # above its bracket.
    hit0 = live0 & (key0 >= cutoff)
    size = above_count + tl.sum(hit0.to(tl.int32), axis=0)
    z = above_mass + tl.sum(tl.where(hit0, v0, 0.0), axis=0)
    # (the same blocks and sums in capture and sample: a row's Z, so its
    # logprobs, are the same bits whichever call made it)
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
        # The exponential race (kernels/sample_draw.py) over the candidates
        # again (L2-hot), DRAW_BLOCK at a time: a Philox state for each of
        # BLOCK lanes at once would double the program's registers. A window
        # row's support reaches past its candidates: its token is drawn by
        # inverse transform over the bracket's part and the chunks' masses
        # above it, reading only the part it falls in (_window_row_draw).
        seed = tl.load(seed_ptr + row)
        best_score = tl.full([], float("-inf"), tl.float32)
        best_id = tl.zeros([], dtype=tl.int32) + vocab
        first_id = tl.zeros([], dtype=tl.int32) + vocab
        if ~window:
            for start in range(0, n, DRAW_BLOCK):
                v, ids, live, hit = _candidates(cand_vals_ptr, cand_ids_ptr, base, start, n,
                                                cutoff, DRAW_BLOCK)
                best_score, best_id, first_id = _draw(v, ids, live, hit, seed, rowmax, vocab,
                                                      best_score, best_id, first_id)
        token = tl.where(greedy, first_id, best_id)
        if WINDOW:
            if window:
                token = _window_row_draw(probs_ptr, row.to(tl.int64) * stride_row, vocab,
                                         cand_vals_ptr, cand_ids_ptr, base, n, cutoff, b_hi,
                                         above_mass_ptr, slots, in_row, seed,
                                         CHUNK, CHUNKS_PAD, DRAW_BLOCK)
    else:
        # checked at the caller's width (int32 or int64), before the cast:
        # an int64 id past 2**31 must not wrap to a valid one
        drawn = tl.load(token_ptr + row)
        token_in = (drawn >= 0) & (drawn < vocab)
        token = tl.where(token_in, drawn, -1).to(tl.int32)
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
def _mass_key_reaching(vals_ptr, base, n, v0, key0, live0, target, BLOCK: tl.constexpr,
                       WAYS: tl.constexpr, ONE_REDUCE: tl.constexpr = False):
    """_largest_key_reaching by mass. Past the BLOCK candidates in registers
    (a row resolved from its whole row keeps up to FLOOR_FIT), every pass
    reads the rest from memory: the search of [0, INF_KEY] by WAYS - 1
    probes a pass takes half the bisection's 31 passes (4 ways: 16), the
    same key (the same sums at each probe; the mass above a key falls as
    the key rises)."""
    if n > BLOCK:
        found = _largest_key_between(vals_ptr, base, n, v0, key0, live0, target,
                                     tl.zeros([], dtype=tl.int32), tl.full([], INF_KEY, tl.int32),
                                     BLOCK, WAYS, ONE_REDUCE)
    else:
        found = _largest_key_reaching(vals_ptr, base, n, v0, key0, live0, target, True, BLOCK)
    return found


@triton.jit
def _largest_key_between(vals_ptr, base, n, v0, key0, live0, target, lo, hi, BLOCK: tl.constexpr,
                         WAYS: tl.constexpr, ONE_REDUCE: tl.constexpr = False):
    """Largest key t in [lo, hi] whose candidates' mass at or above it
    reaches target, lo when none does: a search over the bracket's keys
    alone, not all 31 bits (a window row's bracket spans about 2^22 keys).
    WAYS 4: each pass over the candidates sums the mass above three probes
    (a quarter of the interval apart) and keeps a quarter, half the passes
    of a binary search (WAYS 2). ONE_REDUCE: _reach3's."""
    hi = hi + 1  # the search keeps lo (reaching, or the floor) below hi (not reaching)
    for _step in range(32):  # a binary search takes 31 at most, 4 ways 16
        if hi - lo > 1:
            q = hi - lo
            if WAYS == 4:
                p1 = lo + q // 4
                p2 = lo + q // 2
                p3 = p2 + q // 4
                r1, r2, r3 = _reach3(vals_ptr, base, n, v0, key0, live0, p1, p2, p3, BLOCK,
                                     ONE_REDUCE)
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
def _reach3(vals_ptr, base, n, v0, key0, live0, p1, p2, p3, BLOCK: tl.constexpr,
            ONE_REDUCE: tl.constexpr):
    """The candidates' mass at or above each of three keys, from one pass
    (the first BLOCK candidates from registers, the rest from memory).
    ONE_REDUCE (compiled kernels): the three sums a block in one reduction
    of three operands, whose warps meet once (decision 64: resolve is
    latency-bound, one program a row; 0.978-0.988x on the top-p paths'
    worst cases); Triton's interpreter runs such a reduction element by
    element in Python, so there three sums."""
    r1, r2, r3 = _sums3(tl.where(live0 & (key0 >= p1), v0, 0.0),
                        tl.where(live0 & (key0 >= p2), v0, 0.0),
                        tl.where(live0 & (key0 >= p3), v0, 0.0), ONE_REDUCE)
    for start in range(BLOCK, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        v = tl.load(vals_ptr + base + idx, mask=idx < n, other=0.0)
        key = v.to(tl.int32, bitcast=True)
        s1, s2, s3 = _sums3(tl.where(key >= p1, v, 0.0), tl.where(key >= p2, v, 0.0),
                            tl.where(key >= p3, v, 0.0), ONE_REDUCE)
        r1 += s1
        r2 += s2
        r3 += s3
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
def _row_floor(row_ptr, vocab, target, lo, hi, use_mass, FIT: tl.constexpr,
               BLOCK: tl.constexpr, WAYS: tl.constexpr, LOADS: tl.constexpr):
    """A key f at or under the largest key t reaching target (count, or
    mass with use_mass, of the row's finite w > 0 with key >= t), with at
    most FIT ids at or above it where four passes allow. ``lo`` reaches
    (or is the floor of the search), ``hi`` does not: each pass over the
    whole row counts and sums the ids above WAYS - 1 probes spread evenly
    over [lo, hi) and keeps the interval between the last probe reaching
    and the first one not; it stops once the ids at or above lo fit. Four
    passes of 8 ways narrow 24 binades to a fiftieth of one.

    One program does it while the rest of the batch is done: its passes
    are its row's whole cost. Per probe and lane, sums of a [WAYS, BLOCK]
    tile (the row's columns across the lanes, a probe's in each lane's own
    registers), reduced once after the loop: a block reduction a step
    would cost a barrier each. LOADS blocks a step, so that their loads
    are in flight together (the H100, one pass over 151,936 columns with 8
    warps: 40 us at 16 blocks of 512, 45 at 8, 97 with the [BLOCK, WAYS]
    tile and four blocks a step that came before)."""
    j = tl.arange(0, WAYS)
    fits = tl.zeros([], dtype=tl.int1)
    for _pass in range(4):
        if (hi - lo > 1) & ~fits:
            span = (hi - lo).to(tl.int64)
            probes = (lo + (span * j) // WAYS).to(tl.int32)  # probes[0] = lo
            lane_reach = tl.zeros([WAYS, BLOCK], dtype=tl.float32)
            lane_count = tl.zeros([WAYS, BLOCK], dtype=tl.int32)
            for start in range(0, vocab, LOADS * BLOCK):
                for k in tl.static_range(LOADS):
                    cols = start + k * BLOCK + tl.arange(0, BLOCK)[None, :]
                    w = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
                    hit = ((w > 0.0) & (w < float("inf"))
                           & (w.to(tl.int32, bitcast=True) >= probes[:, None]))
                    lane_count += hit.to(tl.int32)
                    lane_reach += tl.where(hit, w, 0.0)
            count = tl.sum(lane_count, axis=1)
            reach = tl.where(use_mass, tl.sum(lane_reach, axis=1), count.to(tl.float32))
            reaching = (reach >= target) | (j == 0)
            last = tl.max(tl.where(reaching, j, 0), axis=0)  # reach falls as the probe rises
            new_lo = tl.sum(tl.where(j == last, probes, 0), axis=0)
            hi = tl.min(tl.where(reaching, hi, probes), axis=0)
            fits = tl.sum(tl.where(j == last, count, 0), axis=0) <= FIT
            lo = new_lo
    return lo

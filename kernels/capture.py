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

Kernels, each a single pass over its data:
1. stats (program per row chunk): one read of ``probs``: sum, max, a bad-value
   flag and a 32-bucket count histogram of the float exponent (octaves from
   2**-30 to 1).
2. bound (program per row): from the histogram, a key ``L`` that no cutoff can
   be below: the bucket edge under the k-th largest, the bucket edge whose
   lower-bound mass already reaches the top-p target, and ``t_m``.
3. mark + expand (as in compaction): a second read of ``probs`` keeps
   ``w >= L`` (the candidates: about top_k plus one octave) as a bitmask, then
   ascending ids and values, row-local.
4. resolve (program per row): exact cutoffs by bisection over the float bits of
   the candidates (held in registers when they fit), ``Z``, the selected
   logprob or, in :mod:`.sample`, the Gumbel-max draw; status and length.
5. write (program per row): the support's logprobs at offsets[b] and its
   ids or bitmask words at id_offsets[b], both computed from the lengths and
   forms of the rows before (a bitmask row is zeroed, then each run of
   support ids in one word is OR-ed by a segmented scan and stored once).
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import (
    KEEP_AT_LEAST,
    Rows,
    Status,
    bitmask_words,
    check_matrix,
    check_max_tokens,
    is_bitmask,
    launch_expand_local,
    launch_mark,
    pack_rows,
    per_row,
    row_mask,
    tl,
    triton,
    values_capacity,
)
from .direct import claim_step, launching, publish_into
from .host import check_into
from .ring import ring_arrive, ring_claim, ring_commit

__all__ = ["ORDERS", "capture", "reference_capture"]

ORDERS = ("joint", "sequential")
# Stats histogram: bucket j >= 1 holds w in [2**(j-31), 2**(j-30)) (bucket 31
# also everything >= 1), bucket 0 everything below 2**-30 and zeros. For
# weights far from probability scale the bound degrades to "every w > 0"
# (slower, still exact).
BUCKETS = 32
EXPONENT_BASE = 96
STATS_CHUNK = 8192
STATS_WARPS = 8
RESOLVE_BLOCK = 4096  # candidates held in registers by the resolve program
WRITE_BLOCK = 4096  # candidates per step of the write program
INF_KEY = tl.constexpr(0x7F800000)  # float bits of +inf: a floor no candidate reaches


@triton.jit
def _stats_kernel(
    probs_ptr, stride_row, vocab, n_chunks,
    hist_ptr, sum_ptr, max_ptr, bad_ptr,
    BUCKETS: tl.constexpr, BASE: tl.constexpr, CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    w = tl.load(probs_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=0.0)
    w = w.to(tl.float32)
    good = (w >= 0.0) & (w < float("inf"))  # false for NaN
    bad = tl.sum((inside & ~good).to(tl.int32), axis=0)
    w = tl.where(good, w, 0.0)
    # Zeros, padding and bad values land in bucket 0, which never bounds a cutoff.
    exponent = w.to(tl.int32, bitcast=True) >> 23
    bucket = tl.where(w > 0.0, tl.minimum(tl.maximum(exponent - BASE, 0), BUCKETS - 1), 0)
    # tl.histogram's cost grows with the bin count: on the H200 (2026-11-29)
    # this pass took about 2.9x a plain read with 32 bins, 6x with 512, and
    # 9x with packed int64 counters instead of tl.histogram.
    slot = row * n_chunks + chunk
    tl.store(hist_ptr + slot * BUCKETS + tl.arange(0, BUCKETS), tl.histogram(bucket, BUCKETS))
    tl.store(sum_ptr + slot, tl.sum(w, axis=0))
    tl.store(max_ptr + slot, tl.max(w, axis=0))
    tl.store(bad_ptr + slot, bad)


@triton.jit
def _bound_kernel(
    hist_ptr, sum_ptr, max_ptr, bad_ptr, n_chunks, vocab,
    top_k_ptr, top_p_ptr, min_p_ptr, greedy_ptr,
    floor_ptr, total_ptr, rowmax_ptr, rowbad_ptr,
    SEQUENTIAL: tl.constexpr, BUCKETS: tl.constexpr, BASE: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.arange(0, BUCKETS)
    edge_key = (j + BASE) << 23  # float bits of bucket j's lower edge
    hist = tl.zeros([BUCKETS], dtype=tl.int32)
    total = tl.zeros([], dtype=tl.float32)
    rowmax = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.int32)
    for c in range(n_chunks):
        slot = row * n_chunks + c
        hist += tl.load(hist_ptr + slot * BUCKETS + j)
        total += tl.load(sum_ptr + slot)
        rowmax = tl.maximum(rowmax, tl.load(max_ptr + slot))
        bad += tl.load(bad_ptr + slot)
    # Entries in bucket >= j, and a lower bound of their mass (count * lower edge).
    count_at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    edge = edge_key.to(tl.float32, bitcast=True)
    mass_low = tl.where(j >= 1, hist.to(tl.float32) * edge, 0.0)
    mass_at_least = tl.sum(mass_low, axis=0) - tl.cumsum(mass_low, axis=0) + mass_low

    top_k = tl.load(top_k_ptr + row)
    k_on = (top_k >= 1) & (top_k < vocab)
    jk = tl.max(tl.where((j >= 1) & (count_at_least >= top_k), j, 0), axis=0)
    floor_k = tl.where(k_on & (jk >= 1), tl.max(tl.where(j == jk, edge_key, 0), axis=0), 1)
    top_p = tl.load(top_p_ptr + row)
    # The 1e-4 margin keeps the bound valid against float32 rounding of the sums.
    jp = tl.max(tl.where((j >= 1) & (mass_at_least * 0.9999 >= top_p * total), j, 0), axis=0)
    floor_p = tl.where((top_p < 1.0) & (jp >= 1), tl.max(tl.where(j == jp, edge_key, 0), axis=0), 1)
    min_p = tl.load(min_p_ptr + row)
    floor_m = tl.where(min_p > 0.0, (min_p * rowmax).to(tl.int32, bitcast=True), 1)
    floor = tl.maximum(tl.maximum(floor_k, floor_p), tl.maximum(floor_m, 1))
    if SEQUENTIAL:
        # Top-p's target is a share of the top-k mass, so every w >= t_k is needed.
        floor = tl.where(k_on, floor_k, floor)
    greedy = tl.load(greedy_ptr + row) != 0
    floor = tl.where(greedy, tl.maximum(rowmax.to(tl.int32, bitcast=True), 1), floor)
    floor = tl.where(bad > 0, INF_KEY, floor)
    tl.store(floor_ptr + row, floor)
    tl.store(total_ptr + row, total)
    tl.store(rowmax_ptr + row, rowmax)
    tl.store(rowbad_ptr + row, bad)


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
def _resolve_kernel(
    probs_ptr, stride_row, vocab,
    cand_ids_ptr, cand_vals_ptr, counts_ptr, n_chunks,
    floor_ptr, total_ptr, rowmax_ptr, bad_ptr,
    top_k_ptr, top_p_ptr, min_p_ptr, greedy_ptr, opt_in_ptr, token_ptr, seed_ptr,
    max_tokens,
    cutoff_ptr, logz_ptr, sizes_ptr, lengths_ptr, status_ptr, forms_ptr, selected_ptr,
    SEQUENTIAL: tl.constexpr, SAMPLE: tl.constexpr, STATUS_ON_OVERFLOW: tl.constexpr,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    n = tl.sum(tl.load(counts_ptr + row * n_chunks + chunk_idx, mask=chunk_idx < n_chunks,
                       other=0), axis=0)
    base = row.to(tl.int64) * vocab
    idx0 = tl.arange(0, BLOCK)
    live0 = idx0 < n
    v0 = tl.load(cand_vals_ptr + base + idx0, mask=live0, other=0.0)
    key0 = v0.to(tl.int32, bitcast=True)

    # Exact cutoffs. Each search below is only trusted at or above the floor
    # key; below it the search finds 0, which never wins the max.
    top_k = tl.load(top_k_ptr + row)
    k_on = (top_k >= 1) & (top_k < vocab)
    cutoff = tl.zeros([], dtype=tl.int32)
    if k_on:
        cutoff = _largest_key_reaching(cand_vals_ptr, base, n, v0, key0, live0,
                                       top_k.to(tl.float32), False, BLOCK)
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:
        mass = tl.load(total_ptr + row)
        if SEQUENTIAL & k_on:
            # the top-k mass: all of it lies among the candidates (floor <= t_k)
            mass = _reach(cand_vals_ptr, base, n, v0, key0, live0, tl.maximum(cutoff, 1), True,
                          BLOCK)
        target = tl.maximum(top_p * mass, 1e-38)
        key_p = _largest_key_reaching(cand_vals_ptr, base, n, v0, key0, live0, target, True,
                                      BLOCK)
        cutoff = tl.maximum(cutoff, key_p)
    min_p = tl.load(min_p_ptr + row)
    if min_p > 0.0:
        cutoff = tl.maximum(cutoff, (min_p * tl.load(rowmax_ptr + row)).to(tl.int32, bitcast=True))
    # The floor is at or below the exact cutoff, so it never changes a right max;
    # it keeps zeros out when no cutoff is on.
    cutoff = tl.maximum(cutoff, tl.maximum(tl.load(floor_ptr + row), 1))
    greedy = tl.load(greedy_ptr + row) != 0

    # Support size, mass and (sampling) the Gumbel-max draw in one sweep.
    hit0 = live0 & (key0 >= cutoff)
    size = tl.sum(hit0.to(tl.int32), axis=0)
    z = tl.sum(tl.where(hit0, v0, 0.0), axis=0)
    if SAMPLE:
        seed = tl.load(seed_ptr + row)
        ids0 = tl.load(cand_ids_ptr + base + idx0, mask=live0, other=0)
        # exponential race: argmax w / E with E = -log(u), u ~ U[0, 1)
        score0 = tl.log(v0) - tl.log(-tl.log(tl.rand(seed, ids0)))
        score0 = tl.where(hit0, score0, float("-inf"))
        best_score = tl.max(score0, axis=0)
        best_id = tl.min(tl.where(score0 == best_score, ids0, vocab), axis=0)
    for start in range(BLOCK, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        live = idx < n
        v = tl.load(cand_vals_ptr + base + idx, mask=live, other=0.0)
        hit = live & (v.to(tl.int32, bitcast=True) >= cutoff)
        size += tl.sum(hit.to(tl.int32), axis=0)
        z += tl.sum(tl.where(hit, v, 0.0), axis=0)
        if SAMPLE:
            ids = tl.load(cand_ids_ptr + base + idx, mask=live, other=0)
            score = tl.log(v) - tl.log(-tl.log(tl.rand(seed, ids)))
            score = tl.where(hit, score, float("-inf"))
            block_best = tl.max(score, axis=0)
            block_id = tl.min(tl.where(score == block_best, ids, vocab), axis=0)
            take = block_best > best_score
            best_id = tl.where(take, block_id, best_id)
            best_score = tl.maximum(best_score, block_best)

    if SAMPLE:
        # Greedy: the smallest id among the ties at the maximum (the floor of a
        # greedy row is the maximum, so they are exactly the candidates).
        first_id = tl.load(cand_ids_ptr + base, mask=n > 0, other=vocab)
        token = tl.where(greedy, first_id, best_id)
    else:
        token = tl.load(token_ptr + row).to(tl.int32)
    token_ok = (token >= 0) & (token < vocab)
    w_y = tl.load(probs_ptr + row.to(tl.int64) * stride_row + token,
                  mask=token_ok, other=0.0).to(tl.float32)
    in_support = token_ok & (w_y > 0.0) & (w_y.to(tl.int32, bitcast=True) >= cutoff)
    selected = tl.log(w_y) - tl.log(z)
    bad = tl.load(bad_ptr + row) > 0
    invalid = bad | ~in_support | ~(z > 0.0) | ~(tl.abs(selected) < float("inf"))
    # Greedy: the support is the token itself, logprob 0.
    invalid = tl.where(greedy, bad | ~token_ok, invalid)
    selected = tl.where(greedy, 0.0, selected)
    size = tl.where(greedy, 1, size)
    z = tl.where(greedy, w_y, z)
    opted = tl.load(opt_in_ptr + row) != 0
    over = (size > max_tokens) & STATUS_ON_OVERFLOW
    status = tl.where(invalid, 2, tl.where(~opted, 3, tl.where(over, 1, 0)))
    length = tl.where(status == 0, size, 0)
    tl.store(cutoff_ptr + row, cutoff)
    tl.store(logz_ptr + row, tl.log(z))
    tl.store(sizes_ptr + row, size)
    tl.store(lengths_ptr + row, length)
    tl.store(status_ptr + row, status)
    tl.store(forms_ptr + row, is_bitmask(length, status, max_tokens, vocab).to(tl.int32))
    tl.store(selected_ptr + row, tl.where(invalid, float("nan"), selected))
    if SAMPLE:
        tl.store(token_ptr + row, tl.where(invalid, -1, token))


@triton.jit
def _or_in_word(word_a, bits_a, word_b, bits_b):
    """Scan step of a segmented OR over candidates sorted by id: the bits of
    the trailing run of equal words (ids ascend, so a run never resumes)."""
    return word_b, tl.where(word_a == word_b, bits_a | bits_b, bits_b)


@triton.jit
def _write_kernel(
    cand_ids_ptr, cand_vals_ptr, counts_ptr, n_chunks, vocab, batch,
    cutoff_ptr, logz_ptr, lengths_ptr, status_ptr, forms_ptr, greedy_ptr, token_ptr,
    offsets_ptr, id_offsets_ptr, out_ids_ptr, out_vals_ptr, selected_ptr, table, arrivals,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, ROWS_BLOCK: tl.constexpr,
    DIRECT: tl.constexpr, SUPPORT: tl.constexpr,
):
    """Program b places row b's support: values at offsets[b], and at
    id_offsets[b] its ids (ids form) or its bitmask words (bitmask form).
    Both offsets are sums over the rows before b of what resolve decided.

    DIRECT (``into=`` on the GPU-direct path, kernels/direct.py): every store
    of the row's data is made a second time into its queue's buffer in the
    ring (where it fits: ``ring_claim``), then its length, flags and counts
    (``ring_commit``), and the program arrives (``ring_arrive``); SUPPORT
    says whether the ring gets the values or the selected logprob."""
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
    if status == 0:
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
            chunk_idx = tl.arange(0, CHUNKS_PAD)
            n = tl.sum(tl.load(counts_ptr + row * n_chunks + chunk_idx,
                               mask=chunk_idx < n_chunks, other=0), axis=0)
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
                tl.store(out_vals_ptr + offset + rank, tl.log(v) - logz, mask=hit)
                if DIRECT:
                    if SUPPORT:
                        tl.store(ring_vals + rank, tl.log(v) - logz, mask=tl.where(fits, hit, False))
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

    n_stats = triton.cdiv(vocab, STATS_CHUNK)
    hist = torch.empty(batch * n_stats * BUCKETS, dtype=torch.int32, device=device)
    sums = torch.empty(batch * n_stats, dtype=torch.float32, device=device)
    maxes = torch.empty_like(sums)
    bads = torch.empty(batch * n_stats, dtype=torch.int32, device=device)
    _stats_kernel[(batch, n_stats)](
        probs, probs.stride(0), vocab, n_stats, hist, sums, maxes, bads,
        BUCKETS=BUCKETS, BASE=EXPONENT_BASE, CHUNK=STATS_CHUNK, num_warps=STATS_WARPS,
    )
    floor = torch.empty(batch, dtype=torch.int32, device=device)
    total = torch.empty(batch, dtype=torch.float32, device=device)
    rowmax = torch.empty_like(total)
    rowbad = torch.empty_like(floor)
    _bound_kernel[(batch,)](
        hist, sums, maxes, bads, n_stats, vocab, top_k, top_p, min_p, greedy_i8,
        floor, total, rowmax, rowbad,
        SEQUENTIAL=sequential, BUCKETS=BUCKETS, BASE=EXPONENT_BASE, num_warps=4,
    )
    bits, counts, n_chunks = launch_mark(probs, None, floor, KEEP_AT_LEAST)
    chunks_pad = triton.next_power_of_2(n_chunks)
    # Candidates of row b: cand[b * V : b * V + n_b], ascending ids.
    cand_ids = torch.empty(batch * vocab, dtype=torch.int32, device=device)
    cand_vals = torch.empty(batch * vocab, dtype=torch.float32, device=device)
    launch_expand_local(probs, bits, counts, n_chunks, cand_ids, cand_vals)
    cutoff = torch.empty(batch, dtype=torch.int32, device=device)
    logz = torch.empty(batch, dtype=torch.float32, device=device)
    sizes = torch.empty(batch, dtype=torch.int32, device=device)
    lengths = torch.empty_like(sizes)
    status = torch.empty_like(sizes)
    forms = torch.empty_like(sizes)
    selected = torch.empty(batch, dtype=torch.float32, device=device)
    _resolve_kernel[(batch,)](
        probs, probs.stride(0), vocab, cand_ids, cand_vals, counts, n_chunks,
        floor, total, rowmax, rowbad, top_k, top_p, min_p, greedy_i8, opt_in,
        tokens, seeds, max_tokens, cutoff, logz, sizes, lengths, status, forms, selected,
        SEQUENTIAL=sequential, SAMPLE=sample_mode, STATUS_ON_OVERFLOW=overflow == "status",
        BLOCK=RESOLVE_BLOCK, CHUNKS_PAD=chunks_pad, num_warps=8,
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
            cand_ids, cand_vals, counts, n_chunks, vocab, batch,
            cutoff, logz, lengths, status, forms, greedy_i8, tokens, offsets, id_offsets, ids,
            # A program walks its row's candidates one block at a time, so a
            # row past max_tokens (tens of thousands of candidates) sets the
            # kernel's duration: blocks of 4096 over 16 warps (110 registers, no
            # spills; on the H200, 2026-11-30, blocks of 1024 made a batch with
            # 10% such rows 450 us slower than with overflow="status").
            values, selected, 0 if direct is None else direct.publisher.table,
            counts if direct is None else direct.publisher.arrivals,
            BLOCK=WRITE_BLOCK, CHUNKS_PAD=chunks_pad,
            ROWS_BLOCK=min(1024, triton.next_power_of_2(batch)), num_warps=16,
            DIRECT=direct is not None, SUPPORT=target is None or target[2] == "support",
        )
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

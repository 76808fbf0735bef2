"""Capture's write stage: each row's support placed at its offsets in the
result (the write, program per row, from the candidates; into the ring too
on the GPU-direct path), and a window row's from one read of each chunk
(the window write, program per chunk, launched only when the call may have
window rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .capture_mark import _chunk_tile
from .capture_workspace import CaptureSettings, CaptureWorkspace
from .direct import Claim
from .float_bits import INF_KEY, log_any, popcount
from .launch import after_previous, compiled_for_nvidia, launch, launch_options, register_cap
from .ring import ring_arrive, ring_claim, ring_commit
from .rows import Rows


def launch_write(probs: torch.Tensor, settings: CaptureSettings, ws: CaptureWorkspace,
                 tokens: torch.Tensor, rows: Rows, direct: Claim | None, support: bool,
                 pdl: bool) -> None:
    """_write_kernel over the rows, after resolve: rows.offsets,
    rows.id_offsets, and every row's data but a window row's in rows.ids and
    rows.values; ``direct`` (a claimed GPU-direct step) each row into the
    ring too, its values (``support``) or its selected logprob."""
    batch = probs.shape[0]
    # without PDL on the GPU-direct path (its ring stores and arrival have
    # not been measured chained)
    chained = pdl and direct is None
    launch(_write_kernel, (batch,),
        ws.cand_ids, ws.cand_vals, ws.n_cand, ws.window_ok, rows.vocab, batch,
        ws.cutoff, ws.logz, rows.lengths, rows.status, rows.forms, settings.greedy, tokens,
        rows.offsets, rows.id_offsets, rows.ids, rows.values, rows.selected_logprob,
        0 if direct is None else direct.publisher.table,
        ws.counts if direct is None else direct.publisher.arrivals,  # (not read without direct)
        BLOCK=tuning.WRITE_BLOCK,
        ROWS_BLOCK=min(tuning.WRITE_ROWS_BLOCK, triton.next_power_of_2(batch)),
        num_warps=tuning.WRITE_WARPS, DIRECT=direct is not None, SUPPORT=support,
        PDL=chained,
        **launch_options(chained),
    )


def launch_window_write(probs: torch.Tensor, ws: CaptureWorkspace, rows: Rows,
                        pdl: bool) -> None:
    """_window_write_kernel over every (row, chunk), after the write set the
    offsets; rows with window_ok 0 return at once (``pdl``: launched as a
    programmatic dependent of the write, which began after resolve, the
    writer of window_ok, ended)."""
    batch, vocab = probs.shape
    # popc and lg2.approx are PTX: NVIDIA's compiled kernels only
    nvidia = compiled_for_nvidia(probs)
    launch(_window_write_kernel, (batch, ws.n_chunks),
        probs, probs.stride(0), vocab, ws.window_ok, ws.cutoff, ws.logz, rows.forms, ws.before,
        ws.n_chunks, rows.offsets, rows.id_offsets, rows.ids, rows.values, CHUNK=tuning.CHUNK,
        SUB=tuning.WINDOW_WRITE_SUB, FAST=nvidia, LANES=tuning.WINDOW_WRITE_LANES, PDL=pdl,
        num_warps=tuning.WINDOW_WRITE_WARPS,
        **register_cap(nvidia, tuning.WINDOW_WRITE_REGISTERS), **launch_options(pdl),
    )


@triton.jit
def _write_kernel(
    cand_ids_ptr, cand_vals_ptr, n_cand_ptr, window_ok_ptr, vocab, batch,
    cutoff_ptr, logz_ptr, lengths_ptr, status_ptr, forms_ptr, greedy_ptr, token_ptr,
    offsets_ptr, id_offsets_ptr, out_ids_ptr, out_vals_ptr, selected_ptr,
    table, arrivals,
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
def _or_in_word(word_a, bits_a, word_b, bits_b):
    """Scan step of a segmented OR over candidates sorted by id: the bits of
    the trailing run of equal words (ids ascend, so a run never resumes)."""
    return word_b, tl.where(word_a == word_b, bits_a | bits_b, bits_b)


@triton.jit
def _window_write_kernel(
    probs_ptr, stride_row, vocab, window_ok_ptr, cutoff_ptr, logz_ptr, forms_ptr, before_ptr,
    n_chunks, offsets_ptr, id_offsets_ptr, out_ids_ptr, out_vals_ptr, CHUNK: tl.constexpr,
    SUB: tl.constexpr, FAST: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr,
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
        # write kernel, overlapping its end: window_ok is resolve's, which
        # finished before the write kernel began (read from L2: ".cg")
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
        # SUB columns a step, not the whole chunk at once: a thread holds
        # half the values, so more programs share a multiprocessor.
        for part in tl.range(0, CHUNK // SUB):
            if LANES:
                base = _window_write_lanes(probs_ptr, stride_row, vocab, row,
                                           chunk * CHUNK + part * SUB, cutoff, logz, dst, id_dst,
                                           bitmask, base, out_ids_ptr, out_vals_ptr, SUB, FAST)
            else:
                word_idx, bit_idx, cols, w, key = _chunk_tile(
                    probs_ptr, stride_row, vocab, row, chunk * (CHUNK // SUB) + part, SUB)
                # cutoff >= 1: no zero, no negative; +inf's bits and NaNs' excluded
                keep = (key >= cutoff) & (key < INF_KEY)
                # distinct bits: an OR
                words = tl.sum(keep.to(tl.int32) << bit_idx[None, :], axis=1)
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
                # columns, whose kept values land side by side); stored as the
                # [words, 32] tile, they would go through shared memory into
                # lanes running down 32 words.
                rank = tl.reshape(rank, [SUB])
                keep = tl.reshape(keep, [SUB])
                tl.store(out_vals_ptr + dst + rank, tl.reshape(logw - logz, [SUB]), mask=keep)
                if bitmask:
                    word = (chunk * CHUNK + part * SUB) // 32 + word_idx
                    tl.store(out_ids_ptr + id_dst + word, words, mask=word < (vocab + 31) // 32)
                else:
                    tl.store(out_ids_ptr + id_dst + rank, tl.reshape(cols, [SUB]), mask=keep)


@triton.jit
def _window_write_lanes(probs_ptr, stride_row, vocab, row, start, cutoff, logz, dst, id_dst,
                        bitmask, base, out_ids_ptr, out_vals_ptr, SUB: tl.constexpr,
                        FAST: tl.constexpr):
    """One step of the window write (the same bits as the kernel's tile
    step), columns [start, start + SUB) of the row read one column a lane: compiled
    for NVIDIA (FAST), the columns' contiguity is hidden from the compiler,
    so the load takes the layout the scattered stores want (one element a
    thread per register) and no value, rank or address goes through shared
    memory to change layout; a word's 32 columns are then one warp's lanes,
    ORed in one reduction. Returns base plus the support ids in the step."""
    offs = tl.arange(0, SUB)
    if FAST:
        offs = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [offs], dtype=tl.int32,
                                         is_pure=True, pack=1)
    cols = start + offs
    w = tl.load(probs_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=0.0).to(tl.float32)
    key = w.to(tl.int32, bitcast=True)
    keep = (key >= cutoff) & (key < INF_KEY)
    bit = offs % 32
    words = tl.sum(tl.reshape(keep.to(tl.int32) << bit, [SUB // 32, 32]), axis=1)  # an OR
    if FAST:
        per_word = _popc(words)
    else:
        per_word = popcount(words.to(tl.uint32, bitcast=True))
    first = base + tl.cumsum(per_word, axis=0) - per_word  # [words]: the rank of a word's first
    before = tl.reshape(tl.broadcast_to(first[:, None], [SUB // 32, 32]), [SUB])
    below = tl.reshape(tl.broadcast_to(words[:, None], [SUB // 32, 32]), [SUB]) & ((1 << bit) - 1)
    if FAST:
        rank = before + _popc(below)
        logw = _log_approx(w)
    else:
        rank = before + popcount(below.to(tl.uint32, bitcast=True))
        logw = log_any(w)
    tl.store(out_vals_ptr + dst + rank, logw - logz, mask=keep)
    if bitmask:
        word = start // 32 + tl.arange(0, SUB // 32)
        tl.store(out_ids_ptr + id_dst + word, words, mask=word < (vocab + 31) // 32)
    else:
        tl.store(out_ids_ptr + id_dst + rank, cols, mask=keep)
    return base + tl.sum(per_word, axis=0)


@triton.jit
def _prefetch_chunk(probs_ptr, stride_row, limit, row, chunk, CHUNK: tl.constexpr):
    """Bring the 128-byte lines of _chunk_tile's columns below limit into L2
    (NVIDIA's compiled kernels only): no registers held, unlike a load."""
    cols = tl.minimum(chunk * CHUNK + tl.arange(0, CHUNK // 32) * 32, tl.maximum(limit - 1, 0))
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [probs_ptr + row.to(tl.int64) * stride_row + cols],
                              dtype=tl.int32, is_pure=False, pack=1)


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

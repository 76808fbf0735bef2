"""Capture's interleaved mark (tuning.MARK_INTERLEAVE; launched in place of
the candidate mark and the window bracket when some row may be a window
row): the candidate mark's read of a row group and the window mark's read
of an earlier group in one grid, so that a window row's second read of
``probs`` follows its first while the row is still in L2 (decision 61).

Two kernels apart, the window mark rereads every chunk from memory but
what L2 (50 MB on the H100) still holds of the candidate mark's last
chunks, about a third of a 256-row call (decision 60). Here the grid is
blocks of GROUP rows x n_chunks programs in this order:

    first(0) .. first(LAG - 1), second(0), first(LAG), second(1),
    first(LAG + 1), ..., second(n_groups - 1)

first(g): the candidate mark's work on group g's chunks; each window-row
program then counts itself done for its row (acq_rel), and the row's last
computes its window bracket and counts once more (release).

second(g): a window row's program waits (acquire) until its row's count
says the bracket is there, and, for a bracket that is not wide, does the
window mark's work on its chunk, read again a few groups after the first
read. A wide bracket's rows are left to the window refine and the window
mark after this kernel (launch_window(interleaved=True)), as before.

A second-phase program waits only on first-phase programs of lower index,
and the GPU starts a grid's programs in the order of their index (what a
single-pass scan's decoupled look-back relies on too), so every program
it waits on has started and none waits on it: no deadlock. In Triton's
interpreter, which runs the programs one at a time in that order, a wait
finds its row done. ``ws.done`` (a count a row) is cleared by the bound,
the kernel before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .capture_mark import _cand_mark_chunk, _chunk_tile
from .capture_window import _window_bracket_row, _window_mark_chunk
from .capture_workspace import B_WIDE, BRACKET, CaptureSettings, CaptureWorkspace
from .launch import after_previous, compiled_for_nvidia, launch, launch_options, register_cap


def launch_interleaved_mark(probs: torch.Tensor, settings: CaptureSettings,
                            ws: CaptureWorkspace, pdl: bool) -> None:
    """_interleaved_mark_kernel over every (row, chunk) twice: what the
    candidate mark and the window bracket write, and a window row's window
    mark where its bracket is not wide."""
    batch, vocab = probs.shape
    group = tuning.INTERLEAVE_GROUP
    n_groups = triton.cdiv(batch, group)
    launch(_interleaved_mark_kernel, (2 * n_groups * group * ws.n_chunks,),
        probs, probs.stride(0), vocab, batch, ws.lo, ws.window, ws.pivots, settings.top_p,
        settings.min_p, settings.greedy, ws.bits, ws.counts, ws.sums, ws.maxes, ws.pivot_mass,
        ws.bracket, ws.refine_keys, ws.wide_count, ws.wide_rows, ws.refine_mass,
        ws.above_mass, ws.above_count, ws.done, ws.n_chunks,
        CHUNK=tuning.CHUNK, CHUNKS_PAD=triton.next_power_of_2(ws.n_chunks),
        MASS=settings.need_mass, TOP=settings.need_max, PIVOTS=tuning.WINDOW_PIVOTS,
        REFINE=tuning.WINDOW_REFINE, GROUP=group, LAG=tuning.INTERLEAVE_LAG, PDL=pdl,
        num_warps=tuning.WINDOW_MARK_WARPS,
        **register_cap(compiled_for_nvidia(probs) and tuning.INTERLEAVE_REGISTERS > 0,
                       tuning.INTERLEAVE_REGISTERS),
        **launch_options(pdl),
    )


@triton.jit
def _interleaved_mark_kernel(
    probs_ptr, stride_row, vocab, batch, lo_ptr, window_ptr, pivots_ptr, top_p_ptr, min_p_ptr,
    greedy_ptr, bits_ptr, counts_ptr, sum_ptr, max_ptr, pivot_mass_ptr, bracket_ptr,
    refine_keys_ptr, wide_count_ptr, wide_rows_ptr, refine_mass_ptr, above_mass_ptr,
    above_count_ptr, done_ptr, n_chunks,
    CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, MASS: tl.constexpr, TOP: tl.constexpr,
    PIVOTS: tl.constexpr, REFINE: tl.constexpr, GROUP: tl.constexpr, LAG: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p: block p // (GROUP * n_chunks) of the order in the module's
    docstring, row-major inside it (a row's chunks in turn)."""
    per_group = GROUP * n_chunks
    n_groups = tl.cdiv(batch, GROUP)
    lead = tl.minimum(n_groups, LAG)  # the first phases before the first second phase
    paired = tl.maximum(n_groups - LAG, 0)  # (second(j), first(j + LAG)) pairs
    block = tl.program_id(0) // per_group
    within = tl.program_id(0) % per_group
    k = block - lead
    in_pairs = (k >= 0) & (k < 2 * paired)
    first = (block < lead) | (in_pairs & (k % 2 == 1))
    group = tl.where(block < lead, block,
                     tl.where(in_pairs, k // 2 + tl.where(k % 2 == 1, LAG, 0),
                              paired + (k - 2 * paired)))
    row = group * GROUP + within // n_chunks
    chunk = within % n_chunks
    in_batch = row < batch
    row = tl.minimum(row, batch - 1)  # (a group past the batch reads and writes nothing)
    # the first phase's read is issued before the wait: it overlaps the
    # bound's end, as the candidate mark's does
    word_idx, bit_idx, _, w, key = _chunk_tile(probs_ptr, stride_row,
                                               tl.where(first & in_batch, vocab, 0), row, chunk,
                                               CHUNK)
    after_previous(PDL)
    if in_batch:
        window = tl.load(window_ptr + row) != 0
        if first:
            _cand_mark_chunk(row, chunk, word_idx, bit_idx, w, key, lo_ptr, window_ptr,
                             pivots_ptr, top_p_ptr, min_p_ptr, greedy_ptr, bits_ptr, counts_ptr,
                             sum_ptr, max_ptr, pivot_mass_ptr, n_chunks, CHUNK, MASS, TOP, True,
                             PIVOTS)
            if window:
                # every thread's stores before the one thread's release
                tl.debug_barrier()
                if tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == n_chunks - 1:
                    # the row's last chunk: its sums are all there
                    _window_bracket_row(row, pivots_ptr, top_p_ptr, min_p_ptr, sum_ptr, max_ptr,
                                        pivot_mass_ptr, bracket_ptr, refine_keys_ptr,
                                        wide_count_ptr, wide_rows_ptr, n_chunks, CHUNKS_PAD,
                                        PIVOTS, REFINE)
                    tl.debug_barrier()
                    tl.atomic_add(done_ptr + row, 1, sem="release")
        elif window:
            seen = tl.atomic_add(done_ptr + row, 0, sem="acquire")
            while seen <= n_chunks:
                seen = tl.atomic_add(done_ptr + row, 0, sem="acquire")
            if tl.load(bracket_ptr + row * BRACKET + B_WIDE, cache_modifier=".cg") == 0:
                word_idx2, bit_idx2, _, w2, key2 = _chunk_tile(probs_ptr, stride_row, vocab, row,
                                                               chunk, CHUNK)
                _window_mark_chunk(row, chunk, word_idx2, bit_idx2, w2, key2, bracket_ptr,
                                   refine_keys_ptr, refine_mass_ptr, bits_ptr, counts_ptr,
                                   above_mass_ptr, above_count_ptr, n_chunks, CHUNK, CHUNKS_PAD,
                                   REFINE)

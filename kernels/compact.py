"""Compaction: ``[B, V]`` logits or weights to the kept entries of each row,
every row exact, each in the cheaper of two forms.

Semantics
---------
* ``keep="finite"`` (logits): entry kept iff it is finite; ``-inf`` (and NaN,
  ``+inf``) mark dropped tokens. Feed masked log-probabilities to get ids and
  logprobs in one call.
* ``keep="positive"`` (weights / probabilities): entry kept iff ``> 0``
  (NaN is dropped, ``+inf`` kept).
* Row b's support size is ``sizes[b]`` (L). An OK row travels as its L
  ascending ids (``Form.IDS``) while ``32 L < V`` and ``L <= max_tokens``,
  else as a ``ceil(V / 32)``-word bitmask (``Form.BITMASK``); its values
  (the kept inputs as float32, ascending id order) travel in both forms.
* ``overflow="exact"`` (default): no row is dropped; max_tokens bounds only
  the ids form. ``overflow="status"`` (engines that abort such a request):
  a row with ``L > max_tokens`` gets ``Status.OVERFLOW`` and writes nothing.
* Rows with ``rows[b] == False`` are not read at all: ``Status.SKIPPED``,
  length 0.
* ``offsets``/``id_offsets`` int32[B + 1] are computed on the GPU.

Kernels: (1) mark: program (b, c) reads one 8192-column chunk of row b once
and writes a bitmask of its kept entries plus their count (little arithmetic
per element, so it streams at memory speed); (2) scan: one program turns the
counts into sizes, statuses, forms and both offsets; (3) expand: program
(b, c) stores its chunk's words verbatim (bitmask rows) or peels them into
ascending ids (ids rows), and gathers the kept values. Only (1) reads the
whole [B, V] input (1/32 of it comes back as bits), so the call costs about
one read of the logits plus a few bytes per kept entry. On Hopper and later
the three are chained by programmatic dependent launch (each waits for the
one before at its first instruction, so the next one's launch overlaps the
tail of the last).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import launch_plan, tuning
from .checks import check_matrix, check_max_tokens, row_mask
from .direct import claim_step, launching, publish_into
from .float_bits import log_any, popcount
from .host import check_into
from .launch import after_previous, launch, launch_options, pdl_default
from .ring import ring_arrive, ring_claim, ring_commit
from .rows import WORD_BITS, Rows, Status, empty_rows, is_bitmask, pack_rows

__all__ = ["compact", "reference_compact"]

# Predicates of the mark kernel.
KEEP_FINITE = 0  # logits: keep finite entries (-inf marks a dropped token)
KEEP_POSITIVE = 1  # weights: keep entries > 0
KEEP_AT_LEAST = 2  # probabilities: keep finite w > 0 whose float bits >= a per-row key

_KEEP_MODES = {"finite": KEEP_FINITE, "positive": KEEP_POSITIVE}


def compact(
    x: torch.Tensor,
    max_tokens: int,
    *,
    keep: str = "finite",
    rows: torch.Tensor | None = None,
    overflow: str = "exact",
    chunk: int | None = None,
    num_warps: int | None = None,
    expand_words: int | None = None,
    expand_warps: int | None = None,
    pdl: bool | None = None,
    scan_rows: int | None = None,
    into: tuple[Any, ...] | None = None,
) -> Rows:
    """Kept entries of every opted-in row of ``x`` [B, V] (fp32/bf16/fp16).

    ``rows`` (bool[B], default all) opts rows in. ``chunk``, ``num_warps``
    (mark), ``expand_words``, ``expand_warps`` (None: kernels/tuning.py's
    CHUNK, MARK_WARPS, EXPAND_WORDS, EXPAND_WARPS, read at the call), ``pdl``
    (None: on where the GPU has it) and ``scan_rows`` (rows the scan kernel
    takes per step, a power of two; None: as many as a tile of
    ``tuning.SCAN_TILE`` chunk counts holds) are
    launch parameters; none changes the result.
    Output capacity: ``ids``
    ``B * ceil(V / 32)`` words (a row's id data never exceeds its bitmask);
    ``values`` ``B * V`` entries with ``overflow="exact"`` (every row may be
    the whole vocabulary), ``B * min(max_tokens, V)`` with ``"status"``.
    Valid prefixes: ``id_offsets[B]`` and ``offsets[B]``.
    ``into=(writer, handles)`` also publishes the rows (support mode) to
    those RowQueues, row b to ``handles[b]``: where CUDA is present the
    scan and expand kernels store each row into its queue's buffer in the
    ring as they compute it (GPU-direct, kernels/direct.py), else through
    ``kernels.publish``.
    """
    x = check_matrix(x, "x")
    if keep not in _KEEP_MODES:
        raise ValueError(f"keep must be one of {sorted(_KEEP_MODES)}, got {keep!r}")
    if scan_rows is not None and (scan_rows < 1 or scan_rows & (scan_rows - 1)):
        raise ValueError(f"scan_rows must be a power of two >= 1, got {scan_rows}")
    batch, vocab = x.shape
    check_max_tokens(max_tokens, batch, vocab, overflow)
    target = check_into(into, False, max_tokens, vocab)  # refused before any kernel runs
    opt_in = None if rows is None else row_mask(rows, batch, x.device)
    pdl = pdl_default(x.device) if pdl is None else pdl
    chunk = tuning.CHUNK if chunk is None else chunk
    num_warps = tuning.MARK_WARPS if num_warps is None else num_warps
    expand_words = tuning.EXPAND_WORDS if expand_words is None else expand_words
    expand_warps = tuning.EXPAND_WARPS if expand_warps is None else expand_warps
    n_chunks = triton.cdiv(vocab, chunk)
    # A call shape's launches replay from a plan after two calls
    # (kernels/launch_plan.py); into= (scan and expand store into a claimed
    # GPU-direct step) always takes Triton's path.
    where = launch_plan.call_stream(x) if target is None else None
    result, buffers = empty_rows(batch, vocab, max_tokens, overflow, x.device, selected=False,
                                tokens=False, reuse=where)
    marks = torch.empty(batch * n_chunks * (chunk // WORD_BITS + 1), dtype=torch.int32,
                        device=x.device)  # the mark's bitmask, then its counts
    launches: dict[str, Any] = dict(mode=_KEEP_MODES[keep], chunk=chunk, mark_warps=num_warps,
                    expand_words=expand_words, expand_warps=expand_warps, pdl=pdl,
                    scan_rows=scan_rows)
    if where is None:
        return _compact_rows(x, opt_in, max_tokens, overflow, result, marks, target=target,
                             **launches)
    slots = (x, opt_in, marks, *buffers)
    addresses = launch_plan.pointers(slots)
    key = (*where, x.dtype, batch, vocab, x.stride(0), opt_in is None, max_tokens, overflow,
           *launches.values(), launch_plan.slots_key(addresses), launch_plan.tuning_state())
    _PLANS.launch(key, slots, addresses, where[1], lambda: _compact_rows(
        x, opt_in, max_tokens, overflow, result, marks, target=None, **launches))
    return result


_PLANS = launch_plan.Plans("compact")


def _compact_rows(
    x: torch.Tensor, opt_in: torch.Tensor | None, max_tokens: int, overflow: str, rows: Rows,
    marks: torch.Tensor, *, mode: int, chunk: int, mark_warps: int, expand_words: int,
    expand_warps: int, pdl: bool, scan_rows: int | None, target: tuple[Any, Any, str] | None,
) -> Rows:
    """mark + scan + expand into ``rows`` (``marks``: the mark's scratch),
    published where ``target`` (check_into's) says."""
    batch, vocab = x.shape
    device = x.device
    n_chunks = triton.cdiv(vocab, chunk)
    bits, counts = marks[:batch * n_chunks * (chunk // WORD_BITS)], marks[-batch * n_chunks:]
    launch_mark(x, opt_in, None, mode, bits, counts, chunk, mark_warps, pdl)
    sizes, status, lengths, forms = rows.sizes, rows.status, rows.lengths, rows.forms
    offsets, id_offsets = rows.offsets, rows.id_offsets
    chunks_pad = triton.next_power_of_2(n_chunks)
    group = max(1, expand_words // (chunk // WORD_BITS))
    # into= on the GPU-direct path: the table is prepared for this step now
    # (mark already runs); scan claims each row's place in its queue's
    # buffer and expand stores the row there as it computes it.
    direct = claim_step(target, batch, vocab)
    with launching(direct, "compaction's scan and expand kernels"):
        # (inside: a claimed step that raises before its kernels run is cancelled)
        claims = counts if direct is None else torch.empty(batch * 8, dtype=torch.int64,
                                                           device=device)
        table = 0 if direct is None else direct.publisher.table
        arrivals = counts if direct is None else direct.publisher.arrivals
        launch(scan_kernel, (1,),
            counts, n_chunks, sizes if opt_in is None else opt_in, batch, vocab, max_tokens,
            sizes, lengths, status, forms, offsets, id_offsets, table, claims,
            STATUS_ON_OVERFLOW=overflow == "status", ALL_ROWS=opt_in is None, PDL=pdl,
            # one tile of rows x chunks per step; a batch of up to SCAN_TILE /
            # chunks_pad rows is a single step
            ROWS=scan_rows or max(1, min(triton.next_power_of_2(batch),
                                         tuning.SCAN_TILE // chunks_pad)),
            CHUNKS_PAD=chunks_pad, DIRECT=direct is not None, num_warps=tuning.SCAN_WARPS,
            **launch_options(pdl),
        )
        launch(expand_kernel, (batch, triton.cdiv(n_chunks, group)),
            x, x.stride(0), vocab, bits, counts, n_chunks, status, forms, offsets, id_offsets,
            rows.ids, rows.values, table, arrivals, claims, counts, ROW_LOCAL=False, PDL=pdl,
            CHUNK=chunk, GROUP=group, CHUNKS_PAD=chunks_pad, DIRECT=direct is not None,
            LOG_VALUES=False,
            num_warps=expand_warps, **launch_options(pdl),
        )
    if direct is not None:
        direct.launched(rows)
        return rows
    return publish_into(target, rows)


def reference_compact(
    x: torch.Tensor,
    max_tokens: int,
    *,
    keep: str = "finite",
    rows: torch.Tensor | None = None,
    overflow: str = "exact",
) -> Rows:
    """Plain-torch compaction with the same semantics as :func:`compact`."""
    x = check_matrix(x, "x")
    if keep not in _KEEP_MODES:
        raise ValueError(f"keep must be one of {sorted(_KEEP_MODES)}, got {keep!r}")
    batch, vocab = x.shape
    check_max_tokens(max_tokens, batch, vocab, overflow)
    xf = x.float()
    kept = torch.isfinite(xf) if keep == "finite" else xf > 0
    opted = torch.ones(batch, dtype=torch.bool, device=x.device) if rows is None else rows
    kept &= opted[:, None]
    sizes = kept.sum(1).to(torch.int32)
    over = (sizes > max_tokens) & (overflow == "status")
    status = torch.where(over, Status.OVERFLOW, Status.OK)
    status = torch.where(opted, status, Status.SKIPPED).to(torch.int32)
    return pack_rows(kept, xf, status, sizes, max_tokens)


# ------------------------------------------------------------------ kernels


@triton.jit
def mark_kernel(
    x_ptr, stride_row, vocab, opt_in_ptr, key_floor_ptr, bits_ptr, counts_ptr, n_chunks,
    MODE: tl.constexpr, CHUNK: tl.constexpr, ALL_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, c) reads columns [c*CHUNK, (c+1)*CHUNK) of row b once and
    writes which entries its predicate keeps as a bitmask (CHUNK/32 words) plus
    their count. Little work per element, so the pass streams at memory speed;
    the kept ids come out of the bitmask in expand_kernel."""
    WORDS: tl.constexpr = CHUNK // 32
    after_previous(PDL)  # the kernels before wrote x
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    word_idx = tl.arange(0, WORDS)
    bit_idx = tl.arange(0, 32)
    cols = chunk * CHUNK + word_idx[:, None] * 32 + bit_idx[None, :]
    # A row not opted in reads nothing: its column limit becomes 0. ALL_ROWS
    # (no opt-in mask given) saves the caller a fill launch for the mask.
    if ALL_ROWS:
        limit = vocab
    else:
        limit = tl.where(tl.load(opt_in_ptr + row) != 0, vocab, 0)
    inside = cols < limit
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=0.0)
    x = x.to(tl.float32)
    if MODE == 0:
        keep = inside & (x == x) & (tl.abs(x) < float("inf"))
    elif MODE == 1:
        keep = inside & (x > 0.0)
    else:
        key_floor = tl.load(key_floor_ptr + row)
        key = x.to(tl.int32, bitcast=True)
        keep = inside & (x > 0.0) & (x < float("inf")) & (key >= key_floor)
    keep_i = keep.to(tl.int32)
    words = tl.sum(keep_i << bit_idx[None, :], axis=1)  # distinct bits: the sum is an OR
    slot = row * n_chunks + chunk
    tl.store(bits_ptr + slot.to(tl.int64) * WORDS + word_idx, words)
    tl.store(counts_ptr + slot, tl.sum(tl.sum(keep_i, axis=1), axis=0))


def launch_mark(
    x: torch.Tensor, opt_in: torch.Tensor | None, key_floor: torch.Tensor | None, mode: int,
    bits: torch.Tensor, counts: torch.Tensor, chunk: int, num_warps: int, pdl: bool,
) -> None:
    """Run mark_kernel into ``bits`` (B * n_chunks * chunk / 32 words) and
    ``counts`` (B * n_chunks). ``opt_in`` None: every row."""
    batch, vocab = x.shape
    n_chunks = triton.cdiv(vocab, chunk)
    launch(mark_kernel, (batch, n_chunks),
        x, x.stride(0), vocab, counts if opt_in is None else opt_in,
        counts if key_floor is None else key_floor, bits, counts, n_chunks,
        MODE=mode, CHUNK=chunk, ALL_ROWS=opt_in is None, PDL=pdl, num_warps=num_warps,
        **launch_options(pdl),
    )


@triton.jit
def row_status(size, opted, max_tokens, STATUS_ON_OVERFLOW: tl.constexpr):
    """Status of rows that cannot be INVALID (compaction): SKIPPED, then
    OVERFLOW (policy "status" only), else OK."""
    over = (size > max_tokens) & STATUS_ON_OVERFLOW
    return tl.where(opted, tl.where(over, 1, 0), 3)


@triton.jit
def scan_kernel(
    counts_ptr, n_chunks, opt_in_ptr, batch, vocab, max_tokens,
    sizes_ptr, lengths_ptr, status_ptr, forms_ptr, offsets_ptr, id_offsets_ptr,
    table, claims_ptr,
    STATUS_ON_OVERFLOW: tl.constexpr, ALL_ROWS: tl.constexpr, PDL: tl.constexpr,
    ROWS: tl.constexpr, CHUNKS_PAD: tl.constexpr, DIRECT: tl.constexpr,
):
    """One program: per-row sizes from the chunk counts, statuses, forms,
    lengths, and the exclusive scans of the lengths (offsets) and of the id
    lengths (id_offsets).

    DIRECT (compact's ``into=`` on the GPU-direct path): also where each row
    goes in its queue's buffer in the ring (``ring_claim``, a block of rows
    at a time: it only reads the table), written to claims[8 b:8 b + 8] as
    (entry, fits, rows, words, nnz, ring ids address, ring values address,
    0: the row's expand programs that finished). The expand kernel's
    programs store the row there a second time and its last one commits it."""
    after_previous(PDL)
    n_words = (vocab + 31) // 32
    carry = tl.zeros([], dtype=tl.int32)
    id_carry = tl.zeros([], dtype=tl.int32)
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    for start in range(0, batch, ROWS):
        rows = start + tl.arange(0, ROWS)
        in_batch = rows < batch
        tile = tl.load(counts_ptr + rows[:, None] * n_chunks + chunk_idx[None, :],
                       mask=in_batch[:, None] & (chunk_idx[None, :] < n_chunks), other=0)
        size = tl.sum(tile, axis=1)
        if ALL_ROWS:
            opted = in_batch
        else:
            opted = tl.load(opt_in_ptr + rows, mask=in_batch, other=0) != 0
        status = row_status(size, opted, max_tokens, STATUS_ON_OVERFLOW)
        length = tl.where(status == 0, size, 0)
        bitmask = is_bitmask(length, status, max_tokens, vocab)
        id_length = tl.where(bitmask, n_words, length)
        tl.store(sizes_ptr + rows, size, mask=in_batch)
        tl.store(lengths_ptr + rows, length, mask=in_batch)
        tl.store(status_ptr + rows, status, mask=in_batch)
        tl.store(forms_ptr + rows, bitmask.to(tl.int32), mask=in_batch)
        tl.store(offsets_ptr + rows, carry + tl.cumsum(length, axis=0) - length, mask=in_batch)
        tl.store(id_offsets_ptr + rows, id_carry + tl.cumsum(id_length, axis=0) - id_length,
                 mask=in_batch)
        if DIRECT:
            # Rows past the batch are SKIPPED (no claim); they read row
            # batch - 1's slot so that no load leaves the step's arrays.
            fits, entry, q_rows, q_words, q_nnz, ring_ids, ring_vals = ring_claim(
                table, tl.minimum(rows, batch - 1), status, bitmask.to(tl.int32),
                length.to(tl.int64), id_length.to(tl.int64), vocab, True)
            claim = claims_ptr + rows.to(tl.int64) * 8
            tl.store(claim, entry, mask=in_batch)
            tl.store(claim + 1, fits.to(tl.int64), mask=in_batch)
            tl.store(claim + 2, q_rows, mask=in_batch)
            tl.store(claim + 3, q_words, mask=in_batch)
            tl.store(claim + 4, q_nnz, mask=in_batch)
            tl.store(claim + 5, ring_ids.to(tl.int64), mask=in_batch)
            tl.store(claim + 6, ring_vals.to(tl.int64), mask=in_batch)
            tl.store(claim + 7, tl.zeros_like(entry), mask=in_batch)
        carry += tl.sum(length, axis=0)
        id_carry += tl.sum(id_length, axis=0)
    tl.store(offsets_ptr + batch, carry)
    tl.store(id_offsets_ptr + batch, id_carry)


@triton.jit
def expand_kernel(
    x_ptr, stride_row, vocab, bits_ptr, counts_ptr, n_chunks,
    status_ptr, forms_ptr, offsets_ptr, id_offsets_ptr, out_ids_ptr, out_vals_ptr,
    table, arrivals, claims_ptr, logz_ptr,
    ROW_LOCAL: tl.constexpr, PDL: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
    CHUNKS_PAD: tl.constexpr, DIRECT: tl.constexpr, LOG_VALUES: tl.constexpr,
):
    """Program (b, g) turns the bitmasks of chunks [g*GROUP, (g+1)*GROUP) of
    row b into ascending ids and gathers their values from x.

    ROW_LOCAL (capture's candidates): ids and values go to row b's own slice
    out[b * V:], after the counts of the chunks before. Otherwise
    (compaction's result, after scan_kernel): an OK row's values go to
    offsets[b] + the counts of the chunks before, its ids (ids form) to
    id_offsets[b] + the same, or its words verbatim (bitmask form).

    Each step peels the lowest set bits of every word (four per step) and
    gathers their values, so the loop runs as often as the fullest word has
    bits / 4 (once for a sparse row). The first step's gathers are issued
    before the block-wide scans that place them, so their memory latency
    overlaps the scans.

    DIRECT (compaction only, after scan_kernel claimed the step's rows):
    every store is made a second time at the row's place in its queue's
    buffer in the ring, where it fits; the row's last program to finish
    (counted in its claim) commits its length, flags and counts
    (``ring_commit``) and arrives for it (``ring_arrive``), so the step is
    done once every row's programs are.

    LOG_VALUES (no launcher sets it today): the values stored are
    ``log(x) - logz[b]``, the logprobs of a support whose log-mass is logz."""
    WORDS: tl.constexpr = GROUP * (CHUNK // 32)
    after_previous(PDL)
    row = tl.program_id(0)
    first_chunk = tl.program_id(1) * GROUP
    word_idx = tl.arange(0, WORDS)
    first_word = first_chunk * (CHUNK // 32)
    in_row = (first_chunk + word_idx // (CHUNK // 32)) < n_chunks
    words = tl.load(bits_ptr + (row * n_chunks).to(tl.int64) * (CHUNK // 32) + first_word
                    + word_idx, mask=in_row, other=0)
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    counts = tl.load(counts_ptr + row * n_chunks + chunk_idx, mask=chunk_idx < n_chunks, other=0)
    if ROW_LOCAL:
        dst = row.to(tl.int64) * vocab
        id_dst = dst  # ids sit beside their values
    else:
        ok = tl.load(status_ptr + row) == 0
        # a form counts only for an OK row
        bitmask = (tl.load(forms_ptr + row) != 0) & ok
        dst = tl.load(offsets_ptr + row).to(tl.int64)
        id_dst = tl.load(id_offsets_ptr + row).to(tl.int64)
        # A bitmask row's words are its id data as they stand. (A scalar
        # predicate goes into a mask through tl.where: `block & scalar` is
        # not a bool mask in Triton's interpreter.)
        n_words = (vocab + 31) // 32
        tl.store(out_ids_ptr + id_dst + first_word + word_idx, words,
                 mask=tl.where(bitmask, first_word + word_idx < n_words, False))
        if DIRECT:
            claim = claims_ptr + row.to(tl.int64) * 8
            fits = tl.load(claim + 1) != 0
            ring_ids = tl.load(claim + 5).to(tl.pointer_type(tl.int32))
            ring_vals = tl.load(claim + 6).to(tl.pointer_type(tl.float32))
            tl.store(ring_ids + first_word + word_idx, words,
                     mask=tl.where(bitmask & fits, first_word + word_idx < n_words, False))
            ring_id_dst = tl.where(bitmask, -1, 0)
        words = tl.where(ok, words, 0)
        id_dst = tl.where(bitmask, -1, id_dst)  # the ids form only: below, -1 = none
    words = words.to(tl.uint32, bitcast=True)
    col_base = first_chunk * CHUNK + word_idx * 32
    x_row = x_ptr + row.to(tl.int64) * stride_row
    logz = 0.0
    if LOG_VALUES:
        logz = tl.load(logz_ptr + row)
    cols_a, live_a, words_left = _peel(words, col_base)
    cols_b, live_b, words_left = _peel(words_left, col_base)
    cols_c, live_c, words_left = _peel(words_left, col_base)
    cols_d, live_d, words_left = _peel(words_left, col_base)
    vals_a = tl.load(x_row + cols_a, mask=live_a)
    vals_b = tl.load(x_row + cols_b, mask=live_b)
    vals_c = tl.load(x_row + cols_c, mask=live_c)
    vals_d = tl.load(x_row + cols_d, mask=live_d)
    if LOG_VALUES:
        vals_a, vals_b, vals_c, vals_d = _logprobs(vals_a, vals_b, vals_c, vals_d, logz)
    per_word = popcount(words)
    before = tl.sum(tl.where(chunk_idx < first_chunk, counts, 0), axis=0)
    slots = before + tl.cumsum(per_word, axis=0) - per_word  # rank in the row
    rounds = tl.max(per_word, axis=0)
    _place(out_ids_ptr, out_vals_ptr, dst, id_dst, slots, cols_a, vals_a, live_a,
           cols_b, vals_b, live_b, cols_c, vals_c, live_c, cols_d, vals_d, live_d)
    if DIRECT:
        _place_ring(ring_ids, ring_vals, ring_id_dst, fits, slots, cols_a, vals_a, live_a,
                    cols_b, vals_b, live_b, cols_c, vals_c, live_c, cols_d, vals_d, live_d)
    for _ in range(4, rounds, 4):
        slots += 4
        cols_a, live_a, words_left = _peel(words_left, col_base)
        cols_b, live_b, words_left = _peel(words_left, col_base)
        cols_c, live_c, words_left = _peel(words_left, col_base)
        cols_d, live_d, words_left = _peel(words_left, col_base)
        vals_a = tl.load(x_row + cols_a, mask=live_a)
        vals_b = tl.load(x_row + cols_b, mask=live_b)
        vals_c = tl.load(x_row + cols_c, mask=live_c)
        vals_d = tl.load(x_row + cols_d, mask=live_d)
        if LOG_VALUES:
            vals_a, vals_b, vals_c, vals_d = _logprobs(vals_a, vals_b, vals_c, vals_d, logz)
        _place(out_ids_ptr, out_vals_ptr, dst, id_dst, slots, cols_a, vals_a, live_a,
               cols_b, vals_b, live_b, cols_c, vals_c, live_c, cols_d, vals_d, live_d)
        if DIRECT:
            _place_ring(ring_ids, ring_vals, ring_id_dst, fits, slots, cols_a, vals_a, live_a,
                        cols_b, vals_b, live_b, cols_c, vals_c, live_c, cols_d, vals_d, live_d)
    if DIRECT:
        tl.debug_barrier()  # every thread's stores of this program, then its count
        finished = tl.atomic_add(claim + 7, 1, sem="acq_rel", scope="gpu")
        if finished == tl.num_programs(1) - 1:  # the row's last program
            length = (tl.load(offsets_ptr + row + 1) - tl.load(offsets_ptr + row)).to(tl.int64)
            row_words = (tl.load(id_offsets_ptr + row + 1)
                         - tl.load(id_offsets_ptr + row)).to(tl.int64)
            ring_commit(table, tl.load(claim), fits, tl.load(claim + 2), tl.load(claim + 3),
                        tl.load(claim + 4), tl.load(status_ptr + row),
                        tl.load(forms_ptr + row), length, row_words, vocab)
            ring_arrive(table, arrivals)


@triton.jit
def _logprobs(a, b, c, d, logz):
    """log(w) - logz of one peel step's four gathers (masked-off lanes
    are never stored)."""
    return (log_any(a.to(tl.float32)) - logz, log_any(b.to(tl.float32)) - logz,
            log_any(c.to(tl.float32)) - logz, log_any(d.to(tl.float32)) - logz)


@triton.jit
def _place(out_ids_ptr, out_vals_ptr, dst, id_dst, slots, cols_a, vals_a, live_a,
           cols_b, vals_b, live_b, cols_c, vals_c, live_c, cols_d, vals_d, live_d):
    """Store one peel step: values at dst + slot, ids at id_dst + slot unless
    id_dst is -1 (a bitmask row, whose words are its ids)."""
    ids = id_dst >= 0
    tl.store(out_vals_ptr + dst + slots, vals_a.to(tl.float32), mask=live_a)
    tl.store(out_vals_ptr + dst + slots + 1, vals_b.to(tl.float32), mask=live_b)
    tl.store(out_vals_ptr + dst + slots + 2, vals_c.to(tl.float32), mask=live_c)
    tl.store(out_vals_ptr + dst + slots + 3, vals_d.to(tl.float32), mask=live_d)
    tl.store(out_ids_ptr + id_dst + slots, cols_a, mask=tl.where(ids, live_a, False))
    tl.store(out_ids_ptr + id_dst + slots + 1, cols_b, mask=tl.where(ids, live_b, False))
    tl.store(out_ids_ptr + id_dst + slots + 2, cols_c, mask=tl.where(ids, live_c, False))
    tl.store(out_ids_ptr + id_dst + slots + 3, cols_d, mask=tl.where(ids, live_d, False))


@triton.jit
def _place_ring(ring_ids, ring_vals, id_dst, fits, slots, cols_a, vals_a, live_a,
                cols_b, vals_b, live_b, cols_c, vals_c, live_c, cols_d, vals_d, live_d):
    """The same peel step stored at the row's claimed place in the ring,
    where it fits (a scalar and-ed into a block mask through tl.where: the
    interpreter refuses `block & scalar`)."""
    _place(ring_ids, ring_vals, 0, id_dst, slots,
           cols_a, vals_a, tl.where(fits, live_a, False),
           cols_b, vals_b, tl.where(fits, live_b, False),
           cols_c, vals_c, tl.where(fits, live_c, False),
           cols_d, vals_d, tl.where(fits, live_d, False))


@triton.jit
def _peel(words, col_base):
    """Column of each word's lowest set bit, whether there was one, the rest."""
    live = words != 0
    lowest = words & (~words + 1)
    # a power of two converts to float exactly: its exponent is the bit index
    bit = (lowest.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    return col_base + bit, live, words & (words - 1)


def launch_expand_local(
    x: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor, n_chunks: int,
    out_ids: torch.Tensor, out_vals: torch.Tensor, pdl: bool = False,
) -> None:
    """expand_kernel, row-local: row b's kept ids and values at out[b * V:],
    from a bitmask of tuning.CHUNK-column chunks read at the call, as
    capture's candidate mark wrote it (``pdl``: launched as a programmatic
    dependent of the kernel before)."""
    batch, vocab = x.shape
    chunk = tuning.CHUNK
    group = max(1, tuning.EXPAND_WORDS // (chunk // WORD_BITS))
    launch(expand_kernel, (batch, triton.cdiv(n_chunks, group)),
        x, x.stride(0), vocab, bits, counts, n_chunks, counts, counts, counts, counts,
        out_ids, out_vals, 0, counts, counts, counts, ROW_LOCAL=True, PDL=pdl, CHUNK=chunk,
        GROUP=group, CHUNKS_PAD=triton.next_power_of_2(n_chunks), DIRECT=False,
        LOG_VALUES=False, num_warps=tuning.EXPAND_WARPS, **launch_options(pdl),
    )

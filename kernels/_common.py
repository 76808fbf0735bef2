"""Pieces shared by the kernel modules: statuses, forms, the result type,
argument checks, and the mark/scan/expand kernels (bitmask of kept entries,
then ids and values) that compaction and capture use.

Every result is exact rows, each in the cheaper of two forms (see Rows):
two CSR arrays over the batch, ``values`` (offsets) and ``ids``
(id_offsets), both offsets computed on the GPU, so copying
``ids[:id_offsets[B]]`` and ``values[:offsets[B]]`` moves only what the rows
hold, never a padded buffer.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .ring import ring_arrive, ring_claim, ring_commit

CHUNK = 8192  # columns per mark program (32 KiB of fp32 read per program)
WORD_BITS = 32
EXPAND_WORDS = 256  # bitmask words per expand program (8192 columns)


class Status(IntEnum):
    """Per-row status written by every kernel."""

    OK = 0  # row materialised in full (in one of the two forms)
    OVERFLOW = 1  # overflow="status" only: support larger than max_tokens; nothing written
    INVALID = 2  # sampled token outside the support, zero mass, non-finite input/logprob
    SKIPPED = 3  # row not opted in; nothing written, length 0


class Form(IntEnum):
    """How an OK row's ids travel (``Rows.forms``). An OK row of support size
    L is a bitmask iff ``L > max_tokens or 32 * L >= V``: its ids cost 4 L
    bytes and the bitmask 4 ceil(V / 32), and max_tokens bounds only the ids
    form (every kernel and reference applies this one rule)."""

    IDS = 0  # its L ascending int32 ids (CSR)
    BITMASK = 1  # ceil(V / 32) int32 words, bit j of word w <=> id 32 * w + j


OVERFLOW_POLICIES = ("exact", "status")


def bitmask_words(vocab: int) -> int:
    """Words of one bitmask row: ceil(V / 32)."""
    return (vocab + WORD_BITS - 1) // WORD_BITS


def longest_ids_row(max_tokens: int | None, vocab: int) -> int:
    """The most ids an ids-form row can hold (Form's rule: ``L <= max_tokens``
    and ``32 L < V``); max_tokens None (rows of unknown origin): the
    vocabulary's bound alone."""
    bound = (vocab - 1) // WORD_BITS
    return bound if max_tokens is None else min(max_tokens, bound)


@dataclass
class Rows:
    """Exact rows on the device, each in the cheaper of two forms.

    ``values[offsets[b]:offsets[b + 1]]`` are row b's kept values in ascending
    id order: the kept inputs (compaction) or ``log(w_i / sum(w))`` (capture),
    whatever the form. ``ids[id_offsets[b]:id_offsets[b + 1]]`` is row b's id
    data: its L ascending ids (``forms[b] == Form.IDS``) or ``ceil(V / 32)``
    bitmask words (``Form.BITMASK``; bits at ids >= V are zero). Rows that
    are not OK have neither. ``sizes`` is the true support size, also for
    OVERFLOW rows, so a server can say how far over ``max_tokens`` a row
    went. ``selected_logprob`` and ``tokens`` are set by capture and sample
    only. ``max_tokens`` is the kernel's argument (None for rows built
    elsewhere): publishing checks it against the Writer's SHMASK_MAX_TOKENS.
    """

    offsets: torch.Tensor  # int32[B + 1], into values
    lengths: torch.Tensor  # int32[B], support size L if status is OK, else 0
    status: torch.Tensor  # int32[B], Status values
    sizes: torch.Tensor  # int32[B]
    forms: torch.Tensor  # int32[B], Form values; 0 unless status is OK
    id_offsets: torch.Tensor  # int32[B + 1], into ids
    ids: torch.Tensor  # int32[capacity]; valid prefix is id_offsets[B]
    values: torch.Tensor  # float32[capacity]; valid prefix is offsets[B]
    vocab: int
    selected_logprob: torch.Tensor | None = None  # float32[B]
    tokens: torch.Tensor | None = None  # int32[B]
    max_tokens: int | None = None  # bounds an ids row's length (longest_ids_row)

    def row(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's ascending ids (a bitmask row decoded) and values; a host
        sync, for tests and debugging."""
        start, end = int(self.offsets[b]), int(self.offsets[b + 1])
        id_start, id_end = int(self.id_offsets[b]), int(self.id_offsets[b + 1])
        data = self.ids[id_start:id_end]
        if int(self.forms[b]) == Form.BITMASK:
            shifts = torch.arange(WORD_BITS, dtype=torch.int64, device=data.device)
            bits = (data.to(torch.int64)[:, None] >> shifts) & 1
            data = bits.reshape(-1).nonzero()[:, 0].to(torch.int32)
        return data, self.values[start:end]


def check_overflow(overflow: str) -> str:
    """"exact" (no row dropped) or "status" (rows past max_tokens OVERFLOW)."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    return overflow


def values_capacity(batch: int, vocab: int, max_tokens: int, overflow: str) -> int:
    """Entries of ``Rows.values`` that the worst case needs, known without a
    sync: every row the whole vocabulary (exact), or at most max_tokens per
    row (status: a larger row is OVERFLOW and writes nothing)."""
    return batch * (vocab if overflow == "exact" else min(max_tokens, vocab))


def pack_rows(
    kept: torch.Tensor, values: torch.Tensor, status: torch.Tensor, sizes: torch.Tensor,
    max_tokens: int, selected_logprob: torch.Tensor | None = None,
) -> Rows:
    """Rows from a dense kept mask [B, V] and dense values [B, V], in plain
    torch (the references' shared tail). ``status`` says which rows are OK;
    only their kept entries are packed."""
    batch, vocab = kept.shape
    device = kept.device
    ok = status == Status.OK
    kept = kept & ok[:, None]
    lengths = kept.sum(1).to(torch.int32)
    bitmask = ok & ((lengths > max_tokens) | (WORD_BITS * lengths >= vocab))
    forms = torch.where(bitmask, Form.BITMASK, Form.IDS).to(torch.int32)
    offsets = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(lengths, 0)
    n_words = bitmask_words(vocab)
    id_lengths = torch.where(bitmask, n_words, lengths)
    id_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    id_offsets[1:] = torch.cumsum(id_lengths, 0)
    row_idx, col_idx = kept.nonzero(as_tuple=True)  # row-major: ascending ids per row
    padded = torch.zeros(batch, n_words * WORD_BITS, dtype=torch.int64, device=device)
    padded[:, :vocab] = kept
    shifts = torch.arange(WORD_BITS, dtype=torch.int64, device=device)
    words = (padded.reshape(batch, n_words, WORD_BITS) << shifts).sum(2)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    pieces = [words[b] if bitmask[b] else col_idx[row_idx == b].to(torch.int32)
              for b in range(batch)]
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32, device=device)
    return Rows(offsets, lengths, status.to(torch.int32), sizes.to(torch.int32), forms,
                id_offsets, ids, values[row_idx, col_idx].float(), vocab, selected_logprob,
                max_tokens=max_tokens)


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_matrix(x: torch.Tensor, name: str) -> torch.Tensor:
    """A [B, V] float matrix with unit stride along V."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, V], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have V >= 1 columns, got {x.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x


def check_max_tokens(max_tokens: int, rows: int, vocab: int, overflow: str) -> int:
    """max_tokens, once the int32 offsets of the largest possible result are
    known to fit."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    check_overflow(overflow)
    entries = values_capacity(rows, vocab, max_tokens, overflow)
    if max(entries, rows * bitmask_words(vocab)) >= 2**31:
        raise ValueError(
            f"B = {rows} rows of up to {entries // max(rows, 1)} values (V = {vocab}, "
            f"max_tokens = {max_tokens}, overflow={overflow!r}) need {entries} entries; "
            "it must stay below 2**31 (int32 offsets): split the batch"
        )
    return max_tokens


def per_row(
    value: torch.Tensor | int | float | bool | None,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    name: str,
    default: float | int | bool,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Broadcast a scalar to [B] or check a [B] tensor.

    Range checks run on Python scalars only: checking a device tensor would
    cost a host sync per step. Out-of-range tensor values are clamped by the
    kernels' rules (documented per kernel).
    """
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).contiguous()
    if not isinstance(value, numbers.Real):  # a 0-d array, a string, a list...
        raise TypeError(f"{name} must be a number or a tensor of shape ({batch},), "
                        f"got {type(value).__name__}")
    if low is not None and not (low <= value):
        raise ValueError(f"{name}={value!r} is out of range; accepted: >= {low}")
    if high is not None and not (value <= high):
        raise ValueError(f"{name}={value!r} is out of range; accepted: <= {high}")
    return constant_rows(value, batch, dtype, device)


# Broadcast scalars, kept per (value, batch, dtype, device, stream): the
# kernels only read them, and a fill launch per setting per call cost about
# 4 us of GPU time and its host time in every capture (H200, 2026-12-02).
_CONSTANT_ROWS: dict[tuple[Any, ...], torch.Tensor] = {}
_CONSTANT_ROWS_KEPT = 64


def constant_rows(value: Any, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.full((batch,), value) that callers only read, made once per
    setting and stream. Not kept while a CUDA graph is being captured (its
    fill would run only when the graph is replayed)."""
    device = torch.device(device)
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.full((batch,), value, dtype=dtype, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (value, type(value), batch, dtype, device, stream)
    rows = _CONSTANT_ROWS.get(key)
    if rows is None:
        if len(_CONSTANT_ROWS) >= _CONSTANT_ROWS_KEPT:
            _CONSTANT_ROWS.clear()
        rows = _CONSTANT_ROWS[key] = torch.full((batch,), value, dtype=dtype, device=device)
    return rows


def row_mask(rows: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """Opt-in mask as int8[B] (1 = materialise the row)."""
    if rows is None:
        return constant_rows(1, batch, torch.int8, device)
    if rows.shape != (batch,):
        raise ValueError(f"rows must be a bool mask of shape ({batch},), got {tuple(rows.shape)}")
    if rows.dtype != torch.bool:
        raise TypeError(f"rows must be a bool mask, got {rows.dtype}")
    return rows.to(device=device, dtype=torch.int8)


# Predicates of the mark kernel.
KEEP_FINITE = 0  # logits: keep finite entries (-inf marks a dropped token)
KEEP_POSITIVE = 1  # weights: keep entries > 0
KEEP_AT_LEAST = 2  # probabilities: keep finite w > 0 whose float bits >= a per-row key


@triton.jit
def popcount(x):
    """Set bits of each uint32 (SWAR; no libdevice, so it also runs interpreted)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def row_status(size, opted, max_tokens, STATUS_ON_OVERFLOW: tl.constexpr):
    """Status of rows that cannot be INVALID (compaction): SKIPPED, then
    OVERFLOW (policy "status" only), else OK."""
    over = (size > max_tokens) & STATUS_ON_OVERFLOW
    return tl.where(opted, tl.where(over, 1, 0), 3)


@triton.jit
def is_bitmask(length, status, max_tokens, vocab):
    """The form rule (see Form): OK rows past max_tokens or with 32 L >= V
    travel as a bitmask."""
    return (status == 0) & ((length > max_tokens) | (length * 32 >= vocab))


@triton.jit
def after_previous(PDL: tl.constexpr):
    """Programmatic dependent launch (a kernel launched with ``launch_pdl``
    may start while the kernel before it runs): wait until the kernels
    before have finished and their writes are visible, then let the next
    kernel launch. Every program calls it before it reads what they wrote
    or writes anything, and before it exits, so that a kernel finishes
    only after those before it (the kernel after relies on that). Reads of
    the call's inputs, which no kernel of the chain writes, may come first,
    and so may reads from L2 (``.cg``) of what a kernel two or more launches
    back wrote: it finished before the kernel before this one began."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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

    LOG_VALUES (capture's rows with a large support, kernels/capture.py):
    the values stored are ``log(x) - logz[b]``, the support's logprobs."""
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
        # (capture's window pass gates rows by status alone: a form counts only
        # for an OK row)
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
def log_any(x):
    """ln x for every x >= 0, subnormal x too: Triton's log on NVIDIA GPUs
    is libdevice's with flush-to-zero, which takes a subnormal for 0 (and
    gives -inf), so such an x is scaled by 2^24 first and 24 ln 2 taken off."""
    tiny = x < 1.1754943508222875e-38  # below float32's smallest normal
    return tl.log(tl.where(tiny, x * 16777216.0, x)) - tl.where(tiny, 16.635532333438686, 0.0)


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


def pdl_default(device: torch.device) -> bool:
    """Programmatic dependent launch where the GPU has it (NVIDIA sm90+, not
    ROCm, whose gfx9 parts report major 9 too) and the kernels are compiled
    (Triton's interpreter has no grid dependencies)."""
    return (device.type == "cuda" and torch.version.hip is None and not _interpreted()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _interpreted() -> bool:
    """Whether launches run in Triton's interpreter (the knob kernels/__init__
    sets, or TRITON_INTERPRET set by the host before triton was imported)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return bool(getattr(runtime, "interpret", False)) or os.environ.get("TRITON_INTERPRET") == "1"


def launch_options(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def launch_mark(
    x: torch.Tensor, opt_in: torch.Tensor | None, key_floor: torch.Tensor | None, mode: int,
    chunk: int = CHUNK, num_warps: int = 4, pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Run mark_kernel; returns (bits, counts, n_chunks). ``opt_in`` None:
    every row."""
    batch, vocab = x.shape
    n_chunks = triton.cdiv(vocab, chunk)
    bits = torch.empty(batch * n_chunks * (chunk // WORD_BITS), dtype=torch.int32,
                       device=x.device)
    counts = torch.empty(batch * n_chunks, dtype=torch.int32, device=x.device)
    mark_kernel[(batch, n_chunks)](
        x, x.stride(0), vocab, counts if opt_in is None else opt_in,
        counts if key_floor is None else key_floor, bits, counts, n_chunks,
        MODE=mode, CHUNK=chunk, ALL_ROWS=opt_in is None, PDL=pdl, num_warps=num_warps,
        **launch_options(pdl),
    )
    return bits, counts, n_chunks


def launch_expand_local(
    x: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor, n_chunks: int,
    out_ids: torch.Tensor, out_vals: torch.Tensor, chunk: int = CHUNK, pdl: bool = False,
) -> None:
    """expand_kernel, row-local: row b's kept ids and values at out[b * V:]
    (``pdl``: launched as a programmatic dependent of the kernel before)."""
    batch, vocab = x.shape
    group = max(1, EXPAND_WORDS // (chunk // WORD_BITS))
    expand_kernel[(batch, triton.cdiv(n_chunks, group))](
        x, x.stride(0), vocab, bits, counts, n_chunks, counts, counts, counts, counts,
        out_ids, out_vals, 0, counts, counts, counts, ROW_LOCAL=True, PDL=pdl, CHUNK=chunk,
        GROUP=group, CHUNKS_PAD=triton.next_power_of_2(n_chunks), DIRECT=False,
        LOG_VALUES=False, num_warps=8, **launch_options(pdl),
    )

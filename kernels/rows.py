"""The result type of every kernel: exact rows on the device, each in the
cheaper of two forms (:class:`Form`), with a status per row.

Two CSR arrays over the batch, ``values`` (offsets) and ``ids``
(id_offsets), both offsets computed on the GPU, so copying
``ids[:id_offsets[B]]`` and ``values[:offsets[B]]`` moves only what the rows
hold, never a padded buffer. The form rule is stated once for the host
(:func:`pack_rows`, the references' tail) and once for the kernels
(:func:`is_bitmask`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl  # noqa: F401 (Triton's interpreter needs it in is_bitmask's globals)

WORD_BITS = 32


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


def values_capacity(batch: int, vocab: int, max_tokens: int, overflow: str) -> int:
    """Entries of ``Rows.values`` that the worst case needs, known without a
    sync: every row the whole vocabulary (exact), or at most max_tokens per
    row (status: a larger row is OVERFLOW and writes nothing)."""
    return batch * (vocab if overflow == "exact" else min(max_tokens, vocab))


def empty_rows(batch: int, vocab: int, max_tokens: int, overflow: str, device: torch.device,
               *, selected: bool, tokens: bool, values: bool = True,
               reuse: Hashable | None = None) -> tuple[Rows, tuple[torch.Tensor, ...]]:
    """A result for kernels to fill, and its three allocations (a plan's
    slots, kernels/launch_plan.py): the per-row arrays (offsets, id
    offsets, lengths, statuses, sizes, forms; ``selected``: selected
    logprobs; ``tokens``: sample's tokens), each at a multiple of 16 bytes
    (what Triton specializes pointers on) and cut by one split; the ids;
    the values (none without ``values``: rows that carry no values).
    Three, not one: a caller that keeps only the small arrays (the tokens)
    does not keep the values' B x V entries alive.

    ``reuse``: the call's (device, stream, thread) where a later call may
    take this result's memory once nothing else holds it (see
    ``REUSE_RESULTS``); None: fresh allocations."""
    if reuse is None or not REUSE_RESULTS:
        buffers = _allocate(batch, vocab, max_tokens, overflow, device, selected, tokens, values)
        return _rows(_cut(buffers, batch, vocab, max_tokens, overflow, selected, tokens, values),
                     vocab, max_tokens), buffers
    key = (reuse, vocab, max_tokens, overflow, selected, tokens, values)
    kept = _results.get(key)
    if not kept or kept[0].capacity < batch:
        with _RESULTS_LOCK:  # (other threads add and drop their own shapes)
            kept = _results[key] = []  # a larger batch: the smaller buffers go back to torch
            while len(_results) > RESULTS_SHAPES:
                del _results[next(iter(_results))]  # the oldest shape's go back
    for entry in kept:
        if entry.free():
            if entry.batch != batch:
                entry.hold(batch, _cut(entry.buffers, batch, vocab, max_tokens, overflow,
                                       selected, tokens, values))
            return _rows(entry.fields, vocab, max_tokens), entry.buffers
    capacity = triton.next_power_of_2(batch)
    buffers = _allocate(capacity, vocab, max_tokens, overflow, device, selected, tokens, values)
    fields = _cut(buffers, batch, vocab, max_tokens, overflow, selected, tokens, values)
    if len(kept) < RESULTS_KEPT:
        entry = _KeptResult(capacity, buffers)
        entry.hold(batch, fields)
        kept.append(entry)
    return _rows(fields, vocab, max_tokens), buffers


def _small_words(batch: int, selected: bool, tokens: bool) -> dict[str, int]:
    return {"offsets": batch + 1, "id_offsets": batch + 1, "lengths": batch, "status": batch,
            "sizes": batch, "forms": batch, "selected": batch if selected else 0,
            "tokens": batch if tokens else 0}


def _allocate(batch: int, vocab: int, max_tokens: int, overflow: str, device: torch.device,
              selected: bool, tokens: bool,
              values: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """empty_rows' three allocations for ``batch`` rows (the per-row arrays
    each padded to 16 bytes)."""
    words = sum(n + -n % 4 for n in _small_words(batch, selected, tokens).values())
    return (torch.empty(words, dtype=torch.int32, device=device),
            torch.empty(batch * bitmask_words(vocab), dtype=torch.int32, device=device),
            torch.empty(values_capacity(batch, vocab, max_tokens, overflow) if values else 0,
                        dtype=torch.float32, device=device))


def _cut(buffers: tuple[torch.Tensor, ...], batch: int, vocab: int, max_tokens: int,
         overflow: str, selected: bool, tokens: bool,
         has_values: bool) -> tuple[torch.Tensor | None, ...]:
    """The tensors of a Rows of ``batch`` rows (in _FIELDS' order) over
    buffers made for at least as many."""
    small, ids, values = buffers
    words = _small_words(batch, selected, tokens)
    pieces: list[int] = []
    index: list[int] = []  # where each array is among the pieces (its padding after it)
    for n in words.values():
        index.append(len(pieces))
        pieces += [n, -n % 4] if n % 4 else [n]
    pieces.append(small.shape[0] - sum(pieces))  # what a smaller batch leaves of the buffer
    parts = small.split(pieces)
    arrays = {name: parts[i] for name, i in zip(words, index, strict=True)}
    ids_needed = batch * bitmask_words(vocab)
    values_needed = values_capacity(batch, vocab, max_tokens, overflow) if has_values else 0
    return (arrays["offsets"], arrays["lengths"], arrays["status"], arrays["sizes"],
            arrays["forms"], arrays["id_offsets"],
            ids if ids.shape[0] == ids_needed else ids[:ids_needed],
            values if values.shape[0] == values_needed else values[:values_needed],
            arrays["selected"].view(torch.float32) if selected else None,
            arrays["tokens"] if tokens else None)


def _rows(fields: tuple[torch.Tensor | None, ...], vocab: int, max_tokens: int) -> Rows:
    offsets, lengths, status, sizes, forms, id_offsets, ids, values, selected, tokens = fields
    assert ids is not None and values is not None
    return Rows(offsets, lengths, status, sizes, forms, id_offsets, ids, values,  # type: ignore[arg-type]
                vocab, selected, tokens, max_tokens=max_tokens)


# ------------------------------------------------------------ results reused
# An eager call's result is three allocations and the cut of the smallest
# into per-row arrays: about half of a capture's host time on the H200
# (issue 35; the caching allocator's own bookkeeping varies with what ran
# between). A call that a plan may serve (its device, stream and thread
# known: kernels/launch_plan.call_stream) keeps its result, at most
# RESULTS_KEPT per call shape, in buffers sized for the largest batch seen
# (a power of two), and hands it to a later call of that shape once nothing
# else holds any part of it: not the Rows, not any of its tensors, not any
# view of their memory, not their storages (Python's reference counts and
# torch's storage use counts back to what they were when only this cache
# held them). The later
# call runs on the same stream, so the GPU runs its writes after all work
# queued there that used the rows, as the caching allocator orders a freed
# block's reuse; work the caller queued on another stream must hold the
# rows until it is done (as it must for the allocator: record_stream).
REUSE_RESULTS = True  # benchmarks switch it off to measure what it saves
RESULTS_KEPT = 2  # a caller may hold one step's rows while the next is made
RESULTS_SHAPES = 16  # call shapes (stream, thread, V, max_tokens, ...) kept at most
_results: dict[Hashable, list[_KeptResult]] = {}
_RESULTS_LOCK = threading.Lock()


def release_results() -> None:
    """Drop every kept result (the memory goes back to torch's allocator
    once no caller holds it)."""
    _results.clear()


class _KeptResult:
    """One kept result: its buffers, the tensors of the Rows last cut from
    them (each call gets a Rows of its own over them: a caller holding a
    Rows holds its tensors), and the reference counts that say only this
    cache holds them."""

    __slots__ = ("capacity", "buffers", "storages", "handles", "batch", "fields", "held",
                 "alone")

    def __init__(self, capacity: int, buffers: tuple[torch.Tensor, ...]) -> None:
        self.capacity = capacity
        self.buffers = buffers
        # each buffer's storage: torch keeps one Python object a storage (a
        # caller asking for it gets this one, so holding it shows in its
        # reference count) and counts the storage's users (a view of a buffer
        # anywhere is one); read once, they live as long as this entry
        self.storages = tuple(buffer.untyped_storage() for buffer in buffers)
        self.handles = tuple(storage._cdata for storage in self.storages)

    def hold(self, batch: int, fields: tuple[torch.Tensor | None, ...]) -> None:
        """Keep ``fields``, a result of ``batch`` rows (before any Rows is
        made of them: the counts taken now are those of a moment when only
        this cache holds them)."""
        self.batch = batch
        self.fields = fields
        self.held = tuple(field for field in fields if field is not None)  # (None's count
        # moves with everything else)
        self.alone = self._counts()

    def free(self) -> bool:
        """Whether nothing but this cache holds any part of the result."""
        return self._counts() == self.alone

    def _counts(self) -> tuple[int, ...]:
        """The Python references to each field, buffer and buffer's storage,
        and the users of each storage (every eager call asks: no loop in
        Python)."""
        return (*map(sys.getrefcount, self.held), *map(sys.getrefcount, self.buffers),
                *map(sys.getrefcount, self.storages),
                *map(torch._C._storage_Use_Count, self.handles))


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


@triton.jit
def is_bitmask(length, status, max_tokens, vocab):
    """The form rule (see Form): OK rows past max_tokens or with 32 L >= V
    travel as a bitmask."""
    return (status == 0) & ((length > max_tokens) | (length * 32 >= vocab))

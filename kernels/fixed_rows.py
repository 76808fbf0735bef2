"""Rows as an engine's fixed-capacity matrices: ``Rows`` (CSR, ascending
ids, either form) to ``ids[R, cap]`` / ``values[R, cap]`` plus a length per
row, in ascending id order or in the engine's order (descending weight).

Engines that already move a fixed-capacity result (SGLang 0.5.23's
``SamplingMaskOutput``: ``torch.topk(weights, k=cap, sorted=True)`` over
every captured row) keep their host copy and readers unchanged and take
shmask's capture underneath (shmask/adapters/sglang_sampler.py). One
program per output row:

1. its ids (an ids row copied, a bitmask row expanded: per word its set
   bits in order, each word's first position the exclusive scan of the
   words' popcounts) and values, ascending, into its matrix row;
2. ``order="engine"``: the row re-read (in a block of SMALL_SORT entries
   when it fits, else one of the capacity), each id's weight gathered from the
   input ``weights[b, id]`` (the float32 value every cutoff compared), and
   the row sorted by one int64 key per entry, ``(weight bits << 32) |
   (2^31 - 1 - position)``: a positive float32's bits order as its value,
   so the sort is by descending weight and, among equal weights, by
   ascending id (the position in the ascending row). Sorting by the
   weight, not the logprob, keeps the engine's order where two weights
   round to one logprob.

Rows that are not OK get length 0 and nothing written. Entries past a row's
length are zero (the matrices start zeroed), so a copy of them is
deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .float_bits import popcount
from .launch import launch
from .rows import WORD_BITS, Rows, Status

__all__ = ["ORDERS", "SORT_LIMIT", "fixed_rows", "reference_fixed_rows"]

ORDERS = ("engine", "ascending")
# The widest row one program sorts in registers (int64 keys); a wider
# capacity sorts with torch.sort over the matrix instead (same keys).
SORT_LIMIT = 16384
# Rows this short sort in a block of this size, whatever the capacity.
SMALL_SORT = 1024
_BLOCK = 1024
_POSITION_MASK = 0x7FFFFFFF


@triton.jit
def _fixed_rows_kernel(status_ptr, forms_ptr, lengths_ptr, id_offsets_ptr, offsets_ptr,
                       ids_ptr, values_ptr, weights_ptr, weights_stride, batch_rows_ptr,
                       out_ids_ptr, out_values_ptr, out_lengths_ptr, cap, vocab,
                       BLOCK: tl.constexpr, SORT: tl.constexpr, SORT_BLOCK: tl.constexpr,
                       SMALL_BLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = tl.load(batch_rows_ptr + r).to(tl.int64)
    ok = tl.load(status_ptr + b) == 0
    length = tl.where(ok, tl.minimum(tl.load(lengths_ptr + b), cap), 0)
    tl.store(out_lengths_ptr + r, length)
    if length > 0:
        id_start = tl.load(id_offsets_ptr + b).to(tl.int64)
        start = tl.load(offsets_ptr + b).to(tl.int64)
        row = r.to(tl.int64) * cap
        if tl.load(forms_ptr + b) == 0:  # Form.IDS: the ids as they are
            for first in range(0, length, BLOCK):
                j = first + tl.arange(0, BLOCK)
                inside = j < length
                tl.store(out_ids_ptr + row + j, tl.load(ids_ptr + id_start + j, mask=inside),
                         mask=inside)
                tl.store(out_values_ptr + row + j, tl.load(values_ptr + start + j, mask=inside),
                         mask=inside)
        else:  # Form.BITMASK: each word's set bits, in order
            n_words = (vocab + 31) // 32
            base = 0
            for first in range(0, n_words, BLOCK):
                k = first + tl.arange(0, BLOCK)
                words = tl.load(ids_ptr + id_start + k, mask=k < n_words, other=0)
                words = words.to(tl.uint32, bitcast=True)
                counts = popcount(words)
                position = base + tl.cumsum(counts, 0) - counts
                for bit in tl.static_range(32):
                    present = ((words >> bit) & 1) != 0
                    keep = present & (position < cap)
                    tl.store(out_ids_ptr + row + position, k * 32 + bit, mask=keep)
                    tl.store(out_values_ptr + row + position,
                             tl.load(values_ptr + start + position, mask=keep), mask=keep)
                    position += present.to(tl.int32)
                base += tl.sum(counts, 0)
        if SORT:
            tl.debug_barrier()  # step 1's stores are read back by other threads
            # A sort costs its block, not the row: rows that fit the small
            # block (top-k 1000 rows at a cap of 4096) sort 4x fewer keys.
            if length <= SMALL_BLOCK:
                _sort_row(out_ids_ptr, out_values_ptr, weights_ptr + b * weights_stride, row,
                          length, SMALL_BLOCK)
            else:
                _sort_row(out_ids_ptr, out_values_ptr, weights_ptr + b * weights_stride, row,
                          length, SORT_BLOCK)


@triton.jit
def _sort_row(out_ids_ptr, out_values_ptr, weights_row_ptr, row, length, BLOCK: tl.constexpr):
    """One matrix row, its first ``length`` entries ascending by id, sorted
    in place by descending weight (ties by ascending id)."""
    j = tl.arange(0, BLOCK)
    inside = j < length
    ids = tl.load(out_ids_ptr + row + j, mask=inside, other=0)
    weight = tl.load(weights_row_ptr + ids, mask=inside, other=0)
    bits = weight.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(inside, (bits << 32) | (0x7FFFFFFF - j), -1)
    key = tl.sort(key, descending=True)
    source = 0x7FFFFFFF - (key & 0x7FFFFFFF)
    sorted_ids = tl.load(out_ids_ptr + row + source, mask=inside)
    sorted_values = tl.load(out_values_ptr + row + source, mask=inside)
    tl.debug_barrier()  # every thread has read before any overwrites
    tl.store(out_ids_ptr + row + j, sorted_ids, mask=inside)
    tl.store(out_values_ptr + row + j, sorted_values, mask=inside)


def _check(rows: Rows, weights: torch.Tensor, batch_rows: torch.Tensor, cap: int,
           order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if type(cap) is not int or cap < 1:
        raise ValueError(f"cap (entries per row) must be an int >= 1, got {cap!r}")
    if weights.dim() != 2 or weights.shape[1] != rows.vocab or weights.stride(1) != 1:
        raise ValueError(f"weights must be [B, {rows.vocab}] with unit column stride (the "
                         f"rows' input), got shape {tuple(weights.shape)}, "
                         f"strides {weights.stride()}")
    if weights.shape[0] != rows.lengths.numel():
        raise ValueError(f"weights has {weights.shape[0]} rows; the rows have "
                         f"{rows.lengths.numel()}")
    if batch_rows.dim() != 1 or batch_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"batch_rows must be a 1-D int32/int64 tensor, got "
                         f"{batch_rows.dtype} of shape {tuple(batch_rows.shape)}")
    if batch_rows.device != rows.ids.device or weights.device != rows.ids.device:
        raise ValueError(f"batch_rows ({batch_rows.device}) and weights ({weights.device}) "
                         f"must be on the rows' device ({rows.ids.device})")


def fixed_rows(rows: Rows, weights: torch.Tensor, batch_rows: torch.Tensor, cap: int,
               order: str = "engine") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids int32[R, cap], values float32[R, cap], lengths int32[R])``:
    output row r is ``rows``' row ``batch_rows[r]``, its first
    ``lengths[r]`` entries its ids and values (``order="engine"``: by
    descending ``weights[b, id]``, ties by ascending id; ``"ascending"``:
    by id). An OK row longer than ``cap`` keeps its first ``cap`` entries
    (capture's ``overflow="status"`` with ``max_tokens <= cap`` has none);
    other rows have length 0. ``weights`` is the [B, V] input the rows were
    captured from. ``batch_rows`` is trusted to hold row numbers in [0, B)
    (the engine's own index of its opted-in rows)."""
    _check(rows, weights, batch_rows, cap, order)
    count = batch_rows.numel()
    device = rows.ids.device
    out_ids = torch.zeros((count, cap), dtype=torch.int32, device=device)
    out_values = torch.zeros((count, cap), dtype=torch.float32, device=device)
    lengths = torch.zeros(count, dtype=torch.int32, device=device)
    if count == 0:
        return out_ids, out_values, lengths
    in_kernel = order == "engine" and cap <= SORT_LIMIT
    sort_block = triton.next_power_of_2(cap) if in_kernel else 1
    launch(_fixed_rows_kernel, (count,), rows.status, rows.forms, rows.lengths, rows.id_offsets,
           rows.offsets, rows.ids, rows.values, weights, weights.stride(0), batch_rows,
           out_ids, out_values, lengths, cap, rows.vocab, BLOCK=_BLOCK, SORT=in_kernel,
           SORT_BLOCK=sort_block, SMALL_BLOCK=min(SMALL_SORT, sort_block))
    if order == "engine" and not in_kernel:
        _sort_rows(out_ids, out_values, lengths, weights, batch_rows)
    return out_ids, out_values, lengths


def _sort_rows(out_ids: torch.Tensor, out_values: torch.Tensor, lengths: torch.Tensor,
               weights: torch.Tensor, batch_rows: torch.Tensor) -> None:
    """The kernel's sort for capacities past SORT_LIMIT, with torch (the
    same keys)."""
    position = torch.arange(out_ids.shape[1], device=out_ids.device)
    inside = position[None, :] < lengths[:, None]
    weight = weights.index_select(0, batch_rows.long()).gather(1, out_ids.long())
    bits = weight.float().view(torch.int32).long()
    key = torch.where(inside, (bits << 32) | (_POSITION_MASK - position[None, :]), -1)
    key = key.sort(dim=1, descending=True).values
    source = (_POSITION_MASK - (key & _POSITION_MASK)).clamp(max=out_ids.shape[1] - 1)
    out_ids.copy_(torch.where(inside, out_ids.gather(1, source), 0))
    out_values.copy_(torch.where(inside, out_values.gather(1, source), 0.0))


def reference_fixed_rows(rows: Rows, weights: torch.Tensor, batch_rows: torch.Tensor, cap: int,
                         order: str = "engine") -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """:func:`fixed_rows` row by row on the host (``Rows.row`` decodes)."""
    _check(rows, weights, batch_rows, cap, order)
    count = batch_rows.numel()
    out_ids = torch.zeros((count, cap), dtype=torch.int32)
    out_values = torch.zeros((count, cap), dtype=torch.float32)
    lengths = torch.zeros(count, dtype=torch.int32)
    for r, b in enumerate(batch_rows.tolist()):
        if int(rows.status[b]) != Status.OK:
            continue
        ids, values = (t.cpu() for t in rows.row(b))
        ids, values = ids[:cap], values[:cap]
        if order == "engine":
            weight = weights[b].cpu().float()[ids.long()].tolist()
            ranked = sorted(range(ids.numel()), key=lambda i: (-weight[i], int(ids[i])))
            ids, values = ids[ranked], values[ranked]
        lengths[r] = ids.numel()
        out_ids[r, :ids.numel()] = ids
        out_values[r, :ids.numel()] = values
    return out_ids, out_values, lengths


assert WORD_BITS == 32  # the kernel's bit loop

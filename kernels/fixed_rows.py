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
   words' popcounts) and values, ascending, into its matrix row, and
   zeros past its length; an ids row that sorts in parts (below) is left
   where it is, in the rows' CSR, for the parts to read;
2. ``order="engine"``: the row re-read (in a block of SMALL_SORT entries
   when it fits, else of twice that when it fits; a longer row in parts
   of SORT_PART entries, a program each, which a second launch merges:
   an entry's place is its place in its part plus, in each other part,
   the count of keys above its own), each id's weight gathered from the
   input ``weights[b, id]`` (the float32 value every cutoff compared), and
   the row sorted by one int64 key per entry, ``(weight bits << 32) |
   (2^31 - 1 - position)``: a positive float32's bits order as its value,
   so the sort is by descending weight and, among equal weights, by
   ascending id (the position in the ascending row). Sorting by the
   weight, not the logprob, keeps the engine's order where two weights
   round to one logprob.

Rows that are not OK get length 0 and only zeros. Entries past a row's
length are zero (the first kernel writes them: the matrices are not
zeroed first), so a copy of them is deterministic. Calls of one shape
replay their launches from a plan (kernels/launch_plan.py), as capture's do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import launch_plan
from .float_bits import popcount
from .launch import launch
from .rows import WORD_BITS, Rows, Status, bitmask_words

__all__ = ["ORDERS", "SORT_LIMIT", "fixed_rows", "reference_fixed_rows", "reference_spill_rows",
           "spill_rows"]

ORDERS = ("engine", "ascending")
# The widest row one program sorts in registers (int64 keys); a wider
# capacity sorts with torch.sort over the matrix instead (same keys).
SORT_LIMIT = 16384
# Rows this short sort in a block of this size, whatever the capacity.
SMALL_SORT = 1024
_BLOCK = 1024
# Warps a program of the first kernel. On an H100 (B 256, cap 4,096, one
# row a program; rows the same bits at every value), us at 4 / 8 / 16
# warps when it still sorted every row: top_k 1000 rows 34.7-80.0 /
# 27.3-72.8 / 26.2-50.8, top_k 4096 rows (fp32 s1) 188.7 / 186.9 / 198.7.
# With the parts taking the rows past the middle block, 8 / 16: top_k 1000
# rows 27.4-70.7 / 25.9-47.8, top_k 4096 rows 106.1 / 105.9 (the whole call).
SORT_WARPS = 16
# Rows longer than the middle block sort in parts of SORT_PART entries, a
# program a part (PART_WARPS warps), and a second launch merges them. On an
# H100 (B 256, cap 4,096, us; the rows the same bits): top_k 4096 rows 187.8
# in one program a row -> 117.8 in parts of 1,024 at 16 warps (132.6 at 8,
# 174.1 at 4; parts of 512: 140.9 at 8), the mix's 175.6 -> 81.1; top_k
# 1000 rows pay the two launches, 70.8 -> 81.2 at most.
SORT_PART = 1024
PART_WARPS = 16
# Warps a program of the merge. 8 on an H100: top_k 4096 rows (fp32 s1)
# 109.8 us a call against 106.1, the mix's 66.1 against 67.1.
MERGE_WARPS = 16
_POSITION_MASK = 0x7FFFFFFF


@triton.jit
def _fixed_rows_kernel(status_ptr, forms_ptr, lengths_ptr, id_offsets_ptr, offsets_ptr,
                       ids_ptr, values_ptr, weights_ptr, weights_stride, batch_rows_ptr,
                       out_ids_ptr, out_values_ptr, out_lengths_ptr, cap, vocab,
                       BLOCK: tl.constexpr, SORT: tl.constexpr, SMALL_BLOCK: tl.constexpr,
                       MIDDLE_BLOCK: tl.constexpr, LONG_DIRECT: tl.constexpr):
    r = tl.program_id(0)
    b = tl.load(batch_rows_ptr + r).to(tl.int64)
    ok = tl.load(status_ptr + b) == 0
    length = tl.where(ok, tl.minimum(tl.load(lengths_ptr + b), cap), 0)
    tl.store(out_lengths_ptr + r, length)
    row = r.to(tl.int64) * cap
    # the matrices come uninitialised: zeros past the row's length
    for first in range((length // BLOCK) * BLOCK, cap, BLOCK):
        j = first + tl.arange(0, BLOCK)
        past = (j >= length) & (j < cap)
        tl.store(out_ids_ptr + row + j, 0, mask=past)
        tl.store(out_values_ptr + row + j, 0.0, mask=past)
    if length > 0:
        id_start = tl.load(id_offsets_ptr + b).to(tl.int64)
        start = tl.load(offsets_ptr + b).to(tl.int64)
        if tl.load(forms_ptr + b) == 0:  # Form.IDS: the ids as they are
            # (a row the parts sort straight from the CSR: nothing here)
            copied = tl.where(LONG_DIRECT & (length > MIDDLE_BLOCK), 0, length)
            for first in range(0, copied, BLOCK):
                j = first + tl.arange(0, BLOCK)
                inside = j < copied
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
            # block (top-k 1000 rows at a cap of 4096) sort 4x fewer keys,
            # and those that fit twice it (top-k 1000 rows with ties past
            # 1,024, which bf16 weights make common) 2x fewer.
            if length <= SMALL_BLOCK:
                _sort_row(out_ids_ptr, out_values_ptr, weights_ptr + b * weights_stride, row,
                          length, SMALL_BLOCK)
            elif length <= MIDDLE_BLOCK:
                _sort_row(out_ids_ptr, out_values_ptr, weights_ptr + b * weights_stride, row,
                          length, MIDDLE_BLOCK)
            # a longer row: the part kernels below sort it


@triton.jit
def _sort_row(out_ids_ptr, out_values_ptr, weights_row_ptr, row, length, BLOCK: tl.constexpr):
    """One matrix row, its first ``length`` entries ascending by id, sorted
    in place by descending weight (ties by ascending id)."""
    j = tl.arange(0, BLOCK)
    inside = j < length
    _, source = _sorted_keys(out_ids_ptr + row, weights_row_ptr, j, inside)
    sorted_ids = tl.load(out_ids_ptr + row + source, mask=inside)
    sorted_values = tl.load(out_values_ptr + row + source, mask=inside)
    tl.debug_barrier()  # every thread has read before any overwrites
    tl.store(out_ids_ptr + row + j, sorted_ids, mask=inside)
    tl.store(out_values_ptr + row + j, sorted_values, mask=inside)


@triton.jit
def _sorted_keys(row_ids_ptr, weights_row_ptr, j, inside):
    """The row's entries (its ascending ids at ``row_ids_ptr``) at positions
    ``j`` (where ``inside``) as keys ``(weight bits << 32) | (2^31 - 1 -
    position)``, sorted descending (-1 for the others, last), and each
    sorted key's position in the row."""
    ids = tl.load(row_ids_ptr + j, mask=inside, other=0)
    weight = tl.load(weights_row_ptr + ids, mask=inside, other=0)
    bits = weight.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.sort(tl.where(inside, (bits << 32) | (0x7FFFFFFF - j), -1), descending=True)
    return key, 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit
def _part_sort_kernel(lengths_ptr, forms_ptr, id_offsets_ptr, offsets_ptr, ids_ptr, values_ptr,
                      out_ids_ptr, out_values_ptr, weights_ptr, weights_stride,
                      batch_rows_ptr, keys_ptr, part_ids_ptr, part_values_ptr, cap,
                      LONG: tl.constexpr, PART: tl.constexpr, SORT_BLOCK: tl.constexpr):
    """Part q (entries [q PART, (q + 1) PART)) of a row longer than LONG,
    ascending (an ids row in the rows' CSR, a bitmask row in its matrix
    row, where the first kernel expanded it): sorted by the row's keys
    (descending), the keys (-1 past the row) and the part's ids and
    values in that order into the row's slots of the scratch matrices."""
    r = tl.program_id(0)
    q = tl.program_id(1)
    length = tl.load(lengths_ptr + r)
    if length > LONG:
        b = tl.load(batch_rows_ptr + r).to(tl.int64)
        row = r.to(tl.int64) * cap
        row_ids_ptr = out_ids_ptr + row
        row_values_ptr = out_values_ptr + row
        if tl.load(forms_ptr + b) == 0:  # Form.IDS: the first kernel left it in the CSR
            row_ids_ptr = ids_ptr + tl.load(id_offsets_ptr + b).to(tl.int64)
            row_values_ptr = values_ptr + tl.load(offsets_ptr + b).to(tl.int64)
        j = q * PART + tl.arange(0, PART)
        key, source = _sorted_keys(row_ids_ptr, weights_ptr + b * weights_stride, j, j < length)
        real = key >= 0
        slot = r.to(tl.int64) * SORT_BLOCK + q * PART + tl.arange(0, PART)
        tl.store(keys_ptr + slot, key)
        tl.store(part_ids_ptr + slot, tl.load(row_ids_ptr + source, mask=real), mask=real)
        tl.store(part_values_ptr + slot, tl.load(row_values_ptr + source, mask=real), mask=real)


@triton.jit
def _part_merge_kernel(lengths_ptr, out_ids_ptr, out_values_ptr, keys_ptr, part_ids_ptr,
                       part_values_ptr, cap, LONG: tl.constexpr, PART: tl.constexpr,
                       PARTS: tl.constexpr, SORT_BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Part q's entries of a row longer than LONG to their places in the
    row's engine order: an entry's place is its index in its sorted part
    plus, in every other part, the count of keys above its own (a binary
    search of that part's descending keys; keys are unique: the position
    is in them)."""
    r = tl.program_id(0)
    q = tl.program_id(1)
    length = tl.load(lengths_ptr + r)
    if length > LONG:
        base = r.to(tl.int64) * SORT_BLOCK
        i = tl.arange(0, PART)
        key = tl.load(keys_ptr + base + q * PART + i)
        real = key >= 0
        place = i
        for p in tl.static_range(PARTS):
            # the first index of part p whose key is below this one
            lo = tl.zeros([PART], dtype=tl.int32)
            hi = tl.full([PART], PART, tl.int32)
            search = tl.where((q != p) & (length > p * PART), real, False)
            for _ in tl.static_range(STEPS):  # log2(PART) + 1: hi - lo from PART to 0
                open_ = search & (lo < hi)
                mid = (lo + hi) // 2
                above = tl.load(keys_ptr + base + p * PART + mid, mask=open_, other=-1) > key
                lo = tl.where(open_ & above, mid + 1, lo)
                hi = tl.where(open_ & ~above, mid, hi)
            place += tl.where(search, lo, 0)
        slot = base + q * PART + i
        row = r.to(tl.int64) * cap
        tl.store(out_ids_ptr + row + place, tl.load(part_ids_ptr + slot, mask=real), mask=real)
        tl.store(out_values_ptr + row + place, tl.load(part_values_ptr + slot, mask=real),
                 mask=real)


@triton.jit
def _spill_kernel(status_ptr, lengths_ptr, id_offsets_ptr, offsets_ptr, ids_ptr, values_ptr,
                  batch_rows_ptr, value_slots_ptr, out_bits_ptr, out_lengths_ptr, out_values_ptr,
                  cap, vocab, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    first = tl.program_id(1).to(tl.int64) * BLOCK
    b = tl.load(batch_rows_ptr + c).to(tl.int64)
    length = tl.load(lengths_ptr + b)
    spilled = (tl.load(status_ptr + b) == 0) & (length > cap)
    length = tl.where(spilled, length, 0)
    if first == 0:
        tl.store(out_lengths_ptr + c, length)
    n_words = (vocab + 31) // 32
    j = first + tl.arange(0, BLOCK)
    if first < n_words:  # a spilled row is a bitmask row: its words as they are
        id_start = tl.load(id_offsets_ptr + b).to(tl.int64)
        words = tl.load(ids_ptr + id_start + j, mask=j < tl.where(spilled, n_words, 0), other=0)
        tl.store(out_bits_ptr + c.to(tl.int64) * n_words + j, words, mask=j < n_words)
    slot = tl.load(value_slots_ptr + c).to(tl.int64)
    if slot >= 0:  # a support-mode row: its values, ascending by id, zeros after
        start = tl.load(offsets_ptr + b).to(tl.int64)
        values = tl.load(values_ptr + start + j, mask=j < length, other=0.0)
        tl.store(out_values_ptr + slot * vocab + j, values, mask=j < vocab)


def spill_rows(rows: Rows, batch_rows: torch.Tensor, cap: int, value_slots: torch.Tensor,
               value_count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows too long for an engine's fixed capacity, in fixed-size form
    (so copying them to the host needs no sync to size the copy):
    ``(bits int32[C, ceil(V / 32)], lengths int32[C], values float32[S, V] or
    None)``. Entry c is ``rows``' row ``batch_rows[c]``: if it is OK and
    longer than ``cap`` (so a bitmask row, when ``max_tokens <= cap``), its
    bitmask words and its length; else zeros and length 0. ``value_slots[c]``
    >= 0 puts that row's values (ascending by id, zeros past its length) in
    row ``value_slots[c]`` of ``values`` (``value_count`` rows; None when 0)."""
    if type(cap) is not int or cap < 1:
        raise ValueError(f"cap (entries per row) must be an int >= 1, got {cap!r}")
    if rows.max_tokens is None or rows.max_tokens > cap:
        raise ValueError(f"the rows' max_tokens ({rows.max_tokens}) must be at most cap ({cap}): "
                         "an ids row longer than cap would not be a bitmask")
    count, vocab = batch_rows.numel(), rows.vocab
    if value_slots.shape != batch_rows.shape:
        raise ValueError(f"value_slots {tuple(value_slots.shape)} must match batch_rows "
                         f"{tuple(batch_rows.shape)}")
    device = rows.ids.device
    bits = torch.empty((count, bitmask_words(vocab)), dtype=torch.int32, device=device)
    lengths = torch.empty(count, dtype=torch.int32, device=device)
    values = (torch.empty((value_count, vocab), dtype=torch.float32, device=device)
              if value_count else None)
    if count:
        launch(_spill_kernel, (count, triton.cdiv(vocab, _BLOCK)), rows.status, rows.lengths,
               rows.id_offsets, rows.offsets, rows.ids, rows.values, batch_rows, value_slots,
               bits, lengths, bits if values is None else values, cap, vocab, BLOCK=_BLOCK)
    return bits, lengths, values


def reference_spill_rows(rows: Rows, batch_rows: torch.Tensor, cap: int,
                         value_slots: torch.Tensor, value_count: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`spill_rows` row by row on the host (``Rows.row`` decodes)."""
    words = bitmask_words(rows.vocab)
    bits = torch.zeros((batch_rows.numel(), words), dtype=torch.int32)
    lengths = torch.zeros(batch_rows.numel(), dtype=torch.int32)
    values = torch.zeros((value_count, rows.vocab)) if value_count else None
    for c, (b, slot) in enumerate(zip(batch_rows.tolist(), value_slots.tolist(), strict=True)):
        if int(rows.status[b]) != Status.OK or int(rows.lengths[b]) <= cap:
            continue
        ids, row_values = (t.cpu() for t in rows.row(b))
        lengths[c] = ids.numel()
        word = torch.zeros(words * WORD_BITS, dtype=torch.int64)
        word[ids.long()] = 1
        packed = (word.view(words, WORD_BITS) << torch.arange(WORD_BITS)).sum(1)
        bits[c] = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
        if slot >= 0 and values is not None:
            values[slot, :ids.numel()] = row_values
    return bits, lengths, values


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
    # not zeroed: the first kernel writes every entry (zeros past a length)
    out_ids = torch.empty((count, cap), dtype=torch.int32, device=device)
    out_values = torch.empty((count, cap), dtype=torch.float32, device=device)
    lengths = torch.empty(count, dtype=torch.int32, device=device)
    if count == 0:
        return out_ids, out_values, lengths
    in_kernel = order == "engine" and cap <= SORT_LIMIT
    sort_block = triton.next_power_of_2(cap) if in_kernel else 1
    middle = min(2 * SMALL_SORT, sort_block)
    # rows past the middle block: sorted in parts, a program each, then merged
    part = min(SORT_PART, sort_block)
    parts = sort_block // part if in_kernel and sort_block > middle else 0
    # the parts' one allocation: each entry's key (int64), then ids, then values
    scratch = (torch.empty(count * sort_block * 4, dtype=torch.int32, device=device)
               if parts else None)
    shape = _Shape(cap, rows.vocab, sort_block, middle, part, parts, in_kernel)
    # A call shape's launches replay from a plan after two calls
    # (kernels/launch_plan.py): the host time of an eager call, as capture's
    # (the torch sort past SORT_LIMIT runs after them, on its own path).
    where = launch_plan.call_stream(weights)
    if where is None:
        _launch(rows, weights, batch_rows, out_ids, out_values, lengths, scratch, shape)
    else:
        slots = (rows.status, rows.forms, rows.lengths, rows.id_offsets, rows.offsets, rows.ids,
                 rows.values, weights, batch_rows, out_ids, out_values, lengths, scratch)
        addresses = launch_plan.pointers(slots)
        # (the rows' dtypes too: a Rows is the caller's, not made here)
        key = (*where, weights.dtype, weights.stride(0), batch_rows.dtype, count, shape,
               *(slot.dtype for slot in slots[:7]), _constants(),
               launch_plan.slots_key(addresses), launch_plan.tuning_state())
        _PLANS.launch(key, slots, addresses, where[1], lambda: _launch(
            rows, weights, batch_rows, out_ids, out_values, lengths, scratch, shape))
    if order == "engine" and not in_kernel:
        _sort_rows(out_ids, out_values, lengths, weights, batch_rows)
    return out_ids, out_values, lengths


_PLANS = launch_plan.Plans("fixed_rows")


class _Shape(NamedTuple):
    """A call's launch shape (fixed_rows computes it; part of a plan's key)."""

    cap: int
    vocab: int
    sort_block: int
    middle: int  # the longest row the first kernel sorts
    part: int
    parts: int  # 0: no row sorts in parts
    in_kernel: bool  # the engine order sorted by the kernels


def _constants() -> tuple[Any, ...]:
    """This module's launch constants (read at each call: tests change them)."""
    return _BLOCK, SMALL_SORT, SORT_WARPS, SORT_PART, PART_WARPS, MERGE_WARPS


def _launch(rows: Rows, weights: torch.Tensor, batch_rows: torch.Tensor, out_ids: torch.Tensor,
            out_values: torch.Tensor, lengths: torch.Tensor, scratch: torch.Tensor | None,
            shape: _Shape) -> None:
    """fixed_rows' launches (every one through .launch.launch: a plan
    replays what they record)."""
    count = batch_rows.numel()
    launch(_fixed_rows_kernel, (count,), rows.status, rows.forms, rows.lengths, rows.id_offsets,
           rows.offsets, rows.ids, rows.values, weights, weights.stride(0), batch_rows,
           out_ids, out_values, lengths, shape.cap, shape.vocab, BLOCK=_BLOCK,
           SORT=shape.in_kernel, SMALL_BLOCK=min(SMALL_SORT, shape.sort_block),
           MIDDLE_BLOCK=shape.middle, LONG_DIRECT=bool(shape.parts), num_warps=SORT_WARPS)
    if scratch is None:
        return
    entries = count * shape.sort_block
    keys = scratch[:2 * entries].view(torch.int64)
    part_ids = scratch[2 * entries:3 * entries]
    part_values = scratch[3 * entries:].view(torch.float32)
    launch(_part_sort_kernel, (count, shape.parts), lengths, rows.forms, rows.id_offsets,
           rows.offsets, rows.ids, rows.values, out_ids, out_values, weights,
           weights.stride(0), batch_rows, keys, part_ids, part_values, shape.cap,
           LONG=shape.middle, PART=shape.part, SORT_BLOCK=shape.sort_block,
           num_warps=PART_WARPS)
    launch(_part_merge_kernel, (count, shape.parts), lengths, out_ids, out_values, keys,
           part_ids, part_values, shape.cap, LONG=shape.middle, PART=shape.part,
           PARTS=shape.parts, SORT_BLOCK=shape.sort_block, STEPS=shape.part.bit_length(),
           num_warps=MERGE_WARPS)


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

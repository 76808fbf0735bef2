"""Pieces shared by the kernel modules: statuses, result types, argument checks,
and the mark/expand kernels (bitmask of kept entries, then ids and values)
that both compaction and capture use.

Row layout of every result: CSR over the batch. ``offsets`` int32[B + 1] is
computed on the GPU, ``ids[offsets[b]:offsets[b + 1]]`` are row b's kept ids in
ascending order, so copying ``ids[:offsets[B]]`` moves only realized rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl


class Status(IntEnum):
    """Per-row status written by every kernel."""

    OK = 0  # row materialised in full
    OVERFLOW = 1  # support larger than max_tokens; no id of the row is written
    INVALID = 2  # sampled token outside the support, zero mass, non-finite input/logprob
    SKIPPED = 3  # row not opted in; nothing written, length 0


@dataclass
class Rows:
    """CSR rows on the device.

    ``values`` holds the kept inputs (compaction) or ``log(w_i / sum(w))``
    (capture). ``sizes`` is the true support size, also for OVERFLOW rows, so a
    server can say how far over ``max_tokens`` a row went. ``selected_logprob``
    and ``tokens`` are set by capture and sample only.
    """

    offsets: torch.Tensor  # int32[B + 1]
    lengths: torch.Tensor  # int32[B], 0 unless status is OK
    status: torch.Tensor  # int32[B], Status values
    sizes: torch.Tensor  # int32[B]
    ids: torch.Tensor  # int32[capacity]; valid prefix is offsets[B]
    values: torch.Tensor  # float32[capacity]
    selected_logprob: torch.Tensor | None = None  # float32[B]
    tokens: torch.Tensor | None = None  # int32[B]

    def row(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's ids and values (a host sync; for tests and debugging)."""
        start, end = int(self.offsets[b]), int(self.offsets[b + 1])
        return self.ids[start:end], self.values[start:end]


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


def check_max_tokens(max_tokens: int, rows: int) -> int:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if rows * max_tokens >= 2**31:
        raise ValueError(
            f"B * max_tokens = {rows} * {max_tokens} must stay below 2**31 (int32 offsets)"
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
    if low is not None and not (low <= value):
        raise ValueError(f"{name}={value!r} is out of range; accepted: >= {low}")
    if high is not None and not (value <= high):
        raise ValueError(f"{name}={value!r} is out of range; accepted: <= {high}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def row_mask(rows: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """Opt-in mask as int8[B] (1 = materialise the row)."""
    if rows is None:
        return torch.ones(batch, dtype=torch.int8, device=device)
    if rows.shape != (batch,):
        raise ValueError(f"rows must be a bool mask of shape ({batch},), got {tuple(rows.shape)}")
    if rows.dtype != torch.bool:
        raise TypeError(f"rows must be a bool mask, got {rows.dtype}")
    return rows.to(device=device, dtype=torch.int8)


# Predicates of the mark kernel.
KEEP_FINITE = 0  # logits: keep finite entries (-inf marks a dropped token)
KEEP_POSITIVE = 1  # weights: keep entries > 0
KEEP_AT_LEAST = 2  # probabilities: keep finite w > 0 whose float bits >= a per-row key

CHUNK = 8192  # columns per mark program (32 KiB of fp32 read per program)
WORD_BITS = 32
EXPAND_WORDS = 256  # bitmask words per expand program (8192 columns)


@triton.jit
def popcount(x):
    """Set bits of each uint32 (SWAR; no libdevice, so it also runs interpreted)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def mark_kernel(
    x_ptr, stride_row, vocab, opt_in_ptr, key_floor_ptr, bits_ptr, counts_ptr, n_chunks,
    MODE: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (b, c) reads columns [c*CHUNK, (c+1)*CHUNK) of row b once and
    writes which entries its predicate keeps as a bitmask (CHUNK/32 words) plus
    their count. Little work per element, so the pass streams at memory speed;
    the kept ids come out of the bitmask in expand_kernel."""
    WORDS: tl.constexpr = CHUNK // 32
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    word_idx = tl.arange(0, WORDS)
    bit_idx = tl.arange(0, 32)
    cols = chunk * CHUNK + word_idx[:, None] * 32 + bit_idx[None, :]
    # A row not opted in reads nothing: its column limit becomes 0.
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
def expand_kernel(
    x_ptr, stride_row, vocab, bits_ptr, counts_ptr, n_chunks,
    status_ptr, offsets_ptr, out_ids_ptr, out_vals_ptr,
    ROW_LOCAL: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    """Program (b, g) turns the bitmasks of chunks [g*GROUP, (g+1)*GROUP) of
    row b into ascending ids and gathers their values from x. Destination: CSR
    (offsets[b], rows with status OK only) or, with ROW_LOCAL, row b's own
    slice out[b * V:]; either way plus the counts of the chunks before. Each
    step peels the lowest set bits of every word, so the loop runs as often as
    the fullest word has bits / 4 (once for a sparse row)."""
    WORDS: tl.constexpr = GROUP * (CHUNK // 32)
    row = tl.program_id(0)
    first_chunk = tl.program_id(1) * GROUP
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    counts = tl.load(counts_ptr + row * n_chunks + chunk_idx, mask=chunk_idx < n_chunks, other=0)
    before = tl.sum(tl.where(chunk_idx < first_chunk, counts, 0), axis=0)
    if ROW_LOCAL:
        dst = row.to(tl.int64) * vocab + before
        active = True
    else:
        dst = tl.load(offsets_ptr + row).to(tl.int64) + before
        active = tl.load(status_ptr + row) == 0
    word_idx = tl.arange(0, WORDS)
    in_row = (first_chunk + word_idx // (CHUNK // 32)) < n_chunks
    words = tl.load(bits_ptr + (row * n_chunks + first_chunk).to(tl.int64) * (CHUNK // 32)
                    + word_idx, mask=in_row, other=0)
    words = tl.where(active, words, 0).to(tl.uint32, bitcast=True)
    per_word = popcount(words)
    slots = dst + (tl.cumsum(per_word, axis=0) - per_word)
    rounds = tl.max(per_word, axis=0)
    col_base = first_chunk * CHUNK + word_idx * 32
    x_row = x_ptr + row.to(tl.int64) * stride_row
    # Four bits per word per step, their loads issued before any store, so a
    # step waits for memory once rather than four times.
    for _ in range(0, rounds, 4):
        cols_a, live_a, words = _peel(words, col_base)
        cols_b, live_b, words = _peel(words, col_base)
        cols_c, live_c, words = _peel(words, col_base)
        cols_d, live_d, words = _peel(words, col_base)
        vals_a = tl.load(x_row + cols_a, mask=live_a)
        vals_b = tl.load(x_row + cols_b, mask=live_b)
        vals_c = tl.load(x_row + cols_c, mask=live_c)
        vals_d = tl.load(x_row + cols_d, mask=live_d)
        tl.store(out_ids_ptr + slots, cols_a, mask=live_a)
        tl.store(out_vals_ptr + slots, vals_a.to(tl.float32), mask=live_a)
        tl.store(out_ids_ptr + slots + 1, cols_b, mask=live_b)
        tl.store(out_vals_ptr + slots + 1, vals_b.to(tl.float32), mask=live_b)
        tl.store(out_ids_ptr + slots + 2, cols_c, mask=live_c)
        tl.store(out_vals_ptr + slots + 2, vals_c.to(tl.float32), mask=live_c)
        tl.store(out_ids_ptr + slots + 3, cols_d, mask=live_d)
        tl.store(out_vals_ptr + slots + 3, vals_d.to(tl.float32), mask=live_d)
        slots += 4


@triton.jit
def _peel(words, col_base):
    """Column of each word's lowest set bit, whether there was one, the rest."""
    live = words != 0
    lowest = words & (~words + 1)
    # a power of two converts to float exactly: its exponent is the bit index
    bit = (lowest.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    return col_base + bit, live, words & (words - 1)


def launch_mark(
    x: torch.Tensor, opt_in: torch.Tensor, key_floor: torch.Tensor | None, mode: int,
    chunk: int = CHUNK, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Run mark_kernel; returns (bits, counts, n_chunks)."""
    batch, vocab = x.shape
    n_chunks = triton.cdiv(vocab, chunk)
    bits = torch.empty(batch * n_chunks * (chunk // WORD_BITS), dtype=torch.int32,
                       device=x.device)
    counts = torch.empty(batch * n_chunks, dtype=torch.int32, device=x.device)
    mark_kernel[(batch, n_chunks)](
        x, x.stride(0), vocab, opt_in, key_floor if key_floor is not None else opt_in,
        bits, counts, n_chunks, MODE=mode, CHUNK=chunk, num_warps=num_warps,
    )
    return bits, counts, n_chunks


def launch_expand(
    x: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor, n_chunks: int,
    status: torch.Tensor | None, offsets: torch.Tensor | None,
    out_ids: torch.Tensor, out_vals: torch.Tensor, chunk: int = CHUNK, num_warps: int = 8,
    expand_words: int | None = None,
) -> None:
    """Run expand_kernel: CSR placement when status/offsets are given, else row-local."""
    batch, vocab = x.shape
    row_local = status is None
    group = max(1, (expand_words or EXPAND_WORDS) // (chunk // WORD_BITS))
    expand_kernel[(batch, triton.cdiv(n_chunks, group))](
        x, x.stride(0), vocab, bits, counts, n_chunks,
        counts if row_local else status, counts if row_local else offsets,
        out_ids, out_vals, ROW_LOCAL=row_local, CHUNK=chunk, GROUP=group,
        CHUNKS_PAD=triton.next_power_of_2(n_chunks), num_warps=num_warps,
    )

"""Compaction: ``[B, V]`` logits or weights to the ascending ids of the kept
entries of each row, as CSR over the batch.

Semantics
---------
* ``keep="finite"`` (logits): entry kept iff it is finite; ``-inf`` (and NaN,
  ``+inf``) mark dropped tokens. Feed masked log-probabilities to get ids and
  logprobs in one call.
* ``keep="positive"`` (weights / probabilities): entry kept iff ``> 0``
  (NaN is dropped, ``+inf`` kept).
* Row b's support size is ``sizes[b]``. If it exceeds ``max_tokens`` the row
  gets ``Status.OVERFLOW`` and length 0: no partial row is ever written.
* Rows with ``rows[b] == False`` are not read at all: ``Status.SKIPPED``,
  length 0.
* ``ids`` are int32 ascending within a row; ``values`` are the kept inputs
  as float32; ``offsets`` int32[B + 1] are computed on the GPU.

Kernels: (1) mark: program (b, c) reads one 8192-column chunk of row b once
and writes a bitmask of its kept entries plus their count (little arithmetic
per element, so it streams at memory speed); (2) scan: one program turns the
counts into sizes, statuses and CSR offsets; (3) expand: program (b, c) turns
its chunk's bitmask into ascending ids at offsets[b] + the counts of the
chunks before it, and gathers their values. Only (1) reads the whole [B, V]
input (1/32 of it comes back as bits), so the call costs about one read of
the logits plus a few bytes per kept entry.
"""

from __future__ import annotations

import torch

from ._common import (
    CHUNK,
    KEEP_FINITE,
    KEEP_POSITIVE,
    Rows,
    Status,
    check_matrix,
    check_max_tokens,
    launch_expand,
    launch_mark,
    row_mask,
    tl,
    triton,
)

__all__ = ["compact", "reference_compact"]

_KEEP_MODES = {"finite": KEEP_FINITE, "positive": KEEP_POSITIVE}


@triton.jit
def _scan_kernel(
    counts_ptr,
    n_chunks,
    opt_in_ptr,
    batch,
    max_tokens,
    sizes_ptr,
    lengths_ptr,
    status_ptr,
    offsets_ptr,
    ROWS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    """One program: per-row sizes from the chunk counts, statuses, lengths and
    the exclusive scan of lengths into offsets (offsets[batch] = total)."""
    carry = tl.zeros([], dtype=tl.int32)
    chunk_idx = tl.arange(0, CHUNKS_PAD)
    for start in range(0, batch, ROWS):
        rows = start + tl.arange(0, ROWS)
        in_batch = rows < batch
        tile = tl.load(
            counts_ptr + rows[:, None] * n_chunks + chunk_idx[None, :],
            mask=in_batch[:, None] & (chunk_idx[None, :] < n_chunks),
            other=0,
        )
        size = tl.sum(tile, axis=1)
        opted = tl.load(opt_in_ptr + rows, mask=in_batch, other=0) != 0
        status = tl.where(opted, tl.where(size > max_tokens, 1, 0), 3)
        length = tl.where(status == 0, size, 0)
        inclusive = tl.cumsum(length, axis=0)
        tl.store(sizes_ptr + rows, size, mask=in_batch)
        tl.store(lengths_ptr + rows, length, mask=in_batch)
        tl.store(status_ptr + rows, status, mask=in_batch)
        tl.store(offsets_ptr + rows, carry + inclusive - length, mask=in_batch)
        carry += tl.sum(length, axis=0)
    tl.store(offsets_ptr + batch, carry)


def compact(
    x: torch.Tensor,
    max_tokens: int,
    *,
    keep: str = "finite",
    rows: torch.Tensor | None = None,
    chunk: int = CHUNK,
    num_warps: int = 4,
) -> Rows:
    """Kept ids of every opted-in row of ``x`` [B, V] (fp32/bf16/fp16), as CSR.

    ``rows`` (bool[B], default all) opts rows in. Capacity of the output
    buffers is ``B * min(max_tokens, V)``; their valid prefix is
    ``offsets[B]``.
    """
    x = check_matrix(x, "x")
    if keep not in _KEEP_MODES:
        raise ValueError(f"keep must be one of {sorted(_KEEP_MODES)}, got {keep!r}")
    batch, vocab = x.shape
    check_max_tokens(max_tokens, batch)
    opt_in = row_mask(rows, batch, x.device)
    bits, counts, n_chunks = launch_mark(x, opt_in, None, _KEEP_MODES[keep], chunk, num_warps)
    sizes = torch.empty(batch, dtype=torch.int32, device=x.device)
    lengths = torch.empty_like(sizes)
    status = torch.empty_like(sizes)
    offsets = torch.empty(batch + 1, dtype=torch.int32, device=x.device)
    chunks_pad = triton.next_power_of_2(n_chunks)
    _scan_kernel[(1,)](
        counts, n_chunks, opt_in, batch, max_tokens, sizes, lengths, status, offsets,
        # one tile of rows x chunks per step; a batch of up to 16384 / chunks_pad
        # rows (512 at V=151936) is a single step
        ROWS=max(1, min(triton.next_power_of_2(batch), 16384 // chunks_pad)),
        CHUNKS_PAD=chunks_pad, num_warps=8,
    )
    capacity = batch * min(max_tokens, vocab)
    ids = torch.empty(capacity, dtype=torch.int32, device=x.device)
    values = torch.empty(capacity, dtype=torch.float32, device=x.device)
    launch_expand(x, bits, counts, n_chunks, status, offsets, ids, values, chunk)
    return Rows(offsets, lengths, status, sizes, ids, values)


def reference_compact(
    x: torch.Tensor, max_tokens: int, *, keep: str = "finite", rows: torch.Tensor | None = None
) -> Rows:
    """Plain-torch compaction with the same semantics as :func:`compact`."""
    x = check_matrix(x, "x")
    if keep not in _KEEP_MODES:
        raise ValueError(f"keep must be one of {sorted(_KEEP_MODES)}, got {keep!r}")
    batch, vocab = x.shape
    check_max_tokens(max_tokens, batch)
    xf = x.float()
    kept = torch.isfinite(xf) if keep == "finite" else xf > 0
    opted = torch.ones(batch, dtype=torch.bool, device=x.device) if rows is None else rows
    kept &= opted[:, None]
    sizes = kept.sum(1).to(torch.int32)
    status = torch.where(sizes > max_tokens, Status.OVERFLOW, Status.OK)
    status = torch.where(opted, status, Status.SKIPPED).to(torch.int32)
    kept &= (status == Status.OK)[:, None]
    lengths = kept.sum(1).to(torch.int32)
    offsets = torch.zeros(batch + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(lengths, 0)
    row_idx, col_idx = kept.nonzero(as_tuple=True)  # row-major: ascending ids per row
    return Rows(
        offsets, lengths, status, sizes, col_idx.to(torch.int32), xf[row_idx, col_idx].float()
    )

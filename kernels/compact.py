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

from ._common import (
    CHUNK,
    EXPAND_WORDS,
    KEEP_FINITE,
    KEEP_POSITIVE,
    WORD_BITS,
    Rows,
    Status,
    bitmask_words,
    check_matrix,
    check_max_tokens,
    expand_kernel,
    launch_mark,
    launch_options,
    pack_rows,
    pdl_default,
    row_mask,
    scan_kernel,
    values_capacity,
)
from .direct import claim_step, launching, publish_into
from .host import check_into

__all__ = ["compact", "reference_compact"]

_KEEP_MODES = {"finite": KEEP_FINITE, "positive": KEEP_POSITIVE}


def compact(
    x: torch.Tensor,
    max_tokens: int,
    *,
    keep: str = "finite",
    rows: torch.Tensor | None = None,
    overflow: str = "exact",
    chunk: int = CHUNK,
    num_warps: int = 4,
    expand_words: int = EXPAND_WORDS,
    expand_warps: int = 8,
    pdl: bool | None = None,
    scan_rows: int | None = None,
    into: tuple[Any, ...] | None = None,
) -> Rows:
    """Kept entries of every opted-in row of ``x`` [B, V] (fp32/bf16/fp16).

    ``rows`` (bool[B], default all) opts rows in. ``chunk``, ``num_warps``
    (mark), ``expand_words``, ``expand_warps``, ``pdl`` (None: on where
    the GPU has it) and ``scan_rows`` (rows the scan kernel takes per step,
    a power of two; None: as many as a tile of 16384 chunk counts holds) are
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
    ids = torch.empty(batch * bitmask_words(vocab), dtype=torch.int32, device=x.device)
    values = torch.empty(values_capacity(batch, vocab, max_tokens, overflow),
                         dtype=torch.float32, device=x.device)
    return _compact_rows(
        x, _KEEP_MODES[keep], opt_in, max_tokens, overflow, ids, values, chunk=chunk,
        mark_warps=num_warps, expand_words=expand_words, expand_warps=expand_warps,
        pdl=pdl_default(x.device) if pdl is None else pdl, scan_rows=scan_rows, target=target)


def _compact_rows(
    x: torch.Tensor, mode: int, opt_in: torch.Tensor | None, max_tokens: int, overflow: str,
    out_ids: torch.Tensor, out_vals: torch.Tensor, *, chunk: int, mark_warps: int,
    expand_words: int, expand_warps: int, pdl: bool, scan_rows: int | None,
    target: tuple[Any, Any, str] | None,
) -> Rows:
    """mark + scan + expand: the rows in out_ids/out_vals, published where
    ``target`` (check_into's) says."""
    batch, vocab = x.shape
    device = x.device
    bits, counts, n_chunks = launch_mark(x, opt_in, None, mode, chunk, mark_warps, pdl)
    sizes = torch.empty(batch, dtype=torch.int32, device=device)
    status = torch.empty_like(sizes)
    lengths = torch.empty_like(sizes)
    forms = torch.empty_like(sizes)
    offsets = torch.empty(batch + 1, dtype=torch.int32, device=device)
    id_offsets = torch.empty_like(offsets)
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
        scan_kernel[(1,)](
            counts, n_chunks, sizes if opt_in is None else opt_in, batch, vocab, max_tokens,
            sizes, lengths, status, forms, offsets, id_offsets, table, claims,
            STATUS_ON_OVERFLOW=overflow == "status", ALL_ROWS=opt_in is None, PDL=pdl,
            # one tile of rows x chunks per step; a batch of up to 16384 /
            # chunks_pad rows (512 at V=151936) is a single step
            ROWS=scan_rows or max(1, min(triton.next_power_of_2(batch), 16384 // chunks_pad)),
            CHUNKS_PAD=chunks_pad, DIRECT=direct is not None, num_warps=8,
            **launch_options(pdl),
        )
        expand_kernel[(batch, triton.cdiv(n_chunks, group))](
            x, x.stride(0), vocab, bits, counts, n_chunks, status, forms, offsets, id_offsets,
            out_ids, out_vals, table, arrivals, claims, counts, ROW_LOCAL=False, PDL=pdl,
            CHUNK=chunk, GROUP=group, CHUNKS_PAD=chunks_pad, DIRECT=direct is not None,
            LOG_VALUES=False,
            num_warps=expand_warps, **launch_options(pdl),
        )
    rows = Rows(offsets, lengths, status, sizes, forms, id_offsets, out_ids, out_vals, vocab,
                max_tokens=max_tokens)
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

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
               *, selected: bool, tokens: bool) -> tuple[Rows, tuple[torch.Tensor, ...]]:
    """A result for kernels to fill, and its three allocations (a plan's
    slots, kernels/launch_plan.py): the per-row arrays (offsets, id
    offsets, lengths, statuses, sizes, forms; ``selected``: selected
    logprobs; ``tokens``: sample's tokens), each at a multiple of 16 bytes
    (what Triton specializes pointers on) and cut by one split; the ids;
    the values. Three, not one: a caller that keeps only the small arrays
    (the tokens) does not keep the values' B x V entries alive."""
    words = {"offsets": batch + 1, "id_offsets": batch + 1, "lengths": batch, "status": batch,
             "sizes": batch, "forms": batch, "selected": batch if selected else 0,
             "tokens": batch if tokens else 0}
    pieces: list[int] = []
    index: list[int] = []  # where each array is among the pieces (its padding after it)
    for n in words.values():
        index.append(len(pieces))
        pieces += [n, -n % 4] if n % 4 else [n]
    small = torch.empty(sum(pieces), dtype=torch.int32, device=device)
    parts = small.split(pieces)
    arrays = {name: parts[i] for name, i in zip(words, index, strict=True)}
    ids = torch.empty(batch * bitmask_words(vocab), dtype=torch.int32, device=device)
    values = torch.empty(values_capacity(batch, vocab, max_tokens, overflow), dtype=torch.float32,
                         device=device)
    rows = Rows(arrays["offsets"], arrays["lengths"], arrays["status"], arrays["sizes"],
                arrays["forms"], arrays["id_offsets"], ids, values, vocab,
                arrays["selected"].view(torch.float32) if selected else None,
                arrays["tokens"] if tokens else None, max_tokens=max_tokens)
    return rows, (small, ids, values)


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

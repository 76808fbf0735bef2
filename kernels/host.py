"""Host side: move exact rows from the GPU into pinned host buffers and hand
numpy views of those buffers to the transport, with no further host copy.

Per step: one small copy (offsets, id offsets, lengths, statuses, forms,
selected logprobs), a sync to learn the totals, then one copy of exactly the
realized id data and values (``ids[:id_offsets[B]]``, ``values[:offsets[B]]``)
-- never a padded ``[B, capacity]`` buffer. A bitmask row moves its
``ceil(V / 32)`` words, an ids row its L ids.
Buffers are pinned page-locked memory when CUDA is present (so the copies are
DMA at full PCIe/NVLink-C2C speed), plain host memory otherwise; they grow
on demand and are reused, so a step allocates nothing in steady state.

The views returned by :meth:`HostStaging.fetch` stay valid until the next
``fetch``; the transport copies them into shared memory inside
``append_step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shmask.device_port import DevicePort
from shmask.errors import InvalidRowsError

from .rows import Rows, Status, longest_ids_row

__all__ = ["HostRows", "HostStaging", "append_host_rows"]

_MODES = ("support", "selected")


@dataclass
class HostRows:
    """Numpy views into :class:`HostStaging`'s buffers (no copies)."""

    offsets: np.ndarray  # int32[B + 1], into values
    lengths: np.ndarray  # int32[B], support size of OK rows
    status: np.ndarray  # int32[B]
    ids: np.ndarray  # int32[id_offsets[B]], each row's id data (ids or bitmask words)
    values: np.ndarray  # float32[offsets[B]]
    selected_logprob: np.ndarray | None  # float32[B]
    tokens: np.ndarray | None  # int32[B]
    forms: np.ndarray  # int32[B], Form values
    id_offsets: np.ndarray  # int32[B + 1], into ids
    vocab: int


class HostStaging:
    """Reusable (pinned when CUDA is present) host buffers for :class:`Rows`."""

    def __init__(self, batch_capacity: int = 256, entries_capacity: int = 1 << 16) -> None:
        if batch_capacity < 1 or entries_capacity < 1:
            raise ValueError(
                f"capacities must be >= 1, got batch_capacity={batch_capacity}, "
                f"entries_capacity={entries_capacity}"
            )
        self.pinned = torch.cuda.is_available()
        self._batch = 0
        self._entries = 0
        self._grow_batch(batch_capacity)
        self._grow_entries(entries_capacity)

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pinned)

    def _grow_batch(self, batch: int) -> None:
        if batch <= self._batch:
            return
        self._batch = batch
        self.offsets = self._empty(batch + 1, torch.int32)
        self.id_offsets = self._empty(batch + 1, torch.int32)
        self.forms = self._empty(batch, torch.int32)
        self.lengths = self._empty(batch, torch.int32)
        self.status = self._empty(batch, torch.int32)
        self.selected = self._empty(batch, torch.float32)
        self.tokens = self._empty(batch, torch.int32)

    def _grow_entries(self, entries: int) -> None:
        if entries <= self._entries:
            return
        self._entries = max(entries, 2 * self._entries)
        self.ids = self._empty(self._entries, torch.int32)
        self.values = self._empty(self._entries, torch.float32)

    @staticmethod
    def _wait(tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def fetch(self, rows: Rows, values: bool = True) -> HostRows:
        """Copy ``rows`` to the host buffers; returns views of them. Without
        ``values`` (selected mode needs only the selected logprobs) the
        support values stay on the device and ``HostRows.values`` is empty."""
        batch = rows.lengths.numel()
        self._grow_batch(batch)
        small = [(self.offsets[: batch + 1], rows.offsets), (self.lengths[:batch], rows.lengths),
                 (self.status[:batch], rows.status), (self.forms[:batch], rows.forms),
                 (self.id_offsets[: batch + 1], rows.id_offsets)]
        if rows.selected_logprob is not None:
            small.append((self.selected[:batch], rows.selected_logprob))
        if rows.tokens is not None:
            small.append((self.tokens[:batch], rows.tokens))
        for host, device in small:
            host.copy_(device, non_blocking=self.pinned)
        self._wait(rows.offsets)
        words, total = int(self.id_offsets[batch]), int(self.offsets[batch]) if values else 0
        self._grow_entries(max(words, total))
        if words:
            self.ids[:words].copy_(rows.ids[:words], non_blocking=self.pinned)
        if total:
            self.values[:total].copy_(rows.values[:total], non_blocking=self.pinned)
        if words or total:
            self._wait(rows.ids)
        return HostRows(
            offsets=self.offsets[: batch + 1].numpy(),
            lengths=self.lengths[:batch].numpy(),
            status=self.status[:batch].numpy(),
            ids=self.ids[:words].numpy(),
            values=self.values[:total].numpy(),
            selected_logprob=None if rows.selected_logprob is None else self.selected[:batch].numpy(),
            tokens=None if rows.tokens is None else self.tokens[:batch].numpy(),
            forms=self.forms[:batch].numpy(),
            id_offsets=self.id_offsets[: batch + 1].numpy(),
            vocab=rows.vocab,
        )


def append_host_rows(
    writer: DevicePort,
    slots: np.ndarray | Sequence[Any],
    rows: HostRows,
    mode: str = "support",
) -> np.ndarray:
    """Append one step's ``HostRows`` (from :meth:`HostStaging.fetch`) on
    the CPU: ``writer.append_step(slots, lengths, ids, logprobs, status=,
    forms=, vocab=)`` with ``ids`` / ``logprobs`` the staging views. The
    CPU path of ``kernels.publish``, whose docstring says what travels
    (SKIPPED rows are left out, every other row goes in its form, with its
    status). Returns the statuses of the rows sent.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be 'support' or 'selected', got {mode!r}")
    batch = rows.lengths.size
    if len(slots) != batch:
        raise ValueError(f"slots has {len(slots)} entries; expected one per row ({batch})")
    sent = rows.status != Status.SKIPPED
    every = bool(sent.all())
    if isinstance(slots, np.ndarray):
        chosen: Any = slots if every else slots[sent]
    else:
        chosen = [queue for queue, keep in zip(slots, sent, strict=True) if keep]
    # A skipped row has no id data and no values, so the flat arrays need no filtering.
    lengths = rows.lengths if every else rows.lengths[sent]
    status = rows.status if every else rows.status[sent]
    forms = rows.forms if every else rows.forms[sent]
    if mode == "support":
        logprobs = rows.values
    else:
        if rows.selected_logprob is None:
            raise ValueError("mode 'selected' needs rows from capture() or sample()")
        logprobs = rows.selected_logprob if every else rows.selected_logprob[sent]
    writer.append_step(chosen, lengths, rows.ids, logprobs, status=status, forms=forms,
                       vocab=rows.vocab)
    return status


def check_fits_writer(writer: DevicePort, max_tokens: int | None, vocab: int) -> None:
    """Raise InvalidRowsError unless every ids row of a kernel called with
    ``max_tokens`` (None: unknown) at vocabulary ``vocab`` fits ``writer``'s
    SHMASK_MAX_TOKENS. The GPU stores a step's rows in parallel and cannot
    refuse the whole step once one row turns out too long, so device rows
    are checked by their bound, before anything is stored; the CPU path
    refuses the same rows, so every path behaves alike. A bitmask row is
    not bounded by either (it travels exactly, whatever its size)."""
    limit = getattr(getattr(writer, "config", None), "max_tokens", None)
    if limit is None:  # not a shmask.Writer (a test double): append_step checks rows
        return
    longest = longest_ids_row(max_tokens, vocab)
    if longest > limit:
        said = "unknown max_tokens" if max_tokens is None else f"max_tokens={max_tokens}"
        raise InvalidRowsError(
            f"rows from a kernel called with {said} (V={vocab}) may hold ids rows of "
            f"{longest} ids, but this Writer accepts at most {limit} (SHMASK_MAX_TOKENS="
            f"{limit}): call the kernel with max_tokens <= {limit} or raise "
            "SHMASK_MAX_TOKENS; nothing of this step was published")


def check_into(into: Any, selected: bool, max_tokens: int,
               vocab: int) -> tuple[Any, Any, str] | None:
    """The ``into=`` argument of capture / sample / compact: ``(writer,
    handles)`` or ``(writer, handles, mode)``; checked before any kernel
    runs. ``selected``: whether the rows will carry a selected logprob;
    ``max_tokens`` and ``vocab``: the kernel's, checked against the Writer's
    (check_fits_writer)."""
    if into is None:
        return None
    if not isinstance(into, tuple) or len(into) not in (2, 3):
        raise ValueError("into must be (writer, handles) or (writer, handles, mode), "
                         f"got {type(into).__name__}")
    writer, handles, mode = into if len(into) == 3 else (*into, "support")
    if not hasattr(writer, "append_step"):
        raise ValueError(f"into[0] must be a shmask.Writer, got {type(writer).__name__}")
    if mode not in _MODES:
        raise ValueError(f"into's mode must be 'support' or 'selected', got {mode!r}")
    if mode == "selected" and not selected:
        raise ValueError("into's mode 'selected' needs rows from capture() or sample()")
    check_fits_writer(writer, max_tokens, vocab)
    return writer, handles, mode

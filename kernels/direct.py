"""Publishing a step's rows, and the choice of path (:func:`publish`): device
rows go GPU-direct (issue 10) where it can, the GPU storing each step's rows
straight into their requests' RowQueue buffers in the ring, so the
scheduler's CPU work per step is one native call and one kernel launch;
else, and for rows already on the host, through kernels/host.py's CPU path
(which knows nothing of this module).

The ring (and a small device-visible queue table, C memory owned by the
native core) are registered with CUDA as mapped host memory. Each queue's
table entry (``shm_direct_entry`` in native/shmask_direct.h) holds the
addresses of its buffer's arrays, its counts and capacities; a step
descriptor holds the addresses of the step's Rows and the row -> queue
slot array. The kernel, one program per row, stores an OK row's id data,
values, length and flags byte where the counts say, then advances the
counts; a row that does not fit (or a queue already diverted this step)
sets the entry's sticky ``diverted`` flag and bumps a counter instead,
writing nothing. The last program of a step stores the step's target into
the table's ``done`` word (release, system scope): that is how the CPU
knows, with one load and no CUDA call, that the step's stores are visible.

Before each launch, ``shm_direct_step`` (one native call) pulls the last
step's counts, checks the handles, gives every queue room for one more row
(growing it in the ring, so rows divert only when the ring is full) and
pushes the entries. Diverted rows are fetched to the host and appended
with ``Writer.append_step`` in order, before anything else touches the
queues.

Without CUDA, or when registration fails, :class:`DirectPublisher` falls
back to the CPU path (:class:`.host.HostStaging` + :func:`.host.append_host_rows`)
with one warning; ``DirectPublisher.active`` says which. With
``TRITON_INTERPRET=1`` set in the environment (the CPU tests; not what
shmask.kernels sets by itself on a host without CUDA) the kernel runs in
Triton's interpreter on the host and writes the ring through plain host
addresses, so the same code is tested against a real Writer and Reader.

The memory-ordering argument is in docs/architecture.md ("GPU-direct
publishing").
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from shmask import layout
from shmask.device_port import DevicePort

from .host import _MODES, HostRows, HostStaging, append_host_rows, check_fits_writer
from .launch import launches_interpreted
from .ring import DESC, ring_arrive, ring_claim, ring_commit
from .rows import Rows, Status, bitmask_words

__all__ = ["DirectPublisher", "publish", "publisher_for", "reference_direct"]

log = logging.getLogger("shmask")

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_BLOCK = 1024  # entries a program stores per loop iteration
# shm_direct_step_desc's words (shmask/layout.py) as constexprs.
_STATUS = tl.constexpr(layout.DESC_STATUS)
_FORMS = tl.constexpr(layout.DESC_FORMS)
_LENGTHS = tl.constexpr(layout.DESC_LENGTHS)
_ID_OFFSETS = tl.constexpr(layout.DESC_ID_OFFSETS)
_OFFSETS = tl.constexpr(layout.DESC_OFFSETS)
_IDS = tl.constexpr(layout.DESC_IDS)
_VALUES = tl.constexpr(layout.DESC_VALUES)
_SELECTED = tl.constexpr(layout.DESC_SELECTED)
_VOCAB = tl.constexpr(layout.DESC_VOCAB)


# ------------------------------------------------------------------ kernel
@triton.jit
def _direct_kernel(
    table,  # int64: device address of the table (native/shmask_direct.h's layout)
    arrivals,  # int64[1] on the device: programs that finished, ever
    SUPPORT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Stores row b of the step the table's descriptor describes (the
    addresses of its Rows tensors) into its queue's buffer, or diverts it."""
    b = tl.program_id(0)
    desc = table.to(tl.int64).to(tl.pointer_type(tl.int64)) + DESC
    status = tl.load(tl.load(desc + _STATUS).to(tl.pointer_type(tl.int32)) + b)
    form = tl.load(tl.load(desc + _FORMS).to(tl.pointer_type(tl.int32)) + b)
    length = tl.load(tl.load(desc + _LENGTHS).to(tl.pointer_type(tl.int32)) + b).to(tl.int64)
    id_offsets_ptr = tl.load(desc + _ID_OFFSETS).to(tl.pointer_type(tl.int32))
    id_start = tl.load(id_offsets_ptr + b).to(tl.int64)
    n_words = tl.load(id_offsets_ptr + b + 1).to(tl.int64) - id_start
    vocab = tl.load((desc + _VOCAB).to(tl.pointer_type(tl.int32)))
    fits, entry, rows, words, nnz, dest_ids, dest_logprobs = ring_claim(
        table, b, status, form, length, n_words, vocab, SUPPORT)
    if fits:
        ids_ptr = tl.load(desc + _IDS).to(tl.pointer_type(tl.int32))
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_words, BLOCK):
            m = start + offs < n_words
            tl.store(dest_ids + start + offs, tl.load(ids_ptr + id_start + start + offs, mask=m),
                     mask=m)
        if SUPPORT:
            values_ptr = tl.load(desc + _VALUES).to(tl.pointer_type(tl.float32))
            value_start = tl.load(tl.load(desc + _OFFSETS).to(tl.pointer_type(tl.int32)) + b).to(tl.int64)
            for start in range(0, length, BLOCK):
                m = start + offs < length
                data = tl.load(values_ptr + value_start + start + offs, mask=m)
                tl.store(dest_logprobs + start + offs, data, mask=m)
        else:
            tl.store(dest_logprobs, tl.load(tl.load(desc + _SELECTED).to(tl.pointer_type(tl.float32)) + b))
    ring_commit(table, entry, fits, rows, words, nnz, status, form, length, n_words, vocab)
    ring_arrive(table, arrivals)


# --------------------------------------------------------------- reference
def reference_direct(rows: Rows, mode: str = "support") -> list[tuple[int, int, list[int],
                                                                     list[float]] | None]:
    """What the kernel stores for each row, in plain Python: (flags byte,
    length, id data, logprobs), or None for a SKIPPED row. The tests compare
    the ring's chunks with this and with the CPU path."""
    out: list[tuple[int, int, list[int], list[float]] | None] = []
    status = rows.status.cpu().tolist()
    forms = rows.forms.cpu().tolist()
    lengths = rows.lengths.cpu().tolist()
    offsets = rows.offsets.cpu().tolist()
    id_offsets = rows.id_offsets.cpu().tolist()
    ids = rows.ids.cpu()
    values = rows.values.cpu()
    selected = None if rows.selected_logprob is None else rows.selected_logprob.cpu()
    for b, st in enumerate(status):
        if st == Status.SKIPPED:
            out.append(None)
            continue
        data = ids[id_offsets[b]:id_offsets[b + 1]].tolist()
        if mode == "support":
            logprobs = values[offsets[b]:offsets[b + 1]].tolist()
        else:
            assert selected is not None
            logprobs = [float(selected[b])]
        out.append((st | forms[b] << layout.ROW_FORM_SHIFT, lengths[b], data, logprobs))
    return out


# -------------------------------------------------------------- publisher
@dataclass
class _Step:
    """The last launched step: its rows stay referenced until the next step
    (a diverted row is fetched from them)."""

    handles: np.ndarray
    rows: Rows
    mode: str


class DirectPublisher:
    """Publishes each step's device rows straight into ``writer``'s ring.

    ``publish(handles, rows, mode)`` replaces ``HostStaging.fetch`` +
    ``kernels.publish``: same arguments, no host copy. ``handles`` is the
    int64 numpy array of RowQueue handles (row b -> queue ``handles[b]``, one
    row per queue per step; a step that breaks that, or names a queue the
    table cannot hold, takes the CPU path). ``active`` is False when the
    direct path is unavailable (no CUDA, unless ``TRITON_INTERPRET=1`` asks
    for the interpreter; a registration error, an inline transport,
    ``SHMASK_GPU_DIRECT=off``); every call then takes the CPU path.
    Engines normally get one through :func:`publisher_for` (what
    ``kernels.publish`` uses for device rows).

    It uses the Writer only through its device port
    (:class:`shmask.device_port.DevicePort`): it attaches there as the
    Writer's :class:`~shmask.device_port.DeviceAttachment`, and the Writer
    quiesces it around every CPU change of a queue.

    Not thread-safe, like the Writer. ``close()`` (or the Writer's close)
    waits for the last kernel and unregisters the memory. ``max_tokens``
    (default: the Writer's SHMASK_MAX_TOKENS): the ids and values of one
    row each queue is given room for before a step.
    """

    def __init__(self, writer: DevicePort, device: torch.device | str | int | None = None, *,
                 max_tokens: int | None = None, table_slots: int = 4096) -> None:
        # Imported here, not at the top: kernels/ must import without the
        # compiled core (benchmarks/sass_compare.py compiles every kernel in
        # a venv of Triton and torch only); a Writer has loaded it already.
        from shmask._native import ffi, lib

        self._ffi, self._lib = ffi, lib
        self.writer = writer
        self.interpreted = launches_interpreted()
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if self.interpreted or not torch.cuda.is_available()
            else torch.device("cuda", torch.cuda.current_device()))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = -1 if self.device.type != "cuda" else int(self.device.index)
        if max_tokens is None:
            max_tokens = writer.config.max_tokens
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens (id words reserved per row) must be an int >= 1, "
                             f"got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.staging = HostStaging()  # the CPU path and the diverted rows
        self._stats = {"direct_steps": 0, "fused_steps": 0, "cpu_steps": 0, "diverted_rows": 0,
                       "diverted_steps": 0, "waits": 0}
        self._direct: Any = None
        self._registered: list[int] = []
        self._last: _Step | None = None
        self._depth = 0  # quiesce() nesting: > 0 while the CPU owns the queues
        self._launchers: dict[bool, Any] = {}  # support -> the compiled kernel's launch
        self.launcher = "none yet"  # which launch later steps use (the benchmark reports it)
        self._reserve_words: tuple[int, int] = (-1, 0)  # (vocab, id words reserved per row)
        self._slot_mask = (1 << lib.SHM_HANDLE_SLOT_BITS) - 1  # a handle's low bits: its slot
        self._addresses = ffi.new("uint64_t[8]")
        self._bad_row = ffi.new("int64_t *")
        self._bad_slot = ffi.new("uint64_t *")
        self.active = False
        self.reason = ""
        if writer.segment is None:
            self._give_up("the Writer has no ring (SHMASK_TRANSPORT=inline)")
            return
        if getattr(writer.config, "gpu_direct", "auto") == "off":
            self._give_up("SHMASK_GPU_DIRECT=off")
            return
        if writer.attached is not None:
            raise ValueError("this Writer already has a DirectPublisher; close that one first")
        if self.interpreted and not _interpreter_requested():
            # shmask.kernels chose the interpreter (no CUDA): the store kernels
            # would take 0.1-1 s a step there, the CPU path under a millisecond.
            self._give_up("no CUDA device (TRITON_INTERPRET=1 runs the direct path in "
                          "Triton's interpreter, for tests)")
            return
        if not self.interpreted and self.device.type != "cuda":
            self._give_up(f"rows live on {self.device}, not on a CUDA device")
            return
        try:
            ring_offset = 0 if self.interpreted else self._register(
                int(ffi.cast("uintptr_t", writer.segment.base)), writer.segment.size)
            direct = ffi.gc(ffi.new("shm_direct *"), lib.shm_direct_free)
            rc = lib.shm_direct_init(direct, table_slots, ring_offset)
            if rc:
                raise RuntimeError(f"shm_direct_init({table_slots} slots) failed ({rc})")
            table = int(ffi.cast("uintptr_t", direct.table))
            table_offset = 0 if self.interpreted else self._register(table, int(direct.table_bytes))
            direct.table_offset = table_offset  # private C memory: the table's device address
            self._arrivals = torch.zeros(1, dtype=torch.int64, device=self.device)
        except Exception as exc:  # noqa: BLE001 - any failure means: the CPU path, said once
            self._unregister()
            self._give_up(f"registration failed: {exc}")
            return
        self._direct = direct
        self._table_device = table + table_offset
        self.active = True
        writer.attach_direct(self)  # the Writer quiesces us around its CPU changes
        lib.shm_direct_push_all(writer.ring_handle, direct)

    # ------------------------------------------------------------ the step
    def publish(self, handles: np.ndarray, rows: Rows, mode: str = "support") -> None:
        """Publish one step's rows: row b goes to the queue of ``handles[b]``.
        SKIPPED rows are left out; every other row travels with its status
        and form, exactly as ``kernels.publish`` sends it.

        The common step is one native call (``shm_direct_step``: the last
        step's counts, the handle checks, room for this step, the table) and
        one launch of the store kernel; nothing waits for the GPU unless the
        last step's kernel is still running."""
        batch = rows.lengths.numel()
        handles = self._checked(handles, batch, mode)
        # All or nothing on every path: the kernel cannot refuse a whole step
        # once one row is too long, so rows that may be are refused here.
        check_fits_writer(self.writer, rows.max_tokens, rows.vocab)
        if rows.ids.get_device() != self._device_index or not self.claim(handles, mode, rows):
            self._publish_on_cpu(handles, rows, mode)
            return
        try:
            self._launch(batch, mode == "support")
        except Exception as exc:  # noqa: BLE001 - the step must still travel
            self.launch_failed(exc, "the store kernel")
            self._publish_on_cpu(handles, rows, mode)
            return
        self.launched(handles, rows, mode)

    def claim(self, handles: np.ndarray, mode: str, rows: Rows | None = None,
              vocab: int | None = None) -> bool:
        """Prepare the table for one step of ``handles`` (``shm_direct_step``);
        True when kernels may now store the step's rows: the caller then
        launches them so that each row commits once (``ring_commit``) and
        arrives once (``ring_arrive``): the store kernel for ``rows``;
        capture's write kernel, or compaction's expand kernel, with
        ``rows=None`` (they compute the rows); then calls :meth:`launched`,
        or :meth:`launch_failed`. False: the CPU path must take the step."""
        if not self.active or handles.size == 0:
            return False
        if mode == "selected" and rows is not None and rows.selected_logprob is None:
            raise ValueError("mode 'selected' needs rows from capture() or sample()")
        if vocab is None:
            assert rows is not None
            vocab = rows.vocab
        if self._reserve_words[0] != vocab:  # id words a row may need: its ids or its bitmask
            self._reserve_words = (vocab, max(self.max_tokens, bitmask_words(vocab)))
        lib, ffi = self._lib, self._ffi
        support = mode == "support"
        addresses = self._addresses
        if rows is not None:  # where the store kernel reads the step's rows
            addresses[0] = rows.status.data_ptr()
            addresses[1] = rows.forms.data_ptr()
            addresses[2] = rows.lengths.data_ptr()
            addresses[3] = rows.id_offsets.data_ptr()
            addresses[4] = rows.offsets.data_ptr()
            addresses[5] = rows.ids.data_ptr()
            addresses[6] = rows.values.data_ptr()
            selected = rows.values if support else rows.selected_logprob
            addresses[7] = selected.data_ptr()  # type: ignore[union-attr]
        else:
            for index in range(8):
                addresses[index] = 0
        c_handles = ffi.from_buffer("int64_t[]", handles)
        args = (self.writer.ring_handle, self._direct, c_handles, handles.size,
                lib.SHM_MODE_SUPPORT if support else lib.SHM_MODE_SELECTED,
                self._reserve_words[1], self.max_tokens if support else 0, addresses, vocab,
                self._bad_row)
        rc = lib.shm_direct_step(*args)
        while rc > 0:  # the last step is still running, or left diverted rows
            self._stats["waits" if rc == lib.SHM_DIRECT_IN_FLIGHT else "diverted_steps"] += 1
            self._settle(pull=False)
            rc = lib.shm_direct_step(*args)
        if rc == lib.SHM_E_DIRECT_COUNTS:
            raise RuntimeError(f"GPU-direct table is inconsistent ({rc}): the kernel and "
                               "the table disagree")
        # rc < 0: a closed queue, two rows of one queue, a slot past the
        # table: the CPU path takes the step (and names a bad handle).
        return rc == 0

    def launched(self, handles: np.ndarray, rows: Rows, mode: str) -> None:
        """The claimed step's kernel is launched; ``rows`` are its rows (kept
        until the next step: a diverted row is fetched from them)."""
        self._last = _Step(handles.copy(), rows, mode)
        self._stats["direct_steps"] += 1

    def launch_failed(self, exc: BaseException, what: str) -> None:
        """The claimed step's launch failed: none of its rows will arrive;
        the publisher closes and every later step takes the CPU path. An
        earlier kernel of the step that did launch (compaction's scan) may
        still be reading the table: the device finishes its work before
        the memory is unregistered."""
        self._lib.shm_direct_cancel(self._direct)
        if not self.interpreted and self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception as error:  # noqa: BLE001 - a broken context runs nothing more
                log.warning("GPU-direct: device sync after the failed launch: %s", error)
        self.close()
        self._give_up(f"launching {what} failed: {exc}")
        self.writer.default_publisher = self  # publisher_for keeps giving this one: the CPU path

    @property
    def table(self) -> int:
        """The table's device address (a kernel argument)."""
        return self._table_device

    @property
    def arrivals(self) -> torch.Tensor:
        """The device counter of finished programs (a kernel argument)."""
        return self._arrivals

    def _checked(self, handles: Any, batch: int, mode: str) -> np.ndarray:
        if mode != "support" and mode != "selected":
            raise ValueError(f"mode must be 'support' or 'selected', got {mode!r}")
        if self._depth:
            raise RuntimeError("publish() inside quiesce(): resume() first")
        if type(handles) is not np.ndarray or handles.dtype != np.int64 or handles.ndim != 1:
            handles = np.ascontiguousarray(handles, dtype=np.int64).ravel()
        if handles.size != batch:
            raise ValueError(f"handles has {handles.size} entries; expected one per row ({batch})")
        return handles

    def _launch(self, batch: int, support: bool) -> None:
        """One launch of the kernel (two arguments: the table and the arrival
        counter). Triton's JIT dispatch binds and specializes every argument
        on each call (tens of microseconds); once compiled, later steps launch
        it with one native call (cuLaunchKernel from the core, where the
        kernel needs nothing else), else through Triton's own launcher."""
        if self.interpreted:
            _direct_kernel[(batch,)](self._table_device, self._arrivals, SUPPORT=support,
                                     BLOCK=_BLOCK)
            return
        launch = self._launchers.get(support)
        if launch is not None:
            try:
                if launch(batch, torch._C._cuda_getCurrentRawStream(self._device_index)):
                    return
            except (TypeError, ValueError, SystemError) as exc:  # another Triton's launcher
                log.warning("GPU-direct: the compiled kernel's launcher refused its arguments "
                            "(%s); launching through Triton's dispatch from now on", exc)
                self._launchers = {True: None, False: None}
        compiled = _direct_kernel[(batch,)](self._table_device, self._arrivals,
                                            SUPPORT=support, BLOCK=_BLOCK)
        if support not in self._launchers:
            native, why = _native_launcher(self._lib, compiled, self._table_device,
                                           self._arrivals)
            self._launchers[support] = native or _fast_launcher(
                compiled, self._table_device, self._arrivals, support)
            self.launcher = "cuLaunchKernel from the core" if native else (
                ("Triton's launcher" if self._launchers[support] else "Triton's dispatch")
                + f" ({why})")
            if native is None:
                log.info("GPU-direct: the store kernel launches through Triton: %s", why)

    @property
    def stats(self) -> dict[str, int]:
        """Steps by path (direct_steps: stored by the GPU, fused_steps of them
        by the kernels that computed the rows: into=), rows diverted (and the steps that had any), steps
        that found the last kernel still running (waits), and queues given
        room before a launch (grown: new buffers and larger ones)."""
        grown = int(self._direct.grown) if self._direct is not None else 0
        return {**self._stats, "grown": grown}

    def wait(self) -> None:
        """Block until the last step's rows are in the ring (diverted ones
        appended by the CPU)."""
        self.quiesce()
        self.resume()

    # ------------------------------------------------- the Writer's hooks
    def quiesce(self) -> None:
        """Before the CPU changes any queue: wait for the last kernel, append
        its diverted rows, and copy the GPU's counts into the queue table."""
        self._depth += 1
        if self._depth == 1 and self.active:
            self._settle(pull=True)

    def resume(self) -> None:
        """After the CPU changed queues: the table describes them again."""
        self._depth -= 1
        if self._depth == 0 and self.active:
            self._lib.shm_direct_push_all(self.writer.ring_handle, self._direct)

    @property
    def quiet(self) -> bool:
        """True while the CPU owns the queues (inside quiesce())."""
        return self._depth > 0 or not self.active

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        self.quiesce()
        try:
            yield
        finally:
            self.resume()

    def close(self) -> None:
        """Wait for the last kernel, then unregister (idempotent). The
        Writer's close calls this before it unmaps the ring. If waiting or
        appending the last diverted rows raises, the memory is unregistered
        and the Writer's hooks removed all the same, then the error is
        raised."""
        try:
            if self.active:
                self._depth += 1
                try:
                    if not self.writer.closed:
                        self._settle(pull=True)
                    else:
                        self._wait_idle()
                finally:
                    self._depth -= 1
                    self._last = None
                    self.active = False
        finally:
            self._unregister()
            self.writer.detach_direct(self)

    def __enter__(self) -> DirectPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _wait_idle(self) -> None:
        """Until the last kernel completed (its `done` store seen). A step's
        kernel takes microseconds once it runs; if it is queued behind long
        work, wait for the device (which also raises a CUDA error)."""
        lib = self._lib
        if lib.shm_direct_wait(self._direct, 100_000_000):
            return
        if not self.interpreted:
            torch.cuda.synchronize(self.device)
        if not lib.shm_direct_idle(self._direct):
            raise RuntimeError("GPU-direct: the last step's kernel completed without "
                               "reporting done: the table and the device disagree")

    def _settle(self, pull: bool) -> None:
        """Wait for the last kernel; if it diverted rows, append them with the
        CPU (after pulling, so they land after the GPU's rows) and give their
        queues room for another row; with ``pull``, copy every queue's
        counts back (the CPU is about to change queues)."""
        self._wait_idle()
        lib, ffi = self._lib, self._ffi
        diverted = lib.shm_direct_diverted(self._direct) != self._direct.diverted_seen
        if pull or diverted:
            self._pull()
        step = self._last
        if not diverted:
            return
        self._depth += 1  # the Writer's hooks inside append_step do nothing
        try:
            marks = np.zeros(0 if step is None else step.handles.size, np.uint8)
            if step is not None:
                lib.shm_direct_diverted_rows(self.writer.ring_handle, self._direct,
                                             ffi.from_buffer("int64_t[]", step.handles),
                                             step.handles.size,
                                             ffi.from_buffer("uint8_t[]", marks,
                                                             require_writable=True))
            if step is not None and marks.any():
                host = self.staging.fetch(step.rows, values=step.mode == "support")
                chosen = (marks != 0) & (host.status != Status.SKIPPED)
                self._stats["diverted_rows"] += int(chosen.sum())
                self._append_rows(step.handles, host, chosen, step.mode)
                nnz = self.max_tokens if step.mode == "support" else 0
                words = max(self.max_tokens, bitmask_words(host.vocab) if host.vocab else 0)
                for handle in step.handles[chosen]:
                    # SHM_FULL here only means the next rows divert again.
                    lib.shm_direct_reserve(self.writer.ring_handle,
                                           int(handle) & self._slot_mask, 1, words, nnz)
        finally:
            self._depth -= 1
        lib.shm_direct_diverted_done(self._direct)
        lib.shm_direct_push_all(self.writer.ring_handle, self._direct)

    def _append_rows(self, handles: np.ndarray, host: Any, chosen: np.ndarray,
                     mode: str) -> None:
        """The CPU path for a subset of a step's rows (flat CSR slices)."""
        index = np.flatnonzero(chosen)
        if index.size == 0:
            return
        id_pieces = [host.ids[host.id_offsets[b]:host.id_offsets[b + 1]] for b in index]
        ids = np.concatenate(id_pieces) if id_pieces else np.zeros(0, np.int32)
        if mode == "support":
            logprobs = np.concatenate([host.values[host.offsets[b]:host.offsets[b + 1]]
                                       for b in index])
        else:
            logprobs = host.selected_logprob[index]
        self.writer.append_step(handles[index], host.lengths[index], ids, logprobs,
                                status=host.status[index], forms=host.forms[index],
                                vocab=host.vocab)

    def _pull(self) -> None:
        rc = self._lib.shm_direct_pull_all(self.writer.ring_handle, self._direct, self._bad_slot)
        if rc:
            raise RuntimeError(f"GPU-direct table entry of queue slot {int(self._bad_slot[0])} "
                               f"is inconsistent ({rc}): the kernel and the table disagree")

    def _publish_on_cpu(self, handles: np.ndarray, rows: Rows, mode: str) -> None:
        host = self.staging.fetch(rows, values=mode == "support")
        append_host_rows(self.writer, handles, host, mode)  # the Writer's hooks quiesce around it
        self._stats["cpu_steps"] += 1

    def _register(self, address: int, size: int) -> int:
        """cudaHostRegister(Mapped | Portable); returns device address - host
        address (0 where the device uses host pointers as they are)."""
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(address, size,
                                     _CUDA_HOST_REGISTER_MAPPED | _CUDA_HOST_REGISTER_PORTABLE)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister({size} bytes) returned CUDA error {code}")
        self._registered.append(address)
        offset = _device_pointer(address) - address
        if offset:
            log.info("GPU-direct: registered memory at %#x is %#x on the device", address,
                     address + offset)
        return offset

    def _unregister(self) -> None:
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        for address in self._registered:
            rc = cudart.cudaHostUnregister(address)
            code = int(getattr(rc, "value", rc))
            if code != 0:
                log.warning("cudaHostUnregister returned CUDA error %d", code)
        self._registered.clear()

    def _give_up(self, reason: str) -> None:
        self.active = False
        self.reason = reason
        log.warning("GPU-direct publishing is off (%s): rows go through HostStaging and "
                    "Writer.append_step", reason)


@dataclass
class Claim:
    """A step claimed for kernels that compute the rows and store them into
    the ring themselves (``into=`` of capture, sample and compact)."""

    publisher: DirectPublisher
    handles: np.ndarray
    mode: str

    def launched(self, rows: Rows) -> None:
        self.publisher.launched(self.handles, rows, self.mode)
        self.publisher._stats["fused_steps"] += 1


def claim_step(target: tuple[Any, Any, str] | None, batch: int, vocab: int) -> Claim | None:
    """For ``into=(writer, handles, mode)`` (check_into's target): the
    step, claimed on the Writer's GPU-direct table, or None where the rows
    must be published after they are computed (no target, the CPU path, a
    step the table cannot take)."""
    if target is None:
        return None
    writer, handles, mode = target
    publisher = publisher_for(writer)
    if not publisher.active:
        return None
    handles = publisher._checked(_handle_array(handles), batch, mode)
    if not publisher.claim(handles, mode, vocab=vocab):
        return None
    return Claim(publisher, handles, mode)


@contextmanager
def launching(claim: Claim | None, what: str) -> Iterator[None]:
    """Around the launches of a claimed step's kernels (``what``): if
    anything raises, the claim is cancelled and the publisher closed (after
    the device finished what was launched), and the exception goes to the
    caller. Only the last kernel may write the table: an earlier one that
    did launch has only read it."""
    try:
        yield
    except BaseException as exc:
        if claim is not None:
            claim.publisher.launch_failed(exc, what)
        raise


def publish(
    writer: Any,
    slots: np.ndarray | Sequence[Any],
    rows: HostRows | Rows,
    mode: str = "support",
) -> np.ndarray | None:
    """Append one step's rows to the transport.

    Device ``Rows`` (what capture / sample / compact return) go through the
    Writer's :class:`DirectPublisher` (:func:`publisher_for`):
    with CUDA (and ``SHMASK_GPU_DIRECT`` not "off") the GPU stores them into
    the ring, one native call and one launch on the CPU; else they are
    fetched into pinned host buffers and appended as below. Returns None
    (their statuses stay on the device). Rows whose ids form may be longer
    than the Writer accepts (the kernel's ``max_tokens`` above
    ``SHMASK_MAX_TOKENS``) are refused whole, on every path, before anything
    is stored (:func:`.host.check_fits_writer`).

    ``HostRows`` (from :meth:`.host.HostStaging.fetch`) are appended by the
    CPU (:func:`.host.append_host_rows`): ``writer.append_step(slots,
    lengths, ids, logprobs, status=, forms=, vocab=)`` with ``ids`` /
    ``logprobs`` the staging views.

    ``slots[b]`` is row b's RowQueue handle (int64 array) or RowQueue. Rows that
    were not opted in (SKIPPED) are left out. Every other row travels exactly
    as it is: in its form (ids or bitmask), with its status, so an OVERFLOW
    (overflow="status") or INVALID row reaches the reader as that status and
    is never mistaken for an empty support. ``mode`` "support" sends the
    support logprobs, "selected" the selected logprob of each row. Returns
    the statuses of the rows sent.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be 'support' or 'selected', got {mode!r}")
    if isinstance(rows, Rows):
        publisher_for(writer).publish(_handle_array(slots), rows, mode)
        return None
    return append_host_rows(writer, slots, rows, mode)


def publish_into(target: tuple[Any, Any, str] | None, rows: Rows) -> Rows:
    """Publish ``rows`` where check_into's ``target`` says (if anywhere)."""
    if target is not None:
        writer, handles, mode = target
        publish(writer, handles, rows, mode)
    return rows


def _handle_array(slots: np.ndarray | Sequence[Any]) -> np.ndarray:
    """RowQueue handles as an int64 array (RowQueues or handles given)."""
    if isinstance(slots, np.ndarray):
        return slots
    return np.array([getattr(s, "handle", s) for s in slots], np.int64)


def publisher_for(writer: DevicePort, max_tokens: int | None = None) -> DirectPublisher:
    """The Writer's DirectPublisher, made on first use: GPU-direct where
    CUDA is present and SHMASK_GPU_DIRECT is not "off", else one that
    takes the CPU path (said once, in a warning). ``max_tokens``: the ids
    each queue is given room for before a step, if this call makes it
    (default: the Writer's SHMASK_MAX_TOKENS)."""
    publisher = writer.default_publisher
    if publisher is None:
        attached = writer.attached
        publisher = attached if isinstance(attached, DirectPublisher) else DirectPublisher(
            writer, max_tokens=max_tokens)
        writer.default_publisher = publisher
    return publisher


def _native_launcher(lib: Any, compiled: Any, table: int,
                     arrivals: torch.Tensor) -> tuple[Any, str]:
    """A launch of the compiled kernel by the core's cuLaunchKernel: one
    native call per step. Only for a kernel whose parameters are 8 bytes
    (the table's address: 4 or 8), the first two ours (the rest the compiler's scratch pointers,
    passed NULL, so only when it asked for no scratch memory), one CTA per
    program, no cluster or cooperative launch. Returns (launch, "") or
    (None, why not): then Triton launches it."""
    metadata = getattr(compiled, "metadata", None)
    asm = getattr(compiled, "asm", None)
    ptx = asm.get("ptx") if asm is not None else None
    if metadata is None or not isinstance(ptx, str):
        return None, "no metadata or PTX on the compiled kernel"
    for name in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, name, 0):
            return None, f"the kernel asks for scratch memory ({name})"
    if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_pdl", False)
            or getattr(metadata, "launch_cooperative_grid", False)):
        return None, "a cluster, PDL or cooperative launch"
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    if entry is None:
        return None, "no .entry in the PTX"
    params = [p.strip() for p in entry.group(1).split(",") if ".param" in p]
    # Triton types an integer argument by its value: the table's address is
    # .u32 where the heap lies below 2^31 (a non-PIE Python). The core hands
    # cuLaunchKernel a pointer to a u64 per parameter; a 4-byte parameter
    # reads its low half (little-endian), which holds the value.
    if not 2 <= len(params) <= 8 or not all(re.search(r"\.[bsu](64|32)\b", p) for p in params) \
            or not all(re.search(r"\.[bsu]64\b", p) for p in params[1:]):
        return None, f"parameters other than 2 to 8 of 8 bytes (the first 4 or 8): {params}"
    try:
        compiled._init_handles()
        function = int(compiled.function)
        threads = int(metadata.num_warps) * int(getattr(metadata, "warp_size", 32))
        shared = int(metadata.shared)
    except (AttributeError, TypeError, ValueError) as exc:
        return None, f"no function handle or launch size ({exc})"
    arrivals_address = arrivals.data_ptr()
    n_params = len(params)

    def launch(batch: int, stream: int) -> bool:
        rc = lib.shm_direct_launch(function, batch, threads, shared, stream, table,
                                   arrivals_address, n_params)
        if rc:
            raise RuntimeError(f"cuLaunchKernel of the store kernel failed ({rc})")
        return True

    return launch, ""


def _fast_launcher(compiled: Any, table: int, arrivals: torch.Tensor, support: bool) -> Any:
    """A launch of the compiled kernel without Triton's per-call binding:
    its launcher with the grid, stream and the two fixed arguments. Returns
    a function that says False when it cannot launch (another Triton's
    launcher signature, or launch hooks set: then Triton's dispatch runs)."""
    from triton import knobs

    try:
        compiled._init_handles()
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None

    def launch(batch: int, stream: int) -> bool:
        runtime = knobs.runtime
        if runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None:
            return False
        run(batch, 1, 1, stream, function, packed, None, None, None, table, arrivals, support,
            _BLOCK)
        return True

    return launch


def _interpreter_requested() -> bool:
    """TRITON_INTERPRET=1 set by the host (the tests, benchmarks/direct.py
    --quick): every kernel, the store kernels included, is meant to run in
    the interpreter. When shmask.kernels chose the interpreter itself (no
    CUDA) the variable is not set, and publishing takes the CPU path."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _device_pointer(address: int) -> int:
    """The device address of registered host memory, from the CUDA driver
    (torch binds no call for it): with unified addressing and
    cudaDevAttrCanUseHostPointerForRegisteredMem (the H200 here) it is the
    host address itself. The driver library is the one torch's context lives
    in (libcuda.so.1 exists once per process, unlike a CUDA runtime, of which
    several copies can be loaded)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"the CUDA driver library is not loadable ({exc})") from None
    get = driver.cuMemHostGetDevicePointer_v2
    get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    get.restype = ctypes.c_int
    pointer = ctypes.c_uint64(0)
    rc = get(ctypes.byref(pointer), ctypes.c_void_p(address), 0)
    if rc != 0 or not pointer.value:
        raise RuntimeError(f"cuMemHostGetDevicePointer returned CUDA error {rc} "
                           f"(device address {pointer.value:#x})")
    return int(pointer.value)

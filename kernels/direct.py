"""GPU-direct publishing (issue 10): the GPU stores each step's rows straight
into their requests' RowQueue buffers in the ring, so the scheduler's CPU
work per step is one counter read, a handle check and one launch.

The ring (and a small device-visible queue table, C memory owned by the
native core) are registered with CUDA as mapped host memory. Each queue's
table entry (``shm_direct_entry`` in native/shmask_core.h) holds the
addresses of its buffer's arrays, its counts and capacities. The kernel,
one program per row, stores an OK row's id data, values, length and flags
byte where the counts say, then advances the counts; a row that does not fit
(or a queue already diverted this step) sets the entry's sticky ``diverted``
flag and bumps a global counter instead, writing nothing. At the next step
(or before any CPU operation on the queues) the CPU waits for the kernel's
event, copies the counts back (``shm_direct_pull_all``), fetches the
diverted rows to the host and appends them with ``Writer.append_step`` in
order (growing those queues), then pushes the table again.

Without CUDA, or when registration fails, :class:`DirectPublisher` falls
back to today's path (:class:`.host.HostStaging` + :func:`.host.publish`)
with one warning; ``DirectPublisher.active`` says which. Under Triton's
interpreter (the CPU tests) the kernel runs on the host and writes the ring
through plain host addresses, so the same code is tested against a real
Writer and Reader; the interpreter needs no registration and no event.

The memory-ordering argument is in docs/architecture.md ("GPU-direct
publishing").
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import Rows, Status, bitmask_words
from .host import HostStaging, publish

__all__ = ["DirectPublisher", "reference_direct"]

log = logging.getLogger("shmask")

_SLOT_BITS = 24  # a RowQueue handle's low 24 bits are its slot (native/shmask_core.h)
_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_BLOCK = 1024  # entries a program stores per loop iteration


# ------------------------------------------------------------------ kernel
@triton.jit
def _direct_kernel(
    table,  # int64: device address of the table (header line, then 64-byte entries)
    handles_ptr, status_ptr, forms_ptr, lengths_ptr, id_offsets_ptr, offsets_ptr,
    ids_ptr, values_ptr, selected_ptr,
    vocab,
    SUPPORT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    table = table.to(tl.int64)  # Triton types a small integer argument as i32
    status = tl.load(status_ptr + b)
    if status != 3:  # Status.SKIPPED: not opted in, nothing travels
        slot = tl.load(handles_ptr + b) & 0xFFFFFF
        entry = table + 64 + slot * 64
        words32 = entry.to(tl.pointer_type(tl.int32))  # counts start at int32 word 8
        rows = tl.load(words32 + 8).to(tl.int64)
        rows_capacity = tl.load(words32 + 9).to(tl.int64)
        words = tl.load(words32 + 10).to(tl.int64)
        words_capacity = tl.load(words32 + 11).to(tl.int64)
        nnz = tl.load(words32 + 12).to(tl.int64)
        nnz_capacity = tl.load(words32 + 13).to(tl.int64)
        queue_vocab = tl.load(words32 + 14)
        diverted = tl.load(words32 + 15)
        form = tl.load(forms_ptr + b)
        length = tl.load(lengths_ptr + b).to(tl.int64)
        id_start = tl.load(id_offsets_ptr + b).to(tl.int64)
        n_words = tl.load(id_offsets_ptr + b + 1).to(tl.int64) - id_start
        bitmask = (status == 0) & (form == 1)
        fits = (diverted == 0) & (rows < rows_capacity) & (words + n_words <= words_capacity)
        if SUPPORT:
            fits = fits & (nnz + length <= nnz_capacity)
        # One vocabulary per buffer (what the CPU path enforces with SHM_E_VOCAB).
        fits = fits & ((bitmask == 0) | (queue_vocab == 0) | (queue_vocab == vocab))
        if fits:
            addresses = entry.to(tl.pointer_type(tl.int64))
            dest_lengths = tl.load(addresses).to(tl.pointer_type(tl.int32))
            dest_flags = tl.load(addresses + 1).to(tl.pointer_type(tl.uint8))
            dest_ids = tl.load(addresses + 2).to(tl.pointer_type(tl.int32))
            dest_logprobs = tl.load(addresses + 3).to(tl.pointer_type(tl.float32))
            offs = tl.arange(0, BLOCK)
            for start in range(0, n_words, BLOCK):
                m = start + offs < n_words
                data = tl.load(ids_ptr + id_start + start + offs, mask=m)
                tl.store(dest_ids + words + start + offs, data, mask=m)
            if SUPPORT:
                value_start = tl.load(offsets_ptr + b).to(tl.int64)
                for start in range(0, length, BLOCK):
                    m = start + offs < length
                    data = tl.load(values_ptr + value_start + start + offs, mask=m)
                    tl.store(dest_logprobs + nnz + start + offs, data, mask=m)
            else:
                tl.store(dest_logprobs + rows, tl.load(selected_ptr + b))
            tl.store(dest_lengths + rows, length.to(tl.int32))
            tl.store(dest_flags + rows, (status | (form << 2)).to(tl.uint8))
            # Counts last; the CPU reads none of this before the kernel's event.
            tl.store(words32 + 8, (rows + 1).to(tl.int32))
            tl.store(words32 + 10, (words + n_words).to(tl.int32))
            tl.store(words32 + 12, (nnz + length).to(tl.int32))
            if bitmask:
                tl.store(words32 + 14, vocab)
        else:
            tl.store(words32 + 15, 1)
            tl.atomic_add(table.to(tl.pointer_type(tl.int64)), 1)


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
        out.append((st | forms[b] << 2, lengths[b], data, logprobs))
    return out


# -------------------------------------------------------------- publisher
@dataclass
class _Step:
    """A launched step: its rows must stay alive until the CPU has seen the
    kernel finish (the diverted rows are fetched from them)."""

    handles: np.ndarray
    rows: Rows
    mode: str
    event: Any  # torch.cuda.Event, or None under the interpreter (it ran synchronously)


class DirectPublisher:
    """Publishes each step's device rows straight into ``writer``'s ring.

    ``publish(handles, rows, mode)`` replaces ``HostStaging.fetch`` +
    ``kernels.publish``: same arguments, no host copy. ``handles`` is the
    int64 numpy array of RowQueue handles (row b -> queue ``handles[b]``, one
    row per queue per step; a step that breaks that, or names a queue the
    table cannot hold, takes the CPU path). ``active`` is False when the
    direct path is unavailable (no CUDA, a registration error, an inline
    transport); every call then takes the CPU path.

    Not thread-safe, like the Writer. ``close()`` (or the Writer's close)
    waits for the last kernel and unregisters the memory.
    """

    def __init__(self, writer: Any, device: torch.device | str | int | None = None, *,
                 reserve_tokens: int | None = None, table_slots: int = 4096) -> None:
        from shmask._native import ffi, lib  # the compiled transport: only this module needs it

        self._ffi, self._lib = ffi, lib
        self.writer = writer
        self.interpreted = _interpreted()
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if self.interpreted or not torch.cuda.is_available()
            else torch.device("cuda", torch.cuda.current_device()))
        if reserve_tokens is None:
            reserve_tokens = writer.config.max_tokens
        if reserve_tokens < 1:
            raise ValueError(f"reserve_tokens must be >= 1, got {reserve_tokens}")
        self.reserve_tokens = reserve_tokens
        self.staging = HostStaging()  # the CPU path and the diverted rows
        self.stats = {"direct_steps": 0, "cpu_steps": 0, "diverted_rows": 0}
        self._direct: Any = None
        self._registered: list[int] = []
        self._inflight: _Step | None = None
        self._depth = 0  # quiesce() nesting: > 0 while the CPU owns the queues
        self._seen = 0  # the table's diverted counter when last read
        self._host_handles: np.ndarray | None = None
        self._device_handles: torch.Tensor | None = None
        self._compiled: dict[tuple, Any] = {}  # specialization -> compiled kernel
        self._bad_row = ffi.new("int64_t *")
        self._bad_slot = ffi.new("uint64_t *")
        self.active = False
        self.reason = ""
        if writer.segment is None:
            self._give_up("the Writer has no ring (SHMASK_TRANSPORT=inline)")
            return
        if writer._direct is not None:
            raise ValueError("this Writer already has a DirectPublisher; close that one first")
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
            table_device = table if self.interpreted else table + self._register(
                table, int(direct.table_bytes))
        except Exception as exc:  # noqa: BLE001 - any failure means: the CPU path, said once
            self._unregister()
            self._give_up(f"registration failed: {exc}")
            return
        self._direct = direct
        self._table_device = table_device
        self.active = True
        writer._direct = self  # the Writer's hooks: quiesce()/resume() around CPU changes
        lib.shm_direct_push_all(writer._ring, direct)

    # ------------------------------------------------------------ the step
    def publish(self, handles: np.ndarray, rows: Rows, mode: str = "support") -> None:
        """Publish one step's rows: row b goes to the queue of ``handles[b]``.
        SKIPPED rows are left out; every other row travels with its status
        and form, exactly as ``kernels.publish`` sends it."""
        if mode not in ("support", "selected"):
            raise ValueError(f"mode must be 'support' or 'selected', got {mode!r}")
        if self._depth:
            raise RuntimeError("publish() inside quiesce(): resume() first")
        batch = rows.lengths.numel()
        if not isinstance(handles, np.ndarray) or handles.dtype != np.int64 or handles.ndim != 1:
            handles = np.ascontiguousarray(handles, dtype=np.int64).ravel()
        if handles.size != batch:
            raise ValueError(f"handles has {handles.size} entries; expected one per row ({batch})")
        if not self.active:
            self._publish_on_cpu(handles, rows, mode)
            return
        if mode == "selected" and rows.selected_logprob is None:
            raise ValueError("mode 'selected' needs rows from capture() or sample()")
        # (a) the last step's diverted rows go first, in order.
        self._depth += 1
        try:
            self._finish_inflight()
        finally:
            self._depth -= 1
        if batch == 0:
            return
        lib = self._lib
        code = lib.SHM_MODE_SUPPORT if mode == "support" else lib.SHM_MODE_SELECTED
        c_handles = self._ffi.from_buffer("int64_t[]", handles)
        if lib.shm_direct_check(self.writer._ring, self._direct, c_handles, batch, code,
                                self._bad_row):
            # A closed queue, two rows of one queue, a slot past the table:
            # the CPU path takes the step (and names a bad handle).
            self._publish_on_cpu(handles, rows, mode)
            return
        # (b) one launch; its rows stay referenced until (a) of the next step.
        device_handles = self._handles_on_device(handles)
        selected = rows.selected_logprob if rows.selected_logprob is not None else rows.values
        self._launch(batch, (self._table_device, device_handles, rows.status, rows.forms,
                             rows.lengths, rows.id_offsets, rows.offsets, rows.ids, rows.values,
                             selected, rows.vocab), mode == "support")
        event = None
        if not self.interpreted:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._inflight = _Step(handles, rows, mode, event)
        self.stats["direct_steps"] += 1

    def _launch(self, batch: int, args: tuple, support: bool) -> None:
        """One launch of the kernel. Triton's JIT dispatch binds and
        specializes every argument on each call (tens of microseconds, most
        of the step's budget); once a kernel is compiled, later steps launch
        the compiled kernel directly while the properties Triton specializes
        on (16-byte alignment of each pointer, integers equal to 1 or
        divisible by 16) are unchanged, else they go through the dispatch."""
        if self.interpreted:
            _direct_kernel[(batch,)](*args, SUPPORT=support, BLOCK=_BLOCK)
            return
        key = (support, *[(a.data_ptr() if isinstance(a, torch.Tensor) else a) % 16 == 0
                          for a in args], args[-1] == 1)
        runner = self._compiled.get(key)
        if runner is not None:
            try:
                runner[(batch, 1, 1)](*args, support, _BLOCK,
                                      stream=torch.cuda.current_stream(self.device).cuda_stream)
                return
            except (TypeError, ValueError, SystemError) as exc:  # another Triton's launcher
                log.warning("GPU-direct: launching the compiled kernel failed (%s); using "
                            "Triton's dispatch from now on", exc)
                self._compiled = _NoCache()
        compiled = _direct_kernel[(batch,)](*args, SUPPORT=support, BLOCK=_BLOCK)
        self._compiled[key] = compiled

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
            self._finish_inflight()
            self._pull()

    def resume(self) -> None:
        """After the CPU changed queues: the table describes them again."""
        self._depth -= 1
        if self._depth == 0 and self.active:
            self._lib.shm_direct_push_all(self.writer._ring, self._direct)

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
        Writer's close calls this before it unmaps the ring."""
        if self.active:
            self._depth += 1
            try:
                if not self.writer.closed:
                    self._finish_inflight()
                    self._pull()
                elif self._inflight is not None and self._inflight.event is not None:
                    self._inflight.event.synchronize()
            finally:
                self._depth -= 1
                self._inflight = None
                self.active = False
        self._unregister()
        if self.writer._direct is self:
            self.writer._direct = None

    def __enter__(self) -> DirectPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _finish_inflight(self) -> None:
        """(a): wait for the last kernel; if it diverted rows, append them
        with the CPU (after pulling, so they land after the GPU's rows) and
        give their queues room for another step. Called with _depth > 0, so
        the Writer's hooks inside append_step do nothing."""
        step = self._inflight
        if step is None:
            return
        if step.event is not None:
            step.event.synchronize()
        self._inflight = None
        diverted = int(self._lib.shm_direct_diverted(self._direct))
        if diverted == self._seen:
            return
        self._seen = diverted
        self._pull()
        lib, ffi = self._lib, self._ffi
        marks = np.zeros(step.handles.size, np.uint8)
        lib.shm_direct_diverted_rows(self.writer._ring, self._direct,
                                     ffi.from_buffer("int64_t[]", step.handles), step.handles.size,
                                     ffi.from_buffer("uint8_t[]", marks, require_writable=True))
        host = self.staging.fetch(step.rows, values=step.mode == "support")
        chosen = (marks != 0) & (host.status != Status.SKIPPED)
        self.stats["diverted_rows"] += int(chosen.sum())
        self._append_rows(step.handles, host, chosen, step.mode)
        words = max(self.reserve_tokens, bitmask_words(host.vocab) if host.vocab else 0)
        nnz = self.reserve_tokens if step.mode == "support" else 0
        for handle in step.handles[chosen]:
            # SHM_FULL here only means the next rows divert again.
            lib.shm_direct_reserve(self.writer._ring, int(handle) & ((1 << _SLOT_BITS) - 1),
                                   1, words, nnz)
        lib.shm_direct_push_all(self.writer._ring, self._direct)

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
        rc = self._lib.shm_direct_pull_all(self.writer._ring, self._direct, self._bad_slot)
        if rc:
            raise RuntimeError(f"GPU-direct table entry of queue slot {int(self._bad_slot[0])} "
                               f"is inconsistent ({rc}): the kernel and the table disagree")

    def _publish_on_cpu(self, handles: np.ndarray, rows: Rows, mode: str) -> None:
        host = self.staging.fetch(rows, values=mode == "support")
        publish(self.writer, handles, host, mode)  # the Writer's hooks quiesce around it
        self.stats["cpu_steps"] += 1

    def _handles_on_device(self, handles: np.ndarray) -> torch.Tensor:
        """The handles as a device tensor, copied only when they changed
        (engines keep one handle array while the batch keeps its requests)."""
        if (self._device_handles is None or self._host_handles is None
                or self._host_handles.shape != handles.shape
                or not np.array_equal(self._host_handles, handles)):
            self._host_handles = handles.copy()
            self._device_handles = torch.from_numpy(self._host_handles).to(self.device)
        return self._device_handles

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


class _NoCache(dict):
    """A launch cache that keeps nothing (the compiled-kernel launch failed)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _interpreted() -> bool:
    from triton import knobs

    return bool(getattr(knobs.runtime, "interpret", False))


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

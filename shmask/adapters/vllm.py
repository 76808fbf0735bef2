"""shmask inside vLLM (0.33): sampling masks through shared memory, references
through vLLM's own msgpack IPC, with its default (secure) settings.

vLLM's engine core sends each request's mask for a step as
`EngineCoreOutput.new_sampling_mask: SamplingMaskLists` (CSR token ids: a
flat `token_ids` array, `offsets` when the step has several positions), and
the frontend's output processor turns the masks it collected into
`SamplingMask(token_ids=[... to_nested_list() ...])`.

With this adapter the scheduler writes the step's rows once into a shmask
ring (`publish_step`: one native append and one native take for the whole
batch) and each request's `new_sampling_mask` carries only its reference:

    SamplingMaskLists(token_ids=<uint8 array: the ChunkRef bytes>,
                      offsets=None,
                      cu_num_generated_tokens=None, or [0, n] when the
                      scheduler kept n < the chunk's rows)

A uint8 ndarray is a type vLLM's MsgpackEncoder serialises natively (dtype
string, shape, raw bytes; below VLLM_MSGPACK_ZERO_COPY_THRESHOLD it rides
inside the message), so the reference passes its encoder and decoder with
VLLM_ALLOW_INSECURE_SERIALIZATION unset, and no field of vLLM's structs
changes. Real token ids are never uint8 (every vocabulary is larger than
256), so the dtype tells a reference from a mask, and the bytes must still
parse as a shmask reference batch of one.

The frontend calls `resolve_outputs` on each message's outputs before vLLM
looks at their masks: it opens the chunk, copies the kept rows into a plain
SamplingMaskLists (exactly what vLLM's own `slice_request` would have sent)
and releases the ring record at once. The copy is deliberate: vLLM keeps a
request's masks until its next delta or its end, which can outlive a lease,
and a released record lets the ring recycle on the next step.

Rows the ring holds as full-vocabulary bitmasks are decoded to ascending ids
there, so vLLM sees the same int32 CSR either way.

A mask that cannot be delivered (a bad or garbled reference, a chunk read
after its lease, a kept row sent without its ids: SamplingMaskLists has no
status) fails its own request, the way vLLM fails one request: the output
gets ``finish_reason=FinishReason.ERROR`` and ``error=RequestError(...)``
naming what was wrong (AsyncLLM raises it to that request's caller as a
500 GenerationError), its mask is None, and ``resolve_outputs`` returns its
id so the frontend aborts it in the engine core. The other outputs of the
message resolve as usual; nothing raises out of ``resolve_outputs``.

Arrays for in-process consumers (``SHMASK_MASK_FORMAT=arrays`` in the
process that runs ``LLM.generate`` / ``AsyncLLM``, or
``MaskResolver(mask_format="arrays")``): vLLM's output processor builds
``CompletionOutput.sampling_mask.token_ids`` from each resolved mask's
``to_nested_list()``; in arrays mode the resolver returns a
``SamplingMaskLists`` subclass (``arrays_mask_type``) whose
``to_nested_list()`` gives each position's ids as a read-only int32 view of
the one copy made out of the ring, so ``sampling_mask.token_ids`` is a list
of numpy arrays (one per generated token, as vLLM's list is) and no Python
int is made per id. ``mask_csr`` joins them into CSR arrays. The default
("lists") leaves vLLM's lists exactly as they are.

docs/integrations/vllm.md has the patch that wires both calls into vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import metrics
from ..config import MASK_FORMATS, Config
from ..errors import InvalidRefError, InvalidRowsError, ShmaskError, StaleChunkError
from ..reader import Reader
from ..refs import ENTRY_DTYPE, KIND_INLINE, KIND_LOST, KIND_SHM, ChunkRef, RefBatch
from ..remote_refs import Leaving, export_or_none, is_remote, pull, pull_one, rows_ride_inline
from ..writer import RowQueue, Writer

log = logging.getLogger("shmask")

REF_DTYPE = np.dtype(np.uint8)
# vLLM masks can be far wider than a top-k support (temperature-only sampling
# keeps the whole vocabulary: Gemma 3's is 262,208), so unless
# SHMASK_MAX_TOKENS says otherwise the adapter accepts rows up to the largest
# length shmask allows (2**22 ids).
VLLM_MAX_TOKENS = 1 << 22
# vLLM emits every step: a queue holds one row, or k + 1 with speculative
# decoding, so a fresh buffer sized for 64 rows would waste ring space.
VLLM_QUEUE_ROWS = 4
_ENTRY_BYTES = ENTRY_DTYPE.itemsize
_REMOTE_MAGIC = b"SMRR"  # a reference from another host's ring (shmask.remote_refs)
# Step headers a resolver remembers (one per engine core's ring and epoch).
_LEADERS_KEPT = 64


class _MaskLists(NamedTuple):
    """Field-for-field stand-in for vllm.v1.outputs.SamplingMaskLists, used
    only where vLLM is not installed (the CPU tests of this adapter)."""

    token_ids: np.ndarray
    offsets: np.ndarray | None = None
    cu_num_generated_tokens: list[int] | None = None

    def to_nested_list(self) -> list[list[int]]:
        ids = self.token_ids.tolist()
        if self.offsets is None:
            return [ids]
        bounds = self.offsets.tolist()
        return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def mask_type() -> type:
    """vLLM's SamplingMaskLists when vLLM is importable, else the stand-in."""
    try:
        from vllm.v1.outputs import SamplingMaskLists
    except ImportError:
        return _MaskLists
    return SamplingMaskLists


class _RequestError(NamedTuple):
    """Field-for-field stand-in for vllm.outputs.RequestError (vLLM not installed)."""

    code: str
    message: str
    retryable: bool = False


# vllm.v1.engine.FinishReason.ERROR, where vLLM is not installed
_FINISH_ERROR = 3
MASK_ERROR_CODE = "sampling_mask_unreadable"


def _request_failure(message: str, retryable: bool, stand_in: bool) -> tuple[Any, Any]:
    """(FinishReason.ERROR, RequestError) as vLLM's engine core sends a
    request-level error (the stand-ins where the resolver uses _MaskLists:
    vLLM is then not imported)."""
    try:
        if stand_in:
            raise ImportError("the resolver runs without vLLM")
        from vllm.outputs import RequestError
        from vllm.v1.engine import FinishReason
    except ImportError:
        return _FINISH_ERROR, _RequestError(MASK_ERROR_CODE, message, retryable)
    return FinishReason.ERROR, RequestError(code=MASK_ERROR_CODE, message=message,
                                            retryable=retryable)


def adapter_config(environ: dict[str, str] | None = None) -> Config:
    """Config.from_env with vLLM's defaults for the settings left unset."""
    env = os.environ if environ is None else environ
    overrides: dict[str, Any] = {}
    # An empty value means unset, as in Config.from_env.
    if not env.get("SHMASK_MAX_TOKENS", "").strip():
        overrides["max_tokens"] = VLLM_MAX_TOKENS
    if not env.get("SHMASK_QUEUE_ROWS", "").strip():
        overrides["queue_rows"] = VLLM_QUEUE_ROWS
    return Config.from_env(env, **overrides)


_ARRAYS_TYPES: dict[type, type] = {}


def arrays_mask_type(base: type | None = None) -> type:
    """A subclass of ``base`` (vLLM's SamplingMaskLists, or the stand-in)
    whose ``to_nested_list()`` returns each position's ids as a read-only
    int32 numpy view instead of a list (arrays mode). Same fields, so vLLM's
    code that slices or inspects the mask sees what it expects."""
    base = base or mask_type()
    cached = _ARRAYS_TYPES.get(base)
    if cached is not None:
        return cached

    def to_nested_list(self: Any) -> list[np.ndarray]:
        ids = self.token_ids.view()
        ids.flags.writeable = False
        if self.offsets is None:
            return [ids]
        bounds = self.offsets.tolist()
        return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def slice_request(self: Any, req_idx: int, num_positions: int) -> Any:
        # vLLM trims a request's mask after a stop string: keep the type.
        sliced = base.slice_request(self, req_idx, num_positions)  # type: ignore[attr-defined]
        return type(self)(*sliced)

    namespace: dict[str, Any] = {"__slots__": (), "to_nested_list": to_nested_list,
                                 "__doc__": f"{base.__name__} whose to_nested_list() gives "
                                            "numpy arrays (shmask arrays mode)."}
    if hasattr(base, "slice_request"):
        namespace["slice_request"] = slice_request
    cached = _ARRAYS_TYPES[base] = type("SamplingMaskArrays", (base,), namespace)
    return cached


def mask_csr(sampling_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids int32 [nnz], offsets int64 [positions + 1]) of a
    CompletionOutput's ``sampling_mask`` (either form): position i's ids are
    ``token_ids[offsets[i]:offsets[i + 1]]``."""
    rows = sampling_mask.token_ids
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, rows), np.int64, len(rows)), out=offsets[1:])
    if not rows:
        return np.zeros(0, np.int32), offsets
    return np.concatenate([np.asarray(r, np.int32) for r in rows]), offsets


def is_ref(mask: Any) -> bool:
    """True if `mask` (a SamplingMaskLists) carries a shmask reference."""
    token_ids = getattr(mask, "token_ids", None)
    return isinstance(token_ids, np.ndarray) and token_ids.dtype == REF_DTYPE


# ------------------------------------------------------------- producer

class MaskPublisher:
    """The engine core's side (the scheduler process): one per process.

    Requests map to a pool of RowQueues by their index in the step's batch;
    every queue is taken every step, so a queue is empty again before the
    next step hands it to whichever request sits at that index.
    """

    def __init__(self, writer: Writer | None = None, mask_lists: type | None = None) -> None:
        # To a front-end on another host (outputs_go_to): the rows ride
        # inline in their references, or stay in the ring for it to pull
        # through NIXL (SHMASK_REMOTE=nixl).
        self.leaving: Leaving | None = None
        if writer is None:
            writer, self.leaving = _writer_for(adapter_config(), _outputs["head"])
            self._own_writer = True
        else:
            self._own_writer = False
        self.writer = writer
        self._mask_lists = mask_lists or mask_type()
        # Unclaimed chunks (requests the scheduler did not emit this step)
        # are given back through a reader, as a frontend would.
        self._reader = Reader(self.writer.config)
        self._queues: list[RowQueue] = []
        self._handles = np.zeros(0, np.int64)
        self._zeros = np.zeros(0, np.float32)
        self._last: StepMasks | None = None
        # A step the GPU is storing (publish_device), taken before any other
        # step touches the queues
        self._device_step: Any = None

    def publish_step(self, masks: Any) -> StepMasks | None:
        """Write one step's masks (vLLM's batch SamplingMaskLists) into the
        ring. The result answers `slice_request(req_index, num_positions)`
        like the SamplingMaskLists it replaces. None passes through, and so
        does a step the model runner already published from the GPU (a
        StepMasks: shmask/adapters/vllm_gpu.py)."""
        self.finish_step()
        if isinstance(masks, StepMasks):
            self._last = masks
            return masks
        self.take_device_step()
        if masks is None:
            return None
        token_ids = np.asarray(masks.token_ids)
        if masks.offsets is None:  # one position of one request
            offsets = np.array([0, token_ids.size], np.int64)
        else:
            offsets = np.asarray(masks.offsets, np.int64)
        rows = offsets.size - 1
        cu = masks.cu_num_generated_tokens
        if cu is None:
            rows_per_request: np.ndarray = np.ones(rows, np.int64)
        else:
            rows_per_request = np.diff(np.asarray(cu, np.int64))
            if rows_per_request.sum() != rows or np.any(rows_per_request < 0):
                raise InvalidRowsError(f"cu_num_generated_tokens {cu} does not cover {rows} rows")
        requests = rows_per_request.size
        self._grow(requests, rows)
        handles = self._handles[:requests]
        try:
            if rows:
                row_handles = handles if cu is None else np.repeat(handles, rows_per_request)
                # vLLM masks have no values: selected mode with a zero per row
                # costs 4 bytes a row and keeps the ring's record format.
                self.writer.append_step(row_handles, np.diff(offsets).astype(np.int32),
                                        token_ids[offsets[0]:offsets[-1]], self._zeros[:rows])
            batch = self.writer.take_batch(handles)
        except ShmaskError as exc:
            # Never take the engine core down for a mask: this step's masks
            # travel as vLLM's own object (the frontend passes them through).
            log.error("sampling masks of this step sent without shmask: %s", exc)
            self._reset_queues()
            return masks
        self._last = StepMasks(batch, rows_per_request, self._mask_lists, self.leaving)
        return self._last

    def publish_device(self, direct: Any, rows: Any, tensors: Any) -> Any:
        """One step's device rows (``rows_from_fixed`` of vLLM's
        SamplingMaskTensors, one row per request) stored into the ring by
        ``direct``, the Writer's GPU-direct publisher; returns the
        DeviceStep that stands for them. The previous device step is taken
        first: its kernel ran before this step's sampler, and its queues are
        this step's."""
        from .vllm_gpu import DeviceStep

        self.take_device_step()
        requests = rows.lengths.numel()
        self._grow(requests, requests)
        handles = self._handles[:requests]
        direct.publish(handles, rows, "selected")  # GPU-direct; its own CPU path past that
        self._device_step = DeviceStep(self, handles, tensors)
        return self._device_step

    def take_device_step(self) -> StepMasks | None:
        """Take the step the GPU stored last (its rows are in their queues
        once its kernel finished: the take waits for that); its StepMasks,
        also kept for its ``tolists``."""
        step, self._device_step = self._device_step, None
        return None if step is None else step.take()

    def _step_of(self, handles: np.ndarray) -> StepMasks:
        """The chunks of one request a queue, taken as one batch."""
        batch = self.writer.take_batch(handles)
        return StepMasks(batch, np.ones(handles.size, np.int64), self._mask_lists, self.leaving)

    def _reset_queues(self) -> None:
        # Whatever a failed step left staged must not leak into the next one.
        for queue in self._queues:
            queue.close()
        self._queues.clear()
        self._handles = np.zeros(0, np.int64)

    def finish_step(self) -> int:
        """Give back the last step's chunks that no request claimed (called by
        the next publish_step and by close). Returns how many."""
        last, self._last = self._last, None
        return last._discard_unclaimed(self._reader) if last is not None else 0

    def close(self) -> None:
        self.finish_step()
        try:
            untaken = self.take_device_step()  # published, never handed to the scheduler
            if untaken is not None:
                untaken._discard_unclaimed(self._reader)
        except ShmaskError as exc:
            log.warning("the last device step's masks could not be given back: %s", exc)
        self._reader.close()
        for queue in self._queues:
            queue.close()
        self._queues.clear()
        if self.leaving is not None:
            self.leaving.close()
        if self._own_writer:
            self.writer.close()

    def _grow(self, requests: int, rows: int) -> None:
        while len(self._queues) < requests:
            self._queues.append(self.writer.open_queue("selected"))
        if self._handles.size < requests:
            self._handles = np.array([q.handle for q in self._queues], np.int64)
        if self._zeros.size < rows:
            self._zeros = np.zeros(max(rows, 2 * self._zeros.size), np.float32)


class StepMasks:
    """One step's masks in the ring; what the scheduler slices per request."""

    __slots__ = ("batch", "_rows", "_kinds", "_claimed", "_refs", "_mask_lists", "_remote")

    def __init__(self, batch: RefBatch, rows_per_request: np.ndarray, mask_lists: type,
                 leaving: Leaving | None = None) -> None:
        self.batch = batch
        self._rows = rows_per_request.tolist()
        self._kinds = batch.entries["kind"].tolist()
        self._claimed = bytearray(len(batch))  # 1 once sliced
        self._mask_lists = mask_lists
        # A request's reference is a batch of one: every ring request's laid
        # out at once (RefBatch.one_entry_batches), a row each; a slice is
        # then a view of its row (no bytes joined, no RefBatch round trip).
        self._refs = (batch.one_entry_batches() if KIND_SHM in self._kinds
                      else np.zeros((0, 0), REF_DTYPE))
        # for a front-end on another host: each ring reference behind the
        # export's descriptor (shmask.remote_refs)
        self._remote = (None if leaving is None
                        else np.frombuffer(leaving.prefix, REF_DTYPE))

    def __len__(self) -> int:
        return len(self._rows)

    def slice_request(self, req_idx: int, num_positions: int) -> Any:
        """Request `req_idx`'s mask for its first `num_positions` positions,
        as a SamplingMaskLists carrying the chunk's reference."""
        if not 0 <= req_idx < len(self._rows):
            raise IndexError(f"request index {req_idx} outside this step's {len(self._rows)}")
        rows = self._rows[req_idx]
        if not 0 < num_positions <= rows:
            raise InvalidRowsError(
                f"request {req_idx} has {rows} mask rows this step; asked for {num_positions}")
        if self._claimed[req_idx]:
            # Two references to one chunk would release it twice.
            raise InvalidRowsError(f"request {req_idx}'s mask was sliced already this step")
        self._claimed[req_idx] = 1
        if self._kinds[req_idx] == KIND_SHM:
            ref = self._refs[req_idx]
            if self._remote is not None:
                ref = np.concatenate((self._remote, ref))
        else:  # inline (the ring was full): the payload rides in the reference
            ref = np.frombuffer(self.batch[req_idx].to_bytes(), REF_DTYPE)
        kept = None if num_positions == rows else [0, num_positions]
        return self._mask_lists(ref, None, kept)

    def _discard_unclaimed(self, reader: Reader) -> int:
        kinds = np.asarray(self._kinds, np.uint8)
        claimed = np.frombuffer(self._claimed, np.uint8)
        unclaimed = np.flatnonzero((claimed == 0) & (kinds == KIND_SHM))
        if unclaimed.size == 0:
            return 0
        return reader.discard_batch(self.batch.select(unclaimed))


# ------------------------------------------------------------- consumer

class MaskResolver:
    """The frontend's side (the output processor's process)."""

    def __init__(self, reader: Reader | None = None, mask_lists: type | None = None,
                 mask_format: str | None = None) -> None:
        self.reader = reader if reader is not None else Reader(adapter_config())
        self._mask_lists = mask_lists or mask_type()
        # "lists": vLLM's own type (it builds lists); "arrays": the subclass
        # whose to_nested_list gives numpy views (SHMASK_MASK_FORMAT).
        self.mask_format = mask_format or self.reader.config.mask_format
        if self.mask_format not in MASK_FORMATS:
            raise ShmaskError(f"mask_format={self.mask_format!r} is invalid: accepted "
                              f"{', '.join(MASK_FORMATS)}")
        self._resolved_type = (arrays_mask_type(self._mask_lists) if self.mask_format == "arrays"
                               else self._mask_lists)
        # a step reference's header and segment table, checked -> its segment
        self._leaders: dict[bytes, tuple[str, int, int]] = {}

    def resolve(self, mask: Any) -> Any:
        """The SamplingMaskLists vLLM would have sent (in arrays mode, the
        ``arrays_mask_type`` subclass): token ids copied out of the ring
        (int32, rows sent as bitmasks decoded), offsets when there are
        several positions. A mask that is not a reference (or None) is
        returned as it is. A kept row whose status is not OK (sent without
        its ids) raises RowDroppedError: vLLM's lists cannot say so."""
        if not is_ref(mask):
            return mask
        return self._resolve(_chunk_ref(_ref_bytes(mask)), mask.cu_num_generated_tokens)

    def resolve_output(self, output: Any) -> None:
        """Resolve `output.new_sampling_mask` in place (an EngineCoreOutput)."""
        if is_ref(output.new_sampling_mask):
            output.new_sampling_mask = self.resolve(output.new_sampling_mask)

    def resolve_outputs(self, outputs: Sequence[Any]) -> list[str]:
        """resolve_output for every EngineCoreOutput of one message, the
        references of one producer's step copied out together. Returns the
        ids of the requests that failed here and were still running in the
        engine core (the frontend aborts them there). Never raises: each
        reference is its own request's (``_resolve_into``).

        A step's references share their header and segment table and differ
        only in their 48-byte entry: they are laid side by side as one
        table and the native core copies and releases them all in one call
        (Reader.copy_ref_table), after the leader's header was checked once
        (and remembered: the next steps repeat it). Any other reference
        (inline, another engine's ring, one the core would not take) is
        resolved on its own, which says what was wrong with it."""
        # the outputs carrying a reference (is_ref), in one pass
        pending: list[Any] = []
        refs: list[np.ndarray] = []
        kept: list[Any] = []
        for output in outputs:
            mask = output.new_sampling_mask
            token_ids = getattr(mask, "token_ids", None)
            if isinstance(token_ids, np.ndarray) and token_ids.dtype == REF_DTYPE:
                pending.append(output)
                refs.append(token_ids)
                kept.append(getattr(mask, "cu_num_generated_tokens", None))
        failed: list[str] = []
        if not pending:
            return failed
        try:
            done = self._copy_step(pending, refs, kept, failed)
        except Exception:  # noqa: BLE001 - then each reference is resolved on its own
            done = ()
        if len(done) == len(pending):  # the usual step: every reference copied together
            return failed
        for index, output in enumerate(pending):
            if index not in done:
                self._resolve_into(
                    output, lambda o=output: _chunk_ref(_ref_bytes(o.new_sampling_mask)), failed)
        return failed

    def _copy_step(self, pending: list[Any], refs: list[np.ndarray], kept: list[Any],
                   failed: list[str]) -> Collection[int]:
        """The step's references copied out and released by one native call;
        returns the indices (into pending) of the outputs resolved so (or
        failed: into ``failed``, as _resolve_into fails them)."""
        first = refs[0]
        if first.ndim != 1:
            return set()
        if first[:4].tobytes() == _REMOTE_MAGIC:
            # One message comes from one engine core: from another host,
            # all its references are remote, pulled in one pull; they come
            # back inline and are each resolved on their own.
            self._pull_remote(pending, [r.tobytes() if r.ndim == 1 else None for r in refs])
            return set()
        stride = first.size
        segment = self._leader_segment(first)
        if segment is None:
            return set()
        # the references laid out as the leader (1-D, its length), one table;
        # the usual step's are all so, checked by one C-level pass of len()
        # (np.concatenate then refuses one that is not 1-D: each resolves alone)
        grouped: Sequence[int] = range(len(refs))
        same = refs
        if list(map(len, refs)).count(stride) != len(refs):
            grouped = [i for i, ref in enumerate(refs) if ref.ndim == 1 and ref.size == stride]
            same = [refs[i] for i in grouped]
        table = np.concatenate(same).reshape(len(grouped), stride)
        keep = None
        if kept.count(None) != len(kept):  # several positions (speculative decoding)
            entries = np.ascontiguousarray(table[:, stride - _ENTRY_BYTES:]).view(ENTRY_DTYPE)
            keep = entries["rows"].reshape(-1).astype(np.uint32)
            for j, i in enumerate(grouped):
                if kept[i] is not None:
                    try:
                        keep[j] = _kept_positions(kept[i])
                    except Exception:  # noqa: BLE001 - the usual path says what was wrong
                        keep[j] = 0  # never copied
        ids, starts, row_first, row_lengths, copied = self.reader.copy_ref_table(
            table, segment, keep)
        # From here on the copied records are released: each output gets its
        # rows, or fails alone (never a second open of a released record).
        resolved = self._resolved_type
        bounds = starts.tolist()
        which = range(len(grouped)) if copied.all() else np.flatnonzero(copied).tolist()
        single = row_first[-1] == len(which)  # one position each (no speculative decoding)
        rows = [] if single else row_first.tolist()
        for j in which:
            output = pending[grouped[j]]
            try:
                if single:
                    output.new_sampling_mask = resolved(ids[bounds[j]:bounds[j + 1]])
                    continue
                lengths = row_lengths[rows[j]:rows[j + 1]]
                offsets = None  # several positions: vLLM's int64 offsets
                if len(lengths) > 1:
                    offsets = np.zeros(len(lengths) + 1, np.int64)
                    np.cumsum(lengths, out=offsets[1:])
                output.new_sampling_mask = resolved(ids[bounds[j]:bounds[j + 1]], offsets)
            except Exception as exc:  # noqa: BLE001 - this request's alone
                _fail(output, exc, failed, stand_in=self._mask_lists is _MaskLists)
        if len(which) == len(pending):
            return range(len(pending))  # every one (grouped is all of pending, in order)
        return {grouped[j] for j in which}

    def _leader_segment(self, first: np.ndarray) -> tuple[str, int, int] | None:
        """The segment of a step's first reference if it is a canonical
        batch of one ring entry naming one segment (the form StepMasks
        sends), else None. Its header and segment table are checked once
        and remembered by their bytes (the entry itself the core checks)."""
        data = first.tobytes()
        prefix = data[:-_ENTRY_BYTES]
        segment = self._leaders.get(prefix)
        if segment is not None:
            return segment
        leader = RefBatch.from_bytes(data)
        if not (len(leader) == 1 and len(leader.segments) == 1
                and leader.entries["kind"][0] == KIND_SHM
                and RefBatch.build(leader.segments, leader.entries).to_bytes() == data):
            return None
        if len(self._leaders) >= _LEADERS_KEPT:  # a ring per engine core: a few at most
            self._leaders.clear()
        segment = self._leaders[prefix] = leader.segments[0]
        return segment

    def _pull_remote(self, pending: list[Any], datas: list[bytes | None]) -> None:
        """References from an engine core on another host (SHMASK_REMOTE=nixl
        there): their rows pulled through NIXL in one pull per engine core,
        each reference then an inline one (in `pending`). A pull
        that fails (NIXL missing here, its agent down) leaves them remote:
        each then fails alone, saying why."""
        remote = [i for i, data in enumerate(datas)
                  if data is not None and data.startswith(_REMOTE_MAGIC)]
        try:
            pulled = pull([datas[i] for i in remote])  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - said per request by _resolve_into
            log.warning("sampling masks from another host not pulled: %s", exc)
            return
        for i, ref in zip(remote, pulled, strict=True):
            if ref is not None:
                mask = pending[i].new_sampling_mask
                pending[i].new_sampling_mask = self._mask_lists(
                    np.frombuffer(ref, REF_DTYPE), None, mask.cu_num_generated_tokens)

    def _resolve_into(self, output: Any, ref: Any, failed: list[str]) -> None:
        """One output's mask, resolved in place. A bad or late reference, or a
        row sent without its ids, fails that request alone (``_fail``), never
        the others nor the output handler's loop."""
        try:
            output.new_sampling_mask = self._resolve(
                ref(), output.new_sampling_mask.cu_num_generated_tokens)
        except Exception as exc:  # noqa: BLE001 - any read failure costs this request only
            _fail(output, exc, failed, stand_in=self._mask_lists is _MaskLists)

    def _resolve(self, ref: ChunkRef, kept: Sequence[int] | None) -> Any:
        if ref.kind not in (KIND_SHM, KIND_INLINE, KIND_LOST):
            raise InvalidRefError(f"{ref!r} carries no rows")
        # (a LOST one, a forwarding hop's or a pull's, raises its reason at open)
        with self.reader.open(ref) as chunk:
            positions = chunk.rows if kept is None else _kept_positions(kept)
            if not 0 < positions <= chunk.rows:
                raise InvalidRefError(f"mask reference keeps {positions} of {chunk.rows} rows")
            # SamplingMaskLists has no status: a row sent without its ids
            # (OVERFLOW, INVALID) fails this output rather than pass as empty.
            chunk.check_rows(0, positions)
            ids, offsets = chunk._csr_arrays()  # bitmask rows decoded; checked below
            token_ids = ids[:int(offsets[positions])].copy()
            out_offsets = None if positions == 1 else offsets[:positions + 1].copy()
            chunk.check()  # the copy is good only if the record was not reclaimed under it
        return self._resolved_type(token_ids, out_offsets)

    def close(self) -> None:
        self.reader.close()


def _fail(output: Any, exc: Exception, failed: list[str], stand_in: bool) -> None:
    """Finish `output`'s request with an error, as vLLM's engine core
    finishes a request that failed alone: FinishReason.ERROR and a
    RequestError naming what was wrong; no mask. A request the engine core
    is still running goes into `failed` (to be aborted there)."""
    request_id = getattr(output, "request_id", "?")
    message = f"sampling mask could not be read ({type(exc).__name__}: {exc})"
    log.error("request %s failed: %s", request_id, message)
    running = getattr(output, "finish_reason", None) is None
    output.new_sampling_mask = None
    # A read after the lease (a frontend that fell behind) may succeed again.
    output.finish_reason, output.error = _request_failure(
        message, retryable=isinstance(exc, StaleChunkError), stand_in=stand_in)
    if running:
        failed.append(request_id)


def _ref_bytes(mask: Any) -> bytes:
    token_ids = mask.token_ids
    if token_ids.ndim != 1:
        raise InvalidRefError(f"a mask reference is 1-D, got shape {token_ids.shape}")
    return token_ids.tobytes()


def _chunk_ref(data: bytes) -> ChunkRef:
    # a remote reference not pulled with its message's: pulled alone here,
    # or the reason it cannot be (RemoteChunkError, InvalidRefError)
    return ChunkRef.from_bytes(pull_one(data) if is_remote(data) else data)


def _kept_positions(kept: Sequence[int]) -> int:
    if len(kept) != 2 or kept[0] != 0:
        raise InvalidRefError(f"mask reference cu_num_generated_tokens {kept!r}: expected [0, n]")
    return int(kept[1])


# ------------------------------------------------ other hosts
# Where this engine core's outputs go when that is another host (set by
# outputs_go_to before the Scheduler, hence the publisher, is made).
_outputs: dict[str, str | None] = {"head": None}


def outputs_go_to(addresses: Sequence[str] | None) -> str | None:
    """Engine-core start-up (the patched EngineCoreProc.__init__, before its
    Scheduler): ``None`` when the front-end that receives this engine
    core's outputs is on this host (vLLM's ``local_client``), else the
    front-end's output addresses (``addresses.outputs``: a headless engine
    core of a data-parallel deployment spread over nodes). Returns the
    head's host ("" if unknown), for SHMASK_REMOTE_IP's default route."""
    if addresses is None:
        _outputs["head"] = None
        return None
    head = ""
    for address in addresses:
        if isinstance(address, str) and address.startswith("tcp://"):
            head = address[len("tcp://"):]
            break
    _outputs["head"] = head
    return head


def _writer_for(config: Config, head: str | None) -> tuple[Writer, Leaving | None]:
    """The publisher's Writer (and the ring's NIXL export) for outputs that
    stay on this host (head None) or go to `head`."""
    if head is None or config.transport == "inline":
        return Writer(config), None
    if not rows_ride_inline(config, head, "this engine core's outputs"):
        writer = Writer(config)
        leaving = export_or_none(writer, config, head)
        if leaving is not None:
            return writer, leaving
        writer.close()
    return Writer(dataclasses.replace(config, transport="inline")), None


# ------------------------------------------------ process-wide entry points
# What the vLLM patch calls: one publisher per engine-core process, one
# resolver per frontend process, created on first use.
_publisher: MaskPublisher | None = None
_resolver: MaskResolver | None = None


def _enable_metrics(log_stats: bool, labels: Mapping[str, Any] | None) -> bool:
    if not log_stats or metrics.enabled():
        return metrics.enabled()
    try:
        metrics.enable(labels={str(k): v for k, v in (labels or {}).items() if v is not None})
    except (ImportError, ValueError) as exc:
        log.warning("shmask metrics not enabled: %s", exc)  # vLLM's own go on
        return False
    return True


def start_engine_core(*, log_stats: bool = False,
                      metrics_labels: Mapping[str, Any] | None = None) -> MaskPublisher:
    """Engine-core start-up with ``return_sampling_mask`` on (the patched
    Scheduler.__init__ calls it): the process's publisher and its ring are
    made now, not at the first step with masks (a 1 GiB ring takes
    seconds), and shmask.metrics are enabled when vLLM's ``log_stats`` is
    on, with ``metrics_labels`` (e.g. vLLM's ``{"model_name": ...,
    "engine": ...}``) on every series. The engine core's series reach
    vLLM's /metrics only in prometheus_client's multiprocess mode
    (PROMETHEUS_MULTIPROC_DIR, which ``vllm serve --api-server-count`` > 1
    sets up; docs/metrics.md). Returns the publisher."""
    global _publisher
    on = _enable_metrics(log_stats, metrics_labels)
    if _publisher is None:
        _publisher = MaskPublisher()
    if on:
        _publisher.writer.sync_metrics()
    return _publisher


def start_frontend(*, log_stats: bool = False,
                   metrics_labels: Mapping[str, Any] | None = None) -> None:
    """Frontend start-up (the patched OutputProcessor.__init__ calls it):
    shmask's reader metrics on when vLLM's ``log_stats`` is. The resolver
    itself stays lazy: it is cheap, and made only if references arrive."""
    _enable_metrics(log_stats, metrics_labels)


def publish_step(masks: Any) -> StepMasks | None:
    """Engine core: this step's masks into the ring (None passes through)."""
    global _publisher
    if masks is None and _publisher is None:
        return None
    if _publisher is None:
        _publisher = MaskPublisher()
    return _publisher.publish_step(masks)


def resolve_outputs(outputs: Sequence[Any]) -> list[str]:
    """Frontend: replace every reference in the outputs' `new_sampling_mask`
    by the mask it stands for (EngineCoreOutputs.outputs, before vLLM reads
    them). A request whose mask cannot be read fails alone (finish reason
    ERROR with a RequestError); returns the ids of those still running in
    the engine core, for the frontend to abort (its reqs_to_abort)."""
    global _resolver
    if _resolver is None:
        if not any(is_ref(o.new_sampling_mask) for o in outputs):
            return []  # shmask off on the engine side: create nothing here
        _resolver = MaskResolver()
    return _resolver.resolve_outputs(outputs)

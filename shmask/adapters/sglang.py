"""shmask under SGLang's sampling-mask types (SGLang 0.5.23,
``sglang/srt/sampling/sampling_mask.py``).

SGLang's scheduler keeps one ``SamplingMaskRows`` per request
(``append`` per generated token, ``take`` per emission); the emission carries
one ``SamplingMaskChunk`` per request in ``output_token_sampling_mask`` of
``BatchTokenIDOutput`` / ``BatchStrOutput`` (msgspec Structs, sent by msgpack
or pickle), the detokenizer forwards the list, the multi-tokenizer router
splits it by index, and the tokenizer manager calls
``chunk.to_lists(support_logprobs=...)`` and accumulates the lists into
``meta_info``. This module provides types with the same names, methods and
semantics whose rows live in a shmask ring:

- ``SamplingMaskRows``: ``append`` / ``view`` / ``take`` as SGLang's, staged
  per writer and copied into the ring by one ``Writer.append_step`` (a
  request's rows keep their order); ``append_step`` is the vectorised per-step
  path a batch result processor calls with its [R, W] host arrays and
  statuses; ``take_all`` takes a whole emission in one native call.
- ``SamplingMaskChunk``: a msgspec Struct (``gc=False``: never GC-tracked)
  holding only the encoded ``ChunkRef`` (~100 bytes). msgspec encodes it
  natively, so SGLang's enc_hook/ext_hook pass it untouched and its typed
  decoder rebuilds it; pickle (any protocol) carries only the ref bytes.
  ``lengths`` / ``token_ids`` / ``logprobs`` open the rows lazily, as numpy
  views of the ring, through one process-wide ``shmask.Reader`` (rows sent
  as bitmasks are decoded: ``token_ids`` is then a copy).
- ``response_meta_info``: the three meta_info fields as ``orjson.Fragment``s
  (plus the count), byte-identical under orjson to what SGLang builds from
  its lists, without a Python object per row or value; with ``raw=True`` as
  ``shmask.response_json.RawJSON`` for ``shmask.response_json.dumps`` (one
  copy fewer). ``meta_info_rows(chunk)``: one open chunk's fields as holes
  that ``dumps`` fills straight from the ring (no copy before the response's
  own bytes).

Rows whose status is not OK (a producer under the ``overflow="status"``
policy sends OVERFLOW / INVALID rows with their status and no ids; SGLang
aborts such requests) are None in ``to_lists`` (in place of the ids list and
of the logprobs list or value) and null in the JSON parts, never an empty
row; ``status`` gives each row's status.

Arrays for in-process consumers (``SHMASK_MASK_FORMAT=arrays``, or
``configure(mask_format="arrays")``): an RL framework that runs SGLang's
``Engine`` in its own process receives the meta_info objects themselves, so
``lists_or_abort`` copies each chunk's rows once out of the ring, straight
into the request's ``SamplingMaskCSR`` (numpy buffers that grow by
doubling), releases the record, and the two meta_info fields hold that
object (``output_token_sampling_mask``) and its ``SamplingLogprobsCSR``
face (``output_token_sampling_logprobs``): no Python list per row, no
Python number per value. Both support what SGLang does with its lists
(``len``, ``[offset:]`` for incremental streaming, iteration when it
coalesces queued chunks). The default stays "lists": SGLang's lists, exactly.

Failures (``lists_or_abort``, what the patched tokenizer manager calls in
place of ``to_lists``): a chunk that cannot be read (read after
``SHMASK_LEASE_S``, a bad reference) finishes its own request with an abort
finish reason carrying the error, as SGLang finishes a failed request; the
other requests of the message and the tokenizer's loop go on.

Start-up (``start_scheduler`` / ``start_tokenizer``, called once per
process by the patched Scheduler / TokenizerManager ``__init__``): the
rank's ring is created before the first request (a 1 GiB ring takes
seconds to create; lazily, the first masked request would pay it),
SHMASK_MAX_TOKENS is checked against ``--sampling-mask-max-tokens``, and
shmask's metrics are turned on when SGLang's ``--enable-metrics`` is.

Several nodes (``--nnodes`` > 1): SGLang's tokenizer runs on node 0 only,
so the schedulers of ``--node-rank`` 1 and above send their rows to another
host (``outputs_leave_host``). With ``SHMASK_REMOTE=off`` (the default)
their chunks ride inline in their references; with ``SHMASK_REMOTE=nixl``
their ring is exported to NIXL and each reference carries the export's
descriptor (shmask.remote_refs): ``lists_or_abort`` pulls the rows of a
message's remote chunks in one NIXL READ batch per scheduler
(``pull_message``) before reading the first. Never a RemoteChunkError.

Lifetime (the ring record of a chunk): ``to_lists`` builds the lists and then
releases the record (SGLang calls it once per chunk); ``release()`` gives it
back without reading (an aborted request whose chunk arrives after its state
was deleted); a chunk never released is reclaimed by the producer after
``SHMASK_LEASE_S`` (logged). Views from ``lengths`` / ``token_ids`` /
``logprobs`` are valid until the release.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

try:
    import msgspec
except ImportError as exc:  # exercised in a subprocess by tests/test_adapter_sglang.py
    raise ImportError(
        f"shmask.adapters.sglang needs msgspec ({exc}): pip install 'shmask[msgpack]' "
        "(SGLang itself depends on it, so a working SGLang install has it)") from exc
import numpy as np
import orjson

from .. import metrics
from ..chunk import ROW_OK, Chunk
from ..config import MASK_FORMATS, Config
from ..errors import ConfigError, InvalidRefError, InvalidRowsError, SegmentError, ShmaskError
from ..reader import Reader
from ..refs import MODE_SELECTED, MODE_SUPPORT, ChunkRef, RefBatch
from ..remote_refs import export_or_none, is_remote, plain, pull, pull_one, rows_ride_inline
from ..response_json import RawJSON
from ..writer import RowQueue, Writer, _as_array

log = logging.getLogger("shmask")

__all__ = [
    "SamplingLogprobsCSR",
    "SamplingMaskCSR",
    "SamplingMaskChunk",
    "SamplingMaskJSON",
    "SamplingMaskRows",
    "append_step",
    "configure",
    "default_reader",
    "default_writer",
    "flush",
    "lists_or_abort",
    "mask_format",
    "outputs_leave_host",
    "pull_message",
    "release_chunk",
    "response_meta_info",
    "split_refs",
    "start_scheduler",
    "start_tokenizer",
    "take_all",
]

MASK_FIELD = "output_token_sampling_mask"
LOGPROBS_FIELD = "output_token_sampling_logprobs"
LENGTH_FIELD = "output_token_sampling_mask_length"
STATUS_OK = 0  # sglang.srt.layers.logits_processor.SamplingMaskStatus.OK

# -------------------------------------------------------- process-wide ends
_ends: dict[str, Any] = {"writer": None, "reader": None, "mask_format": None,
                         # until the ring is made (or for good, if it cannot
                         # be): the Writer whose chunks ride in their refs
                         "inline": None, "making": None, "ring_error": None,
                         # outputs go to another host (start_scheduler): where
                         # the tokenizer is, and the ring's NIXL export
                         "head": None, "leaving": None}


def configure(writer: Writer | None = None, reader: Reader | None = None,
              mask_format: str | None = None) -> None:
    """Use this Writer (scheduler) / Reader (tokenizer) instead of the
    default ones made from SHMASK_* on first use; ``mask_format`` ("lists"
    or "arrays") overrides the Reader's SHMASK_MASK_FORMAT."""
    if mask_format is not None and mask_format not in MASK_FORMATS:
        raise ShmaskError(f"mask_format={mask_format!r} is invalid: accepted "
                          f"{', '.join(MASK_FORMATS)}")
    if writer is not None:
        _ends["writer"] = writer
    if reader is not None:
        _ends["reader"] = reader
    if mask_format is not None:
        _ends["mask_format"] = mask_format


def mask_format() -> str:
    """What the tokenizer manager's meta_info gets: "lists" (SGLang's) or
    "arrays" (``SamplingMaskCSR``); from ``configure`` or the Reader's
    SHMASK_MASK_FORMAT."""
    chosen = _ends["mask_format"]
    return chosen if chosen is not None else default_reader().config.mask_format


def default_writer() -> Writer:
    """The Writer for a new request's rows in the scheduler process: the
    rank's ring Writer once it is made. No ring is made before the first
    request that asks for masks: that request starts making it on another
    thread (SHMASK_RING_MB of /dev/shm: seconds for a GiB on a busy host)
    and, until it is ready, requests get an inline Writer (no /dev/shm; each
    chunk rides in its reference). A ring that cannot be made (a small
    /dev/shm, ENOSPC) leaves every request on the inline Writer, with one
    warning. A request keeps the Writer it started with."""
    writer = _ends["writer"]
    if writer is not None and not writer.closed:
        return writer
    inline = _ends["inline"]
    if inline is not None and not inline.closed:
        return inline
    config = Config.from_env()
    if config.transport == "inline":  # no ring asked for
        writer = _ends["writer"] = Writer(config)
        return writer
    if _ends["head"] is not None and rows_ride_inline(config, _ends["head"],
                                                      "this scheduler's outputs"):
        # not to be read there through NIXL: inline from the first reference
        writer = _ends["writer"] = Writer(dataclasses.replace(config, transport="inline"))
        return writer
    inline = _ends["inline"] = Writer(dataclasses.replace(config, transport="inline"))
    making = threading.Thread(target=_make_ring, args=(config,), name="shmask-ring",
                              daemon=True)
    _ends["making"] = making
    making.start()
    return inline


def _make_ring(config: Config) -> None:
    """The rank's ring Writer, made off the scheduler's thread; new requests
    take it from their next default_writer()."""
    try:
        writer = Writer(config)
    except (SegmentError, OSError) as exc:
        _ends["ring_error"] = exc
        log.warning(
            "shmask: no shared-memory ring for sampling masks (%s); their chunks travel "
            "inline in their references instead (more bytes on the sockets, nothing lost). "
            "Give the container a larger /dev/shm (docker run --shm-size) or lower "
            "SHMASK_RING_MB (now %d)", exc, config.ring_mb)
        return
    if _ends["head"] is not None:
        # SHMASK_REMOTE=nixl: the consumers on the head node read this ring
        # through NIXL; without an export they could not, so its requests
        # stay inline.
        leaving = export_or_none(writer, config, _ends["head"])
        if leaving is None:
            writer.close()
            _ends["ring_error"] = RuntimeError("the ring could not be exported to NIXL "
                                               "(the warning logged says why)")
            return
        _ends["leaving"] = leaving
    if metrics.enabled():
        writer.sync_metrics()  # the ring's gauges from its start
    log.info("shmask ring %s ready: %d MiB", writer.segment_name,
             writer.config.ring_capacity_bytes >> 20)
    _ends["writer"] = writer


def ring_ready(timeout: float | None = None) -> Writer | None:
    """Wait (up to ``timeout`` s) for the ring that the first request for
    masks started making; the ring Writer, or None (not asked for yet, not
    ready in time, or it could not be made: see the warning)."""
    making = _ends["making"]
    if making is not None:
        making.join(timeout)
    writer = _ends["writer"]
    return writer if writer is not None and not writer.closed else None


def default_reader() -> Reader:
    """The process's Reader: tokenizer processes open every chunk through it."""
    reader = _ends["reader"]
    if reader is None:
        reader = _ends["reader"] = Reader()
    return reader


# ------------------------------------------------------------- start-up
# SGLang's metric labels that name the process (SchedulerMetricsCollector's
# and the tokenizer's); "priority" is per series there, not per process.
_NOT_PROCESS_LABELS = ("priority",)


def check_server_max_tokens(config: Config, server_args: Any) -> None:
    """SHMASK_MAX_TOKENS must hold the widest row SGLang sends:
    ``--sampling-mask-max-tokens`` ids (wider supports abort the request in
    SGLang). Below it, the scheduler's ``rows.append`` would refuse rows."""
    limit = getattr(server_args, "sampling_mask_max_tokens", None)
    if limit is None:
        return
    if config.max_tokens < int(limit):
        raise ConfigError(
            f"SHMASK_MAX_TOKENS={config.max_tokens} is below SGLang's "
            f"--sampling-mask-max-tokens={limit}: a sampling-mask row can hold up to {limit} "
            f"ids and shmask would refuse it at rows.append. Set SHMASK_MAX_TOKENS to "
            f"{limit} or more, or lower --sampling-mask-max-tokens")


def _enable_metrics(server_args: Any, enable: bool | None,
                    labels: Mapping[str, Any] | None) -> bool:
    on = bool(getattr(server_args, "enable_metrics", False)) if enable is None else enable
    if not on or metrics.enabled():
        return metrics.enabled()
    process_labels = {str(name): value for name, value in (labels or {}).items()
                      if value is not None and name not in _NOT_PROCESS_LABELS}
    try:
        metrics.enable(labels=process_labels)
    except (ImportError, ValueError) as exc:
        # The engine's metrics go on without shmask's: never fail its start.
        log.warning("shmask metrics not enabled: %s", exc)
        return False
    return True


def outputs_leave_host(server_args: Any) -> str | None:
    """Where a scheduler's outputs go when that is another host, else None.
    SGLang runs the detokenizer and the tokenizer on node 0 only, so a
    scheduler of ``--node-rank`` 1 or above (``--nnodes`` > 1) sends its
    outputs over TCP to node 0: its ``--dist-init-addr`` ("" when unset)."""
    if server_args is None:
        return None
    if int(getattr(server_args, "nnodes", 1) or 1) > 1 and int(
            getattr(server_args, "node_rank", 0) or 0) >= 1:
        return str(getattr(server_args, "dist_init_addr", None) or "")
    return None


def start_scheduler(server_args: Any = None, *, metrics_labels: Mapping[str, Any] | None = None,
                    enable_metrics: bool | None = None) -> Writer | None:
    """Scheduler start-up, once per scheduler process (one per TP/PP/DP
    rank): check SHMASK_MAX_TOKENS against ``server_args``'s
    ``sampling_mask_max_tokens`` (ConfigError naming both) and enable
    shmask.metrics when ``server_args.enable_metrics`` (or
    ``enable_metrics``) is true, with ``metrics_labels`` (SGLang's
    ``self.metrics_collector.labels``: model_name, tp_rank, pp_rank, ...)
    on every series. No ring is made here: a server that never sees a
    request for masks reserves no /dev/shm (default_writer() makes it at
    the first one). A scheduler whose outputs go to another host
    (``outputs_leave_host``) sends its rows the way SHMASK_REMOTE says.
    Returns the Writer given to ``configure``, if any."""
    writer = _ends["writer"]
    config = writer.config if writer is not None and not writer.closed else Config.from_env()
    check_server_max_tokens(config, server_args)
    _ends["head"] = outputs_leave_host(server_args)
    if _enable_metrics(server_args, enable_metrics, metrics_labels) and writer is not None:
        writer.sync_metrics()
    log.info("shmask: the sampling-mask ring (%d MiB) is made at the first request for masks",
             config.ring_capacity_bytes >> 20)
    return writer if writer is not None and not writer.closed else None


def start_tokenizer(server_args: Any = None, *, metrics_labels: Mapping[str, Any] | None = None,
                    enable_metrics: bool | None = None) -> Reader:
    """Tokenizer-manager start-up: the same SHMASK_MAX_TOKENS check (a
    reader refuses references to longer rows), the process's Reader, and
    shmask.metrics when ``server_args.enable_metrics`` is true. Returns the
    Reader."""
    reader = _ends["reader"]
    check_server_max_tokens(reader.config if reader is not None else Config.from_env(), server_args)
    _enable_metrics(server_args, enable_metrics, metrics_labels)
    return default_reader()


# ---------------------------------------------------------------- the chunk
_RELEASED = False  # SamplingMaskChunk.rows_ after release


class SamplingMaskChunk(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One request's sampling masks in one emission, as a shmask reference.

    Used exactly like SGLang's own chunk: ``lengths`` (int32 [rows]),
    ``token_ids`` (int32, row after row), ``logprobs`` (float32, per entry in
    support mode, per row in selected mode), ``to_lists(support_logprobs)``.
    ``gc=False``: the object is never tracked by the cyclic GC, so a batch of
    chunks adds nothing to GC pauses (it holds bytes and, once opened, a
    shmask Chunk; neither refers back to it, so no cycle can form).
    """

    ref: bytes
    # None: not opened; a shmask Chunk: opened; False: released. Trailing
    # default, so msgpack (omit_defaults) and pickle (__reduce__) carry only ref.
    rows_: Any = None

    def __post_init__(self) -> None:
        # rows_ is this process's state, never the sender's: a decoded chunk
        # (msgpack fills array_like fields by position) always starts unread.
        self.rows_ = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (SamplingMaskChunk, (self.ref,))

    # ------------------------------------------------------------ views
    def _open(self) -> Chunk:
        rows = self.rows_
        if rows is None:
            if is_remote(self.ref):  # another host's ring: its rows pulled here first
                self.ref = pull_one(self.ref)
            rows = self.rows_ = default_reader().open(ChunkRef.from_bytes(self.ref))
        elif rows is _RELEASED:
            raise ShmaskError("sampling-mask chunk was released (to_lists releases it)")
        elif not isinstance(rows, Chunk):
            raise InvalidRefError(f"sampling-mask chunk in an invalid state: {rows!r}")
        return rows

    def open(self) -> Chunk:
        """The rows as a shmask Chunk (numpy views, valid until release())."""
        return self._open()

    @property
    def lengths(self) -> np.ndarray:
        return self._open().lengths

    @property
    def token_ids(self) -> np.ndarray:
        """Every row's ascending ids, back to back (bitmask rows decoded)."""
        rows = self._open()
        return rows.ids if rows.flags is None else rows.csr()[0]

    @property
    def logprobs(self) -> np.ndarray:
        return self._open().logprobs

    @property
    def status(self) -> np.ndarray:
        """Each row's status (uint8): shmask.chunk.ROW_OK, ROW_OVERFLOW, ROW_INVALID."""
        return self._open().status

    @property
    def support_logprobs(self) -> bool:
        """True when the rows carry one logprob per support entry."""
        return self._ref().mode_name == "support"

    def _ref(self) -> ChunkRef:
        # a remote reference (not pulled yet) describes its rows all the same
        return ChunkRef.from_bytes(plain(self.ref)[1] if is_remote(self.ref) else self.ref)

    # ------------------------------------------------------- responses
    def to_lists(self, support_logprobs: bool) -> tuple[list[list[int] | None], list[Any]]:
        """(token ids per row, logprobs per row (support) or per token), as
        SGLang's chunk returns them (a row whose status is not OK: None in
        both); then the ring record is released."""
        rows = self._open()
        try:
            _check_mode(rows, support_logprobs)
            return rows.to_lists()
        finally:
            self.release()

    def to_arrays(self, support_logprobs: bool) -> SamplingMaskCSR:
        """The rows as a ``SamplingMaskCSR`` (numpy arrays, one copy out of
        the ring; a row whose status is not OK: length 0 and its status);
        then the ring record is released."""
        rows = SamplingMaskCSR(support_logprobs)
        rows.extend(self)
        return rows

    def to_json_parts(self, support_logprobs: bool) -> tuple[bytes, bytes, int]:
        """(ids rows, logprobs, row count) as the JSON arrays SGLang's lists
        would be written as, built from the rows (a row whose status is not
        OK: null in both); then the record is released."""
        rows = self._open()
        try:
            _check_mode(rows, support_logprobs)
            return _json_parts(rows)
        finally:
            self.release()

    def release(self) -> None:
        """Give the ring record back (opened or not). Idempotent."""
        rows = self.rows_
        if rows is _RELEASED:
            return
        self.rows_ = _RELEASED
        if rows is None:
            if is_remote(self.ref):
                # Another host's record, never read: its producer reclaims
                # it at the lease (a pull just to give it back would READ it).
                return
            default_reader().discard(ChunkRef.from_bytes(self.ref))
        elif isinstance(rows, Chunk):
            rows.release()
        else:
            raise InvalidRefError(f"sampling-mask chunk in an invalid state: {rows!r}")

    def __repr__(self) -> str:
        state = {None: "unread", _RELEASED: "released"}.get(self.rows_, "open")  # type: ignore[arg-type]
        where = ", remote" if is_remote(self.ref) else ""
        return f"SamplingMaskChunk({self._ref()!r}{where}, {state})"


def release_chunk(chunk: Any) -> None:
    """Release a chunk nobody will read (its request's state is gone); None
    and SGLang's own chunks need nothing. Never raises: it runs in the
    tokenizer's loop, and a chunk that cannot be given back (read after its
    lease, a bad reference) has nothing to give back (logged)."""
    if isinstance(chunk, SamplingMaskChunk):
        try:
            chunk.release()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("sampling-mask chunk of a finished request not released: %s: %s",
                        type(exc).__name__, exc)


# HTTP status of a request whose sampling masks could not be read: the
# server's fault, not the client's (SGLang answers 400 <= code < 600 aborts
# with an error response of that code).
READ_FAILED_STATUS = 500


def lists_or_abort(manager: Any, recv_obj: Any, index: int, meta_info: dict[str, Any],
                   support_logprobs: bool) -> tuple[list[Any], list[Any]]:
    """``to_lists`` of request ``index``'s chunk in a tokenizer manager's
    batch output; if the chunk cannot be read, that request alone fails.

    SGLang's ``handle_loop`` runs under ``print_exception_wrapper``, which
    kills the whole server on any exception, so a chunk read after its
    lease (StaleChunkError) or a bad reference must not escape. The failed
    request is finished the way SGLang finishes a request it aborts with an
    error: its finish reason (in ``recv_obj.finished_reasons`` and
    ``meta_info``) becomes ``{"type": "abort", "message": ..., "status_code":
    500}``, so ``_handle_batch_output`` marks its state finished, hands the
    output to the waiting handler (which answers the client with that error)
    and drops the state; the scheduler is told to abort it (``AbortReq``), and
    its later outputs, if any, find no state and are released. Returns
    ``([], [])`` for a failed request.

    In arrays mode (``mask_format()``) the rows are copied into the
    request state's ``SamplingMaskCSR`` instead (its two sampling-mask
    fields are replaced by it and its logprobs face on the first call) and
    ``([], [])`` is returned: SGLang's ``extend`` of those adds nothing, and
    its meta_info then carries the CSR objects."""
    chunk = recv_obj.output_token_sampling_mask[index]
    try:
        if isinstance(chunk, SamplingMaskChunk) and chunk.rows_ is None and is_remote(chunk.ref):
            pull_message(recv_obj.output_token_sampling_mask)
        if mask_format() == "arrays":
            # The rows go straight into the request's CSR buffers, which the
            # patched code's extend calls then leave as they are.
            state = manager.rid_to_state[recv_obj.rids[index]]
            try:
                csr = _csr_of(state, support_logprobs)
            except Exception:
                # The reference itself was fine: give its record back now
                # rather than at the lease.
                release_chunk(chunk)
                raise
            csr.extend(chunk)
            return [], []
        return chunk.to_lists(support_logprobs=support_logprobs)
    except Exception as exc:  # noqa: BLE001 - any read failure costs this request only
        rid = recv_obj.rids[index]
        log.error("request %s failed: its sampling masks could not be read: %s: %s",
                  rid, type(exc).__name__, exc)
        # Not given back here: a chunk opened and then refused was released by
        # to_lists; one that never opened has a reference that cannot be
        # trusted to name its record (the producer reclaims it at the lease).
        was_running = recv_obj.finished_reasons[index] is None
        reason = {"type": "abort", "status_code": READ_FAILED_STATUS,
                  "message": f"sampling masks of this request could not be read "
                             f"({type(exc).__name__}: {exc})"}
        recv_obj.finished_reasons[index] = meta_info["finish_reason"] = reason
        if was_running:
            try:
                manager.abort_request(rid)
            except Exception as abort_exc:  # noqa: BLE001 - the request already failed here
                log.error("abort of request %s not sent to the scheduler: %s", rid, abort_exc)
        return [], []


def pull_message(chunks: Sequence[Any]) -> None:
    """Pull the rows of every unread remote chunk of one message (chunks of
    a scheduler on another host: SHMASK_REMOTE=nixl there) in one NIXL pull
    per producer, before the first of them is read. A chunk that could not
    be pulled fails when it is read, alone."""
    pending = [c for c in chunks if isinstance(c, SamplingMaskChunk) and c.rows_ is None
               and is_remote(c.ref)]
    if not pending:
        return
    for chunk, ref in zip(pending, pull([c.ref for c in pending]), strict=True):
        if ref is not None:
            chunk.ref = ref


def _check_mode(rows: Chunk, support_logprobs: bool) -> None:
    # The request's mode decides how SGLang reads the lists; a mismatch would
    # silently mis-shape them, so it is an error here.
    if rows.rows and rows.support_mode != bool(support_logprobs):
        raise ShmaskError(f"chunk holds {rows.mode_name}-mode rows; the request asked for "
                          f"support_logprobs={bool(support_logprobs)}")


# ---------------------------------------------- tokenizer: arrays (in-process)
def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class SamplingMaskCSR:
    """A request's sampling-mask rows as numpy arrays in CSR form: what
    ``output_token_sampling_mask`` holds in arrays mode.

    ``lengths`` int32 [rows] (0 for a dropped row), ``token_ids`` int32
    [nnz] (each row's ascending ids, back to back; bitmask rows decoded),
    ``offsets`` int64 [rows + 1] (row i is ``token_ids[offsets[i]:
    offsets[i + 1]]``), ``status`` uint8 [rows] (``shmask.chunk.ROW_OK``,
    ``ROW_OVERFLOW``, ``ROW_INVALID``: a row that is not OK is None in the
    lists form), ``logprobs`` float32: [nnz] aligned with ``token_ids``
    (support mode) or [rows] (selected mode; NaN for a dropped row).

    The arrays are read-only views of buffers this object owns: rows are
    copied into them once, out of the ring (``extend``), and the ring
    record is released. A later ``extend`` writes past the rows a view
    shows, or into new buffers, so a view taken earlier never changes.
    ``len`` counts rows; ``[start:stop]`` is a CSR of those rows (views);
    ``[i]`` and iteration give each row's ids (None for a dropped row), as
    the lists do. ``logprob_rows`` is the same rows' logprobs face.
    """

    __slots__ = ("support", "_lengths", "_status", "_ids", "_logprobs", "_rows", "_nnz",
                 "_offsets", "_origin", "_json")

    def __init__(self, support_logprobs: bool) -> None:
        self.support = bool(support_logprobs)
        self._lengths = np.empty(0, np.int32)
        self._status = np.empty(0, np.uint8)
        self._ids = np.empty(0, np.int32)
        self._logprobs = np.empty(0, np.float32)
        self._rows = self._nnz = 0
        self._offsets: np.ndarray | None = None
        # A slice's rows [start, stop) of the CSR it was cut from (the
        # request's), whose _json caches the last rows written as JSON:
        # both faces of one response are written once (json_default).
        self._origin: tuple[SamplingMaskCSR, int, int] | None = None
        self._json: tuple[tuple[int, int], bytes, bytes] | None = None

    @classmethod
    def _of(cls, support: bool, lengths: np.ndarray, status: np.ndarray, ids: np.ndarray,
            logprobs: np.ndarray) -> SamplingMaskCSR:
        # Buffers exactly full: an extend of this object reallocates, so it
        # never writes into the arrays it was made from.
        out = cls(support)
        out._lengths, out._status, out._ids, out._logprobs = lengths, status, ids, logprobs
        out._rows, out._nnz = lengths.size, ids.size
        return out

    # ------------------------------------------------------------ arrays
    @property
    def lengths(self) -> np.ndarray:
        return _readonly(self._lengths[:self._rows])

    @property
    def status(self) -> np.ndarray:
        return _readonly(self._status[:self._rows])

    @property
    def token_ids(self) -> np.ndarray:
        return _readonly(self._ids[:self._nnz])

    @property
    def logprobs(self) -> np.ndarray:
        return _readonly(self._logprobs[:self._nnz if self.support else self._rows])

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None or self._offsets.size != self._rows + 1:
            offsets = np.zeros(self._rows + 1, np.int64)
            np.cumsum(self._lengths[:self._rows], out=offsets[1:])
            self._offsets = offsets
        return _readonly(self._offsets)

    @property
    def logprob_rows(self) -> SamplingLogprobsCSR:
        return SamplingLogprobsCSR(self)

    def __len__(self) -> int:
        return self._rows

    # ------------------------------------------------------------- grow
    def extend(self, rows: Any) -> None:
        """Append rows: a chunk (``SamplingMaskChunk``: copied out of the
        ring, then released; a shmask ``Chunk``: copied, left to its
        owner) or another ``SamplingMaskCSR``. An empty sequence adds
        nothing (SGLang's extend of what ``lists_or_abort`` returns)."""
        if isinstance(rows, SamplingMaskChunk):
            chunk = rows._open()
            try:
                self._extend_chunk(chunk)
            finally:
                rows.release()
        elif isinstance(rows, Chunk):
            self._extend_chunk(rows)
        elif isinstance(rows, SamplingMaskCSR):
            if len(rows) and rows.support != self.support:
                raise ShmaskError("cannot extend support-mode rows with selected-mode rows "
                                  "or the reverse")
            self._append(rows.lengths, rows.status, rows.token_ids, rows.logprobs)
        elif len(rows):
            raise TypeError(f"SamplingMaskCSR.extend takes chunks or SamplingMaskCSR rows, "
                            f"not {type(rows).__name__} with items")

    def _extend_chunk(self, chunk: Chunk) -> None:
        _check_mode(chunk, self.support)
        # Bitmask rows decoded; views of the ring otherwise (checked below).
        ids, offsets = chunk._csr_arrays()
        count, nnz = chunk.rows, int(offsets[-1])
        self._reserve(count, nnz)
        start, begin = self._rows, self._nnz
        self._lengths[start:start + count] = chunk.lengths
        self._status[start:start + count] = chunk.status
        self._ids[begin:begin + nnz] = ids
        if self.support:
            self._logprobs[begin:begin + nnz] = chunk.logprobs
        else:
            values = self._logprobs[start:start + count]
            values[:] = chunk.logprobs
            if chunk.flags is not None:
                values[chunk.status != ROW_OK] = np.nan  # no value was sent
        # The copy is good only if the record was not reclaimed under it;
        # the rows count only once it is known to be.
        chunk.check()
        self._rows, self._nnz = start + count, begin + nnz

    def _append(self, lengths: np.ndarray, status: np.ndarray, ids: np.ndarray,
                logprobs: np.ndarray) -> None:
        count, nnz = lengths.size, ids.size
        self._reserve(count, nnz)
        start, begin = self._rows, self._nnz
        self._lengths[start:start + count] = lengths
        self._status[start:start + count] = status
        self._ids[begin:begin + nnz] = ids
        at = begin if self.support else start
        self._logprobs[at:at + logprobs.size] = logprobs
        self._rows, self._nnz = start + count, begin + nnz

    def _reserve(self, count: int, nnz: int) -> None:
        # Doubling: a streamed request's rows are copied O(1) times each.
        self._lengths = _grown(self._lengths, self._rows, self._rows + count)
        self._status = _grown(self._status, self._rows, self._rows + count)
        self._ids = _grown(self._ids, self._nnz, self._nnz + nnz)
        used = self._nnz if self.support else self._rows
        self._logprobs = _grown(self._logprobs, used, used + (nnz if self.support else count))

    # ----------------------------------------------------- as SGLang uses it
    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._rows)
            if step != 1:
                raise ValueError("SamplingMaskCSR slices take a step of 1")
            stop = max(start, stop)
            offsets = self.offsets
            lo, hi = int(offsets[start]), int(offsets[stop])
            logprobs = self._logprobs[lo:hi] if self.support else self._logprobs[start:stop]
            part = SamplingMaskCSR._of(self.support, self._lengths[start:stop],
                                       self._status[start:stop], self._ids[lo:hi], logprobs)
            root, base, _ = self._origin or (self, 0, self._rows)
            part._origin = (root, base + start, base + stop)
            return part
        index = range(self._rows)[key]
        if self._status[index] != ROW_OK:
            return None
        offsets = self.offsets
        return self.token_ids[int(offsets[index]):int(offsets[index + 1])]

    def __iter__(self) -> Any:
        return (self[i] for i in range(self._rows))

    def to_lists(self) -> tuple[list[list[int] | None], list[Any]]:
        """The lists form of the same rows (what ``to_lists`` of their
        chunks would have returned, concatenated)."""
        bounds = self.offsets.tolist()
        all_ids = self.token_ids.tolist()
        ids: list[Any] = [all_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        values = self.logprobs.tolist()
        logprobs: list[Any] = ([values[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
                               if self.support else values)
        for dropped in np.flatnonzero(self.status != ROW_OK).tolist():
            ids[dropped] = logprobs[dropped] = None
        return ids, logprobs

    def __repr__(self) -> str:
        mode = "support" if self.support else "selected"
        return f"SamplingMaskCSR({mode}, rows={self._rows}, nnz={self._nnz})"


class SamplingLogprobsCSR:
    """The logprobs face of a ``SamplingMaskCSR``: what
    ``output_token_sampling_logprobs`` holds in arrays mode. ``values``
    (also ``np.asarray(...)``) is the float32 array, ``rows`` the CSR it
    belongs to (its ``offsets`` split support-mode values into rows).
    ``len`` counts rows; ``[start:stop]`` is the face of those rows; ``[i]``
    and iteration give a row's logprobs (float32 array in support mode, a
    float in selected mode, None for a dropped row), as the lists do.
    ``extend`` accepts only an empty sequence: rows come in through the
    ``SamplingMaskCSR``."""

    __slots__ = ("rows",)

    def __init__(self, rows: SamplingMaskCSR) -> None:
        self.rows = rows

    @property
    def values(self) -> np.ndarray:
        return self.rows.logprobs

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        values = self.rows.logprobs
        if dtype is not None and np.dtype(dtype) != values.dtype:
            return values.astype(dtype)
        return values.copy() if copy else values

    def __len__(self) -> int:
        return len(self.rows)

    def extend(self, values: Any) -> None:
        if len(values):
            raise TypeError("logprobs come in with their rows: extend the SamplingMaskCSR")

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return SamplingLogprobsCSR(self.rows[key])
        rows = self.rows
        index = range(len(rows))[key]
        if rows.status[index] != ROW_OK:
            return None
        if not rows.support:
            return float(rows.logprobs[index])
        offsets = rows.offsets
        return rows.logprobs[int(offsets[index]):int(offsets[index + 1])]

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self.rows)))

    def __repr__(self) -> str:
        return f"SamplingLogprobsCSR({self.rows!r})"


def _grown(buffer: np.ndarray, used: int, needed: int) -> np.ndarray:
    if needed <= buffer.size:
        return buffer
    grown = np.empty(max(needed, 2 * buffer.size), buffer.dtype)
    grown[:used] = buffer[:used]
    return grown


def _csr_json(rows: SamplingMaskCSR) -> tuple[bytes, bytes]:
    """(ids, logprobs) of ``rows`` as JSON arrays, byte for byte what orjson
    writes for the lists form (``to_lists``), by the native response writer.
    Rows are append-only, so the JSON of rows [start, stop) of a request
    never changes: the request's CSR keeps the last one written until the
    second face of the response has reused it (one entry per request)."""
    root, start, stop = rows._origin or (rows, 0, rows._rows)
    cached = root._json
    if cached is not None and cached[0] == (start, stop):
        root._json = None  # the second face: nothing keeps the text after the response
        return cached[1], cached[2]
    if not len(rows):
        return b"[]", b"[]"
    chunk = Chunk(MODE_SUPPORT if rows.support else MODE_SELECTED, rows.lengths,
                  rows.token_ids, rows.logprobs, None, flags=rows.status)
    ids, logprobs, _ = chunk.json_arrays()
    root._json = ((start, stop), ids, logprobs)
    return ids, logprobs


def json_default(value: Any) -> Any:
    """orjson's ``default`` for a response that holds arrays-mode rows
    (``SHMASK_MASK_FORMAT=arrays``): a ``SamplingMaskCSR`` (the ids) or
    ``SamplingLogprobsCSR`` (the logprobs) becomes an ``orjson.Fragment`` of
    the JSON that orjson writes for the lists form, written by the native
    writer, so ``orjson.dumps(out, default=json_default)`` is byte-identical
    to the lists mode's ``orjson.dumps(out)`` (tests/compat). The patched
    SGLang's ``dumps_json`` (its /generate responses and stream events)
    passes it. Any other type raises TypeError, as orjson's own does."""
    if isinstance(value, SamplingMaskCSR):
        return orjson.Fragment(_csr_json(value)[0])
    if isinstance(value, SamplingLogprobsCSR):
        return orjson.Fragment(_csr_json(value.rows)[1])
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def model_json(content: Any) -> bytes | None:
    """SGLang's /v1/chat/completions response (a pydantic model) whose
    choices' meta_info hold arrays-mode rows, as JSON: pydantic's own
    fields by ``model_dump`` (its serializers run, as in
    ``model_dump_json``), the rows by the native writer through
    ``json_default``, so the bytes are those pydantic writes for the lists
    form (tests/compat). None for a response without such rows: the
    patched ``model_json_response`` then lets pydantic write it, as
    released."""
    choices = getattr(content, "choices", None)
    if not isinstance(choices, list) or not any(
            isinstance(meta.get(MASK_FIELD), SamplingMaskCSR)
            for meta in (getattr(choice, "meta_info", None) for choice in choices)
            if isinstance(meta, dict)):
        return None
    return orjson.dumps(content.model_dump(by_alias=True), default=json_default,
                        option=orjson.OPT_NON_STR_KEYS)


def coalesced_rows(meta_infos: Sequence[dict[str, Any]], key: str) -> Any:
    """SGLang's join of one incremental-streaming key over queued chunks
    (``_coalesce_streaming_chunks``): arrays-mode rows are joined as rows (a
    CSR, so the response is still written natively); anything else as SGLang
    joins it, one list of every chunk's items."""
    values = [m[key] for m in meta_infos if key in m]
    if values and all(isinstance(v, SamplingMaskCSR) for v in values):
        return _joined_rows(values)
    if values and all(isinstance(v, SamplingLogprobsCSR) for v in values):
        return _joined_rows([v.rows for v in values]).logprob_rows
    return [item for m in meta_infos for item in m.get(key, [])]


def _joined_rows(parts: list[SamplingMaskCSR]) -> SamplingMaskCSR:
    """Rows one after another. Queued incremental chunks are consecutive
    slices of one request's rows: their join is one slice of them (no copy,
    and the ids and logprobs faces share one JSON pass); anything else is
    copied into a new CSR."""
    spans = [part._origin or (part, 0, part._rows) for part in parts]
    root = spans[0][0]
    if all(span[0] is root for span in spans) and all(
            before[2] == after[1] for before, after in zip(spans, spans[1:], strict=False)):
        return root[spans[0][1]:spans[-1][2]]
    joined = SamplingMaskCSR(parts[0].support)
    for part in parts:
        joined.extend(part)
    return joined


def _csr_of(state: Any, support_logprobs: bool) -> SamplingMaskCSR:
    """The request state's CSR rows; on the first chunk, its two (empty)
    sampling-mask lists are replaced by the CSR and its logprobs face."""
    current = state.output_token_sampling_mask
    if isinstance(current, SamplingMaskCSR):
        return current
    if len(current):
        raise ShmaskError("this request already holds its sampling masks as lists: "
                          "the mask format changed while it ran")
    rows = SamplingMaskCSR(support_logprobs)
    state.output_token_sampling_mask = rows
    state.output_token_sampling_logprobs = rows.logprob_rows
    return rows


class SamplingMaskArrays(msgspec.Struct, array_like=True, gc=False):
    """Copies of a queue's rows (what ``SamplingMaskRows.view`` returns)."""

    lengths: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray

    def to_lists(self, support_logprobs: bool) -> tuple[list[list[int] | None], list[Any]]:
        chunk = Chunk(2 if support_logprobs else 1, self.lengths, self.token_ids, self.logprobs,
                      None)
        return chunk.to_lists()


# ------------------------------------------------------ scheduler: staging
class _Staging:
    """Rows appended one at a time (SGLang's per-request ``append``), staged in
    flat buffers until one ``Writer.append_step`` copies them into the ring.

    Staging keeps SGLang's own commit decisions (only rows it appends are
    sent) while the ring sees one native call per decode step, not one per
    row: a second row for a request already staged means a new step began,
    so the staged step is flushed first (speculative decoding, which appends
    several rows per request and step, flushes more often; order is kept)."""

    __slots__ = ("writer", "handles", "staged", "lengths", "selected", "ids", "logprobs", "nnz",
                 "failed", "closing", "flushing")

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.handles: list[int] = []
        self.staged: set[int] = set()
        self.lengths: list[int] = []
        self.selected: list[float] = []
        self.ids = np.empty(1 << 16, np.int32)
        self.logprobs = np.empty(1 << 16, np.float32)  # support rows; aligned with ids
        self.nnz = 0
        # A row refused at flush time, kept for its own request's next call
        # (never raised from another request's append).
        self.failed: dict[int, ShmaskError] = {}
        # Queues whose rows objects were collected: closed after the next
        # flush. __del__ may run inside a flush (the cyclic GC), so it only
        # appends here and never touches the staging or the Writer.
        self.closing: list[RowQueue] = []
        self.flushing = False

    def add(self, handle: int, support: bool, token_ids: Any, logprobs: Any) -> None:
        failed = self.failed.pop(handle, None)
        if failed is not None:
            raise failed
        # Checked here, before staging, so that a bad row is refused by its
        # own request's append (the flush then cannot fail on it).
        ids = _as_array(token_ids, np.int32, "token_ids")
        n = ids.shape[0] if ids.ndim == 1 else -1
        if n < 0 or n > self.writer.config.max_tokens:
            raise InvalidRowsError(f"a row's token_ids must be 1-D with at most "
                                   f"{self.writer.config.max_tokens} entries (SHMASK_MAX_TOKENS), "
                                   f"got shape {ids.shape}")
        values = _as_array(logprobs, np.float32, "logprobs").reshape(-1)
        if values.size != (n if support else 1):
            raise InvalidRowsError(f"logprobs has {values.size} values; a "
                                   f"{'support' if support else 'selected'}-mode row of {n} "
                                   f"ids needs {n if support else 1}")
        if handle in self.staged:
            self.flush()
        end = self.nnz + n
        if end > self.ids.size:
            self._grow(end)
        self.ids[self.nnz:end] = ids
        if support:
            self.logprobs[self.nnz:end] = values
            self.selected.append(0.0)
        else:
            self.selected.append(float(values[0]))
        self.handles.append(handle)
        self.staged.add(handle)
        self.lengths.append(n)
        self.nnz = end

    def _grow(self, end: int) -> None:
        size = max(end, 2 * self.ids.size)
        for name in ("ids", "logprobs"):
            old = getattr(self, name)
            grown = np.empty(size, old.dtype)
            grown[:self.nnz] = old[:self.nnz]
            setattr(self, name, grown)

    def flush(self) -> None:
        """Write the staged rows (one append_step), then close the queues of
        collected rows objects. Never raises for one request's bad row: that
        request's next append or take does."""
        if self.flushing:
            return  # re-entered (a finalizer during the flush): the outer one writes
        self.flushing = True
        try:
            if self.handles:
                nnz = self.nnz
                handles = np.array(self.handles, np.int64)
                lengths = np.array(self.lengths, np.int32)
                selected = np.array(self.selected, np.float32)
                self.handles, self.lengths, self.selected, self.nnz = [], [], [], 0
                self.staged.clear()
                ids, logprobs = self.ids[:nnz], self.logprobs[:nnz]
                try:
                    self.writer.append_step(handles, lengths, ids, logprobs, selected)
                except ShmaskError:
                    # append_step is all or nothing: one bad row must not cost
                    # the other requests theirs. Row by row, each failure kept
                    # for its own request.
                    self._rows_one_by_one(handles, lengths, ids, logprobs, selected)
            while self.closing:
                queue = self.closing.pop()
                if not queue.closed and not self.writer.closed:
                    queue.close()
        finally:
            self.flushing = False

    def _rows_one_by_one(self, handles: np.ndarray, lengths: np.ndarray, ids: np.ndarray,
                         logprobs: np.ndarray, selected: np.ndarray) -> None:
        start = 0
        for i in range(handles.size):
            stop = start + int(lengths[i])
            try:
                self.writer.append_step(handles[i:i + 1], lengths[i:i + 1], ids[start:stop],
                                        logprobs[start:stop], selected[i:i + 1])
            except ShmaskError as exc:
                log.error("sampling-mask row refused for queue handle %d: %s", int(handles[i]), exc)
                self.failed.setdefault(int(handles[i]), exc)
            start = stop

    def raise_failure(self, handle: int) -> None:
        failed = self.failed.pop(handle, None)
        if failed is not None:
            raise failed


_staging: weakref.WeakKeyDictionary[Writer, _Staging] = weakref.WeakKeyDictionary()


def _staging_of(writer: Writer) -> _Staging:
    staging = _staging.get(writer)
    if staging is None:
        staging = _staging[writer] = _Staging(writer)
    return staging


def flush(writer: Writer | None = None) -> None:
    """Copy every staged row into the ring now (take, view and append_step do it)."""
    staging = _staging.get(writer or default_writer())
    if staging is not None:
        staging.flush()


# -------------------------------------------------------- scheduler: rows
class SamplingMaskRows:
    """One request's rows until they are streamed (SGLang's SamplingMaskRows).

    ``mode`` is the request's ``sampling_logprobs_mode`` ("selected", the
    SGLang default, or "support"). The queue is closed when the object goes
    (or by ``close()``), dropping rows never taken; ``abort()`` also gives
    back the chunks it published that no reader has released.
    """

    __slots__ = ("queue", "support", "writer", "__weakref__")

    def __init__(self, mode: str | None = "selected", writer: Writer | None = None) -> None:
        self.writer = writer or default_writer()
        mode = mode or "selected"
        self.queue: RowQueue = self.writer.open_queue(mode)
        self.support = mode == "support"

    @property
    def handle(self) -> int:
        return int(getattr(self.queue, "handle", self.queue.slot))

    def append(self, token_ids: np.ndarray, logprobs: np.ndarray) -> None:
        """Queue one token's int32 support and its logprobs (float32 [len] in
        support mode, one value in selected mode)."""
        _staging_of(self.writer).add(self.handle, self.support, token_ids, logprobs)

    def view(self) -> SamplingMaskArrays:
        """The queued rows, left queued (copies: the ring's staging buffer is
        the producer's, so the rows are published, read back and re-queued)."""
        chunk = self.take()
        rows = chunk._open()
        try:
            # Ascending ids whatever form the ring kept them in: the requeue
            # below appends them as ordinary rows.
            arrays = SamplingMaskArrays(rows.lengths.copy(), rows.csr()[0].copy(),
                                        rows.logprobs.copy())
        finally:
            chunk.release()
        if arrays.lengths.size:
            _requeue(self, arrays)
        return arrays

    def take(self) -> SamplingMaskChunk:
        """Hand off the queued rows (published in place), leaving the queue empty.
        Raises here if one of this request's rows was refused at a flush."""
        staging = _staging_of(self.writer)
        staging.flush()
        staging.raise_failure(self.handle)
        chunk = take_all([self])[0]  # type: ignore[index]
        assert chunk is not None
        return chunk

    def close(self) -> None:
        """The request ended: drop rows never taken and free the queue."""
        if not self.queue.closed and not self.writer.closed:
            flush(self.writer)
            self.queue.close()

    def abort(self) -> int:
        """The request was aborted: drop its rows and give back its chunks
        that no reader released. Returns how many were given back."""
        if self.queue.closed or self.writer.closed:
            return 0
        flush(self.writer)
        return int(self.queue.abort())

    def __del__(self) -> None:
        # Runs wherever the last reference goes, the cyclic GC included, which
        # can be inside a flush: only hand the queue over to be closed after
        # the next flush (touching the staging here could write rows twice).
        try:
            if not self.queue.closed and not self.writer.closed:
                _staging_of(self.writer).closing.append(self.queue)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to free
            pass

    def __repr__(self) -> str:
        return f"SamplingMaskRows({'support' if self.support else 'selected'}, {self.queue!r})"


def _requeue(rows: SamplingMaskRows, arrays: SamplingMaskArrays) -> None:
    # view() published the rows to read them; put them back in the queue so
    # that the next take still carries them.
    count = arrays.lengths.size
    handles = np.full(count, rows.handle, np.int64)
    if rows.support:
        rows.writer.append_step(handles, arrays.lengths, arrays.token_ids, arrays.logprobs)
    else:
        rows.writer.append_step(handles, arrays.lengths, arrays.token_ids,
                                np.zeros(arrays.token_ids.size, np.float32), arrays.logprobs)


def take_all(items: Sequence[SamplingMaskRows | None] | None, final: bool = False,
             writer: Writer | None = None) -> list[SamplingMaskChunk | None] | None:
    """Take many requests' rows in one native call: one chunk per rows
    object, None where the item is None (requests without masks); None for
    None (a batch without masks). This is what an output streamer calls once
    per emission instead of one take() per request."""
    if items is None:
        return None
    out: list[SamplingMaskChunk | None] = [None] * len(items)
    # one take a Writer: requests that began before the ring was ready keep
    # the inline Writer they started with
    by_writer: dict[int, tuple[Writer, list[int]]] = {}
    for i, r in enumerate(items):
        if r is not None:
            owner = writer or r.writer
            by_writer.setdefault(id(owner), (owner, []))[1].append(i)
    for owner, present in by_writer.values():
        flush(owner)
        queues = [items[i].queue for i in present]  # type: ignore[union-attr]
        batch = owner.take_batch(queues, final)
        leaving = _ends["leaving"]
        # to another host through NIXL: the ring's refs carry its descriptor
        refs = leaving.refs(batch) if leaving is not None and leaving.writer is owner \
            else split_refs(batch)
        for i, ref in zip(present, refs, strict=True):
            out[i] = SamplingMaskChunk(ref)
    return out




def split_refs(batch: RefBatch) -> list[bytes]:
    """Each entry of a batch as its own one-entry batch (``ChunkRef.to_bytes()``
    of it): the wire format is refs.py's alone."""
    return batch.split()


def append_step(rows: Sequence[SamplingMaskRows] | np.ndarray, lengths: np.ndarray,
                token_ids: np.ndarray, selected_logprobs: np.ndarray,
                support_logprobs: np.ndarray | None = None, statuses: np.ndarray | None = None,
                support: np.ndarray | None = None, writer: Writer | None = None) -> None:
    """One decode step for the opted-in requests, one native call.

    The arguments are SGLang's ``SamplingMaskOutput`` on the host: row r of
    ``token_ids`` [R, W] / ``lengths`` [R] / ``selected_logprobs`` [R] /
    ``statuses`` [R] belongs to ``rows[r]``; ``support_logprobs`` [S, W] holds
    the support-mode rows only, in order. ``rows`` may instead be an int64
    array of queue handles, with ``support`` [R] bool saying which rows are
    support mode. Rows whose status is not OK are never written (SGLang
    aborts those requests and never commits the token).
    """
    if isinstance(rows, np.ndarray):
        handles = np.ascontiguousarray(rows, np.int64)
        is_support = (np.zeros(handles.size, bool) if support is None
                      else np.asarray(support, bool))
        writer = writer or default_writer()
    else:
        owners = {id(r.writer) for r in rows}
        if writer is None and len(owners) > 1:
            # requests on the inline Writer and on the ring's: a step each
            _append_step_by_writer(rows, lengths, token_ids, selected_logprobs,
                                   support_logprobs, statuses)
            return
        handles = np.fromiter((r.handle for r in rows), np.int64, len(rows))
        is_support = np.fromiter((r.support for r in rows), bool, len(rows))
        writer = writer or (rows[0].writer if len(rows) else default_writer())
    if not handles.size:
        return
    flush(writer)  # rows appended one by one before this step come first
    lengths = np.asarray(lengths)
    token_ids = np.asarray(token_ids)
    selected = np.asarray(selected_logprobs, np.float32).reshape(-1)
    if is_support.any():
        if support_logprobs is None:
            raise ShmaskError("support-mode rows need support_logprobs")
        if is_support.all():
            logprobs = np.asarray(support_logprobs)
        else:
            logprobs = np.zeros(token_ids.shape, np.float32)
            logprobs[is_support] = support_logprobs
    else:
        logprobs = np.zeros(token_ids.shape if token_ids.ndim == 2 else 0, np.float32)
    if statuses is not None:
        ok = np.asarray(statuses) == STATUS_OK
        if not ok.all():
            handles, lengths, token_ids = handles[ok], lengths[ok], token_ids[ok]
            selected = selected[ok]
            logprobs = logprobs[ok] if logprobs.shape[:1] == ok.shape else logprobs
            if not handles.size:
                return
    writer.append_step(handles, lengths, token_ids, logprobs, selected)


def _append_step_by_writer(rows: Sequence[SamplingMaskRows], lengths: np.ndarray,
                           token_ids: np.ndarray, selected_logprobs: np.ndarray,
                           support_logprobs: np.ndarray | None,
                           statuses: np.ndarray | None) -> None:
    """append_step of a step whose rows belong to more than one Writer: the
    step's arrays cut by Writer (support_logprobs holds the support-mode
    rows only, in order: cut by their rank among those)."""
    is_support = np.fromiter((r.support for r in rows), bool, len(rows))
    support_rank = np.cumsum(is_support) - 1
    by_writer: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_writer.setdefault(id(r.writer), []).append(i)
    for picked in by_writer.values():
        index = np.asarray(picked)
        support_part = None
        if support_logprobs is not None and is_support[index].any():
            support_part = np.asarray(support_logprobs)[support_rank[index][is_support[index]]]
        append_step([rows[i] for i in picked], np.asarray(lengths)[index],
                    np.asarray(token_ids)[index], np.asarray(selected_logprobs).reshape(-1)[index],
                    support_part, None if statuses is None else np.asarray(statuses)[index],
                    writer=rows[picked[0]].writer)


# --------------------------------------------------------- tokenizer: JSON


def _json_parts(rows: Chunk) -> tuple[bytes, bytes, int]:
    """(ids rows, logprobs, row count) as JSON arrays, e.g. b"[[1,2],[3]]" and
    b"[[-0.5,-1.25],[-2.0]]" (support) or b"[-0.5,-2.0]" (selected), written
    by the native response writer (``Chunk.json_arrays``): each float32 as
    orjson writes ``float()`` of it, the value SGLang's ``tolist()`` lists
    hold; bitmask rows decoded, non-OK rows null in both arrays."""
    if not rows.rows:
        return b"[]", b"[]", 0
    ids_json, logprobs_json, _ = rows.json_arrays()
    return ids_json, logprobs_json, rows.rows


class SamplingMaskJSON:
    """A request's accumulated sampling masks as JSON pieces (the tokenizer
    manager's ``state.output_token_sampling_mask`` / ``_logprobs`` lists,
    without the lists). ``extend(chunk)`` per emission releases the chunk at
    once, so no ring record is held for the life of a request."""

    __slots__ = ("support", "_ids", "_logprobs", "_rows", "_total")

    def __init__(self, support_logprobs: bool) -> None:
        self.support = bool(support_logprobs)
        self._ids: list[bytes] = []  # one JSON array per emission, as written
        self._logprobs: list[bytes] = []
        self._rows: list[int] = []
        self._total = 0

    def extend(self, chunk: SamplingMaskChunk | Chunk) -> None:
        if isinstance(chunk, SamplingMaskChunk):
            ids, logprobs, count = chunk.to_json_parts(self.support)
        else:
            _check_mode(chunk, self.support)
            ids, logprobs, count = _json_parts(chunk)
        if count:
            # Kept as written (with brackets); joined through memoryviews
            # without them, so the bytes are copied once, into the response.
            self._ids.append(ids)
            self._logprobs.append(logprobs)
            self._rows.append(count)
            self._total += count

    def __len__(self) -> int:
        return self._total

    def fields(self, start: int = 0) -> dict[str, Any]:
        """The three meta_info fields for rows [start:] (``start`` is the
        incremental-streaming offset SGLang slices with); the length field is
        the total, as SGLang's is."""
        ids, logprobs = self._pieces(start)
        return {MASK_FIELD: orjson.Fragment(_joined(ids)),
                LOGPROBS_FIELD: orjson.Fragment(_joined(logprobs)), LENGTH_FIELD: self._total}

    def raw_fields(self, start: int = 0) -> dict[str, Any]:
        """fields(start) with the arrays as RawJSON, for
        shmask.response_json.dumps: each emission's array is copied once,
        straight into the response (no joined array first, no orjson pass)."""
        ids, logprobs = self._pieces(start)
        return {MASK_FIELD: RawJSON(*ids), LOGPROBS_FIELD: RawJSON(*logprobs),
                LENGTH_FIELD: self._total}

    def _pieces(self, start: int) -> tuple[list[bytes | memoryview], list[bytes | memoryview]]:
        """Each field for rows [start:] as pieces of JSON text whose
        concatenation is its array."""
        start = min(max(start, 0), self._total)
        piece, skip = 0, start
        while piece < len(self._rows) and skip >= self._rows[piece]:
            skip -= self._rows[piece]
            piece += 1
        ids, logprobs = self._ids[piece:], self._logprobs[piece:]
        if len(ids) == 1 and not skip:
            return [ids[0]], [logprobs[0]]  # one emission: its arrays are the fields
        id_parts = [memoryview(p)[1:-1] for p in ids]  # contents, without the brackets
        logprob_parts = [memoryview(p)[1:-1] for p in logprobs]
        if skip:  # an offset inside one emission's rows: cut that piece at the row
            # Only a dropped row writes null among the ids (the logprobs may
            # hold null for NaN): bytes search, far cheaper than a scan.
            dropped = b"null" in self._ids[piece]
            id_parts[0] = _drop_rows(id_parts[0], skip, nested=True, dropped=dropped)
            logprob_parts[0] = _drop_rows(logprob_parts[0], skip, nested=self.support,
                                          dropped=dropped)
        return _array(id_parts), _array(logprob_parts)


def _array(contents: list[memoryview]) -> list[bytes | memoryview]:
    """The pieces of a JSON array of `contents` (each the inside of one)."""
    parts: list[bytes | memoryview] = [b"["]
    for piece in contents:
        parts += (piece, b",")
    parts[-1] = b"]" if contents else b"[]"
    return parts


def _joined(pieces: list[bytes | memoryview]) -> bytes:
    # One copy of every piece (none for a single bytes piece).
    return pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytes) else b"".join(pieces)


def _drop_rows(piece: memoryview, count: int, nested: bool, dropped: bool) -> memoryview:
    # Rows of a nested piece end at "]" (rows hold only numbers); a flat
    # piece's values are separated by ",". Either way the row boundaries are
    # found with one vectorised scan.
    data = np.frombuffer(piece, np.uint8)
    if nested and dropped:
        # A dropped row is written null, with no "]" to end it: rows are
        # split at the commas outside brackets instead.
        depth = np.cumsum(data == ord("[")) - np.cumsum(data == ord("]"))
        marks = np.flatnonzero((data == ord(",")) & (depth == 0))
        return piece[int(marks[count - 1]) + 1:]
    marks = np.flatnonzero(data == (ord("]") if nested else ord(",")))
    cut = int(marks[count - 1]) + (2 if nested else 1)  # past "]," or ","
    return piece[cut:]


def meta_info_rows(chunk: Chunk) -> dict[str, Any]:
    """One open chunk's three meta_info fields for shmask.response_json.dumps:
    the arrays as holes (``Chunk.json_rows``) that dumps writes natively,
    straight from the ring into the response's bytes, byte-identical to
    SGLang's lists under orjson. Keep the chunk open until dumps returns
    (then release it): a record reclaimed meanwhile raises StaleChunkError
    there."""
    if not chunk.rows:
        return {MASK_FIELD: RawJSON(b"[]"), LOGPROBS_FIELD: RawJSON(b"[]"), LENGTH_FIELD: 0}
    rows = chunk.json_rows()
    return {MASK_FIELD: rows.ids, LOGPROBS_FIELD: rows.logprobs, LENGTH_FIELD: chunk.rows}


def response_meta_info(source: SamplingMaskJSON | SamplingMaskChunk | Chunk
                       | Iterable[SamplingMaskChunk | Chunk], *, start: int = 0,
                       support_logprobs: bool | None = None, raw: bool = False) -> dict[str, Any]:
    """The three sampling-mask fields of a response's meta_info:
    ``output_token_sampling_mask`` and ``output_token_sampling_logprobs`` as
    ``orjson.Fragment``s and ``output_token_sampling_mask_length`` (an int),
    in SGLang's key order, so that ``orjson.dumps`` of the meta_info is
    byte-identical to SGLang's from its lists.

    ``source`` is a request's ``SamplingMaskJSON`` (streaming: extend it per
    emission, call this per response; ``start`` is SGLang's incremental
    offset), or its chunk(s) (whole response), which then needs
    ``support_logprobs``: each ``SamplingMaskChunk`` is released (an open
    shmask ``Chunk`` stays its opener's to release, as in
    ``SamplingMaskJSON.extend``). The chunks are one request's, so a chunk
    that cannot be read fails the call with its error (StaleChunkError,
    InvalidRefError, ShmaskError), after the chunks not yet read are
    released too (not held until the lease). ``raw=True``: the arrays as
    ``shmask.response_json.RawJSON`` for ``response_json.dumps`` instead
    (the same bytes, one copy fewer)."""
    if not isinstance(source, SamplingMaskJSON):
        if support_logprobs is None:
            raise TypeError("response_meta_info(chunks) needs support_logprobs=")
        accumulated = SamplingMaskJSON(support_logprobs)
        chunks = iter([source] if isinstance(source, SamplingMaskChunk | Chunk) else source)
        try:
            for chunk in chunks:
                accumulated.extend(chunk)
        except BaseException:
            # The failed chunk was released by extend (or never opened);
            # the ones after it are given back here. release_chunk never
            # raises, so the error raised is the failed chunk's.
            for rest in chunks:
                release_chunk(rest)
            raise
        source = accumulated
    return source.raw_fields(start) if raw else source.fields(start)

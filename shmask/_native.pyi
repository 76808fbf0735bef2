# Types of the compiled core, shmask._native (cffi API mode, built from
# native/build.py: shmask_core.h and response_json.h plus the constants and
# enums of shmask_layout.h). tests/test_constants.py checks that every name the core
# exports is declared here and that the values the Python side also writes
# down agree with the core's.
#
# Pointers and buffers are cffi cdata (`CData`). The structs the package
# allocates with ffi.new("<struct> *") have their own classes here, so field
# reads are typed as well.

from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

class CData:
    """A cffi cdata object: a pointer, an array or a struct."""

    def __getitem__(self, index: int | slice, /) -> Any: ...
    def __setitem__(self, index: int | slice, value: Any, /) -> None: ...
    def __add__(self, offset: int, /) -> CData: ...
    def __sub__(self, other: int, /) -> CData: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __int__(self) -> int: ...
    def __len__(self) -> int: ...

_C = TypeVar("_C", bound=CData)

class ShmLayout(CData):
    lengths_offset: int
    flags_offset: int
    ids_offset: int
    logprobs_offset: int
    record_bytes: int

class ShmView(CData):
    record_offset: int
    lengths_offset: int
    flags_offset: int
    ids_offset: int
    logprobs_offset: int
    any_flags: int
    pad: int

class ShmReclaimResult(CData):
    head: int
    tail: int
    advanced_bytes: int
    expired: int
    blocked_position: int
    blocked_state: int
    pad: int

class ShmTakeTotals(CData):
    chunks: int
    rows: int
    payload_bytes: int

class ShmInfo(CData):
    capacity: int
    epoch: int
    producer_pid: int
    producer_start: int
    created_ns: int
    head: int
    tail: int
    published: int
    released: int
    expired: int

class ShmRing(CData):
    base: CData
    mapped_bytes: int
    capacity: int
    head: int
    tail: int
    n_queues: int
    n_free: int
    free_head: int
    handle_tag: int
    initial_nnz_cap: int
    dead: int
    queues: Any  # shm_queue[n_queues]
    free_slots: Any

class ShmDirect(CData):
    table: CData
    table_bytes: int
    slots: int
    ring_offset: int
    table_offset: int
    serial: int
    launched: int
    diverted_seen: int
    last_batch: int
    row_words: int
    row_nnz: int
    grown: int

class IntPointer(CData):
    def __getitem__(self, index: int | slice, /) -> Any: ...  # an int for an int index

class _NativeFFI:
    NULL: CData
    error: type[Exception]
    def cast(self, cdecl: str, source: CData | int, /) -> CData: ...
    def buffer(self, cdata: CData, size: int = -1, /) -> memoryview: ...
    def gc(self, cdata: _C, destructor: Callable[[Any], object] | None, size: int = 0) -> _C: ...
    def sizeof(self, cdecl: str | CData, /) -> int: ...
    def offsetof(self, cdecl: str, *fields_or_indexes: str | int) -> int: ...
    def typeof(self, cdecl: str | CData, /) -> Any: ...
    def string(self, cdata: CData, maxlen: int = -1) -> bytes: ...
    def memmove(self, dest: Any, src: Any, n: int) -> None: ...
    @overload
    def new(self, cdecl: Literal["shm_layout *"], init: Any = None) -> ShmLayout: ...
    @overload
    def new(self, cdecl: Literal["shm_view *"], init: Any = None) -> ShmView: ...
    @overload
    def new(self, cdecl: Literal["shm_reclaim_result *"], init: Any = None) -> ShmReclaimResult: ...
    @overload
    def new(self, cdecl: Literal["shm_take_totals *"], init: Any = None) -> ShmTakeTotals: ...
    @overload
    def new(self, cdecl: Literal["shm_info *"], init: Any = None) -> ShmInfo: ...
    @overload
    def new(self, cdecl: Literal["shm_ring *"], init: Any = None) -> ShmRing: ...
    @overload
    def new(self, cdecl: Literal["shm_direct *"], init: Any = None) -> ShmDirect: ...
    @overload
    def new(
        self, cdecl: Literal["int *", "int64_t *", "uint64_t *", "int32_t *", "uint32_t *"], init: Any = None
    ) -> IntPointer: ...
    @overload
    def new(self, cdecl: str, init: Any = None) -> CData: ...
    # numpy arrays, bytes, bytearray, mmap: anything with the buffer protocol
    # (typeshed's Buffer protocol does not list ndarray before Python 3.12).
    @overload
    def from_buffer(self, cdecl: str, python_buffer: Any, require_writable: bool = False) -> CData: ...
    @overload
    def from_buffer(self, python_buffer: Any, require_writable: bool = False) -> CData: ...

ffi: _NativeFFI

class _Lib:
    # shmask_core.h: return codes
    SHM_OK: int
    SHM_FULL: int
    SHM_E_TOO_BIG: int
    SHM_E_BAD_HEADER: int
    SHM_E_BAD_POSITION: int
    SHM_E_BAD_RECORD: int
    SHM_E_STALE: int
    SHM_E_DOUBLE_RELEASE: int
    SHM_E_NOT_WRITTEN: int
    SHM_E_BAD_LENGTHS: int
    SHM_E_BAD_STATE: int
    SHM_E_OVERFLOW: int
    SHM_E_WRONG_RECORD: int
    SHM_E_BAD_SLOT: int
    SHM_E_BAD_LENGTH: int
    SHM_E_SOURCE_OVERRUN: int
    SHM_E_MODE: int
    SHM_E_MIXED_NEEDS_SELECTED: int
    SHM_E_NO_MEMORY: int
    SHM_E_TRUNCATED: int
    SHM_E_BAD_FLAGS: int
    SHM_E_VOCAB: int
    SHM_E_BAD_BITMASK: int
    SHM_ROW_OK: int
    SHM_ROW_OVERFLOW: int
    SHM_ROW_INVALID: int
    SHM_ROW_STATUS_MASK: int
    SHM_ROW_BITMASK: int
    SHM_ROW_FORM_SHIFT: int
    SHM_HANDLE_SLOT_BITS: int
    SHM_E_NO_SLOT: int
    # response_json.h
    SHM_JSON_FLOAT_BYTES: int
    SHM_JSON_INT_BYTES: int
    SHM_JSON_MAX_THREADS: int
    SHM_JSON_ROOM: int
    SHM_JSON_E_ROWS: int
    SHM_JSON_E_CAPACITY: int
    # binary_rows.h
    SHM_B64_E_ARGS: int
    SHM_B64_E_CAPACITY: int
    SHM_B64_E_SYNTAX: int
    SHM_B64_E_DEPTH: int
    SHM_B64_MAX_DEPTH: int
    # shmask_layout.h (through native/build.py's LAYOUT_CDEF)
    SHM_HEADER_BYTES: int
    SHM_RECORD_ALIGN: int
    SHM_RECORD_HEADER_BYTES: int
    SHM_MIN_CAPACITY: int
    SHM_LAYOUT_VERSION: int
    SHM_STATE_FREE: int
    SHM_STATE_STAGING: int
    SHM_STATE_WRITTEN: int
    SHM_STATE_RELEASED: int
    SHM_STATE_PADDING: int
    SHM_STATE_EXPIRED: int
    SHM_STATE_DISCARDED: int
    SHM_STATE_CORRUPT: int
    SHM_MODE_SELECTED: int
    SHM_MODE_SUPPORT: int
    SHM_COUNTER_PUBLISHED: int
    SHM_COUNTER_RELEASED: int
    SHM_COUNTER_EXPIRED: int
    SHM_COUNTER_PADDING: int
    SHM_COUNTER_DISCARDED: int

    def shm_record_layout(
        self, mode: int, rows_capacity: int, words_capacity: int, nnz_capacity: int,
        out: ShmLayout, /
    ) -> int: ...
    def shm_bitmask_words(self, vocab: int, /) -> int: ...
    def shm_payload_bytes(self, mode: int, rows: int, words: int, nnz: int, /) -> int: ...
    def shm_read_info(self, base: CData, segment_bytes: int, out: ShmInfo, /) -> int: ...
    def shm_open_record(
        self, base: CData, mapped_bytes: int, capacity: int, position: int, seal: int,
        record_bytes: int, rows: int, words: int, nnz: int, vocab: int, mode: int,
        max_tokens: int, geometry: CData, out: ShmView, /,
    ) -> int: ...
    def shm_record_has_rows(
        self, base: CData, mapped_bytes: int, capacity: int, position: int, seal: int,
        rows: int, /,
    ) -> int: ...
    def shm_check_record(self, base: CData, capacity: int, position: int, seal: int, /) -> int: ...
    def shm_release(
        self, base: CData, mapped_bytes: int, capacity: int, position: int, seal: int, /,
    ) -> int: ...
    def shm_validate_rows(
        self, lengths: CData, flags: CData, ids: CData, rows: int, words: int, nnz: int,
        vocab: int, max_tokens: int, check_ids: int, any_flags: IntPointer, /,
    ) -> int: ...
    def shm_ring_init(
        self, ring: CData, base: CData, mapped_bytes: int, capacity: int, epoch: int, pid: int,
        start: int, created_ns: int, handle_tag: int, seal_seed: int, /,
    ) -> int: ...
    def shm_ring_free(self, ring: CData, /) -> None: ...
    def shm_ring_mark_dead(self, ring: CData, /) -> None: ...
    def shm_queue_open(self, ring: CData, mode: int, initial_rows: int, /) -> int: ...
    def shm_queue_slot(self, ring: CData, handle: int, /) -> int: ...
    def shm_queue_close(self, ring: CData, handle: int, /) -> int: ...
    def shm_queue_abort(self, ring: CData, handle: int, given_back: IntPointer, /) -> int: ...
    def shm_append_step(
        self, ring: CData, handles: CData, batch: int, lengths: CData, flags: CData, vocab: int,
        ids: CData, logprobs: CData,
        selected: CData, row_stride: int, ids_len: int, logprobs_len: int, selected_len: int,
        selected_is_logprobs: int, max_tokens: int, bad_row: IntPointer, /,
    ) -> int: ...
    def shm_queue_grow(self, ring: CData, slot: int, allow_ring: int, /) -> int: ...
    def shm_staging_owner(self, ring: CData, position: int, /) -> int: ...
    def shm_queue_relocate(self, ring: CData, slot: int, allow_ring: int, /) -> int: ...
    def shm_direct_forget_sizes(self, ring: CData, /) -> None: ...
    def shm_take_queues(
        self, ring: CData, handles: CData, count: int, start: int, now_ns: int, final: int,
        out: CData, totals: ShmTakeTotals, /,
    ) -> int: ...
    def shm_queue_pack_private(self, ring: CData, slot: int, out: CData, out_len: int, /) -> int: ...
    def shm_map(self, fd: int, bytes: int, populate: int, errno_out: IntPointer, /) -> CData: ...
    def shm_unmap(self, address: CData, /) -> None: ...
    def shm_guard_front(self) -> None: ...
    def shm_mapping_truncated(self, address: CData, /) -> int: ...
    # SIGTERM cleanup of the producer's rings (native/shmask_exit.h)
    SHM_EXIT_PATH_BYTES: int
    def shm_exit_register(self, path: bytes, /) -> int: ...
    def shm_exit_unregister(self, slot: int, /) -> None: ...
    def shm_exit_hook_sigterm(self) -> int: ...
    def shm_release_many(
        self, base: CData, mapped_bytes: int, capacity: int, positions: CData, seals: CData,
        count: int, results: CData, /,
    ) -> None: ...
    def shm_decode_rows(
        self, lengths: CData, flags: CData, ids: CData, rows: int, words: int, vocab: int,
        out: CData, out_len: int, /,
    ) -> int: ...
    # response_json.h
    def shm_set_avx512(self, enable: int, /) -> int: ...
    def shm_json_float(self, value: float, out: CData, /) -> int: ...
    def shm_json_floats(self, values: CData, count: int, out: CData, out_capacity: int, /) -> int: ...
    def shm_json_rows_bound(self, support: int, rows: int, entries: int, /) -> int: ...
    def shm_json_rows(
        self, support: int, lengths: CData, flags: CData, rows: int, ids: CData, ids_count: int,
        logprobs: CData, logprobs_count: int, threads: int, out: CData, out_capacity: int,
        spans: CData, parts_out: CData, /,
    ) -> int: ...
    def shm_json_gather(
        self, out: CData, out_length: int, sources: Any, lengths: Any, count: int,
        threads: int, /,
    ) -> int: ...
    # binary_rows.h
    def shm_b64_encoded_size(self, n: int, /) -> int: ...
    def shm_b64_encode(self, src: CData, n: int, dst: CData, threads: int, /) -> None: ...
    def shm_b64_rows_size(
        self, meta_info: int, support: int, start: int, rows: int, nnz: int, with_status: int,
        length: int, /,
    ) -> int: ...
    def shm_b64_rows(
        self, meta_info: int, support: int, start: int, rows: int, nnz: int, length: int,
        lengths: CData, status: CData, ids: CData, logprobs: CData, out: CData, capacity: int,
        threads: int, /,
    ) -> int: ...
    def shm_b64_rows_many(self, jobs: CData, count: int, threads: int, /) -> None: ...
    def shm_b64_scan(
        self, text: CData, n: int, found: CData, capacity: int, error_at: CData, /,
    ) -> int: ...
    def shm_b64_decode(
        self, text: CData, text_size: int, spans: CData, count: int, out: CData, out_size: int,
        results: CData, threads: int, /,
    ) -> int: ...
    def shm_reserve(
        self, ring: CData, mode: int, rows_capacity: int, words_capacity: int, nnz_capacity: int,
        position_out: IntPointer, /
    ) -> int: ...
    def shm_discard_record(self, ring: CData, position: int, /) -> int: ...
    def shm_publish(
        self, ring: CData, position: int, mode: int, rows: int, words: int, nnz: int, vocab: int,
        now_ns: int, seal_out: CData, /
    ) -> int: ...
    def shm_reclaim(
        self, ring: CData, now_ns: int, lease_ns: int, out: ShmReclaimResult, /
    ) -> int: ...
    def shm_record_offset(self, ring: CData, position: int, /) -> int: ...
    # GPU-direct publishing (kernels/direct.py)
    SHM_DIRECT_HEADER_BYTES: int
    SHM_DIRECT_DIVERTED_WORD: int
    SHM_DIRECT_DONE_WORD: int
    SHM_DIRECT_ENTRY_BYTES: int
    SHM_REF_KIND_EMPTY: int
    SHM_REF_KIND_RING: int
    SHM_REF_KIND_INLINE: int
    SHM_REF_KIND_LOST: int
    SHM_DIRECT_DESC_OFFSET: int
    SHM_DIRECT_IN_FLIGHT: int
    SHM_DIRECT_DIVERTED: int
    SHM_E_DIRECT_SLOT: int
    SHM_E_DIRECT_REPEAT: int
    SHM_E_DIRECT_COUNTS: int
    SHM_E_DIRECT_LAUNCH: int
    SHM_E_LAUNCH_PLAN: int
    SHM_LAUNCH_MAX_PARAMS: int
    SHM_E_COPY_SKIPPED: int
    SHM_E_ROW_DROPPED: int
    SHM_COPY_MAX_ROWS: int
    def shm_direct_init(self, direct: CData, slots: int, ring_offset: int, /) -> int: ...
    def shm_direct_free(self, direct: CData, /) -> None: ...
    def shm_direct_diverted(self, direct: CData, /) -> int: ...
    def shm_direct_idle(self, direct: CData, /) -> int: ...
    def shm_direct_wait(self, direct: CData, timeout_ns: int, /) -> int: ...
    def shm_direct_step(
        self, ring: CData, direct: CData, handles: CData, batch: int, mode: int, words: int,
        nnz: int, addresses: CData, vocab: int, bad_row: IntPointer, /,
    ) -> int: ...
    def shm_direct_launch(
        self, function: int, grid: int, threads: int, shared_bytes: int, stream: int, table: int,
        arrivals: int, n_params: int, /,
    ) -> int: ...
    def shm_launch_plan(
        self, steps: CData, n_steps: int, args: CData, args_bytes: int, holes: CData,
        n_holes: int, pointers: CData, n_pointers: int, stream: int, launch_fn: int,
        failed_step: CData, /,
    ) -> int: ...
    def shm_launch_plan_graph(
        self, steps: CData, n_steps: int, args: CData, args_bytes: int, holes: CData,
        n_holes: int, pointers: CData, n_pointers: int, capture_stream: int,
        graph_exec: CData, failed_step: CData, /,
    ) -> int: ...
    def shm_graph_launch(self, graph_exec: int, stream: int, /) -> int: ...
    def shm_graph_destroy(self, graph_exec: int, /) -> int: ...
    def shm_capture_stream(self, stream: CData, /) -> int: ...
    def shm_copy_rows_many(
        self, base: CData, mapped_bytes: int, capacity: int, entries: CData, keep: CData,
        count: int, max_tokens: int, out: CData, out_len: int, starts: CData,
        row_at: CData, row_lengths: CData, row_lengths_len: int, results: CData, /,
    ) -> int: ...
    def shm_ref_table_sizes(
        self, table: CData, count: int, stride: int, keep: CData, max_ids: int, ids: CData,
        rows: CData, /,
    ) -> int: ...
    def shm_copy_ref_table(
        self, base: CData, mapped_bytes: int, capacity: int, table: CData, count: int,
        stride: int, keep: CData, max_ids: int, max_tokens: int, out: CData, out_len: int,
        starts: CData, row_first: CData, row_lengths: CData, row_lengths_len: int,
        results: CData, /,
    ) -> int: ...
    def shm_direct_cancel(self, direct: CData, /) -> None: ...
    def shm_direct_diverted_done(self, direct: CData, /) -> None: ...
    def shm_direct_push_all(self, ring: CData, direct: CData, /) -> None: ...
    def shm_direct_pull_all(self, ring: CData, direct: CData, bad_slot: IntPointer, /) -> int: ...
    def shm_direct_diverted_rows(
        self, ring: CData, direct: CData, handles: CData, batch: int, out: CData, /,
    ) -> None: ...
    def shm_direct_reserve(
        self, ring: CData, slot: int, rows: int, words: int, nnz: int, /,
    ) -> int: ...

lib: _Lib

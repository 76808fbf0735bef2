"""Device functions that store a step's rows into the ring (GPU-direct
publishing, kernels/direct.py): the claim of a row's place in its queue's
buffer, the commit of its length, flags and counts, and the arrival that
tells the CPU the step's stores are visible.

Every kernel that publishes rows uses them: the store kernel (direct.py),
capture's write kernel (capture.py) and compaction's scan and expand
kernels (compact.py), each launched for one step that
``DirectPublisher.claim`` prepared (``shm_direct_step``). The table layout
they read is native/shmask_direct.h's (``shm_direct_entry``,
``shm_direct_step_desc``), by shmask/layout.py's names; docs/architecture.md
says what orders what.
``ring_claim`` only reads the table, so it may run for a whole block of
rows at once (compaction's scan kernel does); ``ring_commit`` and
``ring_arrive`` run once per row.
"""

import triton
import triton.language as tl

from shmask import layout

from .rows import Form, Status

# The layouts as constexprs (a kernel reads a global only as one; the code
# is the literal's). Row codes: kernels/rows.py; the table: shmask/layout.py.
_OK = tl.constexpr(int(Status.OK))
_SKIPPED = tl.constexpr(int(Status.SKIPPED))
_BITMASK = tl.constexpr(int(Form.BITMASK))
_FORM_SHIFT = tl.constexpr(layout.ROW_FORM_SHIFT)
_DONE = tl.constexpr(layout.DIRECT_DONE_WORD)
_DIVERTED = tl.constexpr(layout.DIRECT_DIVERTED_WORD)
_TARGET = tl.constexpr(layout.DIRECT_TARGET_WORD)
DESC = tl.constexpr(layout.DIRECT_DESC_WORD)  # the step descriptor, in u64 words
DESC_SLOTS = tl.constexpr(layout.DESC_SLOTS)
_HEADER_BYTES = tl.constexpr(layout.DIRECT_HEADER_BYTES)
_ENTRY_BYTES = tl.constexpr(layout.DIRECT_ENTRY_BYTES)
_LENGTHS = tl.constexpr(layout.ENTRY_LENGTHS)
_FLAGS = tl.constexpr(layout.ENTRY_FLAGS)
_IDS = tl.constexpr(layout.ENTRY_IDS)
_LOGPROBS = tl.constexpr(layout.ENTRY_LOGPROBS)
_ROWS = tl.constexpr(layout.ENTRY_ROWS)
_ROWS_CAPACITY = tl.constexpr(layout.ENTRY_ROWS_CAPACITY)
_WORDS = tl.constexpr(layout.ENTRY_WORDS)
_WORDS_CAPACITY = tl.constexpr(layout.ENTRY_WORDS_CAPACITY)
_NNZ = tl.constexpr(layout.ENTRY_NNZ)
_NNZ_CAPACITY = tl.constexpr(layout.ENTRY_NNZ_CAPACITY)
_VOCAB = tl.constexpr(layout.ENTRY_VOCAB)
_ENTRY_DIVERTED = tl.constexpr(layout.ENTRY_DIVERTED)


@triton.jit
def ring_claim(table, b, status, form, length, n_words, vocab, SUPPORT: tl.constexpr):
    """Where row b of the step goes in its queue's buffer. Returns (fits,
    entry, rows, words, nnz, ids, logprobs): `ids` and `logprobs` point at
    the row's first id word and first value (selected mode: its one value);
    `fits` is False for a SKIPPED row and for one that does not fit. Reads
    only; `b` and the row's arguments may be blocks (one claim per element)."""
    table = table.to(tl.int64)  # Triton types a small integer argument as i32
    desc = table.to(tl.pointer_type(tl.int64)) + DESC
    slot = tl.load(tl.load(desc + DESC_SLOTS).to(tl.pointer_type(tl.int32)) + b).to(tl.int64)
    entry = table + _HEADER_BYTES + slot * _ENTRY_BYTES
    counts = entry.to(tl.pointer_type(tl.int32))
    rows = tl.load(counts + _ROWS).to(tl.int64)
    words = tl.load(counts + _WORDS).to(tl.int64)
    nnz = tl.load(counts + _NNZ).to(tl.int64)
    queue_vocab = tl.load(counts + _VOCAB)
    # A SKIPPED row; a queue diverted this step.
    fits = (status != _SKIPPED) & (tl.load(counts + _ENTRY_DIVERTED) == 0)
    fits = fits & (rows < tl.load(counts + _ROWS_CAPACITY))
    fits = fits & (words + n_words <= tl.load(counts + _WORDS_CAPACITY))
    if SUPPORT:
        fits = fits & (nnz + length <= tl.load(counts + _NNZ_CAPACITY))
    # One vocabulary per buffer (what the CPU path enforces with SHM_E_VOCAB).
    bitmask = (status == _OK) & (form == _BITMASK)
    fits = fits & ((bitmask == 0) | (queue_vocab == 0) | (queue_vocab == vocab))
    addresses = entry.to(tl.pointer_type(tl.int64))
    ids = tl.load(addresses + _IDS).to(tl.pointer_type(tl.int32)) + words
    logprobs = tl.load(addresses + _LOGPROBS).to(tl.pointer_type(tl.float32))
    logprobs += nnz if SUPPORT else rows
    return fits, entry, rows, words, nnz, ids, logprobs


@triton.jit
def ring_commit(table, entry, fits, rows, words, nnz, status, form, length, n_words, vocab):
    """After the row's data: its length, flags byte and the counts (a row
    that fits), or the queue's diverted flag and the counter (one that does
    not, unless SKIPPED)."""
    counts = entry.to(tl.pointer_type(tl.int32))
    if fits:
        addresses = entry.to(tl.pointer_type(tl.int64))
        tl.store(tl.load(addresses + _LENGTHS).to(tl.pointer_type(tl.int32)) + rows,
                 length.to(tl.int32))
        tl.store(tl.load(addresses + _FLAGS).to(tl.pointer_type(tl.uint8)) + rows,
                 (status | (form << _FORM_SHIFT)).to(tl.uint8))
        tl.store(counts + _ROWS, (rows + 1).to(tl.int32))
        tl.store(counts + _WORDS, (words + n_words).to(tl.int32))
        tl.store(counts + _NNZ, (nnz + length).to(tl.int32))
        if (status == _OK) & (form == _BITMASK):
            tl.store(counts + _VOCAB, vocab)
    elif status != _SKIPPED:
        tl.store(counts + _ENTRY_DIVERTED, 1)
        # The diverted counter: GPU-side atomicity is all it needs.
        tl.atomic_add(table.to(tl.int64).to(tl.pointer_type(tl.int64)) + _DIVERTED, 1)


@triton.jit
def ring_arrive(table, arrivals):
    """Every thread's stores of this program, then its arrival; the last
    arrival of the step publishes `done` (the CPU's acquire load of it sees
    every store of the step)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    header = table.to(tl.int64).to(tl.pointer_type(tl.int64))
    target = tl.load(header + _TARGET)
    if arrived == target - 1:
        tl.atomic_xchg(header + _DONE, target, sem="release", scope="sys")

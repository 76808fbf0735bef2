"""Device functions that store a step's rows into the ring (GPU-direct
publishing, kernels/direct.py): the claim of a row's place in its queue's
buffer, the commit of its length, flags and counts, and the arrival that
tells the CPU the step's stores are visible.

Every kernel that publishes rows uses them: the store kernel (direct.py),
capture's write kernel (capture.py) and compaction's scan and expand
kernels (_common.py), each launched for one step that
``DirectPublisher.claim`` prepared (``shm_direct_step``). The table layout
they read is native/shmask_core.h's (``shm_direct_entry``,
``shm_direct_step_desc``); docs/architecture.md says what orders what.
``ring_claim`` only reads the table, so it may run for a whole block of
rows at once (compaction's scan kernel does); ``ring_commit`` and
``ring_arrive`` run once per row.
"""

import triton
import triton.language as tl


@triton.jit
def ring_claim(table, b, status, form, length, n_words, vocab, SUPPORT: tl.constexpr):
    """Where row b of the step goes in its queue's buffer. Returns (fits,
    entry, rows, words, nnz, ids, logprobs): `ids` and `logprobs` point at
    the row's first id word and first value (selected mode: its one value);
    `fits` is False for a SKIPPED row and for one that does not fit. Reads
    only; `b` and the row's arguments may be blocks (one claim per element)."""
    table = table.to(tl.int64)  # Triton types a small integer argument as i32
    desc = table.to(tl.pointer_type(tl.int64)) + 8  # shm_direct_step_desc at byte 64
    slot = tl.load(tl.load(desc + 9).to(tl.pointer_type(tl.int32)) + b).to(tl.int64)
    entry = table + 256 + slot * 64  # SHM_DIRECT_HEADER_BYTES, one line per entry
    counts = entry.to(tl.pointer_type(tl.int32))  # counts start at int32 word 8
    rows = tl.load(counts + 8).to(tl.int64)
    words = tl.load(counts + 10).to(tl.int64)
    nnz = tl.load(counts + 12).to(tl.int64)
    queue_vocab = tl.load(counts + 14)
    fits = (status != 3) & (tl.load(counts + 15) == 0)  # SKIPPED; a queue diverted this step
    fits = fits & (rows < tl.load(counts + 9)) & (words + n_words <= tl.load(counts + 11))
    if SUPPORT:
        fits = fits & (nnz + length <= tl.load(counts + 13))
    # One vocabulary per buffer (what the CPU path enforces with SHM_E_VOCAB).
    bitmask = (status == 0) & (form == 1)
    fits = fits & ((bitmask == 0) | (queue_vocab == 0) | (queue_vocab == vocab))
    addresses = entry.to(tl.pointer_type(tl.int64))
    ids = tl.load(addresses + 2).to(tl.pointer_type(tl.int32)) + words
    logprobs = tl.load(addresses + 3).to(tl.pointer_type(tl.float32))
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
        tl.store(tl.load(addresses).to(tl.pointer_type(tl.int32)) + rows, length.to(tl.int32))
        tl.store(tl.load(addresses + 1).to(tl.pointer_type(tl.uint8)) + rows,
                 (status | (form << 2)).to(tl.uint8))
        tl.store(counts + 8, (rows + 1).to(tl.int32))
        tl.store(counts + 10, (words + n_words).to(tl.int32))
        tl.store(counts + 12, (nnz + length).to(tl.int32))
        if (status == 0) & (form == 1):
            tl.store(counts + 14, vocab)
    elif status != 3:
        tl.store(counts + 15, 1)
        # The diverted counter: GPU-side atomicity is all it needs.
        tl.atomic_add(table.to(tl.int64).to(tl.pointer_type(tl.int64)), 1)


@triton.jit
def ring_arrive(table, arrivals):
    """Every thread's stores of this program, then its arrival; the last
    arrival of the step publishes `done` (the CPU's acquire load of it sees
    every store of the step)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    header = table.to(tl.int64).to(tl.pointer_type(tl.int64))
    target = tl.load(header + 16)  # shm_direct_step_desc.target
    if arrived == target - 1:
        tl.atomic_xchg(header + 1, target, sem="release", scope="sys")

/*
 * shmask native core. Memory-ordering contract (see shmask_layout.h), kept
 * by every file of the core:
 *   - the producer fills a record, then release-stores state = WRITTEN;
 *     a reader acquire-loads the state before it reads any payload byte;
 *   - a reader gives a record back with one CAS WRITTEN -> RELEASED, and the
 *     producer's lease expiry races with it through CAS WRITTEN -> EXPIRED,
 *     so exactly one of the two wins;
 *   - the producer release-stores the tail after it has decided to reuse a
 *     range; a reader that read payload re-checks (acquire fence, then the
 *     tail and the record's state and tag): if the tail moved past the
 *     record, the bytes it read may belong to someone else (seqlock style).
 * Only the producer writes head, tail, record headers and counters.
 */

/* What every concern shares: a record's array arithmetic (shmask_core.h). */
#include "shmask_core.h"
#include "shmask_internal.h"

static inline uint64_t align64(uint64_t n) { return (n + 63u) & ~(uint64_t)63u; }
static inline uint64_t align_record(uint64_t n) {
    return (n + SHM_RECORD_ALIGN - 1) & ~(uint64_t)(SHM_RECORD_ALIGN - 1);
}

uint64_t shm_bitmask_words(uint32_t vocab) { return ((uint64_t)vocab + 31) / 32; }

int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t words_capacity,
                      uint64_t nnz_capacity, shm_layout *out) {
    if (mode != SHM_MODE_SELECTED && mode != SHM_MODE_SUPPORT) return SHM_E_BAD_RECORD;
    /* Capacities come from untrusted headers too: keep every product far
     * from overflow (2^40 entries is far beyond any ring). */
    if (rows_capacity >= (1ull << 32) || words_capacity > (1ull << 40) ||
        nnz_capacity > (1ull << 40))
        return SHM_E_OVERFLOW;
    uint64_t lengths = SHM_RECORD_HEADER_BYTES;
    uint64_t flags = lengths + align64(4 * rows_capacity);
    uint64_t ids = flags + align64(rows_capacity);
    uint64_t logprobs = ids + align64(4 * words_capacity);
    uint64_t n_logprobs = mode == SHM_MODE_SUPPORT ? nnz_capacity : rows_capacity;
    out->lengths_offset = lengths;
    out->flags_offset = flags;
    out->ids_offset = ids;
    out->logprobs_offset = logprobs;
    out->record_bytes = align_record(logprobs + 4 * n_logprobs);
    return SHM_OK;
}

/* Copying many records' rows out of one ring (shmask_copy.h).
 *
 * Why one call: a frontend that resolves a step of 256 requests one chunk
 * at a time pays Python's open, decode, check and release per request
 * (about 14 us each on a 2-core VM, more than vLLM's whole frontend step
 * without shmask); the checks themselves are the core's and cost well under
 * a microsecond. Every value comes from a reference or shared memory and
 * is checked as Reader.open checks it: this only strings the same calls
 * together. */
#include "shmask_copy.h"
#include "shmask_core.h"
#include "shmask_decode.h"
#include "shmask_reader.h"

#include <stddef.h>

int64_t shm_copy_rows_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                           const shm_ref_entry *entries, const uint32_t *keep, uint64_t count,
                           uint64_t max_tokens, int32_t *out, uint64_t out_len, int64_t *starts,
                           const int64_t *row_at, int32_t *row_lengths, uint64_t row_lengths_len,
                           int32_t *results) {
    uint64_t cursor = 0;
    /* lengths int32[rows] then flags uint8[rows], as shm_open_record lays them */
    uint32_t geometry[(5 * SHM_COPY_MAX_ROWS + 3) / 4];
    for (uint64_t i = 0; i < count; i++) {
        const shm_ref_entry *e = &entries[i];
        uint64_t rows = e->rows, wanted = keep[i], first_row = (uint64_t)row_at[i];
        results[i] = SHM_E_COPY_SKIPPED;
        starts[i] = (int64_t)cursor;
        if (e->kind != SHM_REF_KIND_RING || rows > SHM_COPY_MAX_ROWS || wanted == 0 ||
            wanted > rows || row_at[i] < 0 || first_row + wanted > row_lengths_len)
            continue;
        shm_view view;
        int rc = shm_open_record(base, mapped_bytes, capacity, e->position, e->seal,
                                 e->record_bytes, rows, e->words, e->nnz, e->vocab, e->mode,
                                 max_tokens, (uint8_t *)geometry, &view);
        if (rc) {
            results[i] = rc;
            continue;
        }
        const int32_t *lengths = (const int32_t *)geometry;
        const uint8_t *flags = (const uint8_t *)geometry + 4 * rows;
        int dropped = 0;
        for (uint64_t r = 0; r < wanted; r++)
            dropped |= flags[r] & SHM_ROW_STATUS_MASK;
        if (dropped) {
            results[i] = SHM_E_ROW_DROPPED;
            continue;
        }
        /* The ids of the first `wanted` rows lead the record's id data. */
        const int32_t *ids = (const int32_t *)((const char *)base + view.ids_offset);
        int64_t written = shm_decode_rows(lengths, view.any_flags ? flags : NULL, ids, wanted,
                                          e->words, e->vocab, out + cursor, out_len - cursor);
        if (written < 0) {
            /* Rows that disagree with their lengths: rewritten under us, or
             * no room left; the usual open tells which. */
            results[i] = shm_check_record(base, capacity, e->position, e->seal)
                             ? SHM_E_STALE : SHM_E_COPY_SKIPPED;
            continue;
        }
        rc = shm_check_record(base, capacity, e->position, e->seal);
        if (!rc) rc = shm_release(base, mapped_bytes, capacity, e->position, e->seal);
        if (rc) {
            results[i] = rc;
            continue;
        }
        for (uint64_t r = 0; r < wanted; r++) row_lengths[first_row + r] = lengths[r];
        cursor += (uint64_t)written;
        results[i] = SHM_OK;
    }
    return (int64_t)cursor;
}

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
#include "shmask_layout.h"
#include "shmask_reader.h"

#include <stddef.h>
#include <string.h>

/* One ring entry: its record opened (every check of the ref against it),
 * its first `wanted` rows required OK, their ids decoded into out[0..room),
 * their lengths into row_lengths[0..wanted), the record checked again and
 * released. Returns SHM_OK with *written set, or the code of what stopped
 * it: then nothing of it was released and the caller's usual open says why.
 * A record of more than SHM_COPY_MAX_ROWS rows (its geometry would not fit
 * the stack buffer) or a `wanted` outside 1..rows is SHM_E_COPY_SKIPPED. */
static int copy_entry(void *base, uint64_t mapped_bytes, uint64_t capacity,
                      const shm_ref_entry *e, uint64_t wanted, uint64_t max_tokens,
                      int32_t *out, uint64_t room, int32_t *row_lengths, int64_t *written) {
    /* lengths int32[rows] then flags uint8[rows], as shm_open_record lays them */
    uint32_t geometry[(5 * SHM_COPY_MAX_ROWS + 3) / 4];
    uint64_t rows = e->rows;
    if (rows > SHM_COPY_MAX_ROWS || wanted == 0 || wanted > rows) return SHM_E_COPY_SKIPPED;
    shm_view view;
    int rc = shm_open_record(base, mapped_bytes, capacity, e->position, e->seal, e->record_bytes,
                             rows, e->words, e->nnz, e->vocab, e->mode, max_tokens,
                             (uint8_t *)geometry, &view);
    if (rc) return rc;
    const int32_t *lengths = (const int32_t *)geometry;
    const uint8_t *flags = (const uint8_t *)geometry + 4 * rows;
    int dropped = 0;
    for (uint64_t r = 0; r < wanted; r++)
        dropped |= flags[r] & SHM_ROW_STATUS_MASK;
    if (dropped) return SHM_E_ROW_DROPPED;
    /* The ids of the first `wanted` rows lead the record's id data. */
    const int32_t *ids = (const int32_t *)((const char *)base + view.ids_offset);
    int64_t n = shm_decode_rows(lengths, view.any_flags ? flags : NULL, ids, wanted, e->words,
                                e->vocab, out, room);
    if (n < 0)
        /* Rows that disagree with their lengths: rewritten under us, or no
         * room left; the usual open tells which. */
        return shm_check_record(base, capacity, e->position, e->seal) ? SHM_E_STALE
                                                                       : SHM_E_COPY_SKIPPED;
    rc = shm_check_record(base, capacity, e->position, e->seal);
    if (!rc) rc = shm_release(base, mapped_bytes, capacity, e->position, e->seal);
    if (rc) return rc;
    for (uint64_t r = 0; r < wanted; r++) row_lengths[r] = lengths[r];
    *written = n;
    return SHM_OK;
}

int64_t shm_copy_rows_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                           const shm_ref_entry *entries, const uint32_t *keep, uint64_t count,
                           uint64_t max_tokens, int32_t *out, uint64_t out_len, int64_t *starts,
                           const int64_t *row_at, int32_t *row_lengths, uint64_t row_lengths_len,
                           int32_t *results) {
    uint64_t cursor = 0;
    for (uint64_t i = 0; i < count; i++) {
        const shm_ref_entry *e = &entries[i];
        uint64_t wanted = keep[i], first_row = (uint64_t)row_at[i];
        results[i] = SHM_E_COPY_SKIPPED;
        starts[i] = (int64_t)cursor;
        /* (rows and wanted are copy_entry's to check) */
        if (e->kind != SHM_REF_KIND_RING || row_at[i] < 0 || first_row + wanted > row_lengths_len)
            continue;
        int64_t written = 0;
        results[i] = copy_entry(base, mapped_bytes, capacity, e, wanted, max_tokens, out + cursor,
                                out_len - cursor, row_lengths + first_row, &written);
        cursor += (uint64_t)written;
    }
    return (int64_t)cursor;
}

/* Reference i of the table, if this call takes it: the same prefix as
 * reference 0 (so the same one-entry header and segment table, which the
 * caller checked), a ring entry of segment 0, a valid mode, at most
 * SHM_COPY_MAX_ROWS rows and max_ids ids, and `wanted` rows in 1..rows.
 * The entry is copied out (the table's rows need not be aligned). */
static int table_entry(const uint8_t *table, uint64_t i, uint64_t stride, const uint32_t *keep,
                       uint64_t max_ids, shm_ref_entry *e, uint64_t *wanted) {
    uint64_t prefix = stride - sizeof(shm_ref_entry);
    const uint8_t *ref = table + i * stride;
    if (i && memcmp(ref, table, prefix)) return 0;
    memcpy(e, ref + prefix, sizeof *e);
    *wanted = keep ? keep[i] : e->rows;
    return e->kind == SHM_REF_KIND_RING && e->segment == 0 &&
           (e->mode == SHM_MODE_SELECTED || e->mode == SHM_MODE_SUPPORT) &&
           e->rows <= SHM_COPY_MAX_ROWS && e->nnz <= max_ids && *wanted >= 1 &&
           *wanted <= e->rows;
}

int shm_ref_table_sizes(const uint8_t *table, uint64_t count, uint64_t stride,
                        const uint32_t *keep, uint64_t max_ids, uint64_t *ids, uint64_t *rows) {
    *ids = *rows = 0;
    if (stride <= sizeof(shm_ref_entry)) return SHM_E_COPY_SKIPPED;
    uint64_t total_ids = 0, total_rows = 0;
    for (uint64_t i = 0; i < count; i++) {
        shm_ref_entry e;
        uint64_t wanted;
        if (!table_entry(table, i, stride, keep, max_ids, &e, &wanted)) continue;
        total_ids = e.nnz > UINT64_MAX - total_ids ? UINT64_MAX : total_ids + e.nnz;
        total_rows += wanted;
    }
    *ids = total_ids;
    *rows = total_rows;
    return SHM_OK;
}

int64_t shm_copy_ref_table(void *base, uint64_t mapped_bytes, uint64_t capacity,
                           const uint8_t *table, uint64_t count, uint64_t stride,
                           const uint32_t *keep, uint64_t max_ids, uint64_t max_tokens,
                           int32_t *out, uint64_t out_len, int64_t *starts, int64_t *row_first,
                           int32_t *row_lengths, uint64_t row_lengths_len, int32_t *results) {
    uint64_t cursor = 0, row_cursor = 0;
    for (uint64_t i = 0; i < count; i++) {
        shm_ref_entry e;
        uint64_t wanted = 0;
        int64_t written = 0;
        starts[i] = (int64_t)cursor;
        row_first[i] = (int64_t)row_cursor;
        results[i] = SHM_E_COPY_SKIPPED;
        if (stride > sizeof(shm_ref_entry) &&
            table_entry(table, i, stride, keep, max_ids, &e, &wanted) &&
            wanted <= row_lengths_len - row_cursor)
            results[i] = copy_entry(base, mapped_bytes, capacity, &e, wanted, max_tokens,
                                    out + cursor, out_len - cursor, row_lengths + row_cursor,
                                    &written);
        if (results[i] == SHM_OK) {
            cursor += (uint64_t)written;
            row_cursor += wanted;
        }
    }
    starts[count] = (int64_t)cursor;
    row_first[count] = (int64_t)row_cursor;
    return (int64_t)cursor;
}

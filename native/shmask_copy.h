/* Copying many records' rows out of one ring and releasing them, in one
 * call (shmask_copy.c): what a consumer that copies on purpose does for a
 * whole step (vLLM's frontend: shmask/adapters/vllm.py resolve_outputs).
 * Return codes: shmask_core.h. */
#ifndef SHMASK_COPY_H
#define SHMASK_COPY_H

#include <stdint.h>

#include "shmask_queue.h" /* shm_ref_entry */

/* An entry this call did not try (not a ring entry, more rows than
 * SHM_COPY_MAX_ROWS, a keep outside 1..rows, no room left in out): the
 * caller opens it the usual way. */
#define SHM_E_COPY_SKIPPED -35
#define SHM_COPY_MAX_ROWS 64

/* For each entry i of one segment's ring (entries' own segment field is
 * not read): its record opened as shm_open_record opens it (every check of
 * the ref against the record, the rows' geometry copied and validated), its
 * first keep[i] rows required OK, their ids written to out from the
 * running cursor (bitmask rows decoded, shm_decode_rows), the record
 * checked again (reclaimed meanwhile: stale) and released. Then
 * results[i] = SHM_OK, starts[i] = index in out of its first id, and its
 * rows' lengths are at row_lengths[row_at[i]] on (the caller's layout).
 * Any other result (an open, check or release code, SHM_E_ROW_DROPPED for
 * a kept row that is not OK, SHM_E_COPY_SKIPPED): nothing of entry i was
 * copied or released, so the caller's usual open says why. Returns the ids
 * written to out. */
#define SHM_E_ROW_DROPPED -36
int64_t shm_copy_rows_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                           const shm_ref_entry *entries, const uint32_t *keep, uint64_t count,
                           uint64_t max_tokens, int32_t *out, uint64_t out_len, int64_t *starts,
                           const int64_t *row_at, int32_t *row_lengths, uint64_t row_lengths_len,
                           int32_t *results);

/* A step's references as vLLM's frontend receives them: `count` references
 * of `stride` bytes back to back in `table`, each a batch of one ring entry
 * (its header and segment table, then its shm_ref_entry as its last
 * bytes). The caller has checked reference 0's leading stride - 48 bytes
 * (a canonical one-entry batch naming one segment: the ring at `base`).
 * Reference i is taken only if its leading bytes equal reference 0's, its
 * entry is a ring entry of segment 0 with a valid mode, of at most
 * SHM_COPY_MAX_ROWS rows and `max_ids` ids (a bound on what references
 * may size), and it keeps `keep[i]` rows (keep NULL: all its rows) in
 * 1..rows; anything else is SHM_E_COPY_SKIPPED, left for the usual open
 * to explain.
 *
 * shm_ref_table_sizes: the ids (saturating) and rows the taken references
 * say they hold, to size out and row_lengths; SHM_E_COPY_SKIPPED when the
 * stride holds no entry.
 * shm_copy_ref_table: each taken reference copied and released as
 * shm_copy_rows_many does it. starts and row_first are running cursors
 * (count + 1 each): reference i's ids are out[starts[i]:starts[i + 1]], its
 * rows' lengths row_lengths[row_first[i]:row_first[i + 1]] (both empty for
 * a reference not copied). Returns the ids written. */
int shm_ref_table_sizes(const uint8_t *table, uint64_t count, uint64_t stride,
                        const uint32_t *keep, uint64_t max_ids, uint64_t *ids, uint64_t *rows);
int64_t shm_copy_ref_table(void *base, uint64_t mapped_bytes, uint64_t capacity,
                           const uint8_t *table, uint64_t count, uint64_t stride,
                           const uint32_t *keep, uint64_t max_ids, uint64_t max_tokens,
                           int32_t *out, uint64_t out_len, int64_t *starts, int64_t *row_first,
                           int32_t *row_lengths, uint64_t row_lengths_len, int32_t *results);

#endif

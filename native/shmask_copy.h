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

#endif

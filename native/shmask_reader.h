/*
 * The reader's checks (shmask_reader.c): segment info, opening, checking
 * and releasing a record a ref names, validating rows.
 * Return codes: shmask_core.h.
 */
#ifndef SHMASK_READER_H
#define SHMASK_READER_H

#include <stdint.h>

/* What a reader gets back from a validated lookup. */
typedef struct {
    uint64_t record_offset; /* from the start of the mapping */
    uint64_t lengths_offset;
    uint64_t flags_offset;
    uint64_t ids_offset;
    uint64_t logprobs_offset;
    uint32_t any_flags;   /* some row is not an OK ids row (set by shm_validate_rows) */
    uint32_t pad;
} shm_view;

typedef struct {
    uint64_t capacity;
    uint64_t epoch;
    uint64_t producer_pid;
    uint64_t producer_start;
    uint64_t created_ns;
    uint64_t head;
    uint64_t tail;
    uint64_t published;
    uint64_t released;
    uint64_t expired;
} shm_info;

/* Reader side: every argument is untrusted and bounds-checked. */
/* Validates the segment header (magic, version, a power-of-two capacity
 * that fits segment_bytes) and copies it out; reads the header page only. */
int shm_read_info(const void *base, uint64_t segment_bytes, shm_info *out);
/* Validates the ref against the record (its seal included: a ref opens only
 * the record it was issued for, else SHM_E_WRONG_RECORD), copies the rows'
 * geometry into the caller's private `geometry` (5 * rows bytes: lengths
 * int32[rows], then flags uint8[rows]) and validates the rows from those
 * copies (shm_validate_rows: SHM_E_BAD_LENGTHS), so the row boundaries a
 * reader uses are the ones checked, whatever is written into the record
 * later; then checks the record again (shm_check_record: SHM_E_STALE if it
 * was reclaimed meanwhile). Fills out, any_flags included. */
int shm_open_record(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                    uint64_t position, uint64_t seal, uint64_t record_bytes, uint64_t rows,
                    uint64_t words, uint64_t nnz, uint32_t vocab, uint32_t mode,
                    uint64_t max_tokens, uint8_t *geometry, shm_view *out);
/* SHM_OK when the record at `position` carries this seal and holds `rows`
 * rows: asked before a reader sizes a large geometry copy by a ref's rows,
 * so a forged ref cannot make it allocate more than a real record needs. */
int shm_record_has_rows(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                        uint64_t position, uint64_t seal, uint64_t rows);
/* SHM_OK while the record at `position` is still the published one with this
 * seal (WRITTEN or RELEASED), else SHM_E_STALE. */
int shm_check_record(const void *base, uint64_t capacity, uint64_t position, uint64_t seal);
int shm_release(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position,
                uint64_t seal);
/* Checks rows read from a ref or shared memory: flags valid, non-OK rows
 * empty, ids rows at most max_tokens long, bitmask rows with exactly L
 * bits set and none at ids >= vocab, lengths summing to nnz and id data to
 * words; with check_ids, every id of an ids row in [0, 2^31). flags may be
 * NULL (every row an OK ids row). *any_flags is set when some row is not an
 * OK ids row. */
int shm_validate_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                      uint64_t rows, uint64_t words, uint64_t nnz, uint32_t vocab,
                      uint64_t max_tokens, int check_ids, uint32_t *any_flags);

/* Releases many records of one segment (a tokenizer dropping an aborted
 * request's chunks without opening them): results[i] is shm_release's code. */
void shm_release_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                      const uint64_t *positions, const uint64_t *seals, uint64_t count,
                      int32_t *results);

#endif

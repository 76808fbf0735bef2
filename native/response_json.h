/*
 * shmask response writer: a chunk's three response fields (ids per row,
 * logprobs per row or per token, lengths) as JSON, byte for byte what
 * orjson writes for the Python lists (Chunk.to_lists), built without a
 * Python object per value and split across threads.
 * native/build.py declares these functions to cffi.
 */
#ifndef SHMASK_RESPONSE_JSON_H
#define SHMASK_RESPONSE_JSON_H

#include <stdint.h>

/* Most bytes one value takes: a float32 widened to double
 * ("-0.000012345678901234567", 17 significant digits at most) and an int32
 * ("-2147483648"). */
#define SHM_JSON_FLOAT_BYTES 24
#define SHM_JSON_INT_BYTES 11
#define SHM_JSON_MAX_THREADS 64
/* Bytes past a value's start that writing it may touch (it copies digits
 * in fixed-size blocks; what lies past its end is overwritten next). */
#define SHM_JSON_ROOM 48

/* Return codes of shm_json_rows. */
#define SHM_JSON_E_ROWS -1     /* a negative length, a non-OK row with ids, or counts that disagree */
#define SHM_JSON_E_CAPACITY -2 /* `out` is smaller than shm_json_rows_bound */

/* One float32 value widened to double as orjson writes a Python float: the
 * shortest decimal that reads back as the same double (the closest of
 * those, ties to an even last digit), "null" for NaN and infinities.
 * Writes at most SHM_JSON_FLOAT_BYTES bytes (no terminating NUL) and
 * returns how many; `out` must hold SHM_JSON_ROOM bytes. */
int shm_json_float(float value, char *out);

/* "[v0,v1,...]" for `count` float32 values (shm_json_float each). `out`
 * must hold 2 + count * (SHM_JSON_FLOAT_BYTES + 1) + SHM_JSON_ROOM bytes.
 * Returns the bytes written, or SHM_JSON_E_CAPACITY. */
int64_t shm_json_floats(const float *values, uint64_t count, char *out, uint64_t out_capacity);

/* Bytes shm_json_rows may need for `rows` rows holding `entries` ids (and,
 * in support mode, as many logprobs); 0 past 2^56 rows or entries. */
uint64_t shm_json_rows_bound(int support, uint64_t rows, uint64_t entries);

/* The three response arrays of a chunk: ids per row ("[[3,7],null,[]]"),
 * logprobs (per row in support mode, one value per row otherwise) and
 * lengths ("[2,null,0]"). A row whose status (flags & 3; flags NULL: all
 * OK) is not OK is null in all three and must have length 0. `ids` holds
 * the rows' ids back to back (sum of lengths), `logprobs` as many values
 * (support) or one per row (selected). Up to `threads` threads share the
 * rows (fewer for small chunks), each writing its own part of each array
 * into `out`: array f is the concatenation of its *parts_out spans, span i
 * at spans[2 * (f * SHM_JSON_MAX_THREADS + i)] (offset into `out`, then
 * length); `spans` holds 6 * SHM_JSON_MAX_THREADS values. (The caller joins
 * the spans in the one copy it makes of them anyway: no moving them
 * together here.) Every count is checked before anything is read. Returns
 * 0, SHM_JSON_E_ROWS or SHM_JSON_E_CAPACITY. */
int shm_json_rows(int support, const int32_t *lengths, const uint8_t *flags, uint64_t rows,
                  const int32_t *ids, uint64_t ids_count, const float *logprobs,
                  uint64_t logprobs_count, int threads, char *out, uint64_t out_capacity,
                  uint64_t *spans, int *parts_out);

/* Copies `count` pieces (sources[i], lengths[i] bytes) back to back into
 * `out`, which holds exactly their total, `out_length` bytes: the one copy
 * that makes a response of orjson's small skeleton and the written rows.
 * Up to `threads` threads share the bytes (fewer below a few hundred KiB
 * each): fresh output memory costs a page fault per 4 KiB, which threads
 * take in parallel. Returns 0, or SHM_JSON_E_CAPACITY when the pieces do
 * not add up to out_length (nothing is written then). */
int shm_json_gather(char *out, uint64_t out_length, const char *const *sources,
                    const uint64_t *lengths, uint64_t count, int threads);

#endif

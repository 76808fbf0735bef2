/*
 * shmask native core: the only code that touches a flag, a position or a
 * record header in shared memory, plus the per-step copy loop. One file
 * pair per concern; this header holds what they all share (return codes,
 * row flags, a record's array arithmetic: shmask_core.c). Each concern has
 * its own header, which a .c file includes when it calls into it (only
 * native/build.py's cffi source includes them all):
 *
 *   shmask_ring.h       the producer's ring: reserve, publish, reclaim
 *   shmask_reader.h     the reader's checks: info, open, check, release
 *   shmask_queue.h      RowQueue buffers: append_step, growth, take
 *   shmask_decode.h     row decoding (bitmask rows to ids)
 *   shmask_guard.h      guarded mappings (SIGBUS)
 *   shmask_direct.h     GPU-direct publishing
 *   shmask_launch.h     a kernel plan's launches in one call (kernels/launch_plan.py)
 *   shmask_copy.h       many records' rows copied out and released in one call
 *
 * The bytes themselves are described once, in shmask_layout.h.
 * native/build.py declares the same functions to cffi (each header in turn).
 */
#ifndef SHMASK_CORE_H
#define SHMASK_CORE_H

#include <stdint.h>

/* Return codes: 0 is success, negative values are errors the Python side
 * turns into exceptions that name the bad value. */
#define SHM_OK 0
#define SHM_FULL 1              /* ring has no room now; reclaim or wait */
#define SHM_E_TOO_BIG -1        /* record larger than the whole ring */
#define SHM_E_BAD_HEADER -2     /* magic, version or capacity wrong */
#define SHM_E_BAD_POSITION -3   /* position outside [tail, head) or misaligned */
#define SHM_E_BAD_RECORD -4     /* record header disagrees with the ref */
#define SHM_E_STALE -5          /* reclaimed (lease) or reused */
#define SHM_E_DOUBLE_RELEASE -6 /* released already */
#define SHM_E_NOT_WRITTEN -7    /* still staging, padding, or garbage */
#define SHM_E_BAD_LENGTHS -8    /* negative length or sum != nnz */
#define SHM_E_BAD_STATE -9      /* producer-side misuse (publish twice, ...) */
#define SHM_E_OVERFLOW -10      /* a size computation would overflow */
#define SHM_E_WRONG_RECORD -11  /* the record's seal is not the ref's: a garbled or misrouted ref */

#define SHM_E_BAD_SLOT -20
#define SHM_E_BAD_LENGTH -21
#define SHM_E_SOURCE_OVERRUN -22
#define SHM_E_MODE -23
#define SHM_E_MIXED_NEEDS_SELECTED -24
#define SHM_E_NO_MEMORY -25
#define SHM_E_TRUNCATED -26
#define SHM_E_BAD_FLAGS -27   /* a row's status/form flags are not a valid combination */
#define SHM_E_VOCAB -28       /* a bitmask row without a vocabulary, or a queue's changed */
#define SHM_E_BAD_BITMASK -29 /* a bitmask row's set bits disagree with its length or vocab */

/* Where the arrays of a record live, relative to the record's start. */
typedef struct {
    uint64_t lengths_offset;
    uint64_t flags_offset;
    uint64_t ids_offset;
    uint64_t logprobs_offset;
    uint64_t record_bytes;
} shm_layout;

/* Row flags (shmask_layout.h): status in bits 0-1, form in bit 2
 * (SHM_ROW_BITMASK == 1 << SHM_ROW_FORM_SHIFT; shmask/layout.py mirrors
 * every value, tests/test_constants.py checks them). */
#define SHM_ROW_OK 0
#define SHM_ROW_OVERFLOW 1
#define SHM_ROW_INVALID 2
#define SHM_ROW_STATUS_MASK 3
#define SHM_ROW_FORM_SHIFT 2
#define SHM_ROW_BITMASK 4

/* nnz_capacity counts support-mode logprobs; a selected-mode record has
 * rows_capacity logprobs and ignores it. */
int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t words_capacity,
                      uint64_t nnz_capacity, shm_layout *out);
/* int32 words of one bitmask row of a vocabulary of `vocab` ids. */
uint64_t shm_bitmask_words(uint32_t vocab);

#endif

/* GPU-direct publishing (shmask_direct.c): the table the GPU stores rows
 * through, and the CPU side of each step. Return codes: shmask_core.h. */
#ifndef SHMASK_DIRECT_H
#define SHMASK_DIRECT_H

#include <stdint.h>

#include "shmask_ring.h"

/* ------------------------------------------------------------------
 * GPU-direct publishing (issue 10, kernels/direct.py). A device-visible
 * queue table lets a GPU kernel store each step's rows straight into the
 * queue buffers in the (CUDA-registered) ring. The table is C memory,
 * page-aligned so that it can be registered too:
 *
 *   byte 0               u64 diverted   rows the GPU refused, ever (GPU atomic add)
 *   byte 8               u64 done       programs of the steps that completed: the
 *                                       last program of a launch stores its
 *                                       target here (release, system scope)
 *   byte 64              shm_direct_step_desc: the launched step's rows
 *   byte 256 + 64 * slot shm_direct_entry of queue slot `slot`
 *   byte slots_offset    int32 per row of the step: its queue slot
 *
 * Only this core writes the table on the CPU side (the step's descriptor,
 * slots and entries); the GPU kernel writes an entry's rows/words/nnz/vocab
 * when it stores a row, or its `diverted` flag (and bumps the counter) when
 * the row does not fit, and `done` when its last program finished; pull
 * copies the GPU's counts back into the shm_queue. Counts are 32 bits: a
 * capacity past 2^31 - 1 is published clamped (the GPU diverts beyond it
 * and the CPU path takes over). Capacities of 0 (no buffer, a privately
 * staged queue, a lost ring, a closed slot) divert every row. */
typedef struct {
    uint64_t lengths;      /* device addresses of the queue buffer's arrays */
    uint64_t flags;
    uint64_t ids;
    uint64_t logprobs;
    uint32_t rows;         /* counts: written by the GPU as it stores rows */
    uint32_t rows_capacity;
    uint32_t words;
    uint32_t words_capacity;
    uint32_t nnz;
    uint32_t nnz_capacity; /* support logprobs; 0 in selected mode (unused) */
    uint32_t vocab;        /* of the bitmask rows in the buffer (0: none yet) */
    uint32_t diverted;     /* sticky: a row did not fit; later rows divert too */
} shm_direct_entry;

/* One launched step, read by every program of its kernel: the device
 * addresses of the Rows tensors (kernels/_common.py: int32 status, forms,
 * lengths, id_offsets, offsets, ids; float32 values, selected), the value
 * `done` takes when the step completed, and where the row -> slot array is. */
typedef struct {
    uint64_t status, forms, lengths, id_offsets, offsets, ids, values, selected;
    uint64_t target;       /* programs launched, this step's included */
    uint64_t slots;        /* device address of the int32 row -> slot array */
    uint32_t vocab;
    uint32_t batch;
    uint8_t reserved[40];
} shm_direct_step_desc;

/* The producer's private side of a direct table (never seen by the GPU). */
typedef struct {
    void *table;           /* the device-visible table: page-aligned C memory */
    uint64_t table_bytes;  /* a multiple of the page size */
    uint64_t slots;        /* entries in the table: queues at slot >= slots go the CPU path */
    int64_t ring_offset;   /* device address - host address of the ring mapping */
    int64_t table_offset;  /* the same for the table (set once it is registered) */
    uint64_t *seen_serial; /* per slot: the last step that saw it (one row per queue per step) */
    uint64_t serial;
    uint64_t launched;     /* programs launched: `done` equals it when nothing is in flight */
    uint64_t diverted_seen;/* the diverted counter when the CPU last appended diverted rows */
    uint64_t last_batch;   /* rows of the last step (their slots are in the table) */
    uint64_t row_words;    /* id words per row stored in the last step that stored any */
    uint64_t row_nnz;      /* values per row, the same */
    uint64_t grown;        /* queues given room (a new buffer or a larger one), ever */
} shm_direct;

/* The table's layout (drawn above); the Triton kernels read it through
 * shmask/layout.py's names, which tests/test_constants.py checks against
 * these and against offsetof of the two structs. */
#define SHM_DIRECT_DIVERTED_WORD 0 /* u64 word of the table: the diverted counter */
#define SHM_DIRECT_DONE_WORD 1     /* u64 word of the table: `done` */
#define SHM_DIRECT_HEADER_BYTES 256
#define SHM_DIRECT_DESC_OFFSET 64
#define SHM_DIRECT_ENTRY_BYTES 64  /* sizeof(shm_direct_entry): one cache line */
#define SHM_DIRECT_IN_FLIGHT 2  /* shm_direct_step: the last step's kernel has not completed */
#define SHM_DIRECT_DIVERTED 3   /* shm_direct_step: the last step diverted rows (CPU appends first) */
#define SHM_E_DIRECT_SLOT -30   /* a queue slot past the direct table: the step takes the CPU path */
#define SHM_E_DIRECT_REPEAT -31 /* a queue has two rows in one step: the step takes the CPU path */
#define SHM_E_DIRECT_COUNTS -32 /* the table's counts went backwards or past a capacity */
#define SHM_E_DIRECT_LAUNCH -33 /* no CUDA driver in this process, or a bad parameter count */

/* Allocates a table of `slots` entries (zeroed: every row diverts). */
int shm_direct_init(shm_direct *direct, uint64_t slots, int64_t ring_offset);
void shm_direct_free(shm_direct *direct);
/* Rows the GPU diverted since the table was made (an acquire load). */
uint64_t shm_direct_diverted(const shm_direct *direct);
/* 1 when every launched program has completed (an acquire load of `done`:
 * the kernels' stores are visible to this thread after it returns 1). */
int shm_direct_idle(const shm_direct *direct);
/* Spins, then sleeps, until idle or `timeout_ns` passed: 1 idle, 0 not. */
int shm_direct_wait(const shm_direct *direct, uint64_t timeout_ns);
/* Everything the CPU does for one step before the launch, while no kernel
 * is in flight (else SHM_DIRECT_IN_FLIGHT) and no diverted rows wait (else
 * SHM_DIRECT_DIVERTED): pulls the last step's counts, checks every handle
 * (open, this ring, mode `mode`, inside the table, at most once), gives
 * each queue room for one more row of `words` id words and `nnz` values
 * (growing it in the ring; where that fails the row diverts), pushes its
 * entry, writes the row -> slot array and the descriptor (`addresses`: the
 * 8 Rows addresses in shm_direct_step_desc's order). Returns 0 (launch
 * `batch` programs), a positive code above, or a negative error with
 * *bad_row set (nothing changed: the step takes the CPU path). */
int shm_direct_step(shm_ring *ring, shm_direct *direct, const int64_t *handles,
                    uint64_t batch, uint32_t mode, uint64_t words, uint64_t nnz,
                    const uint64_t *addresses, uint32_t vocab, int64_t *bad_row);
/* Launches the store kernel (a CUfunction of `n_params` 8-byte parameters:
 * table, arrivals, then NULLs) on `stream` with cuLaunchKernel: `grid`
 * programs of `threads` threads. Returns 0, SHM_E_DIRECT_LAUNCH, or
 * -1000 - the CUDA error. */
int shm_direct_launch(uint64_t function, uint32_t grid, uint32_t threads, uint32_t shared_bytes,
                      uint64_t stream, uint64_t table, uint64_t arrivals, uint32_t n_params);
/* The launch after a 0 from shm_direct_step failed: nothing is in flight. */
void shm_direct_cancel(shm_direct *direct);
/* The diverted rows were appended by the CPU: steps may launch again. */
void shm_direct_diverted_done(shm_direct *direct);
/* Writes every slot's entry from the queue table (addresses, counts,
 * capacities, vocab; diverted cleared) and makes each queue's flags
 * explicit for its rows so far (the GPU writes a flags byte per row). */
void shm_direct_push_all(shm_ring *ring, shm_direct *direct);
/* Copies the GPU's counts of every entry that still describes its queue's
 * buffer back into the queue table. Call only while idle. */
int shm_direct_pull_all(shm_ring *ring, shm_direct *direct, uint64_t *bad_slot);
/* Marks out[i] = 1 for each row i of a step whose queue's entry is diverted. */
void shm_direct_diverted_rows(const shm_ring *ring, const shm_direct *direct,
                              const int64_t *handles, uint64_t batch, uint8_t *out);
/* The publisher is gone: every queue sizes its next buffers from its own
 * rows again, not from the room the GPU-direct steps asked for. */
void shm_direct_forget_sizes(shm_ring *ring);
/* Gives the queue of `slot` room for `rows` more rows of `words` id words
 * and `nnz` support entries, growing it in the ring (SHM_FULL: no room now;
 * the next rows divert again). A privately staged queue is left alone. */
int shm_direct_reserve(shm_ring *ring, uint64_t slot, uint64_t rows, uint64_t words,
                       uint64_t nnz);

#endif

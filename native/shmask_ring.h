/*
 * The producer's ring (shmask_ring.c): its private state, the queue table
 * (shm_queue, shm_ring), and reserve / publish / reclaim of records.
 * Return codes: shmask_core.h.
 */
#ifndef SHMASK_RING_H
#define SHMASK_RING_H

#include <stdint.h>

typedef struct {
    uint64_t head;
    uint64_t tail;
    uint64_t advanced_bytes;
    uint64_t expired;
    uint64_t blocked_position; /* record at the tail that stopped reclaim */
    uint32_t blocked_state;    /* its state, or 0 when the ring is empty */
    uint32_t pad;
} shm_reclaim_result;

/* One RowQueue's staging buffer: where its arrays are and how full. The
 * buffer is a STAGING record in the ring (in_ring) or memory this core
 * malloc'd (the ring had no room). Only the core (shmask_ring.c,
 * shmask_queue.c, shmask_direct.c) writes these. */
typedef struct {
    /* first two cache lines: all the per-step validation and copy touch
     * (the table is 64-byte aligned and this struct is three lines long) */
    int32_t *lengths;
    int32_t *ids;
    float *logprobs;
    uint8_t *flags;
    uint64_t rows;
    uint64_t nnz;          /* sum of lengths: support-mode logprobs */
    uint64_t words;        /* int32 words of ids (== nnz while every row is an OK ids row) */
    uint32_t mode;         /* 0: slot closed */
    uint32_t generation;   /* bumped at every close: stale handles stop matching;
                            * at UINT32_MAX the slot retires instead */
    uint64_t rows_capacity;
    uint64_t nnz_capacity;
    uint64_t words_capacity;
    uint64_t pending_rows; /* this step's rows for the queue (validation pass) */
    uint64_t pending_nnz;
    uint64_t pending_words;
    uint64_t pending_serial; /* the step the pending counts belong to */
    uint32_t vocab;        /* of the bitmask rows in this buffer (0: none yet) */
    uint32_t flagged;      /* flags[0..rows) are written: some row was not an OK ids row.
                            * Until then they are not stored per row; they are
                            * zeroed once, when the first such row or the take comes */
    /* third line: buffer changes and takes */
    uint64_t position;     /* record position when in_ring */
    uint64_t next_rows;    /* capacity of the next buffer: the last take's size */
    uint64_t next_nnz;     /* plus slack, so steady decoding never doubles */
    uint64_t next_words;
    uint64_t lost_position; /* where the rows were when the ring was lost (lost) */
    uint32_t in_ring;
    uint32_t lost;         /* rows were in a segment truncated under us: never
                            * copied out (they may be zero pages); the take sends
                            * a ring ref that readers reject as stale */
    uint64_t direct_words; /* the row size the last GPU-direct step asked room for */
    uint64_t direct_nnz;   /* (id words, nnz; written by each step, so this line is
                            * the step's too): each next buffer holds one such
                            * row, so a steady step stores without growing */
} shm_queue;

/* The producer's private state: everything it created, kept in its own
 * memory. Nothing here is ever re-read from shared memory, so a reader that
 * rewrites the segment header cannot steer the producer's writes. */
typedef struct {
    void *base;            /* the mapping, or NULL (inline transport) */
    uint64_t mapped_bytes;
    uint64_t capacity;     /* data bytes, a power of two */
    uint64_t head;         /* published to the header with release stores */
    uint64_t tail;
    shm_queue *queues;     /* the RowQueue table */
    uint32_t *free_slots;  /* closed slots, oldest first (a FIFO spreads reuse, */
    uint64_t n_queues;     /* so a slot's generation wraps as late as possible) */
    uint64_t n_free;
    uint64_t free_head;
    uint64_t handle_tag;   /* random, 15 bits: another Writer's handles do not match */
    uint64_t seal_state;   /* random start; each publish draws the next seal from it */
    uint64_t initial_nnz_cap; /* bound on a fresh buffer's guessed entries */
    uint64_t step_serial;  /* counts append_step validations (pending_serial) */
    uint32_t dead;         /* the segment was truncated: stage privately from now on */
    uint32_t pad;
} shm_ring;

int shm_ring_init(shm_ring *ring, void *base, uint64_t mapped_bytes, uint64_t capacity,
                  uint64_t epoch, uint64_t pid, uint64_t start, uint64_t created_ns,
                  uint64_t handle_tag, uint64_t seal_seed);
void shm_ring_free(shm_ring *ring);
/* The segment was cut: stage privately from now on; zeroes its magic. */
void shm_ring_mark_dead(shm_ring *ring);

int shm_reserve(shm_ring *ring, uint32_t mode, uint64_t rows_capacity, uint64_t words_capacity,
                uint64_t nnz_capacity, uint64_t *position_out);
/* Gives back a reserved record that will not be published (STAGING -> DISCARDED). */
int shm_discard_record(shm_ring *ring, uint64_t position);
/* Publishes a STAGING record: counts, a fresh seal (*seal_out), then WRITTEN. */
int shm_publish(shm_ring *ring, uint64_t position, uint32_t mode, uint64_t rows, uint64_t words,
                uint64_t nnz, uint32_t vocab, uint64_t now_ns, uint64_t *seal_out);
int shm_reclaim(shm_ring *ring, uint64_t now_ns, uint64_t lease_ns, shm_reclaim_result *out);
/* Offset of a record from the start of the mapping (producer's arithmetic). */
uint64_t shm_record_offset(const shm_ring *ring, uint64_t position);

#endif

/*
 * shmask native core: the only code that touches a flag, a position or a
 * record header in shared memory, plus the per-step copy loop.
 * native/build.py declares the same functions to cffi.
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

/* Where the arrays of a record live, relative to the record's start. */
typedef struct {
    uint64_t lengths_offset;
    uint64_t ids_offset;
    uint64_t logprobs_offset;
    uint64_t record_bytes;
} shm_layout;

/* What a reader gets back from a validated lookup. */
typedef struct {
    uint64_t record_offset; /* from the start of the mapping */
    uint64_t lengths_offset;
    uint64_t ids_offset;
    uint64_t logprobs_offset;
} shm_view;

typedef struct {
    uint64_t head;
    uint64_t tail;
    uint64_t advanced_bytes;
    uint64_t expired;
    uint64_t blocked_position; /* record at the tail that stopped reclaim */
    uint32_t blocked_state;    /* its state, or 0 when the ring is empty */
    uint32_t pad;
} shm_reclaim_result;

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

/* One RowQueue's staging buffer: where its arrays are and how full. The
 * buffer is a STAGING record in the ring (in_ring) or private memory the
 * Python side owns (the ring had no room). */
typedef struct {
    int32_t *lengths;
    int32_t *ids;
    float *logprobs;
    uint64_t rows;
    uint64_t rows_capacity;
    uint64_t nnz;
    uint64_t nnz_capacity;
    uint64_t position;  /* record position when in_ring */
    uint64_t next_rows; /* capacity of the next buffer: the last take's size */
    uint64_t next_nnz;  /* plus slack, so steady decoding never doubles */
    uint32_t mode;      /* 0: slot closed */
    uint32_t in_ring;
} shm_queue;

int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t nnz_capacity,
                      shm_layout *out);

/* Producer side. */
int shm_init(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t epoch,
             uint64_t pid, uint64_t start, uint64_t created_ns);
int shm_reserve(void *base, uint32_t mode, uint64_t rows_capacity, uint64_t nnz_capacity,
                uint64_t *position_out);
int shm_publish(void *base, uint64_t position, uint64_t rows, uint64_t nnz, uint64_t now_ns);
int shm_discard(void *base, uint64_t position);
int shm_reclaim(void *base, uint64_t now_ns, uint64_t lease_ns, shm_reclaim_result *out);
void *shm_record_address(void *base, uint64_t position);
uint64_t shm_load_head(const void *base);
uint64_t shm_load_tail(const void *base);
uint64_t shm_load_counter(const void *base, uint32_t which);

/* Reader side: every argument is untrusted and bounds-checked. */
/* Validates the segment header (magic, version, a power-of-two capacity
 * that fits segment_bytes) and copies it out; reads the header page only. */
int shm_read_info(const void *base, uint64_t segment_bytes, shm_info *out);
int shm_open_record(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                    uint64_t position, uint64_t record_bytes, uint64_t rows, uint64_t nnz,
                    uint32_t mode, shm_view *out);
int shm_check_record(const void *base, uint64_t capacity, uint64_t position);
int shm_release(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position);
int shm_validate_lengths(const int32_t *lengths, uint64_t rows, uint64_t nnz,
                         uint64_t max_row_length);

/* The per-step copy: row i of the step goes to queues[slots[i]].
 * ids/logprobs are [B, row_stride] when row_stride > 0, else flat CSR with
 * rows consecutive (*source_cursor carries the CSR offset across calls).
 * A queue that needs a larger buffer gets one in the ring (doubling) when
 * the ring has room right now. Returns B when every row landed; i in
 * [start_row, B) when queue slots[i] needs a buffer the ring cannot give
 * now (or is in private memory), so the caller grows it and calls again
 * from row i; or a negative error (*bad_row says which row). */
int64_t shm_append_step(void *base, shm_queue *queues, uint64_t n_queues, const int32_t *slots,
                        uint64_t batch, const int32_t *lengths, const int32_t *ids,
                        const float *logprobs, uint64_t row_stride, uint64_t ids_len,
                        uint64_t logprobs_len, uint32_t mode, uint64_t max_row_length,
                        uint64_t start_row, uint64_t *source_cursor, int64_t *bad_row);

/* Gives queue `slot` a ring buffer of these capacities, keeping its rows
 * (the old ring buffer is discarded). SHM_FULL / SHM_E_TOO_BIG when the ring
 * cannot; the queue is then unchanged. Not for queues in private memory. */
int shm_queue_restage(void *base, shm_queue *queue, uint64_t slot, uint64_t rows_capacity,
                      uint64_t nnz_capacity);

/* The capacities a queue grows to so that one more row of n entries fits
 * (doubling; a fresh buffer is sized from the last take). */
void shm_queue_grown_capacities(const shm_queue *queue, uint64_t n, uint64_t *rows_out,
                                uint64_t *nnz_out);

/* Points a queue at the buffers the caller allocated (private memory) and
 * copies its rows there, discarding the ring buffer it had. */
void shm_queue_move(void *base, shm_queue *queue, int32_t *lengths, int32_t *ids,
                    float *logprobs, uint64_t rows_capacity, uint64_t nnz_capacity);

/* Drops a queue's buffer and rows (the ring buffer is discarded). */
void shm_queue_drop(void *base, shm_queue *queue);

/* One emission: publishes the ring buffers of queues[slots[start..count)]
 * in place and writes each chunk's kind (0 empty, 1 ring), mode, position,
 * record size, rows and nnz; then gives each queue a fresh ring buffer
 * sized for the next emission (or drops it when `final`). Returns count, or
 * i when queue slots[i] stages in private memory (the caller sends it
 * inline and calls again from i + 1), or a negative error. */
int64_t shm_take_queues(void *base, shm_queue *queues, uint64_t n_queues, const int32_t *slots,
                        uint64_t count, uint64_t start, uint64_t now_ns, int final,
                        uint8_t *kind_out, uint8_t *mode_out, uint64_t *position_out, uint64_t *bytes_out,
                        uint32_t *rows_out, uint64_t *nnz_out);

/* The queue slot that owns the STAGING record at `position` (for moving
 * a buffer that blocks the tail), or -1. The caller checks it. */
int64_t shm_staging_owner(void *base, uint64_t position);

/* Response building: turns orjson's flat JSON array "[a,b,c,...]" of
 * numbers into one array per row, "[[a,b],[c],...]", split by `lengths`
 * (numbers never contain ',' or ']'). `out` must hold flat_len + 3 * rows
 * bytes. Returns the bytes written, or -1 if the counts do not match. */
int64_t shm_json_nest(const char *flat, uint64_t flat_len, const int32_t *lengths, uint64_t rows,
                      char *out, uint64_t out_capacity);

#define SHM_E_BAD_SLOT -20
#define SHM_E_BAD_LENGTH -21
#define SHM_E_SOURCE_OVERRUN -22
#define SHM_E_MODE -23

#endif

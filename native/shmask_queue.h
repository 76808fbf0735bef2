/*
 * RowQueue buffers (shmask_queue.c): queue handles, the per-step copy,
 * growth and relocation of a queue's buffer, and the emission (take).
 * The queue table itself (shm_queue, shm_ring) is in shmask_ring.h.
 * Return codes: shmask_core.h.
 */
#ifndef SHMASK_QUEUE_H
#define SHMASK_QUEUE_H

#include <stdint.h>

#include "shmask_ring.h"

/* A queue handle: slot (bits 0-15), generation (16-47: the slot's whole
 * uint32 generation), ring tag (48-62). A slot whose generation would wrap
 * is retired (never reopened), so a stale handle never matches another
 * queue. 2^16 slots and 2^32 generations: 2^48 opens in a Writer's life
 * (about 13 years of back-to-back open+close from Python); after that, or
 * with 2^16 queues open at once, shm_queue_open returns SHM_E_NO_SLOT. */
#define SHM_HANDLE_SLOT_BITS 16
#define SHM_E_NO_SLOT -40 /* every queue slot is open or retired */

/* Opens a queue: its handle (>= 0), or a negative error. */
int64_t shm_queue_open(shm_ring *ring, uint32_t mode, uint64_t initial_rows);
/* The slot of a valid, open handle of this ring, or SHM_E_BAD_SLOT. */
int64_t shm_queue_slot(const shm_ring *ring, int64_t handle);
/* Drops the queue's unpublished rows and frees its slot. */
int shm_queue_close(shm_ring *ring, int64_t handle);
/* Close, and give back every chunk this queue published that no reader has
 * released yet (WRITTEN -> EXPIRED); *given_back counts them. */
int shm_queue_abort(shm_ring *ring, int64_t handle, uint64_t *given_back);

/* The per-step copy, all or nothing. Row i goes to the queue of handles[i].
 * ids is [B, row_stride] when row_stride > 0, else flat CSR. flags (NULL:
 * every row an OK ids row) gives each row's status and form (shmask_layout.h);
 * a bitmask row's id data is shm_bitmask_words(vocab) words; a row that is
 * not OK has length 0 and no id data. A support-mode
 * row's logprobs sit beside its ids in `logprobs` (flat: their own cursor,
 * L values per row); a selected-mode row's
 * one value is selected[i] (when selected_is_logprobs, `selected` is the
 * same array as `logprobs`, allowed only if no support row is in the step).
 * Every row is validated before any is copied. Returns B when every row
 * landed; i in [0, B) when the queue of row i needs a buffer the ring cannot
 * give now (nothing copied: the caller calls shm_queue_grow and calls again);
 * or a negative error (*bad_row says which row; nothing copied). */
int64_t shm_append_step(shm_ring *ring, const int64_t *handles, uint64_t batch,
                        const int32_t *lengths, const uint8_t *flags, uint32_t vocab,
                        const int32_t *ids, const float *logprobs,
                        const float *selected, uint64_t row_stride, uint64_t ids_len,
                        uint64_t logprobs_len, uint64_t selected_len, int selected_is_logprobs,
                        uint64_t max_tokens, int64_t *bad_row);

/* Gives the queue of `slot` room for its pending rows (set by the last
 * shm_append_step), keeping its rows: in the ring when allow_ring and there
 * is room (SHM_FULL otherwise), else in private memory (SHM_E_NO_MEMORY). */
int shm_queue_grow(shm_ring *ring, uint64_t slot, int allow_ring);

/* The queue slot whose ring buffer is the STAGING record at `position`
 * (checked against the producer's own table), or -1. */
int64_t shm_staging_owner(const shm_ring *ring, uint64_t position);
/* Moves that queue's buffer to the head of the ring (allow_ring) or to
 * private memory, so it stops blocking reclaim. */
int shm_queue_relocate(shm_ring *ring, uint64_t slot, int allow_ring);

/* One entry of a RefBatch, byte for byte shmask.refs.ENTRY_DTYPE (48 bytes;
 * tests/test_constants.py compares them), so a take writes the batch's
 * entries in place. */
typedef struct {
    uint8_t kind;          /* SHM_REF_KIND_* */
    uint8_t mode;
    uint16_t segment;
    uint32_t rows;
    uint64_t position;
    uint64_t record_bytes;
    uint64_t nnz;
    uint32_t words;
    uint32_t vocab;
    uint64_t seal;         /* ring: the record's seal; other kinds: 0 */
} shm_ref_entry;

/* shm_ref_entry.kind (shmask.refs.KIND_*: shmask/layout.py). The core
 * writes RING entries; EMPTY, INLINE and LOST (a chunk a forwarding hop
 * could not read) are written by Python. */
#define SHM_REF_KIND_EMPTY 0
#define SHM_REF_KIND_RING 1
#define SHM_REF_KIND_INLINE 2
#define SHM_REF_KIND_LOST 3

/* What one take published into the ring (the Writer's stats): ring
 * entries (lost ones too), their rows, and their payload bytes as an inline
 * payload would count them (shm_payload_bytes). Added to, never reset. */
typedef struct {
    uint64_t chunks;
    uint64_t rows;
    uint64_t payload_bytes;
} shm_take_totals;

/* One emission: validates every handle, then publishes the ring buffers of
 * handles[start..count) in place and writes each chunk's entry (kind 0
 * empty or 1 ring, mode, position, record size, rows, nnz, words, vocab;
 * segment 0); then gives each queue
 * a fresh ring buffer sized for the next emission (or drops it when
 * `final`). Returns count, or i when queue i stages in private memory (the
 * caller packs it with shm_queue_pack_private and calls again from i + 1),
 * or a negative error. Each ring entry is added to `totals`. */
int64_t shm_take_queues(shm_ring *ring, const int64_t *handles, uint64_t count, uint64_t start,
                        uint64_t now_ns, int final, shm_ref_entry *out, shm_take_totals *totals);
/* Bytes of an inline payload: lengths | flags (padded to 4) | ids | logprobs. */
uint64_t shm_payload_bytes(uint32_t mode, uint64_t rows, uint64_t words, uint64_t nnz);
/* Copies a privately staged queue's rows (the inline payload above) into
 * out (exactly its payload size) and empties the queue. */
int shm_queue_pack_private(shm_ring *ring, uint64_t slot, char *out, uint64_t out_len);

#endif

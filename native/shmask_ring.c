/* The producer's ring (shmask_ring.h); ordering: shmask_core.c. */
#include "shmask_ring.h"
#include "shmask_internal.h"

#include <stdlib.h>
#include <string.h>

static void write_record_header(struct shm_record_header *r, uint64_t pos, uint32_t mode,
                                uint64_t bytes, uint64_t rows_capacity, uint64_t words_capacity,
                                uint64_t nnz_capacity, uint64_t owner, uint32_t state) {
    r->tag = pos;
    r->mode = mode;
    r->record_bytes = bytes;
    r->rows = 0;
    r->rows_capacity = (uint32_t)rows_capacity;
    r->nnz = 0;
    r->nnz_capacity = nnz_capacity;
    r->published_ns = 0;
    r->owner = owner;
    r->words = 0;
    r->words_capacity = words_capacity;
    r->vocab = 0;
    r->pad = 0;
    memset(r->reserved, 0, sizeof r->reserved);
    atomic_store_explicit(&r->state, state, memory_order_release);
}

#define INITIAL_SLOTS 64u

_Static_assert(sizeof(shm_queue) == 192, "a queue is three cache lines");
_Static_assert(offsetof(shm_queue, position) == 128, "per-step fields in the first two lines");

/* Called only when no slot is free, so the FIFO is empty and restarts at 0. */
int grow_table(shm_ring *ring) {
    uint64_t old = ring->n_queues, size = old ? 2 * old : INITIAL_SLOTS;
    if (size > HANDLE_SLOT_MASK + 1) return SHM_E_NO_SLOT;
    /* Cache-line aligned, so a queue's per-step fields are its first two lines. */
    shm_queue *queues = aligned_alloc(64, size * sizeof *queues);
    if (!queues) return SHM_E_NO_MEMORY;
    if (old) memcpy(queues, ring->queues, old * sizeof *queues);
    free(ring->queues);
    ring->queues = queues;
    uint32_t *free_slots = realloc(ring->free_slots, size * sizeof *free_slots);
    if (!free_slots) return SHM_E_NO_MEMORY;
    ring->free_slots = free_slots;
    memset(queues + old, 0, (size - old) * sizeof *queues);
    ring->free_head = 0;
    for (uint64_t slot = old; slot < size; slot++) ring->free_slots[ring->n_free++] = (uint32_t)slot;
    ring->n_queues = size;
    return SHM_OK;
}

int shm_ring_init(shm_ring *ring, void *base, uint64_t mapped_bytes, uint64_t capacity,
                  uint64_t epoch, uint64_t pid, uint64_t start, uint64_t created_ns,
                  uint64_t handle_tag, uint64_t seal_seed) {
    memset(ring, 0, sizeof *ring);
    ring->handle_tag = handle_tag & HANDLE_TAG_MASK;
    ring->seal_state = seal_seed;
    /* A fresh buffer's size is a guess (rows x this step's row length) until
     * the queue's first take; bound the guess so one odd setting cannot ask
     * for gigabytes (it still grows by doubling if rows really are that long). */
    ring->initial_nnz_cap = base ? max_u64(capacity / 64 / 4, 1024) : (1ull << 20);
    if (base) {
        if (!is_power_of_two(capacity) || capacity < SHM_MIN_CAPACITY) return SHM_E_BAD_HEADER;
        if (mapped_bytes < SHM_HEADER_BYTES + capacity) return SHM_E_BAD_HEADER;
        struct shm_segment_header *h = seg(base);
        memset(h, 0, SHM_HEADER_BYTES);
        h->layout_version = SHM_LAYOUT_VERSION;
        h->header_bytes = SHM_HEADER_BYTES;
        h->capacity = capacity;
        h->epoch = epoch;
        h->producer_pid = pid;
        h->producer_start = start;
        h->created_ns = created_ns;
        atomic_store_explicit(&h->head, 0, memory_order_relaxed);
        atomic_store_explicit(&h->tail, 0, memory_order_relaxed);
        /* Magic last: a reader that maps a half-made segment rejects it. */
        atomic_thread_fence(memory_order_release);
        __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
        ring->base = base;
        ring->mapped_bytes = mapped_bytes;
        ring->capacity = capacity;
    }
    return grow_table(ring);
}

void shm_ring_free(shm_ring *ring) {
    for (uint64_t slot = 0; slot < ring->n_queues; slot++) free_private(&ring->queues[slot]);
    free(ring->queues);
    free(ring->free_slots);
    ring->queues = NULL;
    ring->free_slots = NULL;
    ring->n_queues = ring->n_free = 0;
}

/* The segment was cut under us: nothing staged in it is trusted again, and
 * its magic goes to zero, what a cut leaves (the file may have its size back,
 * its pages zeros), so every reader of it is told the ring was lost. */
void shm_ring_mark_dead(shm_ring *ring) {
    ring->dead = 1;
    if (ring->base) __atomic_store_n(&seg(ring->base)->magic, 0, __ATOMIC_RELEASE);
}

int reserve_record(shm_ring *ring, uint32_t mode, uint64_t rows_capacity,
                   uint64_t words_capacity, uint64_t nnz_capacity, uint64_t owner,
                   uint64_t *position_out) {
    if (!ring->base) return SHM_E_TOO_BIG;
    if (ring->dead) return SHM_E_TRUNCATED;
    shm_layout layout;
    int rc = shm_record_layout(mode, rows_capacity, words_capacity, nnz_capacity, &layout);
    if (rc) return rc;
    uint64_t capacity = ring->capacity, bytes = layout.record_bytes;
    if (bytes > capacity) return SHM_E_TOO_BIG;
    uint64_t head = ring->head, tail = ring->tail;
    uint64_t offset = head & (capacity - 1);
    uint64_t padding = offset + bytes > capacity ? capacity - offset : 0;
    if (head + padding + bytes - tail > capacity) return SHM_FULL;
    if (padding) {
        write_record_header(ring_record(ring, head), head, 0, padding, 0, 0, 0, 0,
                            SHM_STATE_PADDING);
        bump(ring->base, SHM_COUNTER_PADDING);
        head += padding;
    }
    write_record_header(ring_record(ring, head), head, mode, bytes, rows_capacity,
                        words_capacity, nnz_capacity, owner, SHM_STATE_STAGING);
    *position_out = head;
    ring->head = head + bytes;
    atomic_store_explicit(&seg(ring->base)->head, ring->head, memory_order_release);
    return SHM_OK;
}

int shm_reserve(shm_ring *ring, uint32_t mode, uint64_t rows_capacity, uint64_t words_capacity,
                uint64_t nnz_capacity, uint64_t *position_out) {
    return reserve_record(ring, mode, rows_capacity, words_capacity, nnz_capacity, 0,
                          position_out);
}

int shm_discard_record(shm_ring *ring, uint64_t position) {
    if (!ring_usable(ring)) return SHM_OK;
    if (position < ring->tail || position >= ring->head || position % SHM_RECORD_ALIGN)
        return SHM_E_BAD_POSITION;
    struct shm_record_header *r = ring_record(ring, position);
    uint32_t expected = SHM_STATE_STAGING;
    if (r->tag != position ||
        !atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_DISCARDED,
                                                 memory_order_acq_rel, memory_order_acquire))
        return SHM_E_BAD_STATE;
    bump(ring->base, SHM_COUNTER_DISCARDED);
    return SHM_OK;
}

uint64_t shm_record_offset(const shm_ring *ring, uint64_t position) {
    return SHM_HEADER_BYTES + (position & (ring->capacity - 1));
}

/* The next seal: splitmix64 of a counter that starts at a random value. The
 * mix is a bijection of the counter, so no two records of one ring share a
 * seal in 2^64 publishes; 0 is skipped (no ref carries it). */
static uint64_t next_seal(shm_ring *ring) {
    for (;;) {
        uint64_t z = (ring->seal_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        if (z) return z;
    }
}

int shm_publish(shm_ring *ring, uint64_t position, uint32_t mode, uint64_t rows, uint64_t words,
                uint64_t nnz, uint32_t vocab, uint64_t now_ns, uint64_t *seal_out) {
    if (!ring_usable(ring)) return SHM_E_TRUNCATED;
    if (position < ring->tail || position >= ring->head || position % SHM_RECORD_ALIGN)
        return SHM_E_BAD_POSITION;
    struct shm_record_header *r = ring_record(ring, position);
    if (r->tag != position || r->mode != mode) return SHM_E_BAD_POSITION;
    if (atomic_load_explicit(&r->state, memory_order_relaxed) != SHM_STATE_STAGING)
        return SHM_E_BAD_STATE;
    r->rows = (uint32_t)rows;
    r->nnz = nnz;
    r->words = words;
    r->vocab = vocab;
    r->published_ns = now_ns;
    r->seal = *seal_out = next_seal(ring);
    /* The commit word, written last: payload and header before it. */
    atomic_store_explicit(&r->state, SHM_STATE_WRITTEN, memory_order_release);
    bump(ring->base, SHM_COUNTER_PUBLISHED);
    return SHM_OK;
}

int shm_reclaim(shm_ring *ring, uint64_t now_ns, uint64_t lease_ns, shm_reclaim_result *out) {
    memset(out, 0, sizeof *out);
    if (!ring_usable(ring)) return SHM_OK;
    uint64_t head = ring->head, tail = ring->tail, start = tail;
    while (tail < head) {
        struct shm_record_header *r = ring_record(ring, tail);
        uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
        if (state == SHM_STATE_WRITTEN && lease_ns && now_ns >= r->published_ns &&
            now_ns - r->published_ns >= lease_ns) {
            uint32_t expected = SHM_STATE_WRITTEN;
            if (atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_EXPIRED,
                                                        memory_order_acq_rel,
                                                        memory_order_acquire)) {
                out->expired++;
                bump(ring->base, SHM_COUNTER_EXPIRED);
                state = SHM_STATE_EXPIRED;
            } else {
                state = expected; /* the reader released it first */
            }
        }
        if (state != SHM_STATE_RELEASED && state != SHM_STATE_PADDING &&
            state != SHM_STATE_EXPIRED && state != SHM_STATE_DISCARDED) {
            out->blocked_position = tail;
            out->blocked_state = state;
            break;
        }
        if (!record_size_ok(ring, r, tail, head)) {
            out->blocked_position = tail;
            out->blocked_state = SHM_STATE_CORRUPT;
            break;
        }
        tail += r->record_bytes;
    }
    if (tail != ring->tail) {
        ring->tail = tail;
        /* Release: the CASes above happen before a reader can observe the
         * new tail. The full fence after it keeps every later store into the
         * reclaimed range (next reserve, next copy) from becoming visible
         * before the tail on weakly ordered CPUs. */
        atomic_store_explicit(&seg(ring->base)->tail, tail, memory_order_release);
        atomic_thread_fence(memory_order_seq_cst);
    }
    out->head = head;
    out->tail = tail;
    out->advanced_bytes = tail - start;
    return SHM_OK;
}

/*
 * shmask native core. Memory-ordering contract (see shmask_layout.h):
 *   - the producer fills a record, then release-stores state = WRITTEN;
 *     a reader acquire-loads the state before it reads any payload byte;
 *   - a reader gives a record back with one CAS WRITTEN -> RELEASED, and the
 *     producer's lease expiry races with it through CAS WRITTEN -> EXPIRED,
 *     so exactly one of the two wins;
 *   - the producer release-stores the tail after it has decided to reuse a
 *     range; a reader that read payload re-checks (acquire fence, then the
 *     tail and the record's state and tag): if the tail moved past the
 *     record, the bytes it read may belong to someone else (seqlock style).
 * Only the producer writes head, tail, record headers and counters.
 */
#define _GNU_SOURCE /* MAP_POPULATE, MAP_ANONYMOUS, SA_ONSTACK */
#include "shmask_core.h"
#include "shmask_layout.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline struct shm_segment_header *seg(void *base) {
    return (struct shm_segment_header *)base;
}
static inline const struct shm_segment_header *cseg(const void *base) {
    return (const struct shm_segment_header *)base;
}
static inline struct shm_record_header *record_at(void *base, uint64_t capacity, uint64_t pos) {
    return (struct shm_record_header *)((char *)base + SHM_HEADER_BYTES + (pos & (capacity - 1)));
}
static inline struct shm_record_header *ring_record(const shm_ring *ring, uint64_t pos) {
    return record_at(ring->base, ring->capacity, pos);
}
static inline uint64_t align64(uint64_t n) { return (n + 63u) & ~(uint64_t)63u; }
static inline uint64_t align_record(uint64_t n) {
    return (n + SHM_RECORD_ALIGN - 1) & ~(uint64_t)(SHM_RECORD_ALIGN - 1);
}
static inline int is_power_of_two(uint64_t n) { return n && !(n & (n - 1)); }
static inline void bump(void *base, int which) {
    atomic_fetch_add_explicit(&seg(base)->counters[which], 1, memory_order_relaxed);
}

uint64_t shm_bitmask_words(uint32_t vocab) { return ((uint64_t)vocab + 31) / 32; }

int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t words_capacity,
                      uint64_t nnz_capacity, shm_layout *out) {
    if (mode != SHM_MODE_SELECTED && mode != SHM_MODE_SUPPORT) return SHM_E_BAD_RECORD;
    /* Capacities come from untrusted headers too: keep every product far
     * from overflow (2^40 entries is far beyond any ring). */
    if (rows_capacity >= (1ull << 32) || words_capacity > (1ull << 40) ||
        nnz_capacity > (1ull << 40))
        return SHM_E_OVERFLOW;
    uint64_t lengths = SHM_RECORD_HEADER_BYTES;
    uint64_t flags = lengths + align64(4 * rows_capacity);
    uint64_t ids = flags + align64(rows_capacity);
    uint64_t logprobs = ids + align64(4 * words_capacity);
    uint64_t n_logprobs = mode == SHM_MODE_SUPPORT ? nnz_capacity : rows_capacity;
    out->lengths_offset = lengths;
    out->flags_offset = flags;
    out->ids_offset = ids;
    out->logprobs_offset = logprobs;
    out->record_bytes = align_record(logprobs + 4 * n_logprobs);
    return SHM_OK;
}

/* ------------------------------------------------------------ producer */

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


static inline uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static inline uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static inline int ring_usable(const shm_ring *ring) { return ring->base && !ring->dead; }

#define HANDLE_GENERATION_MASK 0xffffffffull /* the whole uint32 generation */
#define HANDLE_SLOT_MASK ((1ull << SHM_HANDLE_SLOT_BITS) - 1)
#define HANDLE_TAG_MASK 0x7fffull
#define INITIAL_SLOTS 64u

static int64_t make_handle(const shm_ring *ring, uint64_t slot) {
    uint64_t generation = ring->queues[slot].generation & HANDLE_GENERATION_MASK;
    return (int64_t)(slot | generation << SHM_HANDLE_SLOT_BITS | ring->handle_tag << 48);
}

_Static_assert(sizeof(shm_queue) == 192, "a queue is three cache lines");
_Static_assert(offsetof(shm_queue, position) == 128, "per-step fields in the first two lines");

/* Called only when no slot is free, so the FIFO is empty and restarts at 0. */
static int grow_table(shm_ring *ring) {
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

static void free_private(shm_queue *q) {
    if (!q->in_ring && q->rows_capacity) free(q->lengths); /* one block: lengths|flags|ids|logprobs */
}

static void drop_buffer(shm_ring *ring, shm_queue *q) {
    if (q->in_ring && q->rows_capacity && ring_usable(ring)) {
        struct shm_record_header *r = ring_record(ring, q->position);
        uint32_t expected = SHM_STATE_STAGING;
        /* A tag or state someone else rewrote is left alone: reclaim stops
         * there and reports it, rather than guess. */
        if (r->tag == q->position &&
            atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_DISCARDED,
                                                    memory_order_acq_rel, memory_order_acquire))
            bump(ring->base, SHM_COUNTER_DISCARDED);
    }
    free_private(q);
    q->lengths = NULL;
    q->flags = NULL;
    q->ids = NULL;
    q->logprobs = NULL;
    q->rows = q->nnz = q->rows_capacity = q->nnz_capacity = 0;
    q->words = q->words_capacity = 0;
    q->vocab = 0;
    q->flagged = 0;
    q->in_ring = 0;
    q->position = 0;
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

/* Whether rows just copied out of the queue buffer at `position` are the
 * ones we wrote: the segment was not cut (no SIGBUS mark, its magic in
 * place) and the record keeps the header we gave it, which a cut zeroes
 * even when the file has its size again. Checked after the copy: a cut
 * before or during it shows here. If not, the queue's rows are lost (its
 * take gives a ref to where they were) and the ring is dead. */
static int staged_rows_intact(shm_ring *ring, shm_queue *q, uint64_t position) {
    atomic_thread_fence(memory_order_acquire); /* the copy's loads stay above */
    const struct shm_record_header *r = ring_record(ring, position);
    if (!ring->dead && !shm_mapping_truncated(ring->base) && r->tag == position &&
        atomic_load_explicit(&r->state, memory_order_acquire) == SHM_STATE_STAGING)
        return 1;
    if (!q->lost) {
        q->lost = 1;
        q->lost_position = position;
    }
    shm_ring_mark_dead(ring);
    return 0;
}

static int reserve_record(shm_ring *ring, uint32_t mode, uint64_t rows_capacity,
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

/* A record header a reader may have rewritten: its size is trusted only if
 * it keeps the walk on record boundaries inside [tail, head). */
static int record_size_ok(const shm_ring *ring, const struct shm_record_header *r, uint64_t pos,
                          uint64_t head) {
    uint64_t bytes = r->record_bytes;
    return r->tag == pos && bytes >= SHM_RECORD_HEADER_BYTES && bytes % SHM_RECORD_ALIGN == 0 &&
           bytes <= ring->capacity - (pos & (ring->capacity - 1)) && bytes <= head - pos;
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

/* -------------------------------------------------------------- reader */

static uint64_t load_counter(const void *base, uint32_t which) {
    if (which >= SHM_N_COUNTERS) return 0;
    return atomic_load_explicit(&cseg(base)->counters[which], memory_order_relaxed);
}

int shm_read_info(const void *base, uint64_t segment_bytes, shm_info *out) {
    if (segment_bytes < SHM_HEADER_BYTES) return SHM_E_BAD_HEADER;
    const struct shm_segment_header *h = cseg(base);
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHM_MAGIC) return SHM_E_BAD_HEADER;
    if (h->layout_version != SHM_LAYOUT_VERSION || h->header_bytes != SHM_HEADER_BYTES)
        return SHM_E_BAD_HEADER;
    uint64_t capacity = h->capacity;
    if (!is_power_of_two(capacity) || capacity < SHM_MIN_CAPACITY) return SHM_E_BAD_HEADER;
    /* A sound header over a file shorter than its ring: cut by someone. */
    if (capacity > segment_bytes - SHM_HEADER_BYTES) return SHM_E_TRUNCATED;
    out->capacity = capacity;
    out->epoch = h->epoch;
    out->producer_pid = h->producer_pid;
    out->producer_start = h->producer_start;
    out->created_ns = h->created_ns;
    out->head = atomic_load_explicit(&h->head, memory_order_acquire);
    out->tail = atomic_load_explicit(&h->tail, memory_order_acquire);
    out->published = load_counter(base, SHM_COUNTER_PUBLISHED);
    out->released = load_counter(base, SHM_COUNTER_RELEASED);
    out->expired = load_counter(base, SHM_COUNTER_EXPIRED);
    return SHM_OK;
}

/* capacity is the reader's own copy, validated once against its mapping, so
 * a header rewritten later cannot steer a reader outside the mapping. */
static int locate(const void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position,
                  uint64_t *offset_out) {
    if (!is_power_of_two(capacity) || capacity > mapped_bytes - SHM_HEADER_BYTES)
        return SHM_E_BAD_HEADER;
    if (position % SHM_RECORD_ALIGN) return SHM_E_BAD_POSITION;
    uint64_t tail = atomic_load_explicit(&cseg(base)->tail, memory_order_acquire);
    uint64_t head = atomic_load_explicit(&cseg(base)->head, memory_order_acquire);
    if (position < tail) return SHM_E_STALE;
    if (position >= head) return SHM_E_BAD_POSITION;
    *offset_out = position & (capacity - 1);
    return SHM_OK;
}

/* A record whose seal is not the ref's, read while its tag says it is the
 * record at `position`: the ref is wrong (garbled, or names another record),
 * unless the ring moved on meanwhile and the header bytes are a newer
 * record's (then it is stale). */
static int wrong_record(const void *base, uint64_t position) {
    atomic_thread_fence(memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&cseg(base)->tail, memory_order_acquire);
    return position < tail ? SHM_E_STALE : SHM_E_WRONG_RECORD;
}

int shm_open_record(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                    uint64_t position, uint64_t seal, uint64_t record_bytes, uint64_t rows,
                    uint64_t words, uint64_t nnz, uint32_t vocab, uint32_t mode,
                    uint64_t max_row_length, uint8_t *geometry, shm_view *out) {
    uint64_t offset;
    int rc = locate(base, mapped_bytes, capacity, position, &offset);
    if (rc) return rc;
    if (record_bytes < SHM_RECORD_HEADER_BYTES || record_bytes % SHM_RECORD_ALIGN ||
        record_bytes > capacity - offset)
        return SHM_E_BAD_RECORD;
    const struct shm_record_header *r = record_at((void *)base, capacity, position);
    uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
    if (r->tag != position) return SHM_E_STALE;
    if (r->seal != seal) return wrong_record(base, position);
    if (state == SHM_STATE_EXPIRED) return SHM_E_STALE;
    if (state == SHM_STATE_RELEASED) return SHM_E_DOUBLE_RELEASE;
    if (state != SHM_STATE_WRITTEN) return SHM_E_NOT_WRITTEN;
    /* Each capacity is read once: a process rewriting the header between a
     * check and the layout made from it cannot move a copy past the record. */
    uint64_t rows_capacity = r->rows_capacity, words_capacity = r->words_capacity;
    uint64_t nnz_capacity = r->nnz_capacity;
    if (r->record_bytes != record_bytes || r->mode != mode || r->rows != rows ||
        r->nnz != nnz || r->words != words || r->vocab != vocab || rows > rows_capacity ||
        words > words_capacity || (mode == SHM_MODE_SUPPORT && nnz > nnz_capacity))
        return SHM_E_BAD_RECORD;
    shm_layout layout;
    rc = shm_record_layout(mode, rows_capacity, words_capacity, nnz_capacity, &layout);
    if (rc) return SHM_E_BAD_RECORD;
    if (layout.record_bytes != record_bytes) return SHM_E_BAD_RECORD;
    out->record_offset = SHM_HEADER_BYTES + offset;
    out->lengths_offset = out->record_offset + layout.lengths_offset;
    out->flags_offset = out->record_offset + layout.flags_offset;
    out->ids_offset = out->record_offset + layout.ids_offset;
    out->logprobs_offset = out->record_offset + layout.logprobs_offset;
    /* The rows' geometry, copied once and validated from the copies: a
     * writer rewriting lengths or flags later changes nothing the reader
     * uses to find a row. */
    const char *at = (const char *)base;
    int32_t *lengths = (int32_t *)geometry; /* numpy's allocation: aligned */
    uint8_t *flags = geometry + 4 * rows;
    memcpy(lengths, at + out->lengths_offset, 4 * rows);
    memcpy(flags, at + out->flags_offset, rows);
    rc = shm_validate_rows(lengths, flags, (const int32_t *)(at + out->ids_offset), rows, words,
                           nnz, vocab, max_row_length, &out->any_flags);
    /* Reclaimed while we read (the copies or the bitmask words may be a
     * newer record's): stale, whatever the validation said. */
    if (shm_check_record(base, capacity, position, seal)) return SHM_E_STALE;
    return rc;
}

int shm_record_has_rows(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                        uint64_t position, uint64_t seal, uint64_t rows) {
    uint64_t offset;
    int rc = locate(base, mapped_bytes, capacity, position, &offset);
    if (rc) return rc;
    const struct shm_record_header *r = record_at((void *)base, capacity, position);
    if (r->tag != position) return SHM_E_STALE;
    if (r->seal != seal) return wrong_record(base, position);
    return r->rows == rows ? SHM_OK : SHM_E_BAD_RECORD;
}

int shm_check_record(const void *base, uint64_t capacity, uint64_t position, uint64_t seal) {
    /* Payload loads above this fence cannot move below it. */
    atomic_thread_fence(memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&cseg(base)->tail, memory_order_acquire);
    if (position < tail) return SHM_E_STALE;
    const struct shm_record_header *r = record_at((void *)base, capacity, position);
    uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
    if (r->tag != position || r->seal != seal || state == SHM_STATE_EXPIRED) return SHM_E_STALE;
    if (state != SHM_STATE_WRITTEN && state != SHM_STATE_RELEASED) return SHM_E_STALE;
    return SHM_OK;
}

int shm_release(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position,
                uint64_t seal) {
    uint64_t offset;
    int rc = locate(base, mapped_bytes, capacity, position, &offset);
    if (rc) return rc;
    struct shm_record_header *r = record_at(base, capacity, position);
    if (r->tag != position) return SHM_E_STALE;
    /* The seal is written before WRITTEN and never changes while the record
     * lives, so comparing it before the exchange binds the release to it. */
    if (r->seal != seal) return wrong_record(base, position);
    uint32_t expected = SHM_STATE_WRITTEN;
    if (atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_RELEASED,
                                                memory_order_acq_rel, memory_order_acquire)) {
        atomic_fetch_add_explicit(&seg(base)->counters[SHM_COUNTER_RELEASED], 1,
                                  memory_order_relaxed);
        return SHM_OK;
    }
    if (expected == SHM_STATE_RELEASED) return SHM_E_DOUBLE_RELEASE;
    if (expected == SHM_STATE_EXPIRED) return SHM_E_STALE;
    return SHM_E_NOT_WRITTEN;
}

/* Set bits of n 32-bit words. Built twice, with the POPCNT instruction and
 * without (the x86-64 baseline the wheel targets lacks it), picked at load
 * time: the whole vocabulary (4748 words) costs ~1 us instead of ~5. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("popcnt", "default")))
#endif
static uint64_t count_bits(const int32_t *words, uint64_t n) {
    uint64_t set = 0, w = 0;
    for (; w + 2 <= n; w += 2) {
        uint64_t pair;
        memcpy(&pair, words + w, sizeof pair); /* ids are only 4-byte aligned */
        set += (uint64_t)__builtin_popcountll(pair);
    }
    if (w < n) set += (uint64_t)__builtin_popcount((uint32_t)words[w]);
    return set;
}

/* A bitmask row's words: exactly `length` bits set, none at ids >= vocab. */
static int bitmask_ok(const int32_t *words, uint32_t vocab, uint64_t length) {
    uint64_t n_words = shm_bitmask_words(vocab), set = count_bits(words, n_words);
    uint32_t used = vocab % 32; /* bits of the last word that name ids */
    if (used && ((uint32_t)words[n_words - 1] >> used)) return 0;
    return set == length;
}

/* A row's flags: 0 (OK ids row), a non-OK status alone, or OK + bitmask. */
static inline int flags_ok(uint8_t f) {
    return f == 0 || f == SHM_ROW_OVERFLOW || f == SHM_ROW_INVALID || f == SHM_ROW_BITMASK;
}

int shm_validate_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                      uint64_t rows, uint64_t words, uint64_t nnz, uint32_t vocab,
                      uint64_t max_row_length, uint32_t *any_flags) {
    uint64_t total = 0, cursor = 0, mask_words = shm_bitmask_words(vocab);
    uint32_t any = 0;
    for (uint64_t i = 0; i < rows; i++) {
        int32_t n = lengths[i];
        uint8_t f = flags ? flags[i] : 0;
        if (n < 0) return SHM_E_BAD_LENGTHS;
        if (f == 0) {
            if ((uint64_t)n > max_row_length || (uint64_t)n > words - cursor)
                return SHM_E_BAD_LENGTHS;
            cursor += (uint64_t)n;
        } else {
            any = 1;
            if (!flags_ok(f)) return SHM_E_BAD_LENGTHS;
            if (f & SHM_ROW_STATUS_MASK) {
                if (n) return SHM_E_BAD_LENGTHS; /* a dropped row carries nothing */
            } else {
                if (!vocab || (uint64_t)n > vocab || mask_words > words - cursor ||
                    !bitmask_ok(ids + cursor, vocab, (uint64_t)n))
                    return SHM_E_BAD_LENGTHS;
                cursor += mask_words;
            }
        }
        total += (uint64_t)n;
    }
    *any_flags = any;
    return total == nnz && cursor == words ? SHM_OK : SHM_E_BAD_LENGTHS;
}

/* ------------------------------------------------------ RowQueue buffers */

/* static inline: called per row on the step path, where an exported
 * function would go through the PLT (-fPIC) on every call. */
static inline int64_t queue_slot(const shm_ring *ring, int64_t handle) {
    if (handle < 0) return SHM_E_BAD_SLOT;
    uint64_t h = (uint64_t)handle, slot = h & HANDLE_SLOT_MASK;
    if (slot >= ring->n_queues || (h >> 48) != ring->handle_tag) return SHM_E_BAD_SLOT;
    const shm_queue *q = &ring->queues[slot];
    if (!q->mode || ((h >> SHM_HANDLE_SLOT_BITS) & HANDLE_GENERATION_MASK) !=
                        (q->generation & HANDLE_GENERATION_MASK))
        return SHM_E_BAD_SLOT;
    return (int64_t)slot;
}

int64_t shm_queue_slot(const shm_ring *ring, int64_t handle) { return queue_slot(ring, handle); }

int64_t shm_queue_open(shm_ring *ring, uint32_t mode, uint64_t initial_rows) {
    if (mode != SHM_MODE_SELECTED && mode != SHM_MODE_SUPPORT) return SHM_E_MODE;
    if (!ring->n_free) {
        int rc = grow_table(ring);
        if (rc) return rc;
    }
    uint64_t slot = ring->free_slots[ring->free_head];
    ring->free_head = (ring->free_head + 1) % ring->n_queues;
    ring->n_free--;
    shm_queue *q = &ring->queues[slot];
    uint32_t generation = q->generation;
    memset(q, 0, sizeof *q);
    q->generation = generation;
    q->mode = mode;
    q->next_rows = max_u64(initial_rows, 1);
    return make_handle(ring, slot);
}

static void close_slot(shm_ring *ring, uint64_t slot) {
    shm_queue *q = &ring->queues[slot];
    drop_buffer(ring, q);
    q->mode = 0;
    q->lost = 0;
    q->pending_rows = q->pending_nnz = q->pending_words = 0;
    /* The handle carries the whole generation: wrapping it would let a
     * handle of the slot's first queue match again. Retire the slot
     * instead: closed for good, never in the free FIFO (2^32 reopenings
     * of one slot: hours of nothing but open+close; the table grows). */
    if (q->generation == UINT32_MAX) return;
    q->generation++;
    ring->free_slots[(ring->free_head + ring->n_free) % ring->n_queues] = (uint32_t)slot;
    ring->n_free++;
}

int shm_queue_close(shm_ring *ring, int64_t handle) {
    int64_t slot = shm_queue_slot(ring, handle);
    if (slot < 0) return (int)slot;
    close_slot(ring, (uint64_t)slot);
    return SHM_OK;
}

int shm_queue_abort(shm_ring *ring, int64_t handle, uint64_t *given_back) {
    int64_t slot = shm_queue_slot(ring, handle);
    *given_back = 0;
    if (slot < 0) return (int)slot;
    if (ring_usable(ring)) {
        /* Walk the live records; the owner word is only a hint (readers can
         * write it), so a rewritten one at worst gives back the wrong chunk
         * early (its reader then gets StaleChunkError, never other rows). */
        uint64_t owner = (uint64_t)handle + 1, head = ring->head;
        for (uint64_t pos = ring->tail; pos < head;) {
            struct shm_record_header *r = ring_record(ring, pos);
            if (!record_size_ok(ring, r, pos, head)) break;
            uint32_t expected = SHM_STATE_WRITTEN;
            if (r->owner == owner &&
                atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_EXPIRED,
                                                        memory_order_acq_rel,
                                                        memory_order_acquire)) {
                bump(ring->base, SHM_COUNTER_EXPIRED);
                (*given_back)++;
            }
            pos += r->record_bytes;
        }
    }
    close_slot(ring, (uint64_t)slot);
    return SHM_OK;
}

static void point_at_record(shm_ring *ring, shm_queue *q, uint64_t position) {
    char *record = (char *)ring_record(ring, position);
    shm_layout layout;
    shm_record_layout(q->mode, q->rows_capacity, q->words_capacity, q->nnz_capacity, &layout);
    q->lengths = (int32_t *)(record + layout.lengths_offset);
    q->flags = (uint8_t *)(record + layout.flags_offset);
    q->ids = (int32_t *)(record + layout.ids_offset);
    q->logprobs = (float *)(record + layout.logprobs_offset);
    q->position = position;
    q->in_ring = 1;
}

static void copy_rows(const shm_queue *from, int32_t *lengths, uint8_t *flags, int32_t *ids,
                      float *logprobs) {
    memcpy(lengths, from->lengths, from->rows * sizeof(int32_t));
    memcpy(flags, from->flags, from->rows);
    memcpy(ids, from->ids, from->words * sizeof(int32_t));
    uint64_t n_logprobs = from->mode == SHM_MODE_SUPPORT ? from->nnz : from->rows;
    memcpy(logprobs, from->logprobs, n_logprobs * sizeof(float));
}

/* Capacities of a queue buffer; a selected-mode queue needs no room for
 * support logprobs (its record has one logprob per row). */
typedef struct {
    uint64_t rows, words, nnz;
} capacities;

static inline int fits(const shm_queue *q, uint64_t rows, uint64_t words, uint64_t nnz) {
    return rows <= q->rows_capacity && words <= q->words_capacity &&
           (q->mode != SHM_MODE_SUPPORT || nnz <= q->nnz_capacity);
}

/* Moves the queue's rows into a new ring buffer of these capacities. */
static int restage_in_ring(shm_ring *ring, uint64_t slot, capacities cap) {
    shm_queue *q = &ring->queues[slot];
    if (cap.rows < q->rows || cap.words < q->words ||
        (q->mode == SHM_MODE_SUPPORT && cap.nnz < q->nnz))
        return SHM_E_OVERFLOW;
    uint64_t position;
    int rc = reserve_record(ring, q->mode, cap.rows, cap.words, cap.nnz,
                            (uint64_t)make_handle(ring, slot) + 1, &position);
    if (rc) return rc;
    shm_queue old = *q;
    q->rows_capacity = cap.rows;
    q->words_capacity = cap.words;
    q->nnz_capacity = cap.nnz;
    point_at_record(ring, q, position);
    if (old.rows_capacity) {
        copy_rows(&old, q->lengths, q->flags, q->ids, q->logprobs);
        if (old.in_ring) staged_rows_intact(ring, q, old.position); /* else: lost */
        old.rows = old.nnz = old.words = 0;
        drop_buffer(ring, &old);
    }
    return SHM_OK;
}

/* Moves the queue's rows into private memory of these capacities. */
static int stage_private(shm_ring *ring, uint64_t slot, capacities cap) {
    shm_queue *q = &ring->queues[slot];
    if (cap.rows < q->rows || cap.words < q->words ||
        (q->mode == SHM_MODE_SUPPORT && cap.nnz < q->nnz))
        return SHM_E_OVERFLOW;
    shm_layout layout;
    int rc = shm_record_layout(q->mode, cap.rows, cap.words, cap.nnz, &layout);
    if (rc) return rc;
    char *block = malloc(layout.record_bytes - SHM_RECORD_HEADER_BYTES);
    if (!block) return SHM_E_NO_MEMORY;
    char *start = block - SHM_RECORD_HEADER_BYTES; /* offsets count from a record header */
    int32_t *lengths = (int32_t *)(start + layout.lengths_offset);
    uint8_t *flags = (uint8_t *)(start + layout.flags_offset);
    int32_t *ids = (int32_t *)(start + layout.ids_offset);
    float *logprobs = (float *)(start + layout.logprobs_offset);
    shm_queue old = *q;
    if (old.rows_capacity && !q->lost) {
        copy_rows(&old, lengths, flags, ids, logprobs);
        /* Rows read from a segment cut under us (before or during the copy;
         * grown back or not) may be zero pages: never pass them on as rows. */
        if (old.in_ring) staged_rows_intact(ring, q, old.position);
    }
    drop_buffer(ring, &old);
    q->lengths = lengths;
    q->flags = flags;
    q->ids = ids;
    q->logprobs = logprobs;
    q->rows_capacity = cap.rows;
    q->words_capacity = cap.words;
    q->nnz_capacity = cap.nnz;
    q->in_ring = 0;
    q->position = 0;
    return SHM_OK;
}

/* Doubling: each byte is copied O(1) times however long the queue runs. A
 * fresh buffer is sized from the last take (next_*); before the first take
 * it guesses rows as long as this step's, within a bound. */
static uint64_t grown(uint64_t capacity, uint64_t need) {
    return need > capacity ? max_u64(2 * capacity, need) : capacity;
}

static uint64_t first_guess(const shm_ring *ring, uint64_t next, uint64_t pending,
                            uint64_t pending_rows, uint64_t rows, uint64_t need) {
    if (next) return max_u64(max_u64(next, need), 1);
    uint64_t per_row = pending_rows ? (pending + pending_rows - 1) / pending_rows : 1;
    return max_u64(max_u64(min_u64(max_u64(per_row, 1) * rows, ring->initial_nnz_cap), need), 1);
}

static capacities grown_capacities(const shm_ring *ring, const shm_queue *q) {
    uint64_t need_rows = q->rows + q->pending_rows, need_nnz = q->nnz + q->pending_nnz;
    uint64_t need_words = q->words + q->pending_words;
    capacities cap;
    if (!q->rows_capacity) {
        cap.rows = max_u64(q->next_rows, need_rows);
        cap.words = first_guess(ring, q->next_words, q->pending_words, q->pending_rows, cap.rows,
                                need_words);
        cap.nnz = first_guess(ring, q->next_nnz, q->pending_nnz, q->pending_rows, cap.rows,
                              need_nnz);
    } else {
        cap.rows = grown(q->rows_capacity, need_rows);
        cap.words = grown(q->words_capacity, need_words);
        cap.nnz = grown(q->nnz_capacity, need_nnz);
    }
    if (q->mode != SHM_MODE_SUPPORT) cap.nnz = 0; /* no support logprobs to hold */
    return cap;
}

static capacities current_capacities(const shm_queue *q) {
    capacities cap = {q->rows_capacity, q->words_capacity, q->nnz_capacity};
    return cap;
}

int shm_queue_grow(shm_ring *ring, uint64_t slot, int allow_ring) {
    if (slot >= ring->n_queues || !ring->queues[slot].mode) return SHM_E_BAD_SLOT;
    shm_queue *q = &ring->queues[slot];
    capacities cap = grown_capacities(ring, q);
    int private_now = !q->in_ring && q->rows_capacity;
    if (allow_ring && ring_usable(ring) && !private_now) return restage_in_ring(ring, slot, cap);
    return stage_private(ring, slot, cap);
}

int64_t shm_staging_owner(const shm_ring *ring, uint64_t position) {
    if (!ring_usable(ring)) return -1;
    /* The owner word is a hint a reader could have rewritten: believe it
     * only if our own table agrees, else search the table. */
    uint64_t owner = ring_record(ring, position)->owner;
    uint64_t hint = owner ? (owner - 1) & HANDLE_SLOT_MASK : ring->n_queues;
    if (hint < ring->n_queues) {
        const shm_queue *q = &ring->queues[hint];
        if (q->mode && q->in_ring && q->rows_capacity && q->position == position) return (int64_t)hint;
    }
    for (uint64_t slot = 0; slot < ring->n_queues; slot++) {
        const shm_queue *q = &ring->queues[slot];
        if (q->mode && q->in_ring && q->rows_capacity && q->position == position) return (int64_t)slot;
    }
    return -1;
}

int shm_queue_relocate(shm_ring *ring, uint64_t slot, int allow_ring) {
    if (slot >= ring->n_queues || !ring->queues[slot].mode) return SHM_E_BAD_SLOT;
    shm_queue *q = &ring->queues[slot];
    if (!q->in_ring || !q->rows_capacity) return SHM_E_BAD_STATE;
    if (allow_ring) return restage_in_ring(ring, slot, current_capacities(q));
    return stage_private(ring, slot, current_capacities(q));
}

/* Words of row data a row of these flags and length carries (0 when the
 * row is dropped: its status travels, its ids do not). */
static inline uint64_t row_words(uint8_t f, int32_t n, uint64_t mask_words) {
    return f == 0 ? (uint64_t)n : (f == SHM_ROW_BITMASK ? mask_words : 0);
}

/* The body of shm_append_step, compiled twice (has_flags 0 and 1) so a
 * step of OK ids rows only (flags NULL, the common case) pays nothing for
 * the row forms: with has_flags 0 every flags test folds away. */
static inline __attribute__((always_inline)) int64_t
append_rows(shm_ring *ring, const int64_t *handles, uint64_t batch, const int32_t *lengths,
            const uint8_t *flags, uint32_t vocab, const int32_t *ids, const float *logprobs,
            const float *selected, uint64_t row_stride, uint64_t ids_len, uint64_t logprobs_len,
            uint64_t selected_len, int selected_is_logprobs, uint64_t max_row_length,
            int64_t *bad_row, const int has_flags) {
    /* 1. Every handle names an open queue of this ring; every row's flags,
     * length and source ranges; each queue's totals for the step (a queue's
     * pending counts restart at its first row of this step: step_serial).
     * Flat sources have two cursors: id data (a bitmask row's words) and
     * support logprobs (L per row) advance differently. */
    uint64_t id_cursor = 0, value_cursor = 0, n_support = 0, n_selected = 0;
    uint64_t serial = ++ring->step_serial, mask_words = shm_bitmask_words(vocab);
    int need_room = 0;
    for (uint64_t i = 0; i < batch; i++) {
        *bad_row = (int64_t)i;
        int64_t slot = queue_slot(ring, handles[i]);
        if (slot < 0) return SHM_E_BAD_SLOT;
        shm_queue *q = &ring->queues[slot];
        if (q->pending_serial != serial) {
            q->pending_serial = serial;
            q->pending_rows = q->pending_nnz = q->pending_words = 0;
        }
        int32_t n = lengths[i];
        uint8_t f = has_flags ? flags[i] : 0;
        if (n < 0) return SHM_E_BAD_LENGTH;
        if (f == 0) {
            if ((uint64_t)n > max_row_length) return SHM_E_BAD_LENGTH;
        } else if (!flags_ok(f)) {
            return SHM_E_BAD_FLAGS;
        } else if (f & SHM_ROW_STATUS_MASK) {
            if (n) return SHM_E_BAD_LENGTH; /* a dropped row carries no ids */
        } else {
            /* One vocabulary per buffer: its readers decode with one width. */
            if (!vocab || (q->vocab && q->vocab != vocab)) return SHM_E_VOCAB;
            if ((uint64_t)n > vocab) return SHM_E_BAD_LENGTH;
        }
        uint64_t w = row_words(f, n, mask_words);
        if (row_stride && (w > row_stride || (uint64_t)n > row_stride)) return SHM_E_BAD_LENGTH;
        uint64_t id_source = row_stride ? i * row_stride : id_cursor;
        /* Without flags a row's values sit beside its ids: one cursor. */
        uint64_t value_source = !has_flags || row_stride ? id_source : value_cursor;
        if (id_source + w > ids_len) return SHM_E_SOURCE_OVERRUN;
        if (f == SHM_ROW_BITMASK && !bitmask_ok(ids + id_source, vocab, (uint64_t)n))
            return SHM_E_BAD_BITMASK;
        if (q->mode == SHM_MODE_SUPPORT) {
            if (value_source + (uint64_t)n > logprobs_len) return SHM_E_SOURCE_OVERRUN;
            n_support++;
        } else {
            if (i >= selected_len) return SHM_E_SOURCE_OVERRUN;
            n_selected++;
        }
        q->pending_rows += 1;
        q->pending_nnz += (uint64_t)n;
        q->pending_words += w;
        id_cursor += w;
        if (has_flags) value_cursor += (uint64_t)n;
        /* Totals only grow, so a queue short of room is caught at its last row. */
        need_room |= !fits(q, q->rows + q->pending_rows, q->words + q->pending_words,
                           q->nnz + q->pending_nnz);
    }
    if (selected_is_logprobs && n_support && n_selected) {
        *bad_row = -1;
        return SHM_E_MIXED_NEEDS_SELECTED;
    }
    if (selected_is_logprobs && n_selected && selected_len != batch) {
        *bad_row = -1; /* per-entry logprobs given to selected-mode rows */
        return SHM_E_MODE;
    }
    /* 2. Room for every queue's rows; a queue the ring cannot serve right
     * now goes back to the caller (which waits, or stages it privately). */
    for (uint64_t i = 0; need_room && i < batch; i++) {
        uint64_t slot = (uint64_t)handles[i] & HANDLE_SLOT_MASK;
        shm_queue *q = &ring->queues[slot];
        if (fits(q, q->rows + q->pending_rows, q->words + q->pending_words,
                 q->nnz + q->pending_nnz))
            continue;
        int private_now = !q->in_ring && q->rows_capacity;
        int rc = shm_queue_grow(ring, slot, !private_now);
        if (rc == SHM_OK) continue;
        if (private_now || rc == SHM_E_NO_MEMORY || rc == SHM_E_OVERFLOW) {
            *bad_row = (int64_t)i;
            return rc;
        }
        *bad_row = -1;
        return (int64_t)i;
    }
    /* 3. Copy: nothing can fail from here on. */
    id_cursor = value_cursor = 0;
    for (uint64_t i = 0; i < batch; i++) {
        shm_queue *q = &ring->queues[(uint64_t)handles[i] & HANDLE_SLOT_MASK];
        uint64_t n = (uint64_t)lengths[i];
        uint8_t f = has_flags ? flags[i] : 0;
        uint64_t w = row_words(f, (int32_t)n, mask_words);
        uint64_t id_source = row_stride ? i * row_stride : id_cursor;
        /* Without flags a row's values sit beside its ids: one cursor. */
        uint64_t value_source = !has_flags || row_stride ? id_source : value_cursor;
        q->lengths[q->rows] = (int32_t)n;
        if (f && !q->flagged) {
            memset(q->flags, 0, q->rows); /* the rows before were OK ids rows */
            q->flagged = 1;
        }
        if (q->flagged) q->flags[q->rows] = f;
        memcpy(q->ids + q->words, ids + id_source, w * sizeof(int32_t));
        if (q->mode == SHM_MODE_SUPPORT)
            memcpy(q->logprobs + q->nnz, logprobs + value_source, n * sizeof(float));
        else
            q->logprobs[q->rows] = selected[i];
        if (f == SHM_ROW_BITMASK) q->vocab = vocab;
        q->rows += 1;
        q->nnz += n;
        q->words += w;
        id_cursor += w;
        if (has_flags) value_cursor += n;
    }
    *bad_row = -1;
    return (int64_t)batch;
}

int64_t shm_append_step(shm_ring *ring, const int64_t *handles, uint64_t batch,
                        const int32_t *lengths, const uint8_t *flags, uint32_t vocab,
                        const int32_t *ids, const float *logprobs,
                        const float *selected, uint64_t row_stride, uint64_t ids_len,
                        uint64_t logprobs_len, uint64_t selected_len, int selected_is_logprobs,
                        uint64_t max_row_length, int64_t *bad_row) {
    if (flags)
        return append_rows(ring, handles, batch, lengths, flags, vocab, ids, logprobs, selected,
                           row_stride, ids_len, logprobs_len, selected_len,
                           selected_is_logprobs, max_row_length, bad_row, 1);
    return append_rows(ring, handles, batch, lengths, NULL, vocab, ids, logprobs, selected,
                       row_stride, ids_len, logprobs_len, selected_len, selected_is_logprobs,
                       max_row_length, bad_row, 0);
}

_Static_assert(sizeof(shm_ref_entry) == 48, "a RefBatch entry is 48 bytes");
_Static_assert(offsetof(shm_ref_entry, rows) == 4 && offsetof(shm_ref_entry, position) == 8 &&
                   offsetof(shm_ref_entry, nnz) == 24 && offsetof(shm_ref_entry, words) == 32 &&
                   offsetof(shm_ref_entry, vocab) == 36 && offsetof(shm_ref_entry, seal) == 40 &&
                   sizeof(shm_ref_entry) == 48,
               "shm_ref_entry matches shmask.refs.ENTRY_DTYPE");

/* Entry i of a take's output: a ring chunk of queue q's rows at `position`. */
static void put_ring_ref(shm_ref_entry *e, uint64_t position, uint64_t record_bytes,
                         uint64_t seal, const shm_queue *q) {
    e->kind = 1;
    e->seal = seal;
    e->position = position;
    e->record_bytes = record_bytes;
    e->rows = (uint32_t)q->rows;
    e->nnz = q->nnz;
    e->words = (uint32_t)q->words;
    e->vocab = q->vocab;
}

/* A buffer's flags are stored per row only once a row needed them; before
 * its rows leave (take, private pack) the others are written: all zero. */
static inline void settle_flags(shm_queue *q) {
    if (!q->flagged && q->rows_capacity) {
        memset(q->flags, 0, q->rows);
        q->flagged = 1;
    }
}

/* The next buffer holds the last take's rows plus a quarter. */
static void size_next_buffer(shm_queue *q) {
    q->next_rows = q->rows + q->rows / 4 + 1;
    q->next_nnz = q->nnz + q->nnz / 4 + 1;
    q->next_words = q->words + q->words / 4 + 1;
}

int64_t shm_take_queues(shm_ring *ring, const int64_t *handles, uint64_t count, uint64_t start,
                        uint64_t now_ns, int final, shm_ref_entry *out) {
    if (start == 0)
        for (uint64_t i = 0; i < count; i++)
            if (queue_slot(ring, handles[i]) < 0) return SHM_E_BAD_SLOT;
    for (uint64_t i = start; i < count; i++) {
        uint64_t slot = (uint64_t)handles[i] & HANDLE_SLOT_MASK;
        shm_queue *q = &ring->queues[slot];
        shm_ref_entry *e = &out[i];
        memset(e, 0, sizeof *e);
        e->mode = (uint8_t)q->mode;
        if (q->rows == 0) {
            if (final) drop_buffer(ring, q);
            continue;
        }
        if (q->words > UINT32_MAX) return SHM_E_OVERFLOW; /* a ref's words field is 32 bits */
        settle_flags(q);
        uint64_t seal = 0;
        if (q->in_ring && !ring->dead &&
            shm_publish(ring, q->position, q->mode, q->rows, q->words, q->nnz, q->vocab,
                        now_ns, &seal) != SHM_OK) {
            /* Someone rewrote our staging record's header (or cut the file):
             * move the rows out and send them inline rather than publish a
             * record readers would reject; cut rows become lost below. */
            int rc = stage_private(ring, slot, current_capacities(q));
            if (rc) return rc;
        }
        if (q->lost) {
            /* A ref to where the rows were: its reader gets StaleChunkError. */
            shm_layout layout;
            shm_record_layout(q->mode, q->rows, q->words, q->nnz, &layout);
            put_ring_ref(e, q->lost_position, layout.record_bytes, 0, q);
            drop_buffer(ring, q);
            q->lost = 0;
            continue;
        }
        /* On a truncated segment the rows may be gone: the ref still points
         * at the ring, where its reader gets StaleChunkError (never zeros). */
        if (!q->in_ring) return (int64_t)i;
        shm_layout layout;
        shm_record_layout(q->mode, q->rows_capacity, q->words_capacity, q->nnz_capacity, &layout);
        put_ring_ref(e, q->position, layout.record_bytes, seal, q);
        size_next_buffer(q);
        /* The published record is the reader's now: forget it, don't discard. */
        q->in_ring = 0;
        q->lengths = NULL;
        q->flags = NULL;
        q->ids = NULL;
        q->logprobs = NULL;
        q->rows = q->nnz = q->rows_capacity = q->nnz_capacity = 0;
        q->words = q->words_capacity = 0;
        q->vocab = 0;
        q->flagged = 0;
        q->position = 0;
        /* Next emission's buffer now, while we are at it; if the ring has no
         * room the next append takes the slow path instead. */
        if (!final && ring_usable(ring)) {
            capacities next = {q->next_rows, q->next_words,
                               q->mode == SHM_MODE_SUPPORT ? q->next_nnz : 0};
            restage_in_ring(ring, slot, next);
        }
    }
    return (int64_t)count;
}

uint64_t shm_payload_bytes(uint32_t mode, uint64_t rows, uint64_t words, uint64_t nnz) {
    uint64_t n_logprobs = mode == SHM_MODE_SUPPORT ? nnz : rows;
    return 4 * rows + ((rows + 3) & ~(uint64_t)3) + 4 * words + 4 * n_logprobs;
}

int shm_queue_pack_private(shm_ring *ring, uint64_t slot, char *out, uint64_t out_len) {
    if (slot >= ring->n_queues || !ring->queues[slot].mode) return SHM_E_BAD_SLOT;
    shm_queue *q = &ring->queues[slot];
    if (q->in_ring || !q->rows_capacity || q->lost) return SHM_E_BAD_STATE;
    uint64_t n_logprobs = q->mode == SHM_MODE_SUPPORT ? q->nnz : q->rows;
    if (out_len != shm_payload_bytes(q->mode, q->rows, q->words, q->nnz)) return SHM_E_OVERFLOW;
    uint64_t flags_bytes = (q->rows + 3) & ~(uint64_t)3; /* keeps ids 4-byte aligned */
    settle_flags(q);
    char *at = out;
    memcpy(at, q->lengths, 4 * q->rows);
    at += 4 * q->rows;
    memcpy(at, q->flags, q->rows);
    memset(at + q->rows, 0, flags_bytes - q->rows);
    at += flags_bytes;
    memcpy(at, q->ids, 4 * q->words);
    at += 4 * q->words;
    memcpy(at, q->logprobs, 4 * n_logprobs);
    size_next_buffer(q);
    drop_buffer(ring, q);
    return SHM_OK;
}

/* ------------------------------------------------------------ decoding */

int64_t shm_decode_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                        uint64_t rows, uint64_t words, uint32_t vocab, int32_t *out,
                        uint64_t out_len) {
    uint64_t in = 0, at = 0, mask_words = shm_bitmask_words(vocab);
    for (uint64_t r = 0; r < rows; r++) {
        int32_t n = lengths[r];
        uint8_t f = flags ? flags[r] : 0;
        /* The rows were validated at open, but they live in shared memory:
         * every bound is checked again, so rewritten rows fail, never overrun. */
        if (n < 0 || (uint64_t)n > out_len - at) return -1;
        if (f == 0) {
            if ((uint64_t)n > words - in) return -1;
            memcpy(out + at, ids + in, (uint64_t)n * sizeof(int32_t));
            in += (uint64_t)n;
        } else if (f == SHM_ROW_BITMASK) {
            if (mask_words > words - in) return -1;
            uint64_t got = 0;
            for (uint64_t w = 0; w < mask_words; w++) {
                uint32_t bits = (uint32_t)ids[in + w];
                while (bits) {
                    uint64_t id = 32 * w + (uint64_t)__builtin_ctz(bits);
                    if (got == (uint64_t)n || id >= vocab) return -1;
                    out[at + got++] = (int32_t)id;
                    bits &= bits - 1;
                }
            }
            if (got != (uint64_t)n) return -1;
            in += mask_words;
        } else if (n) {
            return -1;
        }
        at += (uint64_t)n;
    }
    return (int64_t)at;
}

/* ------------------------------------------------------ guarded mappings */

#define GUARD_SLOTS 1024
struct guard {
    _Atomic uintptr_t start; /* 0: free */
    _Atomic uintptr_t end;
    _Atomic uint32_t truncated;
    _Atomic int fd; /* our own descriptor of the file: its size, from a handler */
};
static struct guard guards[GUARD_SLOTS];
static _Atomic int guards_used; /* slots at or past this index were never used */
static pthread_mutex_t guards_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction previous_sigbus;
/* Set once a foreign fault was handed to the previous handler. A handler
 * that re-raises after putting its own predecessor back (faulthandler does,
 * and its predecessor may be us) must not bounce the signal forever: the
 * second time round the process dies, as it would have without shmask. */
static volatile sig_atomic_t sigbus_chained;

/* Zero pages over the whole mapping (mmap is a plain system call, safe in
 * a handler); the faulting access then completes on them. */
static int replace_with_zeros(struct guard *g, uintptr_t start, uintptr_t end) {
    void *replaced = mmap((void *)start, end - start, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (replaced == MAP_FAILED) return 0;
    atomic_store_explicit(&g->truncated, 1, memory_order_release);
    return 1;
}

/* A SIGBUS that a handler installed after ours re-raised (faulthandler puts
 * its predecessor back, then raise()s): the fault's address is gone, so
 * every mapping whose file is now shorter than it gets zero pages. Returns
 * how many; when one of them was the faulting one, the access completes on
 * them once that handler returns. fstat is async-signal-safe. */
static int replace_cut_mappings(void) {
    int replaced = 0, used = atomic_load_explicit(&guards_used, memory_order_acquire);
    for (int i = 0; i < used; i++) {
        struct guard *g = &guards[i];
        uintptr_t start = atomic_load_explicit(&g->start, memory_order_acquire);
        uintptr_t end = atomic_load_explicit(&g->end, memory_order_acquire);
        int fd = atomic_load_explicit(&g->fd, memory_order_acquire);
        if (!start || fd < 0 || atomic_load_explicit(&g->truncated, memory_order_acquire))
            continue;
        struct stat st;
        if (fstat(fd, &st) != 0 || (uint64_t)st.st_size >= end - start) continue;
        /* Still the same mapping (not unmapped while we looked)? */
        if (atomic_load_explicit(&g->start, memory_order_acquire) != start) continue;
        replaced += replace_with_zeros(g, start, end);
    }
    return replaced;
}

static void on_sigbus(int signum, siginfo_t *info, void *context) {
    if (info && info->si_code > 0) { /* a fault (never a SIGBUS sent with kill()) */
        uintptr_t address = (uintptr_t)info->si_addr;
        int used = atomic_load_explicit(&guards_used, memory_order_acquire);
        for (int i = 0; i < used; i++) {
            uintptr_t start = atomic_load_explicit(&guards[i].start, memory_order_acquire);
            uintptr_t end = atomic_load_explicit(&guards[i].end, memory_order_acquire);
            if (!start || address < start || address >= end) continue;
            if (replace_with_zeros(&guards[i], start, end)) return;
            break;
        }
    } else if (info && info->si_code == SI_TKILL && info->si_pid == getpid() &&
               replace_cut_mappings()) {
        return; /* our fault, re-raised (raise()) by a handler in front of ours */
    }
    /* Not ours: what would have happened without shmask. */
    if (sigbus_chained) {
        signal(SIGBUS, SIG_DFL);
        raise(SIGBUS);
        return;
    }
    sigbus_chained = 1;
    if ((previous_sigbus.sa_flags & SA_SIGINFO) && previous_sigbus.sa_sigaction) {
        previous_sigbus.sa_sigaction(signum, info, context);
        return;
    }
    if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
        previous_sigbus.sa_handler(signum);
        return;
    }
    signal(SIGBUS, SIG_DFL);
    raise(SIGBUS);
}

/* Puts our handler in front (the one found there is chained). Called under
 * guards_lock at every mapping and by shm_guard_front. */
static void install_sigbus_handler(void) {
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) return;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    previous_sigbus = current;
    sigaction(SIGBUS, &ours, NULL);
}

void shm_guard_front(void) {
    if (!atomic_load_explicit(&guards_used, memory_order_acquire)) return; /* nothing mapped */
    pthread_mutex_lock(&guards_lock);
    install_sigbus_handler();
    pthread_mutex_unlock(&guards_lock);
}

void *shm_map(int fd, uint64_t bytes, int populate, int *errno_out) {
    *errno_out = 0;
    pthread_mutex_lock(&guards_lock);
    int slot = -1;
    for (int i = 0; i < GUARD_SLOTS && slot < 0; i++)
        if (!atomic_load_explicit(&guards[i].start, memory_order_relaxed)) slot = i;
    void *address = NULL;
    if (slot < 0) {
        *errno_out = EMFILE;
    } else {
        int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
        /* Our own descriptor (the caller closes its one): it tells the
         * handler the file's size when a fault reaches us re-raised. */
        int own_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        void *mapped = own_fd < 0 ? MAP_FAILED
                                  : mmap(NULL, bytes, PROT_READ | PROT_WRITE, flags, fd, 0);
        if (mapped == MAP_FAILED) {
            *errno_out = errno;
            if (own_fd >= 0) close(own_fd);
        } else {
            address = mapped;
            atomic_store_explicit(&guards[slot].truncated, 0, memory_order_relaxed);
            atomic_store_explicit(&guards[slot].fd, own_fd, memory_order_relaxed);
            atomic_store_explicit(&guards[slot].end, (uintptr_t)mapped + bytes, memory_order_release);
            atomic_store_explicit(&guards[slot].start, (uintptr_t)mapped, memory_order_release);
            if (slot >= atomic_load_explicit(&guards_used, memory_order_relaxed))
                atomic_store_explicit(&guards_used, slot + 1, memory_order_release);
            install_sigbus_handler();
        }
    }
    pthread_mutex_unlock(&guards_lock);
    return address;
}

void shm_unmap(void *address) {
    pthread_mutex_lock(&guards_lock);
    int used = atomic_load_explicit(&guards_used, memory_order_relaxed);
    for (int i = 0; i < used; i++) {
        uintptr_t start = atomic_load_explicit(&guards[i].start, memory_order_relaxed);
        if (start != (uintptr_t)address || !start) continue;
        uintptr_t end = atomic_load_explicit(&guards[i].end, memory_order_relaxed);
        /* Forget it first: once unmapped, the range may be mapped again by
         * someone else, whose faults are not ours to paper over. */
        atomic_store_explicit(&guards[i].start, 0, memory_order_release);
        int fd = atomic_exchange_explicit(&guards[i].fd, -1, memory_order_acq_rel);
        munmap(address, end - start);
        if (fd >= 0) close(fd);
        break;
    }
    pthread_mutex_unlock(&guards_lock);
}

int shm_mapping_truncated(const void *address) {
    int used = atomic_load_explicit(&guards_used, memory_order_acquire);
    for (int i = 0; i < used; i++) {
        if (atomic_load_explicit(&guards[i].start, memory_order_acquire) != (uintptr_t)address)
            continue;
        if (atomic_load_explicit(&guards[i].truncated, memory_order_acquire)) return 1;
        /* Cut and grown back to its size (no fault then: the pages read as
         * zeros), or declared lost by its producer: the magic reads zero. */
        uint64_t bytes = atomic_load_explicit(&guards[i].end, memory_order_acquire) -
                         (uintptr_t)address;
        return bytes >= SHM_HEADER_BYTES &&
               __atomic_load_n(&cseg(address)->magic, __ATOMIC_ACQUIRE) == 0;
    }
    return 0;
}

void shm_release_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                      const uint64_t *positions, const uint64_t *seals, uint64_t count,
                      int32_t *results) {
    for (uint64_t i = 0; i < count; i++)
        results[i] = shm_release(base, mapped_bytes, capacity, positions[i], seals[i]);
}

/* ------------------------------------------------------- response JSON */

/* Where the n-th number starting at p ends: at its comma, or at `end`
 * when it is the last one; NULL if fewer than n numbers remain. */
static const char *nth_comma(const char *p, const char *end, int32_t n) {
    int32_t wanted = n; /* the n-th comma ends the row; the last row ends at `end` */
#if defined(__SSE2__)
    const __m128i comma = _mm_set1_epi8(',');
    while (end - p >= 16) {
        unsigned mask = (unsigned)_mm_movemask_epi8(
            _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)p), comma));
        int count = __builtin_popcount(mask);
        if (count >= wanted) {
            while (--wanted) mask &= mask - 1; /* drop the commas before ours */
            return p + __builtin_ctz(mask);
        }
        wanted -= count;
        p += 16;
    }
#endif
    for (; p < end; p++)
        if (*p == ',' && --wanted == 0) return p;
    return wanted == 1 ? end : NULL; /* the row's last number closes the array */
}

int64_t shm_json_nest(const char *flat, uint64_t flat_len, const int32_t *lengths, uint64_t rows,
                      char *out, uint64_t out_capacity) {
    if (flat_len < 2 || flat[0] != '[' || flat[flat_len - 1] != ']') return -1;
    if (out_capacity < flat_len + 3 * rows) return -1; /* rows add 3 bytes at most: [ ] , */
    const char *p = flat + 1, *end = flat + flat_len - 1; /* the numbers, comma-separated */
    char *o = out;
    *o++ = '[';
    for (uint64_t r = 0; r < rows; r++) {
        if (r) *o++ = ',';
        *o++ = '[';
        int32_t n = lengths[r];
        if (n < 0) return -1;
        if (n > 0) {
            /* n numbers end at the n-th comma (or at the closing bracket) */
            if (p >= end) return -1; /* no numbers left for this row */
            const char *q = nth_comma(p, end, n);
            if (!q) return -1; /* fewer numbers than the lengths say */
            memcpy(o, p, (size_t)(q - p));
            o += q - p;
            p = q < end ? q + 1 : end;
        }
        *o++ = ']';
    }
    if (p != end) return -1; /* numbers left over */
    *o++ = ']';
    return (int64_t)(o - out);
}

/* ------------------------------------------------- GPU-direct publishing */
/* The table of shmask_core.h's "GPU-direct publishing". Ordering (see
 * docs/architecture.md, "GPU-direct publishing"): the CPU writes the table
 * only while no kernel that could write it is in flight (`done` equals
 * `launched`, read with acquire), and reads the GPU's counts only then too.
 * Each program of the kernel stores its row, then (after a barrier) adds 1
 * to a device counter with acq_rel ordering; the program that makes it
 * reach the step's target stores the target into `done` with a release at
 * system scope. So every store of the step happens before `done` changes,
 * and a CPU acquire load that sees the new `done` sees them all. */

_Static_assert(sizeof(shm_direct_entry) == 64, "a direct entry is one cache line");
_Static_assert(sizeof(shm_direct_step_desc) == 128, "the step descriptor is two cache lines");
_Static_assert(SHM_DIRECT_DESC_OFFSET + sizeof(shm_direct_step_desc) <= SHM_DIRECT_HEADER_BYTES,
               "the descriptor fits in the header");

#define DIRECT_COUNT_MAX 0x7fffffffull /* the kernel does 32-bit signed arithmetic */

static inline shm_direct_entry *direct_entry(const shm_direct *direct, uint64_t slot) {
    return (shm_direct_entry *)((char *)direct->table + SHM_DIRECT_HEADER_BYTES) + slot;
}

static inline uint64_t direct_slots_offset(const shm_direct *direct) {
    return SHM_DIRECT_HEADER_BYTES + direct->slots * sizeof(shm_direct_entry);
}

static inline int32_t *direct_slots(const shm_direct *direct) {
    return (int32_t *)((char *)direct->table + direct_slots_offset(direct));
}

static inline uint64_t *direct_counter(const shm_direct *direct, int index) {
    return (uint64_t *)direct->table + index; /* 0: diverted, 1: done */
}

int shm_direct_init(shm_direct *direct, uint64_t slots, int64_t ring_offset) {
    memset(direct, 0, sizeof *direct);
    if (!slots || slots > HANDLE_SLOT_MASK + 1) return SHM_E_OVERFLOW;
    uint64_t bytes = SHM_DIRECT_HEADER_BYTES + slots * (sizeof(shm_direct_entry) + sizeof(int32_t));
    bytes = (bytes + 4095) & ~(uint64_t)4095; /* whole pages: cudaHostRegister maps pages */
    void *table = aligned_alloc(4096, bytes);
    uint64_t *seen = calloc(slots, sizeof *seen);
    if (!table || !seen) {
        free(table);
        free(seen);
        return SHM_E_NO_MEMORY;
    }
    memset(table, 0, bytes);
    direct->table = table;
    direct->table_bytes = bytes;
    direct->slots = slots;
    direct->ring_offset = ring_offset;
    direct->seen_serial = seen;
    return SHM_OK;
}

void shm_direct_free(shm_direct *direct) {
    free(direct->table);
    free(direct->seen_serial);
    direct->table = NULL;
    direct->seen_serial = NULL;
    direct->slots = 0;
}

uint64_t shm_direct_diverted(const shm_direct *direct) {
    return __atomic_load_n(direct_counter(direct, 0), __ATOMIC_ACQUIRE);
}

int shm_direct_idle(const shm_direct *direct) {
    return __atomic_load_n(direct_counter(direct, 1), __ATOMIC_ACQUIRE) == direct->launched;
}

static uint64_t monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}

int shm_direct_wait(const shm_direct *direct, uint64_t timeout_ns) {
    /* A step's kernel takes tens of microseconds: spin that long, then
     * sleep in short naps (the caller falls back to a device sync). */
    uint64_t start = monotonic_ns();
    while (!shm_direct_idle(direct)) {
        uint64_t waited = monotonic_ns() - start;
        if (waited >= timeout_ns) return 0;
        if (waited < 200000) {
#if defined(__SSE2__)
            _mm_pause();
#endif
        } else {
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
    }
    return 1;
}

static inline uint32_t clamp_count(uint64_t n) {
    return (uint32_t)min_u64(n, DIRECT_COUNT_MAX);
}

/* The entry of `slot` from its queue (capacities 0 where the GPU may not write). */
static void push_slot(shm_ring *ring, shm_direct *direct, uint64_t slot) {
    shm_queue *q = &ring->queues[slot];
    shm_direct_entry *e = direct_entry(direct, slot);
    /* Only ring buffers are registered with the device: private memory,
     * a lost ring or no buffer at all publish zero capacities, so every
     * row for them diverts to the CPU path. */
    if (!q->mode || !q->in_ring || !q->rows_capacity || q->lost || !ring_usable(ring) ||
        q->rows > DIRECT_COUNT_MAX || q->words > DIRECT_COUNT_MAX || q->nnz > DIRECT_COUNT_MAX) {
        memset(e, 0, sizeof *e);
        return;
    }
    settle_flags(q); /* the kernel writes a flags byte for every row it stores */
    int64_t off = direct->ring_offset;
    e->lengths = (uint64_t)((int64_t)(uintptr_t)q->lengths + off);
    e->flags = (uint64_t)((int64_t)(uintptr_t)q->flags + off);
    e->ids = (uint64_t)((int64_t)(uintptr_t)q->ids + off);
    e->logprobs = (uint64_t)((int64_t)(uintptr_t)q->logprobs + off);
    e->rows = (uint32_t)q->rows;
    e->rows_capacity = clamp_count(q->rows_capacity);
    e->words = (uint32_t)q->words;
    e->words_capacity = clamp_count(q->words_capacity);
    e->nnz = (uint32_t)q->nnz;
    e->nnz_capacity = q->mode == SHM_MODE_SUPPORT ? clamp_count(q->nnz_capacity) : 0;
    e->vocab = q->vocab;
    e->diverted = 0;
}

/* The GPU's counts of `slot` into its queue, if its entry still describes
 * the queue's buffer (push wrote it and nothing changed the buffer since). */
static int pull_slot(shm_ring *ring, const shm_direct *direct, uint64_t slot) {
    shm_queue *q = &ring->queues[slot];
    const shm_direct_entry *e = direct_entry(direct, slot);
    if (!q->mode || !q->in_ring || !e->rows_capacity ||
        e->lengths != (uint64_t)((int64_t)(uintptr_t)q->lengths + direct->ring_offset))
        return SHM_OK;
    if (e->rows == q->rows) return SHM_OK; /* the GPU stored nothing here */
    /* The GPU only appends: counts never go back or past a capacity. */
    if (e->rows < q->rows || e->words < q->words || e->nnz < q->nnz ||
        e->rows > q->rows_capacity || e->words > q->words_capacity ||
        (q->mode == SHM_MODE_SUPPORT && e->nnz > q->nnz_capacity) ||
        (q->vocab && e->vocab != q->vocab))
        return SHM_E_DIRECT_COUNTS;
    q->rows = e->rows;
    q->words = e->words;
    q->nnz = e->nnz;
    q->vocab = e->vocab;
    q->flagged = 1;
    return SHM_OK;
}

void shm_direct_push_all(shm_ring *ring, shm_direct *direct) {
    uint64_t n = min_u64(ring->n_queues, direct->slots);
    for (uint64_t slot = 0; slot < n; slot++) push_slot(ring, direct, slot);
}

int shm_direct_pull_all(shm_ring *ring, shm_direct *direct, uint64_t *bad_slot) {
    uint64_t n = min_u64(ring->n_queues, direct->slots);
    for (uint64_t slot = 0; slot < n; slot++) {
        if (pull_slot(ring, direct, slot) != SHM_OK) {
            *bad_slot = slot;
            return SHM_E_DIRECT_COUNTS;
        }
    }
    direct->last_batch = 0; /* every slot is pulled */
    return SHM_OK;
}

int shm_direct_step(shm_ring *ring, shm_direct *direct, const int64_t *handles,
                    uint64_t batch, uint32_t mode, uint64_t words, uint64_t nnz,
                    const uint64_t *addresses, uint32_t vocab, int64_t *bad_row) {
    *bad_row = -1;
    if (!shm_direct_idle(direct)) return SHM_DIRECT_IN_FLIGHT;
    if (shm_direct_diverted(direct) != direct->diverted_seen) return SHM_DIRECT_DIVERTED;
    int32_t *slots = direct_slots(direct);
    /* The last step's counts first: only its queues can have changed. What
     * they grew by says how large a row is now (for new queues' buffers). */
    uint64_t seen_rows = 0, seen_words = 0, seen_nnz = 0;
    for (uint64_t i = 0; i < direct->last_batch; i++) {
        const shm_queue *q = &ring->queues[(uint64_t)slots[i]];
        uint64_t rows = q->rows, words_before = q->words, nnz_before = q->nnz;
        int rc = pull_slot(ring, direct, (uint64_t)slots[i]);
        if (rc) return rc;
        if (q->rows > rows) {
            seen_rows += q->rows - rows;
            seen_words += q->words - words_before;
            seen_nnz += q->nnz - nnz_before;
        }
    }
    if (seen_rows) {
        direct->row_words = (seen_words + seen_rows - 1) / seen_rows;
        direct->row_nnz = (seen_nnz + seen_rows - 1) / seen_rows;
    }
    direct->last_batch = 0;
    uint64_t serial = ++direct->serial;
    for (uint64_t i = 0; i < batch; i++) {
        *bad_row = (int64_t)i;
        int64_t slot = queue_slot(ring, handles[i]);
        if (slot < 0) return SHM_E_BAD_SLOT;
        if ((uint64_t)slot >= direct->slots) return SHM_E_DIRECT_SLOT;
        if (ring->queues[slot].mode != mode) return SHM_E_MODE;
        /* A bitmask row of another vocabulary would divert alone and be
         * refused by the CPU after the step's other rows landed: the CPU
         * path takes (or refuses) the whole step instead. */
        if (ring->queues[slot].vocab && ring->queues[slot].vocab != vocab) return SHM_E_VOCAB;
        /* Two rows of one queue in a step would race for the same counts. */
        if (direct->seen_serial[slot] == serial) return SHM_E_DIRECT_REPEAT;
        direct->seen_serial[slot] = serial;
    }
    *bad_row = -1;
    for (uint64_t i = 0; i < batch; i++) {
        uint64_t slot = (uint64_t)handles[i] & HANDLE_SLOT_MASK;
        shm_queue *q = &ring->queues[slot];
        /* Room for one more row of the largest size asked for; a queue that
         * cannot grow now (ring full) diverts its row to the CPU path. */
        if (!fits(q, q->rows + 1, q->words + words, q->nnz + nnz) && ring_usable(ring)) {
            /* Room for the buffer's remaining rows at the size rows had in
             * the last step, plus one row of the largest size: not that many
             * rows of the largest size (gigabytes for a batch of new
             * requests), and not one row at a time (a relocation a step).
             * A first buffer (none yet) holds next_rows rows so; a full one
             * at least doubles (shm_queue_grow). Before any step has stored
             * a row, the size is unknown: room for one largest row. */
            uint64_t more = q->rows_capacity > q->rows ? q->rows_capacity - q->rows : q->next_rows;
            uint64_t more_words = (more ? more - 1 : 0) * direct->row_words + words;
            uint64_t more_nnz = (more ? more - 1 : 0) * direct->row_nnz + nnz;
            if (!q->rows_capacity && !q->next_words) {
                q->next_words = q->words + more_words;
                q->next_nnz = q->nnz + more_nnz;
            }
            (void)shm_direct_reserve(ring, slot, 1, more_words,
                                     mode == SHM_MODE_SUPPORT ? more_nnz : 0);
            direct->grown++;
        }
        push_slot(ring, direct, slot);
        slots[i] = (int32_t)slot;
    }
    shm_direct_step_desc *desc =
        (shm_direct_step_desc *)((char *)direct->table + SHM_DIRECT_DESC_OFFSET);
    memcpy(desc, addresses, 8 * sizeof(uint64_t));
    direct->launched += batch;
    desc->target = direct->launched;
    desc->slots = (uint64_t)((int64_t)(uintptr_t)slots + direct->table_offset);
    desc->vocab = vocab;
    desc->batch = (uint32_t)batch;
    direct->last_batch = batch;
    return SHM_OK;
}

/* cuLaunchKernel from the CUDA driver, resolved on first use: the core is
 * built without CUDA; a process that launches has the driver loaded (torch
 * made its context), so this finds that same library. */
typedef int (*cu_launch_kernel_fn)(void *function, unsigned grid_x, unsigned grid_y,
                                   unsigned grid_z, unsigned block_x, unsigned block_y,
                                   unsigned block_z, unsigned shared_bytes, void *stream,
                                   void **params, void **extra);

int shm_direct_launch(uint64_t function, uint32_t grid, uint32_t threads, uint32_t shared_bytes,
                      uint64_t stream, uint64_t table, uint64_t arrivals, uint32_t n_params) {
    static cu_launch_kernel_fn launch_kernel;
    if (!launch_kernel) {
        void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!driver) return SHM_E_DIRECT_LAUNCH;
        launch_kernel = (cu_launch_kernel_fn)dlsym(driver, "cuLaunchKernel");
        if (!launch_kernel) return SHM_E_DIRECT_LAUNCH;
    }
    /* The kernel's parameters: the table's address, the arrival counter,
     * then the compiler's own pointers (scratch memory), passed NULL: the
     * caller uses this only for a kernel that needs none. Each points at a
     * u64; a 4-byte parameter reads its low half (x86-64, AArch64: little
     * endian), which holds the value (Triton chose the 4-byte type because
     * the value fits). */
    if (n_params < 2 || n_params > 8) return SHM_E_DIRECT_LAUNCH;
    uint64_t values[8] = {table, arrivals, 0, 0, 0, 0, 0, 0};
    void *params[8];
    for (uint32_t i = 0; i < n_params; i++) params[i] = &values[i];
    int rc = launch_kernel((void *)(uintptr_t)function, grid, 1, 1, threads, 1, 1, shared_bytes,
                           (void *)(uintptr_t)stream, params, NULL);
    return rc ? -1000 - rc : SHM_OK; /* CUDA error e as -1000 - e */
}

void shm_direct_cancel(shm_direct *direct) {
    /* The launch failed: its programs will never arrive. */
    direct->launched = __atomic_load_n(direct_counter(direct, 1), __ATOMIC_ACQUIRE);
}

void shm_direct_diverted_done(shm_direct *direct) {
    direct->diverted_seen = shm_direct_diverted(direct);
}

void shm_direct_diverted_rows(const shm_ring *ring, const shm_direct *direct,
                              const int64_t *handles, uint64_t batch, uint8_t *out) {
    for (uint64_t i = 0; i < batch; i++) {
        int64_t slot = queue_slot(ring, handles[i]);
        out[i] = slot >= 0 && (uint64_t)slot < direct->slots &&
                 direct_entry(direct, (uint64_t)slot)->diverted;
    }
}

int shm_direct_reserve(shm_ring *ring, uint64_t slot, uint64_t rows, uint64_t words,
                       uint64_t nnz) {
    if (slot >= ring->n_queues || !ring->queues[slot].mode) return SHM_E_BAD_SLOT;
    shm_queue *q = &ring->queues[slot];
    if (!q->in_ring && q->rows_capacity) return SHM_OK; /* private until its take */
    if (fits(q, q->rows + rows, q->words + words, q->nnz + nnz)) return SHM_OK;
    /* shm_queue_grow sizes from the pending counts (doubling): these rows. */
    q->pending_rows = rows;
    q->pending_words = words;
    q->pending_nnz = nnz;
    q->pending_serial = 0;
    return shm_queue_grow(ring, slot, 1);
}

/*
 * The core's file-local helpers that several of its .c files use: static
 * inline here (the hot ones stay inlinable in every file, as they were
 * when the core was one file), plus the two larger producer functions that
 * the ring and the queue buffers share, hidden from the shared object's
 * symbol table. Never declared to cffi.
 */
#ifndef SHMASK_INTERNAL_H
#define SHMASK_INTERNAL_H

#include "shmask_core.h"
#include "shmask_layout.h"
#include "shmask_queue.h" /* shm_ring, shm_queue, the handle bits: the producer's helpers */

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define SHM_INTERNAL __attribute__((visibility("hidden")))

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

static inline int is_power_of_two(uint64_t n) { return n && !(n & (n - 1)); }
static inline void bump(void *base, int which) {
    atomic_fetch_add_explicit(&seg(base)->counters[which], 1, memory_order_relaxed);
}

static inline uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static inline uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static inline int ring_usable(const shm_ring *ring) { return ring->base && !ring->dead; }

#define HANDLE_GENERATION_MASK 0xffffffffull /* the whole uint32 generation */
#define HANDLE_SLOT_MASK ((1ull << SHM_HANDLE_SLOT_BITS) - 1)
#define HANDLE_TAG_MASK 0x7fffull

/* ------------------------------------------------------------ producer */

static inline void free_private(shm_queue *q) {
    if (!q->in_ring && q->rows_capacity) free(q->lengths); /* one block: lengths|flags|ids|logprobs */
}

/* A record header a reader may have rewritten: its size is trusted only if
 * it keeps the walk on record boundaries inside [tail, head). */
static inline int record_size_ok(const shm_ring *ring, const struct shm_record_header *r, uint64_t pos,
                                 uint64_t head) {
    uint64_t bytes = r->record_bytes;
    return r->tag == pos && bytes >= SHM_RECORD_HEADER_BYTES && bytes % SHM_RECORD_ALIGN == 0 &&
           bytes <= ring->capacity - (pos & (ring->capacity - 1)) && bytes <= head - pos;
}

/* shmask_ring.c: the queue table doubles (ring init, queue open); a record
 * is reserved at the head (shm_reserve, a queue's ring buffer). */
SHM_INTERNAL int grow_table(shm_ring *ring);
SHM_INTERNAL int reserve_record(shm_ring *ring, uint32_t mode, uint64_t rows_capacity,
                                uint64_t words_capacity, uint64_t nnz_capacity, uint64_t owner,
                                uint64_t *position_out);

/* -------------------------------------------------------- row checks */

/* Set bits of n 32-bit words. Built twice, with the POPCNT instruction and
 * without (the x86-64 baseline the wheel targets lacks it), picked at load
 * time: the whole vocabulary (4748 words) costs ~1 us instead of ~5. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("popcnt", "default")))
#endif
static inline uint64_t count_bits(const int32_t *words, uint64_t n) {
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
static inline int bitmask_ok(const int32_t *words, uint32_t vocab, uint64_t length) {
    uint64_t n_words = shm_bitmask_words(vocab), set = count_bits(words, n_words);
    uint32_t used = vocab % 32; /* bits of the last word that name ids */
    if (used && ((uint32_t)words[n_words - 1] >> used)) return 0;
    return set == length;
}

/* A row's flags: 0 (OK ids row), a non-OK status alone, or OK + bitmask. */
static inline int flags_ok(uint8_t f) {
    return f == 0 || f == SHM_ROW_OVERFLOW || f == SHM_ROW_INVALID || f == SHM_ROW_BITMASK;
}

/* Ids are non-negative int32 (0 <= id < 2^31) wherever rows enter: no
 * vocabulary bounds an ids row (a bitmask row's vocab only gives its
 * width), and every decoder downstream (binary rows, the adapters) refuses
 * a negative one. The checks OR the ids together, eight to a vector, and
 * test the sign bit once; the functions that run them are built twice,
 * with AVX2 and without (SHM_AVX2_CLONES, picked at load time). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SHM_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SHM_AVX2_CLONES
#endif

/* Eight 4-byte words (ids, or float logprobs as their bits). */
typedef int32_t shm_words8 __attribute__((vector_size(32)));

/* Eight words at any 4-byte alignment (rows sit in records and numpy
 * arrays); through a pointer, as a vector return would change the ABI of
 * the build without AVX. */
static inline __attribute__((always_inline)) void load8(shm_words8 *v, const void *at) {
    memcpy(v, at, sizeof *v);
}

/* `at` OR-ed into *seen. */
static inline __attribute__((always_inline)) void or8(shm_words8 *seen, const void *at) {
    shm_words8 v;
    load8(&v, at);
    *seen |= v;
}

/* Eight words copied, OR-ed into *seen. */
static inline __attribute__((always_inline)) void copy8(void *to, const void *from,
                                                         shm_words8 *seen) {
    shm_words8 v;
    load8(&v, from);
    memcpy(to, &v, sizeof v);
    *seen |= v;
}

/* ids[0, n) OR-ed into *seen: 64 ids a step, then the last 8s, the very
 * last eight overlapping the ones before (a row shorter than eight goes
 * one by one). */
static inline __attribute__((always_inline)) void or_ids(shm_words8 *seen, const int32_t *ids,
                                                          uint64_t n) {
    uint64_t i = 0;
    if (n < 8) {
        for (; i < n; i++) (*seen)[0] |= ids[i];
        return;
    }
    for (; i + 64 <= n; i += 64)
#pragma GCC unroll 8 /* -O2 keeps the loop otherwise: three more instructions a vector */
        for (int k = 0; k < 8; k++) or8(seen, ids + i + 8 * k);
    for (; i + 8 <= n; i += 8) or8(seen, ids + i);
    if (i < n) or8(seen, ids + n - 8);
}

/* memcpy(dst, src, 4 n) of a row's words, OR-ing what it moves into *seen
 * (the per-step copy checks the ids it moves, reading them once; for the
 * logprobs nothing reads `seen` and the ORs go). Inline: rows of up to 32
 * words as two overlapping halves, longer ones 64 words a step, as glibc's
 * memcpy copies them but without its call and size dispatch, which pays
 * for the check (the hot path's budget: benchmarks/hot_path.py). */
static inline __attribute__((always_inline)) void copy_words(void *dst, const void *src,
                                                              uint64_t n, shm_words8 *seen) {
    char *to = dst;
    const char *from = src;
    if (n < 8) {
        for (uint64_t i = 0; i < n; i++) {
            int32_t word;
            memcpy(&word, from + 4 * i, 4);
            memcpy(to + 4 * i, &word, 4);
            (*seen)[0] |= word;
        }
        return;
    }
    if (n <= 16) { /* the first eight and the last eight (overlapping) */
        shm_words8 a, b;
        load8(&a, from);
        load8(&b, from + 4 * (n - 8));
        memcpy(to, &a, 32);
        memcpy(to + 4 * (n - 8), &b, 32);
        *seen |= a | b;
        return;
    }
    if (n <= 32) { /* the first sixteen and the last sixteen */
        shm_words8 a, b, c, d;
        load8(&a, from);
        load8(&b, from + 32);
        load8(&c, from + 4 * (n - 16));
        load8(&d, from + 4 * (n - 8));
        memcpy(to, &a, 32);
        memcpy(to + 32, &b, 32);
        memcpy(to + 4 * (n - 16), &c, 32);
        memcpy(to + 4 * (n - 8), &d, 32);
        *seen |= (a | b) | (c | d);
        return;
    }
    uint64_t i = 0;
    for (; i + 64 <= n; i += 64)
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) copy8(to + 4 * (i + 8 * k), from + 4 * (i + 8 * k), seen);
    for (; i + 8 <= n; i += 8) copy8(to + 4 * i, from + 4 * i, seen);
    if (i < n) copy8(to + 4 * (n - 8), from + 4 * (n - 8), seen);
}

/* Whether an id OR-ed into `seen` was negative. */
static inline __attribute__((always_inline)) int any_negative(const shm_words8 *seen) {
    int32_t all = 0;
    for (int k = 0; k < 8; k++) all |= (*seen)[k];
    return all < 0;
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

static inline int fits(const shm_queue *q, uint64_t rows, uint64_t words, uint64_t nnz) {
    return rows <= q->rows_capacity && words <= q->words_capacity &&
           (q->mode != SHM_MODE_SUPPORT || nnz <= q->nnz_capacity);
}

/* A buffer's flags are stored per row only once a row needed them; before
 * its rows leave (take, private pack) the others are written: all zero. */
static inline void settle_flags(shm_queue *q) {
    if (!q->flagged && q->rows_capacity) {
        memset(q->flags, 0, q->rows);
        q->flagged = 1;
    }
}

#endif

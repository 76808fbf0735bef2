/* The reader's checks (shmask_reader.h); ordering: shmask_core.c. Every
 * argument is untrusted and bounds-checked. */
#include "shmask_reader.h"
#include "shmask_internal.h"

#include <string.h>

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
                    uint64_t max_tokens, uint8_t *geometry, shm_view *out) {
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
    /* The ids rows' ids are not read here (check_ids 0): they were checked where
     * they entered (the producer's copy and publish), a process of the
     * ring's uid can rewrite them after open anyway, and what turns them
     * into a response (to_lists, to_json, the binary encoder) refuses a
     * negative one. Reading every id at open cost 1.36x the instructions of
     * open + release at support 1000 (issue 33). */
    rc = shm_validate_rows(lengths, flags, (const int32_t *)(at + out->ids_offset), rows, words,
                           nnz, vocab, max_tokens, 0, &out->any_flags);
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

void shm_release_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                      const uint64_t *positions, const uint64_t *seals, uint64_t count,
                      int32_t *results) {
    for (uint64_t i = 0; i < count; i++)
        results[i] = shm_release(base, mapped_bytes, capacity, positions[i], seals[i]);
}

/* Ids rows hold ids 0 <= id < 2^31 (shmask_internal.h): a negative one is
 * a malformed row like a bad length. check_ids 0: ids rows' ids are not read
 * (open; bitmask rows' words always are: they are the row's geometry). */
SHM_AVX2_CLONES
int shm_validate_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                      uint64_t rows, uint64_t words, uint64_t nnz, uint32_t vocab,
                      uint64_t max_tokens, int check_ids, uint32_t *any_flags) {
    uint64_t total = 0, cursor = 0, mask_words = shm_bitmask_words(vocab);
    uint32_t any = 0;
    shm_words8 seen = {0};
    for (uint64_t i = 0; i < rows; i++) {
        int32_t n = lengths[i];
        uint8_t f = flags ? flags[i] : 0;
        if (n < 0) return SHM_E_BAD_LENGTHS;
        if (f == 0) {
            if ((uint64_t)n > max_tokens || (uint64_t)n > words - cursor)
                return SHM_E_BAD_LENGTHS;
            if (flags && check_ids) or_ids(&seen, ids + cursor, (uint64_t)n); /* else: below */
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
    if (total != nnz || cursor != words) return SHM_E_BAD_LENGTHS;
    if (!flags && check_ids) or_ids(&seen, ids, words); /* every row an ids row: one run of ids */
    if (any_negative(&seen)) return SHM_E_BAD_LENGTHS;
    *any_flags = any;
    return SHM_OK;
}

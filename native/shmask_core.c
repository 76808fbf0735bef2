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
#include "shmask_core.h"
#include "shmask_layout.h"

#include <string.h>

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
static inline uint64_t align64(uint64_t n) { return (n + 63u) & ~(uint64_t)63u; }
static inline int is_power_of_two(uint64_t n) { return n && !(n & (n - 1)); }
static inline void bump(void *base, int which) {
    atomic_fetch_add_explicit(&seg(base)->counters[which], 1, memory_order_relaxed);
}

int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t nnz_capacity,
                      shm_layout *out) {
    if (mode != SHM_MODE_SELECTED && mode != SHM_MODE_SUPPORT) return SHM_E_BAD_RECORD;
    /* Capacities come from untrusted headers too: keep every product far
     * from overflow (2^40 entries is far beyond any ring). */
    if (rows_capacity > (1ull << 32) || nnz_capacity > (1ull << 40)) return SHM_E_OVERFLOW;
    uint64_t lengths = SHM_RECORD_HEADER_BYTES;
    uint64_t ids = lengths + align64(4 * rows_capacity);
    uint64_t logprobs = ids + align64(4 * nnz_capacity);
    uint64_t n_logprobs = mode == SHM_MODE_SUPPORT ? nnz_capacity : rows_capacity;
    out->lengths_offset = lengths;
    out->ids_offset = ids;
    out->logprobs_offset = logprobs;
    out->record_bytes = logprobs + align64(4 * n_logprobs);
    return SHM_OK;
}

/* ------------------------------------------------------------ producer */

int shm_init(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t epoch,
             uint64_t pid, uint64_t start, uint64_t created_ns) {
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
    /* Magic last: a janitor that maps a half-made segment skips it. */
    atomic_thread_fence(memory_order_release);
    __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
    return SHM_OK;
}

static void write_record_header(struct shm_record_header *r, uint64_t pos, uint32_t mode,
                                uint64_t bytes, uint64_t rows_capacity, uint64_t nnz_capacity,
                                uint64_t owner, uint32_t state) {
    r->tag = pos;
    r->mode = mode;
    r->record_bytes = bytes;
    r->rows = 0;
    r->rows_capacity = (uint32_t)rows_capacity;
    r->nnz = 0;
    r->nnz_capacity = nnz_capacity;
    r->published_ns = 0;
    r->owner = owner;
    atomic_store_explicit(&r->state, state, memory_order_release);
}

static int reserve_record(void *base, uint32_t mode, uint64_t rows_capacity,
                          uint64_t nnz_capacity, uint64_t owner, uint64_t *position_out) {
    struct shm_segment_header *h = seg(base);
    shm_layout layout;
    int rc = shm_record_layout(mode, rows_capacity, nnz_capacity, &layout);
    if (rc) return rc;
    uint64_t capacity = h->capacity;
    uint64_t bytes = layout.record_bytes;
    if (bytes > capacity) return SHM_E_TOO_BIG;
    uint64_t head = atomic_load_explicit(&h->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    uint64_t offset = head & (capacity - 1);
    uint64_t padding = offset + bytes > capacity ? capacity - offset : 0;
    if (head + padding + bytes - tail > capacity) return SHM_FULL;
    if (padding) {
        write_record_header(record_at(base, capacity, head), head, 0, padding, 0, 0, 0,
                            SHM_STATE_PADDING);
        bump(base, SHM_COUNTER_PADDING);
        head += padding;
    }
    write_record_header(record_at(base, capacity, head), head, mode, bytes, rows_capacity,
                        nnz_capacity, owner, SHM_STATE_STAGING);
    *position_out = head;
    atomic_store_explicit(&h->head, head + bytes, memory_order_release);
    return SHM_OK;
}

int shm_reserve(void *base, uint32_t mode, uint64_t rows_capacity, uint64_t nnz_capacity,
                uint64_t *position_out) {
    return reserve_record(base, mode, rows_capacity, nnz_capacity, 0, position_out);
}

void *shm_record_address(void *base, uint64_t position) {
    return record_at(base, seg(base)->capacity, position);
}

int shm_publish(void *base, uint64_t position, uint64_t rows, uint64_t nnz, uint64_t now_ns) {
    struct shm_record_header *r = record_at(base, seg(base)->capacity, position);
    if (r->tag != position) return SHM_E_BAD_POSITION;
    if (atomic_load_explicit(&r->state, memory_order_relaxed) != SHM_STATE_STAGING)
        return SHM_E_BAD_STATE;
    if (rows > r->rows_capacity || nnz > r->nnz_capacity) return SHM_E_OVERFLOW;
    r->rows = (uint32_t)rows;
    r->nnz = nnz;
    r->published_ns = now_ns;
    /* The commit word, written last: payload and header before it. */
    atomic_store_explicit(&r->state, SHM_STATE_WRITTEN, memory_order_release);
    bump(base, SHM_COUNTER_PUBLISHED);
    return SHM_OK;
}

int shm_discard(void *base, uint64_t position) {
    struct shm_record_header *r = record_at(base, seg(base)->capacity, position);
    if (r->tag != position) return SHM_E_BAD_POSITION;
    uint32_t expected = SHM_STATE_STAGING;
    if (!atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_DISCARDED,
                                                 memory_order_acq_rel, memory_order_acquire))
        return SHM_E_BAD_STATE;
    bump(base, SHM_COUNTER_DISCARDED);
    return SHM_OK;
}

int shm_reclaim(void *base, uint64_t now_ns, uint64_t lease_ns, shm_reclaim_result *out) {
    struct shm_segment_header *h = seg(base);
    uint64_t capacity = h->capacity;
    uint64_t head = atomic_load_explicit(&h->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    uint64_t start = tail;
    memset(out, 0, sizeof *out);
    while (tail < head) {
        struct shm_record_header *r = record_at(base, capacity, tail);
        uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
        if (state == SHM_STATE_WRITTEN && lease_ns && now_ns >= r->published_ns &&
            now_ns - r->published_ns >= lease_ns) {
            uint32_t expected = SHM_STATE_WRITTEN;
            if (atomic_compare_exchange_strong_explicit(&r->state, &expected, SHM_STATE_EXPIRED,
                                                        memory_order_acq_rel,
                                                        memory_order_acquire)) {
                out->expired++;
                bump(base, SHM_COUNTER_EXPIRED);
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
        /* Readers can write this page too: never trust a size that would
         * move the tail off a record boundary or past the head. */
        uint64_t bytes = r->record_bytes;
        if (r->tag != tail || bytes < SHM_RECORD_HEADER_BYTES || bytes % SHM_RECORD_ALIGN ||
            bytes > capacity - (tail & (capacity - 1)) || bytes > head - tail) {
            out->blocked_position = tail;
            out->blocked_state = SHM_STATE_CORRUPT;
            break;
        }
        tail += bytes;
    }
    /* Release: everything above (the CASes included) happens before a
     * reader can observe the new tail and conclude its record is gone. */
    atomic_store_explicit(&h->tail, tail, memory_order_release);
    out->head = head;
    out->tail = tail;
    out->advanced_bytes = tail - start;
    return SHM_OK;
}

uint64_t shm_load_head(const void *base) {
    return atomic_load_explicit(&cseg(base)->head, memory_order_acquire);
}
uint64_t shm_load_tail(const void *base) {
    return atomic_load_explicit(&cseg(base)->tail, memory_order_acquire);
}
uint64_t shm_load_counter(const void *base, uint32_t which) {
    if (which >= SHM_N_COUNTERS) return 0;
    return atomic_load_explicit(&cseg(base)->counters[which], memory_order_relaxed);
}

/* -------------------------------------------------------------- reader */

int shm_read_info(const void *base, uint64_t segment_bytes, shm_info *out) {
    if (segment_bytes < SHM_HEADER_BYTES) return SHM_E_BAD_HEADER;
    const struct shm_segment_header *h = cseg(base);
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHM_MAGIC) return SHM_E_BAD_HEADER;
    if (h->layout_version != SHM_LAYOUT_VERSION || h->header_bytes != SHM_HEADER_BYTES)
        return SHM_E_BAD_HEADER;
    uint64_t capacity = h->capacity;
    if (!is_power_of_two(capacity) || capacity < SHM_MIN_CAPACITY ||
        capacity > segment_bytes - SHM_HEADER_BYTES)
        return SHM_E_BAD_HEADER;
    out->capacity = capacity;
    out->epoch = h->epoch;
    out->producer_pid = h->producer_pid;
    out->producer_start = h->producer_start;
    out->created_ns = h->created_ns;
    out->head = atomic_load_explicit(&h->head, memory_order_acquire);
    out->tail = atomic_load_explicit(&h->tail, memory_order_acquire);
    out->published = shm_load_counter(base, SHM_COUNTER_PUBLISHED);
    out->released = shm_load_counter(base, SHM_COUNTER_RELEASED);
    out->expired = shm_load_counter(base, SHM_COUNTER_EXPIRED);
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

int shm_open_record(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                    uint64_t position, uint64_t record_bytes, uint64_t rows, uint64_t nnz,
                    uint32_t mode, shm_view *out) {
    uint64_t offset;
    int rc = locate(base, mapped_bytes, capacity, position, &offset);
    if (rc) return rc;
    if (record_bytes < SHM_RECORD_HEADER_BYTES || record_bytes % SHM_RECORD_ALIGN ||
        record_bytes > capacity - offset)
        return SHM_E_BAD_RECORD;
    const struct shm_record_header *r = record_at((void *)base, capacity, position);
    uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
    if (r->tag != position) return SHM_E_STALE;
    if (state == SHM_STATE_EXPIRED) return SHM_E_STALE;
    if (state == SHM_STATE_RELEASED) return SHM_E_DOUBLE_RELEASE;
    if (state != SHM_STATE_WRITTEN) return SHM_E_NOT_WRITTEN;
    if (r->record_bytes != record_bytes || r->mode != mode || r->rows != rows ||
        r->nnz != nnz || rows > r->rows_capacity || nnz > r->nnz_capacity)
        return SHM_E_BAD_RECORD;
    shm_layout layout;
    rc = shm_record_layout(mode, r->rows_capacity, r->nnz_capacity, &layout);
    if (rc) return SHM_E_BAD_RECORD;
    if (layout.record_bytes != record_bytes) return SHM_E_BAD_RECORD;
    out->record_offset = SHM_HEADER_BYTES + offset;
    out->lengths_offset = out->record_offset + layout.lengths_offset;
    out->ids_offset = out->record_offset + layout.ids_offset;
    out->logprobs_offset = out->record_offset + layout.logprobs_offset;
    return SHM_OK;
}

int shm_check_record(const void *base, uint64_t capacity, uint64_t position) {
    /* Payload loads above this fence cannot move below it. */
    atomic_thread_fence(memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&cseg(base)->tail, memory_order_acquire);
    if (position < tail) return SHM_E_STALE;
    const struct shm_record_header *r = record_at((void *)base, capacity, position);
    uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
    if (r->tag != position || state == SHM_STATE_EXPIRED) return SHM_E_STALE;
    if (state != SHM_STATE_WRITTEN && state != SHM_STATE_RELEASED) return SHM_E_STALE;
    return SHM_OK;
}

int shm_release(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position) {
    uint64_t offset;
    int rc = locate(base, mapped_bytes, capacity, position, &offset);
    if (rc) return rc;
    struct shm_record_header *r = record_at(base, capacity, position);
    if (r->tag != position) return SHM_E_STALE;
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

int shm_validate_lengths(const int32_t *lengths, uint64_t rows, uint64_t nnz,
                         uint64_t max_row_length) {
    uint64_t total = 0;
    for (uint64_t i = 0; i < rows; i++) {
        int32_t n = lengths[i];
        if (n < 0 || (uint64_t)n > max_row_length) return SHM_E_BAD_LENGTHS;
        total += (uint64_t)n;
    }
    return total == nnz ? SHM_OK : SHM_E_BAD_LENGTHS;
}

/* ------------------------------------------------------ RowQueue buffers */

static inline uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

static void point_at_record(void *base, shm_queue *q, uint64_t position) {
    struct shm_segment_header *h = seg(base);
    char *record = (char *)record_at(base, h->capacity, position);
    shm_layout layout;
    shm_record_layout(q->mode, q->rows_capacity, q->nnz_capacity, &layout);
    q->lengths = (int32_t *)(record + layout.lengths_offset);
    q->ids = (int32_t *)(record + layout.ids_offset);
    q->logprobs = (float *)(record + layout.logprobs_offset);
    q->position = position;
    q->in_ring = 1;
}

static void copy_rows(const shm_queue *from, int32_t *lengths, int32_t *ids, float *logprobs) {
    memcpy(lengths, from->lengths, from->rows * sizeof(int32_t));
    memcpy(ids, from->ids, from->nnz * sizeof(int32_t));
    uint64_t n_logprobs = from->mode == SHM_MODE_SUPPORT ? from->nnz : from->rows;
    memcpy(logprobs, from->logprobs, n_logprobs * sizeof(float));
}

static void discard_buffer(void *base, shm_queue *q) {
    if (q->in_ring && q->rows_capacity) shm_discard(base, q->position);
    q->in_ring = 0;
    q->position = 0;
}

int shm_queue_restage(void *base, shm_queue *q, uint64_t slot, uint64_t rows_capacity,
                      uint64_t nnz_capacity) {
    if (!base || (!q->in_ring && q->rows_capacity)) return SHM_FULL;
    if (rows_capacity < q->rows || nnz_capacity < q->nnz) return SHM_E_OVERFLOW;
    uint64_t position;
    int rc = reserve_record(base, q->mode, rows_capacity, nnz_capacity, slot + 1, &position);
    if (rc) return rc;
    shm_queue old = *q;
    q->rows_capacity = rows_capacity;
    q->nnz_capacity = nnz_capacity;
    point_at_record(base, q, position);
    if (old.rows_capacity) {
        copy_rows(&old, q->lengths, q->ids, q->logprobs);
        discard_buffer(base, &old);
    }
    return SHM_OK;
}

void shm_queue_move(void *base, shm_queue *q, int32_t *lengths, int32_t *ids, float *logprobs,
                    uint64_t rows_capacity, uint64_t nnz_capacity) {
    shm_queue old = *q;
    if (old.rows_capacity) copy_rows(&old, lengths, ids, logprobs);
    if (base) discard_buffer(base, &old);
    q->lengths = lengths;
    q->ids = ids;
    q->logprobs = logprobs;
    q->rows_capacity = rows_capacity;
    q->nnz_capacity = nnz_capacity;
    q->in_ring = 0;
    q->position = 0;
}

void shm_queue_drop(void *base, shm_queue *q) {
    if (base) discard_buffer(base, q);
    q->lengths = NULL;
    q->ids = NULL;
    q->logprobs = NULL;
    q->rows = q->nnz = q->rows_capacity = q->nnz_capacity = 0;
    q->in_ring = 0;
    q->position = 0;
}

/* Doubling: each byte is copied O(1) times however long the queue runs. A
 * fresh buffer is sized from the last take (next_rows/next_nnz); the very
 * first one assumes rows as long as the one being appended. */
void shm_queue_grown_capacities(const shm_queue *q, uint64_t n, uint64_t *rows_out,
                                uint64_t *nnz_out) {
    uint64_t need_rows = q->rows + 1, need_nnz = q->nnz + n;
    if (!q->rows_capacity) {
        *rows_out = max_u64(q->next_rows, need_rows);
        *nnz_out = q->next_nnz ? max_u64(q->next_nnz, need_nnz) : max_u64(n, 1) * *rows_out;
        return;
    }
    *rows_out = need_rows > q->rows_capacity ? max_u64(2 * q->rows_capacity, need_rows)
                                             : q->rows_capacity;
    *nnz_out = need_nnz > q->nnz_capacity ? max_u64(2 * q->nnz_capacity, need_nnz)
                                          : q->nnz_capacity;
}

static int grow(void *base, shm_queue *q, uint64_t slot, uint64_t n) {
    uint64_t rows_capacity, nnz_capacity;
    shm_queue_grown_capacities(q, n, &rows_capacity, &nnz_capacity);
    return shm_queue_restage(base, q, slot, rows_capacity, nnz_capacity);
}

int64_t shm_append_step(void *base, shm_queue *queues, uint64_t n_queues, const int32_t *slots,
                        uint64_t batch, const int32_t *lengths, const int32_t *ids,
                        const float *logprobs, uint64_t row_stride, uint64_t ids_len,
                        uint64_t logprobs_len, uint32_t mode, uint64_t max_row_length,
                        uint64_t start_row, uint64_t *source_cursor, int64_t *bad_row) {
    uint64_t cursor = *source_cursor;
    for (uint64_t i = start_row; i < batch; i++) {
        *bad_row = (int64_t)i;
        int32_t slot = slots[i];
        if (slot < 0 || (uint64_t)slot >= n_queues) return SHM_E_BAD_SLOT;
        shm_queue *q = &queues[slot];
        if (q->mode != mode) return q->mode ? SHM_E_MODE : SHM_E_BAD_SLOT;
        int32_t n = lengths[i];
        if (n < 0 || (uint64_t)n > max_row_length || (row_stride && (uint64_t)n > row_stride))
            return SHM_E_BAD_LENGTH;
        uint64_t source = row_stride ? i * row_stride : cursor;
        if (source + (uint64_t)n > ids_len) return SHM_E_SOURCE_OVERRUN;
        if (mode == SHM_MODE_SUPPORT && source + (uint64_t)n > logprobs_len)
            return SHM_E_SOURCE_OVERRUN;
        if (mode == SHM_MODE_SELECTED && i >= logprobs_len) return SHM_E_SOURCE_OVERRUN;
        if (q->rows + 1 > q->rows_capacity || q->nnz + (uint64_t)n > q->nnz_capacity) {
            if (grow(base, q, (uint64_t)slot, (uint64_t)n) != SHM_OK) {
                *source_cursor = cursor;
                return (int64_t)i; /* the caller grows it (waiting, or privately) */
            }
        }
        q->lengths[q->rows] = n;
        memcpy(q->ids + q->nnz, ids + source, (size_t)n * sizeof(int32_t));
        if (mode == SHM_MODE_SUPPORT) {
            memcpy(q->logprobs + q->nnz, logprobs + source, (size_t)n * sizeof(float));
        } else {
            q->logprobs[q->rows] = logprobs[i];
        }
        q->rows += 1;
        q->nnz += (uint64_t)n;
        cursor += (uint64_t)n;
    }
    *bad_row = -1;
    *source_cursor = cursor;
    return (int64_t)batch;
}

int64_t shm_take_queues(void *base, shm_queue *queues, uint64_t n_queues, const int32_t *slots,
                        uint64_t count, uint64_t start, uint64_t now_ns, int final,
                        uint8_t *kind_out, uint8_t *mode_out, uint64_t *position_out, uint64_t *bytes_out,
                        uint32_t *rows_out, uint64_t *nnz_out) {
    for (uint64_t i = start; i < count; i++) {
        int32_t slot = slots[i];
        if (slot < 0 || (uint64_t)slot >= n_queues || !queues[slot].mode) return SHM_E_BAD_SLOT;
        shm_queue *q = &queues[slot];
        kind_out[i] = 0;
        mode_out[i] = (uint8_t)q->mode;
        position_out[i] = bytes_out[i] = nnz_out[i] = 0;
        rows_out[i] = 0;
        if (q->rows == 0) {
            if (final) shm_queue_drop(base, q);
            continue;
        }
        if (!q->in_ring) return (int64_t)i;
        int rc = shm_publish(base, q->position, q->rows, q->nnz, now_ns);
        if (rc) return rc;
        shm_layout layout;
        shm_record_layout(q->mode, q->rows_capacity, q->nnz_capacity, &layout);
        kind_out[i] = 1;
        position_out[i] = q->position;
        bytes_out[i] = layout.record_bytes;
        rows_out[i] = (uint32_t)q->rows;
        nnz_out[i] = q->nnz;
        q->next_rows = q->rows + q->rows / 4 + 1;
        q->next_nnz = q->nnz + q->nnz / 4 + 1;
        /* The published record is the reader's now: forget it, don't discard. */
        q->in_ring = 0;
        q->lengths = NULL;
        q->ids = NULL;
        q->logprobs = NULL;
        q->rows = q->nnz = q->rows_capacity = q->nnz_capacity = 0;
        q->position = 0;
        /* Next emission's buffer now, while we are at it; if the ring has no
         * room the next append takes the slow path instead. */
        if (!final) shm_queue_restage(base, q, (uint64_t)slot, q->next_rows, q->next_nnz);
    }
    return (int64_t)count;
}

int64_t shm_staging_owner(void *base, uint64_t position) {
    struct shm_record_header *r = record_at(base, seg(base)->capacity, position);
    if (r->tag != position ||
        atomic_load_explicit(&r->state, memory_order_acquire) != SHM_STATE_STAGING || !r->owner)
        return -1;
    return (int64_t)(r->owner - 1);
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

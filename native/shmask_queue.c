/* RowQueue buffers (shmask_queue.h); ordering: shmask_core.c. */
#include "shmask_queue.h"
#include "shmask_guard.h" /* shm_mapping_truncated */
#include "shmask_internal.h"

#include <stdlib.h>
#include <string.h>

static int64_t make_handle(const shm_ring *ring, uint64_t slot) {
    uint64_t generation = ring->queues[slot].generation & HANDLE_GENERATION_MASK;
    return (int64_t)(slot | generation << SHM_HANDLE_SLOT_BITS | ring->handle_tag << 48);
}

/* The queue holds no buffer any more (dropped, or handed to a reader). */
static inline void forget_buffer(shm_queue *q) {
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
    forget_buffer(q);
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

/* Whether buffers of these capacities hold the queue's rows. */
static int holds_rows(const shm_queue *q, capacities cap) {
    return cap.rows >= q->rows && cap.words >= q->words &&
           (q->mode != SHM_MODE_SUPPORT || cap.nnz >= q->nnz);
}

/* Moves the queue's rows into a new ring buffer of these capacities. */
static int restage_in_ring(shm_ring *ring, uint64_t slot, capacities cap) {
    shm_queue *q = &ring->queues[slot];
    if (!holds_rows(q, cap)) return SHM_E_OVERFLOW;
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
    if (!holds_rows(q, cap)) return SHM_E_OVERFLOW;
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

/* A step whose copy met a negative id: every row's counts taken back (its
 * bytes stay past the counts, where the next rows overwrite them). Returns
 * the first row holding a negative id, for the caller's message. */
static int64_t undo_step(shm_ring *ring, const int64_t *handles, uint64_t batch,
                         const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                         uint64_t row_stride, uint64_t mask_words, int has_flags) {
    int64_t first = -1;
    uint64_t id_cursor = 0;
    for (uint64_t i = 0; i < batch; i++) {
        shm_queue *q = &ring->queues[(uint64_t)handles[i] & HANDLE_SLOT_MASK];
        uint8_t f = has_flags ? flags[i] : 0;
        uint64_t n = (uint64_t)lengths[i], w = row_words(f, (int32_t)n, mask_words);
        const int32_t *row = ids + (row_stride ? i * row_stride : id_cursor);
        for (uint64_t k = 0; first < 0 && f == 0 && k < n; k++)
            if (row[k] < 0) first = (int64_t)i;
        q->rows -= 1;
        q->nnz -= n;
        q->words -= w;
        id_cursor += w;
    }
    return first;
}

/* The body of shm_append_step, compiled twice (has_flags 0 and 1) so a
 * step of OK ids rows only (flags NULL, the common case) pays nothing for
 * the row forms: with has_flags 0 every flags test folds away. */
static inline __attribute__((always_inline)) int64_t
append_rows(shm_ring *ring, const int64_t *handles, uint64_t batch, const int32_t *lengths,
            const uint8_t *flags, uint32_t vocab, const int32_t *ids, const float *logprobs,
            const float *selected, uint64_t row_stride, uint64_t ids_len, uint64_t logprobs_len,
            uint64_t selected_len, int selected_is_logprobs, uint64_t max_tokens,
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
            if ((uint64_t)n > max_tokens) return SHM_E_BAD_LENGTH;
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
    /* 3. Copy, the ids of ids rows checked as they pass (read once, not in
     * a pass of their own: the hot path's budget). A negative id undoes
     * the step: nothing else can fail here, so every row was copied and
     * counted, and every count moves back (the bytes stay past the counts,
     * unseen). */
    shm_words8 seen = {0}, unread = {0}; /* the ids' ORs; the others' (never read) */
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
        /* a bitmask row's words may have bit 31 set (id 32 w + 31) */
        copy_words(q->ids + q->words, ids + id_source, w, f == 0 ? &seen : &unread);
        if (q->mode == SHM_MODE_SUPPORT)
            copy_words(q->logprobs + q->nnz, logprobs + value_source, n, &unread);
        else
            q->logprobs[q->rows] = selected[i];
        q->rows += 1;
        q->nnz += n;
        q->words += w;
        id_cursor += w;
        if (has_flags) value_cursor += n;
    }
    if (any_negative(&seen)) {
        *bad_row = undo_step(ring, handles, batch, lengths, flags, ids, row_stride, mask_words,
                             has_flags);
        return SHM_E_BAD_LENGTHS;
    }
    if (has_flags) /* the buffer's width is set once no row can be undone */
        for (uint64_t i = 0; i < batch; i++)
            if (flags[i] == SHM_ROW_BITMASK)
                ring->queues[(uint64_t)handles[i] & HANDLE_SLOT_MASK].vocab = vocab;
    *bad_row = -1;
    return (int64_t)batch;
}

SHM_AVX2_CLONES
int64_t shm_append_step(shm_ring *ring, const int64_t *handles, uint64_t batch,
                        const int32_t *lengths, const uint8_t *flags, uint32_t vocab,
                        const int32_t *ids, const float *logprobs,
                        const float *selected, uint64_t row_stride, uint64_t ids_len,
                        uint64_t logprobs_len, uint64_t selected_len, int selected_is_logprobs,
                        uint64_t max_tokens, int64_t *bad_row) {
    if (flags)
        return append_rows(ring, handles, batch, lengths, flags, vocab, ids, logprobs, selected,
                           row_stride, ids_len, logprobs_len, selected_len,
                           selected_is_logprobs, max_tokens, bad_row, 1);
    return append_rows(ring, handles, batch, lengths, NULL, vocab, ids, logprobs, selected,
                       row_stride, ids_len, logprobs_len, selected_len, selected_is_logprobs,
                       max_tokens, bad_row, 0);
}

_Static_assert(sizeof(shm_ref_entry) == 48, "a RefBatch entry is 48 bytes");
_Static_assert(SHM_ROW_BITMASK == 1 << SHM_ROW_FORM_SHIFT, "the form bit sits above the status");
_Static_assert(offsetof(shm_ref_entry, rows) == 4 && offsetof(shm_ref_entry, position) == 8 &&
                   offsetof(shm_ref_entry, nnz) == 24 && offsetof(shm_ref_entry, words) == 32 &&
                   offsetof(shm_ref_entry, vocab) == 36 && offsetof(shm_ref_entry, seal) == 40 &&
                   sizeof(shm_ref_entry) == 48,
               "shm_ref_entry matches shmask.refs.ENTRY_DTYPE");

/* Entry i of a take's output: a ring chunk of queue q's rows at `position`. */
static void put_ring_ref(shm_ref_entry *e, uint64_t position, uint64_t record_bytes,
                         uint64_t seal, const shm_queue *q, shm_take_totals *totals) {
    totals->chunks += 1;
    totals->rows += q->rows;
    totals->payload_bytes += shm_payload_bytes(q->mode, q->rows, q->words, q->nnz);
    e->kind = SHM_REF_KIND_RING;
    e->seal = seal;
    e->position = position;
    e->record_bytes = record_bytes;
    e->rows = (uint32_t)q->rows;
    e->nnz = q->nnz;
    e->words = (uint32_t)q->words;
    e->vocab = q->vocab;
}

/* The next buffer holds the last take's rows plus a quarter. */
static void size_next_buffer(shm_queue *q) {
    q->next_rows = q->rows + q->rows / 4 + 1;
    q->next_nnz = max_u64(q->nnz + q->nnz / 4 + 1, q->direct_nnz);
    q->next_words = max_u64(q->words + q->words / 4 + 1, q->direct_words);
}

int64_t shm_take_queues(shm_ring *ring, const int64_t *handles, uint64_t count, uint64_t start,
                        uint64_t now_ns, int final, shm_ref_entry *out, shm_take_totals *totals) {
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
            put_ring_ref(e, q->lost_position, layout.record_bytes, 0, q, totals);
            drop_buffer(ring, q);
            q->lost = 0;
            continue;
        }
        /* On a truncated segment the rows may be gone: the ref still points
         * at the ring, where its reader gets StaleChunkError (never zeros). */
        if (!q->in_ring) return (int64_t)i;
        shm_layout layout;
        shm_record_layout(q->mode, q->rows_capacity, q->words_capacity, q->nnz_capacity, &layout);
        put_ring_ref(e, q->position, layout.record_bytes, seal, q, totals);
        size_next_buffer(q);
        /* The published record is the reader's now: forget it, don't discard. */
        forget_buffer(q);
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

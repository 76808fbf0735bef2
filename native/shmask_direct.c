/* GPU-direct publishing (shmask_direct.h). */
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include "shmask_direct.h"
#include "shmask_queue.h" /* shm_queue_grow */
#include "shmask_internal.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The table of shmask_direct.h's "GPU-direct publishing". Ordering (see
 * docs/architecture.md, "GPU-direct publishing"): the CPU writes the table
 * only while no kernel that could write it is in flight (`done` equals
 * `launched`, read with acquire), and reads the GPU's counts only then too.
 * Each program of the kernel stores its row, then (after a barrier) adds 1
 * to a device counter with acq_rel ordering; the program that makes it
 * reach the step's target stores the target into `done` with a release at
 * system scope. So every store of the step happens before `done` changes,
 * and a CPU acquire load that sees the new `done` sees them all. */

_Static_assert(sizeof(shm_direct_entry) == SHM_DIRECT_ENTRY_BYTES, "a direct entry is one cache line");
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
    return (uint64_t *)direct->table + index; /* SHM_DIRECT_DIVERTED_WORD or SHM_DIRECT_DONE_WORD */
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
    return __atomic_load_n(direct_counter(direct, SHM_DIRECT_DIVERTED_WORD), __ATOMIC_ACQUIRE);
}

int shm_direct_idle(const shm_direct *direct) {
    return __atomic_load_n(direct_counter(direct, SHM_DIRECT_DONE_WORD), __ATOMIC_ACQUIRE) ==
           direct->launched;
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
        q->direct_words = words;
        q->direct_nnz = mode == SHM_MODE_SUPPORT ? nnz : 0;
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
    direct->launched = __atomic_load_n(direct_counter(direct, SHM_DIRECT_DONE_WORD), __ATOMIC_ACQUIRE);
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

void shm_direct_forget_sizes(shm_ring *ring) {
    for (uint64_t slot = 0; slot < ring->n_queues; slot++)
        ring->queues[slot].direct_words = ring->queues[slot].direct_nnz = 0;
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

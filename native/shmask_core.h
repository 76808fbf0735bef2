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
#define SHM_E_WRONG_RECORD -11  /* the record's seal is not the ref's: a garbled or misrouted ref */

/* Where the arrays of a record live, relative to the record's start. */
typedef struct {
    uint64_t lengths_offset;
    uint64_t flags_offset;
    uint64_t ids_offset;
    uint64_t logprobs_offset;
    uint64_t record_bytes;
} shm_layout;

/* What a reader gets back from a validated lookup. */
typedef struct {
    uint64_t record_offset; /* from the start of the mapping */
    uint64_t lengths_offset;
    uint64_t flags_offset;
    uint64_t ids_offset;
    uint64_t logprobs_offset;
    uint32_t any_flags;   /* some row is not an OK ids row (set by shm_validate_rows) */
    uint32_t pad;
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

/* Row flags (shmask_layout.h): status in bits 0-1, form in bit 2. */
#define SHM_ROW_OK 0
#define SHM_ROW_OVERFLOW 1
#define SHM_ROW_INVALID 2
#define SHM_ROW_STATUS_MASK 3
#define SHM_ROW_BITMASK 4

/* nnz_capacity counts support-mode logprobs; a selected-mode record has
 * rows_capacity logprobs and ignores it. */
int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t words_capacity,
                      uint64_t nnz_capacity, shm_layout *out);
/* int32 words of one bitmask row of a vocabulary of `vocab` ids. */
uint64_t shm_bitmask_words(uint32_t vocab);


/* Reader side: every argument is untrusted and bounds-checked. */
/* Validates the segment header (magic, version, a power-of-two capacity
 * that fits segment_bytes) and copies it out; reads the header page only. */
int shm_read_info(const void *base, uint64_t segment_bytes, shm_info *out);
/* Validates the ref against the record (its seal included: a ref opens only
 * the record it was issued for, else SHM_E_WRONG_RECORD), copies the rows'
 * geometry into the caller's private `geometry` (5 * rows bytes: lengths
 * int32[rows], then flags uint8[rows]) and validates the rows from those
 * copies (shm_validate_rows: SHM_E_BAD_LENGTHS), so the row boundaries a
 * reader uses are the ones checked, whatever is written into the record
 * later; then checks the record again (shm_check_record: SHM_E_STALE if it
 * was reclaimed meanwhile). Fills out, any_flags included. */
int shm_open_record(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                    uint64_t position, uint64_t seal, uint64_t record_bytes, uint64_t rows,
                    uint64_t words, uint64_t nnz, uint32_t vocab, uint32_t mode,
                    uint64_t max_row_length, uint8_t *geometry, shm_view *out);
/* SHM_OK when the record at `position` carries this seal and holds `rows`
 * rows: asked before a reader sizes a large geometry copy by a ref's rows,
 * so a forged ref cannot make it allocate more than a real record needs. */
int shm_record_has_rows(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                        uint64_t position, uint64_t seal, uint64_t rows);
/* SHM_OK while the record at `position` is still the published one with this
 * seal (WRITTEN or RELEASED), else SHM_E_STALE. */
int shm_check_record(const void *base, uint64_t capacity, uint64_t position, uint64_t seal);
int shm_release(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position,
                uint64_t seal);
/* Checks rows read from a ref or shared memory: flags valid, non-OK rows
 * empty, ids rows at most max_row_length long, bitmask rows with exactly L
 * bits set and none at ids >= vocab, lengths summing to nnz and id data to
 * words. flags may be NULL (every row an OK ids row). *any_flags is set
 * when some row is not an OK ids row. */
int shm_validate_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                      uint64_t rows, uint64_t words, uint64_t nnz, uint32_t vocab,
                      uint64_t max_row_length, uint32_t *any_flags);

/* One RowQueue's staging buffer: where its arrays are and how full. The
 * buffer is a STAGING record in the ring (in_ring) or memory this core
 * malloc'd (the ring had no room). Only shmask_core.c writes these. */
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
    uint64_t pad[2];
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

/* A queue handle: slot (bits 0-15), generation (16-47: the slot's whole
 * uint32 generation), ring tag (48-62). A slot whose generation would wrap
 * is retired (never reopened), so a stale handle never matches another
 * queue. 2^16 slots and 2^32 generations: 2^48 opens in a Writer's life
 * (about 13 years of back-to-back open+close from Python); after that, or
 * with 2^16 queues open at once, shm_queue_open returns SHM_E_NO_SLOT. */
#define SHM_HANDLE_SLOT_BITS 16
#define SHM_E_NO_SLOT -40 /* every queue slot is open or retired */

int shm_ring_init(shm_ring *ring, void *base, uint64_t mapped_bytes, uint64_t capacity,
                  uint64_t epoch, uint64_t pid, uint64_t start, uint64_t created_ns,
                  uint64_t handle_tag, uint64_t seal_seed);
void shm_ring_free(shm_ring *ring);
/* The segment was cut: stage privately from now on; zeroes its magic. */
void shm_ring_mark_dead(shm_ring *ring);

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
                        uint64_t max_row_length, int64_t *bad_row);

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
    uint8_t kind;          /* 0 empty, 1 ring, 2 inline */
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

/* One emission: validates every handle, then publishes the ring buffers of
 * handles[start..count) in place and writes each chunk's entry (kind 0
 * empty or 1 ring, mode, position, record size, rows, nnz, words, vocab;
 * segment 0); then gives each queue
 * a fresh ring buffer sized for the next emission (or drops it when
 * `final`). Returns count, or i when queue i stages in private memory (the
 * caller packs it with shm_queue_pack_private and calls again from i + 1),
 * or a negative error. */
int64_t shm_take_queues(shm_ring *ring, const int64_t *handles, uint64_t count, uint64_t start,
                        uint64_t now_ns, int final, shm_ref_entry *out);
/* Bytes of an inline payload: lengths | flags (padded to 4) | ids | logprobs. */
uint64_t shm_payload_bytes(uint32_t mode, uint64_t rows, uint64_t words, uint64_t nnz);
/* Copies a privately staged queue's rows (the inline payload above) into
 * out (exactly its payload size) and empties the queue. */
int shm_queue_pack_private(shm_ring *ring, uint64_t slot, char *out, uint64_t out_len);

/* Guarded mappings. A segment file truncated by another process would kill
 * any process touching its pages with SIGBUS; mappings made here are
 * registered with a SIGBUS handler that replaces the whole mapping with
 * zero pages instead and marks it truncated, so every later check of the
 * ring fails cleanly (StaleChunkError) and the faulting load or store just
 * completes on the zero pages. A handler installed later (faulthandler)
 * sees the fault first; the guard still holds when it re-raises, and
 * shm_guard_front puts the guard back in front (a sigaction call). */
void *shm_map(int fd, uint64_t bytes, int populate, int *errno_out);
void shm_unmap(void *address);
void shm_guard_front(void);
/* 1 when the segment mapped at `address` was cut: a SIGBUS marked it, or its
 * header's magic reads zero (cut and grown back, or declared lost by its
 * producer). */
int shm_mapping_truncated(const void *address);

/* Releases many records of one segment (a tokenizer dropping an aborted
 * request's chunks without opening them): results[i] is shm_release's code. */
void shm_release_many(void *base, uint64_t mapped_bytes, uint64_t capacity,
                      const uint64_t *positions, const uint64_t *seals, uint64_t count,
                      int32_t *results);

/* Every row's support as ascending ids, back to back (out: sum of
 * lengths): ids rows copied, bitmask rows decoded. Rows come from shared
 * memory, so every bound is checked: returns the ids written, or -1 when
 * the rows disagree with their lengths, flags, words or vocab. */
int64_t shm_decode_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                        uint64_t rows, uint64_t words, uint32_t vocab, int32_t *out,
                        uint64_t out_len);

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
#define SHM_E_MIXED_NEEDS_SELECTED -24
#define SHM_E_NO_MEMORY -25
#define SHM_E_TRUNCATED -26
#define SHM_E_BAD_FLAGS -27   /* a row's status/form flags are not a valid combination */
#define SHM_E_VOCAB -28       /* a bitmask row without a vocabulary, or a queue's changed */
#define SHM_E_BAD_BITMASK -29 /* a bitmask row's set bits disagree with its length or vocab */

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

/* ------------------------------------------------------------------
 * GPU-direct publishing (issue 10, kernels/direct.py). A device-visible
 * queue table lets a GPU kernel store each step's rows straight into the
 * queue buffers in the (CUDA-registered) ring. The table is C memory,
 * page-aligned so that it can be registered too:
 *
 *   byte 0               u64 diverted   rows the GPU refused, ever (GPU atomic add)
 *   byte 8               u64 done       programs of the steps that completed: the
 *                                       last program of a launch stores its
 *                                       target here (release, system scope)
 *   byte 64              shm_direct_step_desc: the launched step's rows
 *   byte 256 + 64 * slot shm_direct_entry of queue slot `slot`
 *   byte slots_offset    int32 per row of the step: its queue slot
 *
 * Only this core writes the table on the CPU side (the step's descriptor,
 * slots and entries); the GPU kernel writes an entry's rows/words/nnz/vocab
 * when it stores a row, or its `diverted` flag (and bumps the counter) when
 * the row does not fit, and `done` when its last program finished; pull
 * copies the GPU's counts back into the shm_queue. Counts are 32 bits: a
 * capacity past 2^31 - 1 is published clamped (the GPU diverts beyond it
 * and the CPU path takes over). Capacities of 0 (no buffer, a privately
 * staged queue, a lost ring, a closed slot) divert every row. */
typedef struct {
    uint64_t lengths;      /* device addresses of the queue buffer's arrays */
    uint64_t flags;
    uint64_t ids;
    uint64_t logprobs;
    uint32_t rows;         /* counts: written by the GPU as it stores rows */
    uint32_t rows_capacity;
    uint32_t words;
    uint32_t words_capacity;
    uint32_t nnz;
    uint32_t nnz_capacity; /* support logprobs; 0 in selected mode (unused) */
    uint32_t vocab;        /* of the bitmask rows in the buffer (0: none yet) */
    uint32_t diverted;     /* sticky: a row did not fit; later rows divert too */
} shm_direct_entry;

/* One launched step, read by every program of its kernel: the device
 * addresses of the Rows tensors (kernels/_common.py: int32 status, forms,
 * lengths, id_offsets, offsets, ids; float32 values, selected), the value
 * `done` takes when the step completed, and where the row -> slot array is. */
typedef struct {
    uint64_t status, forms, lengths, id_offsets, offsets, ids, values, selected;
    uint64_t target;       /* programs launched, this step's included */
    uint64_t slots;        /* device address of the int32 row -> slot array */
    uint32_t vocab;
    uint32_t batch;
    uint8_t reserved[40];
} shm_direct_step_desc;

/* The producer's private side of a direct table (never seen by the GPU). */
typedef struct {
    void *table;           /* the device-visible table: page-aligned C memory */
    uint64_t table_bytes;  /* a multiple of the page size */
    uint64_t slots;        /* entries in the table: queues at slot >= slots go the CPU path */
    int64_t ring_offset;   /* device address - host address of the ring mapping */
    int64_t table_offset;  /* the same for the table (set once it is registered) */
    uint64_t *seen_serial; /* per slot: the last step that saw it (one row per queue per step) */
    uint64_t serial;
    uint64_t launched;     /* programs launched: `done` equals it when nothing is in flight */
    uint64_t diverted_seen;/* the diverted counter when the CPU last appended diverted rows */
    uint64_t last_batch;   /* rows of the last step (their slots are in the table) */
    uint64_t row_words;    /* id words per row stored in the last step that stored any */
    uint64_t row_nnz;      /* values per row, the same */
    uint64_t grown;        /* queues given room (a new buffer or a larger one), ever */
} shm_direct;

#define SHM_DIRECT_HEADER_BYTES 256
#define SHM_DIRECT_DESC_OFFSET 64
#define SHM_DIRECT_IN_FLIGHT 2  /* shm_direct_step: the last step's kernel has not completed */
#define SHM_DIRECT_DIVERTED 3   /* shm_direct_step: the last step diverted rows (CPU appends first) */
#define SHM_E_DIRECT_SLOT -30   /* a queue slot past the direct table: the step takes the CPU path */
#define SHM_E_DIRECT_REPEAT -31 /* a queue has two rows in one step: the step takes the CPU path */
#define SHM_E_DIRECT_COUNTS -32 /* the table's counts went backwards or past a capacity */
#define SHM_E_DIRECT_LAUNCH -33 /* no CUDA driver in this process, or a bad parameter count */

/* Allocates a table of `slots` entries (zeroed: every row diverts). */
int shm_direct_init(shm_direct *direct, uint64_t slots, int64_t ring_offset);
void shm_direct_free(shm_direct *direct);
/* Rows the GPU diverted since the table was made (an acquire load). */
uint64_t shm_direct_diverted(const shm_direct *direct);
/* 1 when every launched program has completed (an acquire load of `done`:
 * the kernels' stores are visible to this thread after it returns 1). */
int shm_direct_idle(const shm_direct *direct);
/* Spins, then sleeps, until idle or `timeout_ns` passed: 1 idle, 0 not. */
int shm_direct_wait(const shm_direct *direct, uint64_t timeout_ns);
/* Everything the CPU does for one step before the launch, while no kernel
 * is in flight (else SHM_DIRECT_IN_FLIGHT) and no diverted rows wait (else
 * SHM_DIRECT_DIVERTED): pulls the last step's counts, checks every handle
 * (open, this ring, mode `mode`, inside the table, at most once), gives
 * each queue room for one more row of `words` id words and `nnz` values
 * (growing it in the ring; where that fails the row diverts), pushes its
 * entry, writes the row -> slot array and the descriptor (`addresses`: the
 * 8 Rows addresses in shm_direct_step_desc's order). Returns 0 (launch
 * `batch` programs), a positive code above, or a negative error with
 * *bad_row set (nothing changed: the step takes the CPU path). */
int shm_direct_step(shm_ring *ring, shm_direct *direct, const int64_t *handles,
                    uint64_t batch, uint32_t mode, uint64_t words, uint64_t nnz,
                    const uint64_t *addresses, uint32_t vocab, int64_t *bad_row);
/* Launches the store kernel (a CUfunction of `n_params` 8-byte parameters:
 * table, arrivals, then NULLs) on `stream` with cuLaunchKernel: `grid`
 * programs of `threads` threads. Returns 0, SHM_E_DIRECT_LAUNCH, or
 * -1000 - the CUDA error. */
int shm_direct_launch(uint64_t function, uint32_t grid, uint32_t threads, uint32_t shared_bytes,
                      uint64_t stream, uint64_t table, uint64_t arrivals, uint32_t n_params);
/* The launch after a 0 from shm_direct_step failed: nothing is in flight. */
void shm_direct_cancel(shm_direct *direct);
/* The diverted rows were appended by the CPU: steps may launch again. */
void shm_direct_diverted_done(shm_direct *direct);
/* Writes every slot's entry from the queue table (addresses, counts,
 * capacities, vocab; diverted cleared) and makes each queue's flags
 * explicit for its rows so far (the GPU writes a flags byte per row). */
void shm_direct_push_all(shm_ring *ring, shm_direct *direct);
/* Copies the GPU's counts of every entry that still describes its queue's
 * buffer back into the queue table. Call only while idle. */
int shm_direct_pull_all(shm_ring *ring, shm_direct *direct, uint64_t *bad_slot);
/* Marks out[i] = 1 for each row i of a step whose queue's entry is diverted. */
void shm_direct_diverted_rows(const shm_ring *ring, const shm_direct *direct,
                              const int64_t *handles, uint64_t batch, uint8_t *out);
/* Gives the queue of `slot` room for `rows` more rows of `words` id words
 * and `nnz` support entries, growing it in the ring (SHM_FULL: no room now;
 * the next rows divert again). A privately staged queue is left alone. */
int shm_direct_reserve(shm_ring *ring, uint64_t slot, uint64_t rows, uint64_t words,
                       uint64_t nnz);

#endif

/*
 * shmask shared-memory layout. This file owns every offset; nothing else
 * (no Python, no other C file) computes one.
 *
 * One segment per producer (a scheduler rank), a POSIX shm object:
 *
 *   0                 4096                                   4096 + capacity
 *   +-----------------+------------------------------------------+
 *   | segment header  | data region: records, 128-byte aligned    |
 *   +-----------------+------------------------------------------+
 *
 * Segment header (one page; positions on their own cache lines so the
 * producer's stores do not bounce the readers' lines):
 *
 *   byte 0    u64 magic            "SHMASK01"
 *   byte 8    u32 layout_version   SHM_LAYOUT_VERSION
 *   byte 12   u32 header_bytes     4096
 *   byte 16   u64 capacity         data bytes, a power of two
 *   byte 24   u64 epoch            random, fixed at creation; refs carry it
 *   byte 32   u64 producer_pid
 *   byte 40   u64 producer_start   /proc/<pid>/stat start time (clock ticks)
 *   byte 48   u64 created_ns       CLOCK_REALTIME at creation
 *   byte 64   u64 head   (atomic)  next byte position the producer writes
 *   byte 128  u64 tail   (atomic)  oldest position not yet reclaimed
 *   byte 192  u64 counters[8] (atomic, producer-written, for `shmask ls`)
 *
 * Positions are monotonic u64 byte counts; a record lives at
 * data + (pos & (capacity - 1)). A record never wraps: when it does not
 * fit before the end, the producer writes a PADDING record over the rest
 * and starts again at offset 0.
 *
 * Record (record_bytes long, a multiple of SHM_RECORD_ALIGN = 128):
 *
 *   byte 0    u64 tag              the record's position; readers compare it
 *   byte 8    u32 state (atomic)   STAGING -> WRITTEN -> RELEASED | EXPIRED
 *   byte 12   u32 mode             SHM_MODE_SELECTED | SHM_MODE_SUPPORT
 *   byte 16   u64 record_bytes
 *   byte 24   u32 rows             valid once WRITTEN
 *   byte 28   u32 rows_capacity
 *   byte 32   u64 nnz              valid once WRITTEN (sum of lengths)
 *   byte 40   u64 nnz_capacity
 *   byte 48   u64 published_ns     CLOCK_MONOTONIC of the producer (leases)
 *   byte 56   u64 owner            the owning queue's handle + 1 (0: none); kept
 *                                  after publish so an aborted queue's chunks
 *                                  can be given back (the producer checks it
 *                                  against its own table before acting on it)
 *   byte 64   u64 words            valid once WRITTEN (int32 words of ids)
 *   byte 72   u64 words_capacity
 *   byte 80   u32 vocab            V of the bitmask rows (0: none yet)
 *   byte 84   u32 pad
 *   byte 88   u64 seal             valid once WRITTEN: drawn by the producer at
 *                                  publish, unique within the ring, never 0; the
 *                                  ref carries it and open, check and release
 *                                  compare it, so a ref opens only the record it
 *                                  was issued for
 *   byte 96   zeros up to byte 128
 *   byte 128  int32 lengths[rows_capacity]            padded to 64
 *             u8    flags[rows_capacity]              padded to 64
 *             int32 ids[words_capacity]               padded to 64
 *             float logprobs[nnz_capacity | rows_capacity]
 *
 * Rows (layout version 2). lengths[i] is row i's support size L; flags[i]
 * holds its status (bits 0-1: SHM_ROW_OK, SHM_ROW_OVERFLOW, SHM_ROW_INVALID)
 * and its form (bit 2, SHM_ROW_BITMASK). ids holds the rows' id data back to
 * back: an OK row in ids form gives its L ascending ids, an OK bitmask row
 * exactly ceil(vocab / 32) words (bit j of word w: id 32 w + j is kept;
 * bits at ids >= vocab are zero), a non-OK row nothing (and L = 0). nnz is
 * the sum of L: in support mode logprobs holds L values per row, in
 * ascending id order for both forms; in selected mode one per row. words is
 * the sum of the id data; a chunk whose rows are all OK ids rows has
 * words == nnz, the layout version 1 case.
 *
 * The arrays are placed by capacity, not by count, so a record can be
 * filled in place while it is STAGING (a RowQueue's buffer) and published
 * without moving a byte: publish writes rows and nnz, then release-stores
 * WRITTEN. Readers derive the array offsets from the capacities with
 * shm_record_layout(); no offset is ever read from shared memory.
 */
#ifndef SHMASK_LAYOUT_H
#define SHMASK_LAYOUT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define SHM_MAGIC 0x31304b53414d4853ULL /* "SHMASK01" little-endian */
#define SHM_LAYOUT_VERSION 3u /* 2: row flags, bitmask rows, 128-byte record header; 3: seal */
#define SHM_HEADER_BYTES 4096u
/* Records are multiples of the header size, so even the smallest padding
 * record at the end of the ring holds a whole header. */
#define SHM_RECORD_ALIGN 128u
#define SHM_RECORD_HEADER_BYTES 128u
#define SHM_MIN_CAPACITY 4096u
#define SHM_N_COUNTERS 8

enum shm_state {
    SHM_STATE_FREE = 0,
    SHM_STATE_STAGING = 1,   /* producer is filling it (a RowQueue buffer) */
    SHM_STATE_WRITTEN = 2,   /* published; one reader may release it */
    SHM_STATE_RELEASED = 3,  /* reader is done; reclaimable */
    SHM_STATE_PADDING = 4,   /* filler up to the end of the data region */
    SHM_STATE_EXPIRED = 5,   /* lease ran out before release; reclaimable */
    SHM_STATE_DISCARDED = 6, /* staging buffer abandoned (grown or moved) */
    SHM_STATE_CORRUPT = 255, /* reclaim result only: a header failed its checks */
};

enum shm_mode { SHM_MODE_SELECTED = 1, SHM_MODE_SUPPORT = 2 };

enum shm_counter {
    SHM_COUNTER_PUBLISHED = 0,
    SHM_COUNTER_RELEASED = 1,
    SHM_COUNTER_EXPIRED = 2,
    SHM_COUNTER_PADDING = 3,
    SHM_COUNTER_DISCARDED = 4,
};

struct shm_segment_header {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t header_bytes;
    uint64_t capacity;
    uint64_t epoch;
    uint64_t producer_pid;
    uint64_t producer_start;
    uint64_t created_ns;
    uint64_t pad0;
    _Atomic uint64_t head; /* byte 64 */
    uint64_t pad1[7];
    _Atomic uint64_t tail; /* byte 128 */
    uint64_t pad2[7];
    _Atomic uint64_t counters[SHM_N_COUNTERS]; /* byte 192 */
};

struct shm_record_header {
    uint64_t tag;
    _Atomic uint32_t state;
    uint32_t mode;
    uint64_t record_bytes;
    uint32_t rows;
    uint32_t rows_capacity;
    uint64_t nnz;
    uint64_t nnz_capacity;
    uint64_t published_ns;
    uint64_t owner;
    uint64_t words;
    uint64_t words_capacity;
    uint32_t vocab;
    uint32_t pad;
    uint64_t seal;
    uint64_t reserved[4];
};

_Static_assert(offsetof(struct shm_segment_header, magic) == 0, "magic at byte 0");
_Static_assert(offsetof(struct shm_segment_header, head) == 64, "head at byte 64");
_Static_assert(offsetof(struct shm_segment_header, tail) == 128, "tail at byte 128");
_Static_assert(offsetof(struct shm_segment_header, counters) == 192, "counters at 192");
_Static_assert(sizeof(struct shm_segment_header) <= SHM_HEADER_BYTES, "header fits a page");
_Static_assert(sizeof(struct shm_record_header) == SHM_RECORD_HEADER_BYTES, "record header");
_Static_assert(offsetof(struct shm_segment_header, layout_version) == 8, "version at 8");
_Static_assert(offsetof(struct shm_segment_header, header_bytes) == 12, "header_bytes at 12");
_Static_assert(offsetof(struct shm_segment_header, capacity) == 16, "capacity at 16");
_Static_assert(offsetof(struct shm_segment_header, epoch) == 24, "epoch at 24");
_Static_assert(offsetof(struct shm_segment_header, producer_pid) == 32, "pid at 32");
_Static_assert(offsetof(struct shm_segment_header, producer_start) == 40, "start at 40");
_Static_assert(offsetof(struct shm_segment_header, created_ns) == 48, "created_ns at 48");
_Static_assert(offsetof(struct shm_segment_header, pad0) == 56, "pad0 at 56");
_Static_assert(offsetof(struct shm_segment_header, pad1) == 72, "pad1 at 72");
_Static_assert(offsetof(struct shm_segment_header, pad2) == 136, "pad2 at 136");
_Static_assert(sizeof(((struct shm_segment_header *)0)->counters) == 8 * SHM_N_COUNTERS,
               "counters: 8 u64 at 192..255");
_Static_assert(sizeof(struct shm_segment_header) == 256, "segment header fields end at 256");
_Static_assert(offsetof(struct shm_record_header, tag) == 0, "tag at byte 0");
_Static_assert(offsetof(struct shm_record_header, state) == 8, "state at byte 8");
_Static_assert(offsetof(struct shm_record_header, mode) == 12, "mode at byte 12");
_Static_assert(offsetof(struct shm_record_header, record_bytes) == 16, "record_bytes at 16");
_Static_assert(offsetof(struct shm_record_header, rows) == 24, "rows at 24");
_Static_assert(offsetof(struct shm_record_header, rows_capacity) == 28, "rows_capacity at 28");
_Static_assert(offsetof(struct shm_record_header, nnz) == 32, "nnz at 32");
_Static_assert(offsetof(struct shm_record_header, nnz_capacity) == 40, "nnz_capacity at 40");
_Static_assert(offsetof(struct shm_record_header, published_ns) == 48, "published_ns at 48");
_Static_assert(offsetof(struct shm_record_header, owner) == 56, "owner at 56");
_Static_assert(offsetof(struct shm_record_header, words) == 64, "words at 64");
_Static_assert(offsetof(struct shm_record_header, words_capacity) == 72, "words_capacity at 72");
_Static_assert(offsetof(struct shm_record_header, vocab) == 80, "vocab at 80");
_Static_assert(offsetof(struct shm_record_header, pad) == 84, "pad at 84");
_Static_assert(offsetof(struct shm_record_header, seal) == 88, "seal at 88");
_Static_assert(offsetof(struct shm_record_header, reserved) == 96, "reserved: zeros at 96..127");

#endif

/*
 * Binary rows: see binary_rows.h.
 *
 * Base64 (RFC 4648, standard alphabet, padded). Encoding takes 3 bytes to
 * 4 characters of 6 bits each. The scalar path looks each 6-bit value up in
 * the alphabet; on x86-64 with AVX2 (checked at run time) 24 bytes at a
 * time are spread to 32 lanes of 6 bits with one byte shuffle, two 16-bit
 * multiplies and masks, and mapped to characters by adding a per-range
 * offset chosen by a second shuffle (the well-known vector formulation).
 * Decoding, scalar: four tables of the character's 6 bits already shifted
 * into place, OR-ed, with one marker bit that any non-alphabet character
 * sets, so a block of characters is checked with one test; only a block
 * that fails is read again to find the first bad character. With AVX2, 32
 * characters at a time (decode_avx2), the scalar code taking the tail and
 * any block with a bad character.
 *
 * Splitting: a job (one or more arrays) is cut into `tasks` ranges of about
 * equal size, each a whole number of 3-byte groups (encoding) or 4-character
 * quartets (decoding) of each array, so every task writes its own bytes of
 * the destination and no two tasks touch the same byte: writing the
 * destination in parallel also spreads its first-touch page faults.
 */
#include "binary_rows.h"

#include <stdatomic.h>

#include "shmask_cpu_internal.h"
#include "shmask_pool.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define B64_X86 1
#endif

#define COUNT_LIMIT ((uint64_t)1 << 56)
/* Base64 characters a task is worth waking a worker for (a wake-up costs
 * several microseconds; 32 KiB takes about that to encode). */
#define CHARS_PER_TASK (32u << 10)

static const char alphabet[64] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

uint64_t shm_b64_encoded_size(uint64_t n) { return (n + 2) / 3 * 4; }

#ifdef B64_X86
/* Whether a byte at offset 3 modulo 4 of p[0 : 32 * blocks] has its top
 * bit set (the sign of a little-endian int32 starting at p): the OR of the
 * blocks, then the top bits of bytes 3, 7, ..., 31. Half the decoder's
 * time when it was a loop over words. */
__attribute__((target("avx2"))) static int any_high_top_byte_avx2(const uint8_t *p,
                                                                   uint64_t blocks) {
    __m256i any = _mm256_setzero_si256();
#pragma GCC unroll 8 /* one OR per block, not four instructions: the encoder checks every id */
    for (uint64_t i = 0; i < blocks; i++)
        any = _mm256_or_si256(any, _mm256_loadu_si256((const __m256i *)(p + 32 * i)));
    return (_mm256_movemask_epi8(any) & (int)0x88888888u) != 0;
}
#endif

/* Whether a little-endian int32 array (starting at `array`) holds a
 * negative value among its bytes [first, last): the top bit of a byte at
 * offset 3 modulo 4. A task's bytes need not start or end on a word: a
 * word it shares with the task before is judged by its top byte alone. The
 * decoder reports it (the client refuses negative ids and lengths), the
 * encoder refuses ids it would otherwise send. */
static int any_negative_int32(const uint8_t *array, uint64_t first, uint64_t last) {
    uint64_t b = first + (3 - first % 4) % 4; /* the first such byte */
    uint32_t high = 0;
    if (b < last && b < first + 3) { /* its word starts in another task's bytes */
        high = (uint32_t)array[b] << 24;
        b += 4;
    }
    b -= 3; /* a word's first byte: whole words from here, then the last top byte */
#ifdef B64_X86
    if (b < last && last - b >= 64 && shm_avx2()) {
        uint64_t blocks = (last - b) / 32;
        if (any_high_top_byte_avx2(array + b, blocks)) high |= 0x80000000u;
        b += 32 * blocks;
    }
#endif
    uint64_t pairs = 0; /* two words at a time: compilers do not vectorize the loop at -O2 */
    for (; b + 8 <= last; b += 8) {
        uint64_t two;
        memcpy(&two, array + b, 8);
        pairs |= two;
    }
    high |= (uint32_t)pairs | (uint32_t)(pairs >> 32);
    for (; b + 4 <= last; b += 4) {
        uint32_t word;
        memcpy(&word, array + b, 4);
        high |= word;
    }
    if (b + 3 < last) high |= (uint32_t)array[b + 3] << 24;
    return (high & 0x80000000u) != 0;
}

/* ------------------------------------------------------------ encoding */

/* Base64 of the whole 3-byte groups of src[0:n], then of the 1 or 2 bytes
 * left, padded. */
static void encode_scalar(const uint8_t *src, uint64_t n, char *dst) {
    uint64_t i = 0;
    for (; i + 3 <= n; i += 3, dst += 4) {
        uint32_t v = (uint32_t)src[i] << 16 | (uint32_t)src[i + 1] << 8 | src[i + 2];
        dst[0] = alphabet[v >> 18];
        dst[1] = alphabet[v >> 12 & 63];
        dst[2] = alphabet[v >> 6 & 63];
        dst[3] = alphabet[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)src[i] << 16;
        dst[0] = alphabet[v >> 18];
        dst[1] = alphabet[v >> 12 & 63];
        dst[2] = dst[3] = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)src[i] << 16 | (uint32_t)src[i + 1] << 8;
        dst[0] = alphabet[v >> 18];
        dst[1] = alphabet[v >> 12 & 63];
        dst[2] = alphabet[v >> 6 & 63];
        dst[3] = '=';
    }
}

#ifdef B64_X86
/* Encodes 24-byte blocks while 28 bytes remain (each lane loads 16 bytes
 * for its 12) and returns the bytes done (a multiple of 3). */
__attribute__((target("avx2"))) static uint64_t encode_avx2(const uint8_t *src, uint64_t n,
                                                             char *dst) {
    /* Each 32-bit lane gets bytes b1 b0 b2 b1 of its group b0 b1 b2: the
     * low 16 bits then hold b0b1 (sextets a, b at bits 10 and 4), the high
     * 16 bits b1b2 (sextets c, d at bits 6 and 0). */
    const __m256i spread = _mm256_setr_epi8(1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10,
                                            1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10);
    const __m256i mask_ac = _mm256_set1_epi32(0x0fc0fc00), mul_ac = _mm256_set1_epi32(0x04000040);
    const __m256i mask_bd = _mm256_set1_epi32(0x003f03f0), mul_bd = _mm256_set1_epi32(0x01000010);
    /* Character = sextet + offset of its range: A-Z (0-25), a-z (26-51),
     * 0-9 (52-61), '+' (62), '/' (63); the range's index is the sextet
     * minus 51 (saturated), or 13 below 26. */
    const __m256i offsets = _mm256_setr_epi8(
        'a' - 26, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52,
        '0' - 52, '0' - 52, '+' - 62, '/' - 63, 'A', 0, 0, 'a' - 26, '0' - 52, '0' - 52, '0' - 52,
        '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '0' - 52, '+' - 62, '/' - 63,
        'A', 0, 0);
    const __m256i s51 = _mm256_set1_epi8(51), s26 = _mm256_set1_epi8(26), s13 = _mm256_set1_epi8(13);
    uint64_t i = 0;
    for (; i + 28 <= n; i += 24, dst += 32) {
        __m128i low = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i high = _mm_loadu_si128((const __m128i *)(src + i + 12));
        __m256i in = _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
        in = _mm256_shuffle_epi8(in, spread);
        __m256i ac = _mm256_mulhi_epu16(_mm256_and_si256(in, mask_ac), mul_ac);
        __m256i bd = _mm256_mullo_epi16(_mm256_and_si256(in, mask_bd), mul_bd);
        __m256i sextets = _mm256_or_si256(ac, bd);
        __m256i range = _mm256_subs_epu8(sextets, s51);
        range = _mm256_or_si256(range, _mm256_and_si256(_mm256_cmpgt_epi8(s26, sextets), s13));
        __m256i chars = _mm256_add_epi8(sextets, _mm256_shuffle_epi8(offsets, range));
        _mm256_storeu_si256((__m256i *)dst, chars);
    }
    return i;
}
#endif

#ifdef B64_X86
/* Encodes 48-byte blocks (64 characters) with AVX-512 VBMI and returns the
 * bytes done (a multiple of 48): one byte permute puts each group's bytes
 * b0 b1 b2 in its 32-bit lane as b1 b0 b2 b1 (as above), one multishift
 * takes the four sextets out of those lanes (a at bit 10, b at 4, c at 22,
 * d at 16) into bytes, and one byte permute of the 64-character alphabet
 * (which reads only each index's low 6 bits) maps them to characters. The
 * load is masked to the 48 bytes used: nothing past the source is read. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static uint64_t encode_avx512(
    const uint8_t *src, uint64_t n, char *dst) {
    static const char alphabet64[64] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    /* Lane l (of 16) takes bytes 3l+1, 3l, 3l+2, 3l+1. */
    static const uint8_t spread_bytes[64] = {
        1,  0,  2,  1,  4,  3,  5,  4,  7,  6,  8,  7,  10, 9,  11, 10,
        13, 12, 14, 13, 16, 15, 17, 16, 19, 18, 20, 19, 22, 21, 23, 22,
        25, 24, 26, 25, 28, 27, 29, 28, 31, 30, 32, 31, 34, 33, 35, 34,
        37, 36, 38, 37, 40, 39, 41, 40, 43, 42, 44, 43, 46, 45, 47, 46};
    const __m512i spread = _mm512_loadu_si512(spread_bytes);
    const __m512i sextets_at = _mm512_set1_epi64(0x3036242a1016040aLL); /* 10 4 22 16, +32 each */
    const __m512i lookup = _mm512_loadu_si512(alphabet64);
    const __mmask64 used = 0xffffffffffffULL; /* 48 bytes */
    uint64_t i = 0;
    for (; i + 48 <= n; i += 48, dst += 64) {
        __m512i in = _mm512_maskz_loadu_epi8(used, src + i);
        __m512i lanes = _mm512_permutexvar_epi8(spread, in);
        __m512i sextets = _mm512_multishift_epi64_epi8(sextets_at, lanes);
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi8(sextets, lookup));
    }
    return i;
}
#endif

static void encode_block(const uint8_t *src, uint64_t n, char *dst) {
#ifdef B64_X86
    if (n >= 48 && shm_avx512_vbmi()) {
        uint64_t done = encode_avx512(src, n, dst);
        src += done;
        dst += done / 3 * 4;
        n -= done;
    }
    if (n >= 28 && shm_avx2()) {
        uint64_t done = encode_avx2(src, n, dst);
        src += done;
        dst += done / 3 * 4;
        n -= done;
    }
#endif
    encode_scalar(src, n, dst);
}

/* Up to four arrays, encoded in `tasks` parts of about equal size. */
typedef struct {
    const uint8_t *src[4];
    uint64_t size[4];
    char *dst[4];
    int arrays;
    uint64_t total, tasks;
    int ids;          /* the array of ids (int32 LE), checked as it is encoded; -1: none */
    atomic_int negative; /* set by a task that met a negative id */
} encode_job;

/* A cut at byte `at` of an array of `size` bytes, moved up to a whole
 * 3-byte group: every task computes the same cuts, so their parts meet. */
static uint64_t group_cut(uint64_t at, uint64_t size) {
    uint64_t cut = (at + 2) / 3 * 3;
    return cut < size ? cut : size;
}

static void encode_task(void *context, uint64_t task) {
    encode_job *job = context;
    uint64_t begin = job->total * task / job->tasks, end = job->total * (task + 1) / job->tasks;
    uint64_t base = 0; /* where array a starts in the job's bytes */
    for (int a = 0; a < job->arrays; base += job->size[a], a++) {
        if (end <= base || begin >= base + job->size[a]) continue;
        uint64_t from = begin > base ? group_cut(begin - base, job->size[a]) : 0;
        uint64_t to = group_cut(end - base, job->size[a]);
        if (to <= from) continue;
        char *dst = job->dst[a] + from / 3 * 4;
        shm_pool_prefault(dst, dst + (to - from + 2) / 3 * 4); /* only while few tasks run */
        /* Ids are non-negative int32 wherever rows enter; arrays handed to
         * the encoder directly are held to it too (checked just before
         * they are encoded: the bytes are then in cache). */
        if (a == job->ids && any_negative_int32(job->src[a], from, to))
            atomic_store_explicit(&job->negative, 1, memory_order_relaxed);
        encode_block(job->src[a] + from, to - from, dst);
    }
}

static void run_encode(encode_job *job, int threads) {
    uint64_t chars = job->total / 3 * 4;
    uint64_t tasks = shm_pool_tasks(threads, chars, CHARS_PER_TASK);
    job->tasks = tasks;
    shm_pool_run(encode_task, job, tasks);
}

void shm_b64_encode(const uint8_t *src, uint64_t n, char *dst, int threads) {
    encode_job job = {{src}, {n}, {dst}, 1, n, 1, -1, 0};
    run_encode(&job, threads);
}

/* ------------------------------------------------- the object, meta_info */

/* Writes (when out is not NULL) and counts: the document is laid out once
 * to size it and once to write it, by the same code. */
typedef struct {
    char *out;
    uint64_t at;
} cursor;

static void put(cursor *c, const char *text) {
    uint64_t length = strlen(text);
    if (c->out) memcpy(c->out + c->at, text, length);
    c->at += length;
}

static void put_uint(cursor *c, uint64_t value) {
    char digits[24];
    int count = 0;
    do {
        digits[count++] = (char)('0' + value % 10);
        value /= 10;
    } while (value);
    for (int k = 0; k < count; k++)
        if (c->out) c->out[c->at + k] = digits[count - 1 - k];
    c->at += (uint64_t)count;
}

/* Lays the document out; the base64 fields become job arrays (their
 * characters are left for the job). */
static void layout(cursor *c, encode_job *job, int meta_info, int support, uint64_t start,
                   uint64_t rows, uint64_t nnz, uint64_t length, const uint8_t *lengths,
                   const uint8_t *status, int with_status, const uint8_t *ids,
                   const uint8_t *logprobs) {
    if (meta_info) put(c, "{\"output_token_sampling_mask\":");
    put(c, support ? "{\"format\":\"base64\",\"version\":1,\"mode\":\"support\",\"start\":"
                   : "{\"format\":\"base64\",\"version\":1,\"mode\":\"selected\",\"start\":");
    put_uint(c, start);
    put(c, ",\"rows\":");
    put_uint(c, rows);
    put(c, ",\"nnz\":");
    put_uint(c, nnz);
    const char *keys[4] = {",\"lengths\":\"", "\",\"status\":\"", "\",\"ids\":\"",
                           "\",\"logprobs\":\""};
    const uint8_t *arrays[4] = {lengths, status, ids, logprobs};
    uint64_t sizes[4] = {4 * rows, rows, 4 * nnz, 4 * (support ? nnz : rows)};
    job->arrays = 0;
    job->total = 0;
    job->ids = -1;
    atomic_init(&job->negative, 0);
    for (int f = 0; f < 4; f++) {
        if (f == 1 && !with_status) continue;
        put(c, keys[f]);
        if (f == 2) job->ids = job->arrays;
        job->src[job->arrays] = arrays[f];
        job->size[job->arrays] = sizes[f];
        job->dst[job->arrays] = c->out ? c->out + c->at : NULL;
        job->arrays++;
        job->total += sizes[f];
        c->at += shm_b64_encoded_size(sizes[f]);
    }
    put(c, "\"}");
    if (meta_info) {
        put(c, ",\"output_token_sampling_mask_length\":");
        put_uint(c, length);
        put(c, "}");
    }
}

uint64_t shm_b64_rows_size(int meta_info, int support, uint64_t start, uint64_t rows,
                           uint64_t nnz, int with_status, uint64_t length) {
    if (rows > COUNT_LIMIT || nnz > COUNT_LIMIT) return 0;
    cursor c = {NULL, 0};
    encode_job job;
    layout(&c, &job, meta_info, support, start, rows, nnz, length, NULL, NULL, with_status, NULL,
           NULL);
    return c.at;
}

int64_t shm_b64_rows(int meta_info, int support, uint64_t start, uint64_t rows, uint64_t nnz,
                     uint64_t length, const uint8_t *lengths, const uint8_t *status,
                     const uint8_t *ids, const uint8_t *logprobs, char *out, uint64_t capacity,
                     int threads) {
    uint64_t size = shm_b64_rows_size(meta_info, support, start, rows, nnz, status != NULL, length);
    if (size == 0) return SHM_B64_E_ARGS;
    if (capacity != size) return SHM_B64_E_CAPACITY;
    cursor c = {out, 0};
    encode_job job;
    layout(&c, &job, meta_info, support, start, rows, nnz, length, lengths, status,
           status != NULL, ids, logprobs);
    run_encode(&job, threads);
    /* A negative id: the rows are malformed, whatever was written (the
     * caller finds the id for its message). */
    if (atomic_load_explicit(&job.negative, memory_order_relaxed)) return SHM_B64_E_ARGS;
    return (int64_t)size;
}

typedef struct {
    shm_b64_rows_job *jobs;
    uint64_t count;
    int each;            /* threads per document */
    atomic_ulong next;   /* the next job to take */
} many_job;

/* A task of the batch: documents in turn until none is left (they differ
 * in size, so fixed shares would leave threads idle). */
static void many_task(void *context, uint64_t index) {
    (void)index;
    many_job *m = context;
    for (;;) {
        uint64_t i = atomic_fetch_add_explicit(&m->next, 1, memory_order_relaxed);
        if (i >= m->count) return;
        shm_b64_rows_job *j = &m->jobs[i];
        j->written = shm_b64_rows(j->meta_info, j->support, j->start, j->rows, j->nnz, j->length,
                                  j->lengths, j->status, j->ids, j->logprobs, j->out,
                                  j->capacity, m->each);
    }
}

void shm_b64_rows_many(shm_b64_rows_job *jobs, uint64_t count, int threads) {
    if (count == 0) return;
    uint64_t wanted = shm_pool_tasks(threads, UINT64_MAX, 1); /* threads, clamped */
    uint64_t tasks = count < wanted ? count : wanted;
    many_job m = {jobs, count, 1, 0};
    if (count < wanted) /* fewer documents than threads: each split */
        m.each = (int)(wanted / count);
    shm_pool_dispatch(many_task, &m, tasks);
}

/* ------------------------------------------------------------ the scan */

enum {
    KEY_OTHER, KEY_FORMAT, KEY_VERSION, KEY_MODE, KEY_ROWS, KEY_NNZ,
    KEY_FIELD /* + 0..3: lengths, status, ids, logprobs */
};

static int key_of(const unsigned char *key, uint64_t length) {
    static const char *const names[9] = {"format", "version", "mode", "rows", "nnz",
                                         "lengths", "status", "ids", "logprobs"};
    for (int k = 0; k < 9; k++)
        if (strlen(names[k]) == length && memcmp(key, names[k], length) == 0) return KEY_FORMAT + k;
    return KEY_OTHER;
}

#define UNKNOWN UINT64_MAX /* a count not (yet) read as a plain integer */

typedef struct {
    uint8_t is_object, format_ok, version_ok, key;
    uint8_t mode;   /* 0 not seen, 1 "selected", 2 "support" */
    uint8_t jumped; /* bit f: field f's recorded span was jumped over, not read */
    uint64_t rows, nnz;
    int64_t span[8];
} scan_frame;

/* The string starting at s[*at] (a quote): its content's span, and *at
 * moved past its closing quote; 0 if it does not end. The first quote
 * found ends it unless a backslash stands before it; only then are the
 * escapes followed from the start. */
static int string_span(const unsigned char *s, uint64_t n, uint64_t *at, uint64_t *begin,
                       uint64_t *end) {
    uint64_t i = *at + 1;
    const unsigned char *quote = i < n ? memchr(s + i, '"', n - i) : NULL;
    if (!quote) return 0;
    uint64_t q = (uint64_t)(quote - s);
    if (s[q - 1] == '\\') { /* q - 1 >= *at: s[*at] is the opening quote, never a backslash */
        for (q = i;; q++) {
            if (q >= n) return 0;
            if (s[q] == '\\') {
                q++;
                continue;
            }
            if (s[q] == '"') break;
        }
    }
    *begin = i;
    *end = q;
    *at = q + 1;
    return 1;
}

/* The base64 length field f of `frame` has for the counts read before it
 * (members in the order an encoder writes them), or UNKNOWN. */
static uint64_t expected_chars(const scan_frame *frame, int f) {
    if (!frame->format_ok || !frame->version_ok || !frame->mode) return UNKNOWN;
    uint64_t count = f < 2 || (f == 3 && frame->mode == 1) ? frame->rows : frame->nnz;
    if (count == UNKNOWN) return UNKNOWN;
    return shm_b64_encoded_size(f == 1 ? count : 4 * count);
}

static int is_space(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

/* One pass of the scan (shm_b64_scan). With `jump`, a field string whose
 * length the object's earlier members give is taken to end there when a
 * quote stands there, unread; *unrecorded is set when such a string is not
 * among the spans stored (a later member of the same name, or an object
 * that turns out not to be binary rows): nothing would check it. */
static int64_t scan(const unsigned char *s, uint64_t n, int64_t *found, uint64_t capacity,
                    uint64_t *error_at, scan_frame *stack, int jump, int *unrecorded) {
    int depth = 0, kind = 0; /* the value just read: 0 other, 1 a string, 2 a plain integer */
    int jumped = 0;          /* the string just read was jumped over */
    uint64_t i = 0, begin = 0, end = 0, number = 0;
    int64_t objects = 0, code = SHM_B64_E_SYNTAX;
    scan_frame *top;

value:
    while (i < n && is_space(s[i])) i++;
    if (i >= n) goto fail;
    switch (s[i]) {
    case '{':
    case '[':
        if (depth == SHM_B64_MAX_DEPTH) {
            code = SHM_B64_E_DEPTH;
            goto fail;
        }
        top = &stack[depth++];
        top->is_object = s[i] == '{';
        top->format_ok = top->version_ok = top->mode = top->jumped = 0;
        top->key = KEY_OTHER;
        top->rows = top->nnz = UNKNOWN;
        for (int k = 0; k < 8; k++) top->span[k] = -1;
        i++;
        while (i < n && is_space(s[i])) i++;
        if (i < n && s[i] == (top->is_object ? '}' : ']')) {
            i++;
            goto close;
        }
        if (top->is_object) goto key;
        goto value;
    case '"':
        kind = 1;
        jumped = 0;
        if (jump && depth && stack[depth - 1].key >= KEY_FIELD) {
            uint64_t chars = expected_chars(&stack[depth - 1], stack[depth - 1].key - KEY_FIELD);
            if (chars < n - i - 1 && s[i + 1 + chars] == '"') {
                begin = i + 1;
                end = begin + chars;
                i = end + 1;
                jumped = 1;
                goto next;
            }
        }
        if (!string_span(s, n, &i, &begin, &end)) goto fail;
        goto next;
    case 't':
    case 'f':
    case 'n': {
        const char *word = s[i] == 't' ? "true" : s[i] == 'f' ? "false" : "null";
        uint64_t length = strlen(word);
        if (n - i < length || memcmp(s + i, word, length) != 0) goto fail;
        i += length;
        kind = 0;
        goto next;
    }
    default: { /* a number: its grammar is the parser's to check */
        uint64_t first = i;
        number = 0;
        kind = 2;
        while (i < n && ((s[i] >= '0' && s[i] <= '9') || s[i] == '-' || s[i] == '+' ||
                         s[i] == '.' || s[i] == 'e' || s[i] == 'E')) {
            if (s[i] < '0' || s[i] > '9' || number > COUNT_LIMIT)
                kind = 0;
            else
                number = number * 10 + (uint64_t)(s[i] - '0');
            i++;
        }
        if (i == first) goto fail;
        if (number > COUNT_LIMIT || (i - first > 1 && s[first] == '0')) kind = 0;
        goto next;
    }
    }

key:
    if (i >= n || s[i] != '"' || !string_span(s, n, &i, &begin, &end)) goto fail;
    stack[depth - 1].key = (uint8_t)key_of(s + begin, end - begin);
    while (i < n && is_space(s[i])) i++;
    if (i >= n || s[i] != ':') goto fail;
    i++;
    goto value;

close: /* the container on top ended just before s[i] */
    top = &stack[depth - 1];
    if (top->is_object && top->format_ok && top->version_ok) {
        if ((uint64_t)objects < capacity) memcpy(found + 8 * objects, top->span, sizeof top->span);
        objects++;
    } else if (top->jumped) {
        *unrecorded = 1;
    }
    depth--;
    kind = 0;

next: /* a value ended just before s[i] */
    while (i < n && is_space(s[i])) i++;
    if (depth == 0) {
        if (i != n) goto fail;
        return objects;
    }
    top = &stack[depth - 1];
    if (top->is_object) {
        switch (top->key) {
        case KEY_OTHER:
            break;
        case KEY_FORMAT:
            top->format_ok = kind == 1 && end - begin == 6 && memcmp(s + begin, "base64", 6) == 0;
            break;
        case KEY_VERSION:
            top->version_ok = kind == 2 && number == 1;
            break;
        case KEY_MODE:
            top->mode = kind != 1                                                      ? 0
                        : end - begin == 8 && memcmp(s + begin, "selected", 8) == 0 ? 1
                        : end - begin == 7 && memcmp(s + begin, "support", 7) == 0  ? 2
                                                                                      : 0;
            break;
        case KEY_ROWS:
        case KEY_NNZ:
            *(top->key == KEY_ROWS ? &top->rows : &top->nnz) = kind == 2 ? number : UNKNOWN;
            break;
        default: {
            int f = top->key - KEY_FIELD;
            if (top->jumped & 1u << f) *unrecorded = 1; /* overridden: never checked */
            top->jumped = (uint8_t)(top->jumped & ~(1u << f));
            if (kind == 1 && jumped) top->jumped |= (uint8_t)(1u << f);
            top->span[2 * f] = kind == 1 ? (int64_t)begin : -1;
            top->span[2 * f + 1] = kind == 1 ? (int64_t)end : -1;
        }
        }
    }
    if (i < n && s[i] == ',') {
        i++;
        while (i < n && is_space(s[i])) i++;
        if (top->is_object) goto key;
        goto value;
    }
    if (i < n && s[i] == (top->is_object ? '}' : ']')) {
        i++;
        goto close;
    }

fail:
    *error_at = i;
    return code;
}

int64_t shm_b64_scan(const char *text, uint64_t n, int64_t *found, uint64_t capacity,
                     uint64_t *error_at) {
    const unsigned char *s = (const unsigned char *)text;
    scan_frame *stack = malloc(sizeof(scan_frame) * SHM_B64_MAX_DEPTH);
    if (!stack) return SHM_B64_E_ARGS;
    int unrecorded = 0;
    int64_t objects = scan(s, n, found, capacity, error_at, stack, 1, &unrecorded);
    /* A failure, or a jump nothing will check, may come from a jump over a
     * string that is not base64 (a quote inside, where the length led):
     * the scan that reads every string says what the text is. Past
     * `capacity` the caller calls again anyway. */
    if (objects < 0 || (unrecorded && (uint64_t)objects <= capacity)) {
        unrecorded = 0;
        objects = scan(s, n, found, capacity, error_at, stack, 0, &unrecorded);
    }
    free(stack);
    return objects;
}

/* ------------------------------------------------------------ decoding */

/* decode_table[k][c]: character c's 6 bits shifted to quartet position k
 * (18, 12, 6, 0), or BAD for a character outside the alphabet. */
#define BAD 0x01000000u
static uint32_t decode_table[4][256];
static pthread_once_t decode_once = PTHREAD_ONCE_INIT;

static void fill_decode_table(void) {
    for (int k = 0; k < 4; k++)
        for (int c = 0; c < 256; c++) decode_table[k][c] = BAD;
    for (uint32_t v = 0; v < 64; v++)
        for (int k = 0; k < 4; k++)
            decode_table[k][(unsigned char)alphabet[v]] = v << (18 - 6 * k);
}

static inline uint32_t quartet(const unsigned char *q) {
    return decode_table[0][q[0]] | decode_table[1][q[1]] | decode_table[2][q[2]] |
           decode_table[3][q[3]];
}

#ifdef B64_X86
/* Decodes 32 characters (8 quartets) at a time while 11 quartets remain
 * (each store writes 32 bytes for its 24: the next block's, or the scalar
 * tail's, bytes), and returns the quartets done: up to the first block
 * holding a character outside the alphabet, which the scalar code then
 * finds. Validation and translation by nibble lookups: a character is in
 * the alphabet when the class bits its low nibble allows and those its
 * high nibble has share none; its 6 bits are the character plus an offset
 * chosen by its high nibble ('/' set apart); the sextets are packed by two
 * multiply-adds and a byte and a lane shuffle (the well-known method). */
__attribute__((target("avx2"))) static uint64_t decode_avx2(const unsigned char *text,
                                                             uint64_t count, uint8_t *out) {
    const __m256i lut_lo = _mm256_setr_epi8(
        0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B, 0x1B,
        0x1A, 0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B,
        0x1B, 0x1A);
    const __m256i lut_hi = _mm256_setr_epi8(
        0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
        0x10, 0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
        0x10, 0x10);
    const __m256i lut_roll = _mm256_setr_epi8(0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0, 0, 0,
                                              0, 0, 0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0,
                                              0, 0, 0, 0);
    const __m256i mask_2f = _mm256_set1_epi8(0x2f);
    const __m256i merge_ab = _mm256_set1_epi32(0x01400140), merge_abc = _mm256_set1_epi32(0x00011000);
    const __m256i pack = _mm256_setr_epi8(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1,
                                          2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, -1, -1);
    uint64_t q = 0;
    for (; q + 11 <= count; q += 8) {
        __m256i in = _mm256_loadu_si256((const __m256i *)(text + 4 * q));
        __m256i hi_nibbles = _mm256_and_si256(_mm256_srli_epi32(in, 4), mask_2f);
        __m256i lo = _mm256_shuffle_epi8(lut_lo, _mm256_and_si256(in, mask_2f));
        __m256i hi = _mm256_shuffle_epi8(lut_hi, hi_nibbles);
        if (!_mm256_testz_si256(lo, hi)) break;
        __m256i roll = _mm256_shuffle_epi8(
            lut_roll, _mm256_add_epi8(_mm256_cmpeq_epi8(in, mask_2f), hi_nibbles));
        __m256i sextets = _mm256_add_epi8(in, roll);
        __m256i words = _mm256_madd_epi16(_mm256_maddubs_epi16(sextets, merge_ab), merge_abc);
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(words, pack), lanes);
        _mm256_storeu_si256((__m256i *)(out + 3 * q), bytes);
    }
    return q;
}
#endif

/* Decodes quartets [0, count) of `text` into out (3 bytes each); returns
 * the offset of the first character outside the alphabet, or -1. */
static int64_t decode_quartets(const unsigned char *text, uint64_t count, uint8_t *out) {
    const uint64_t block = 64;
    uint64_t start = 0;
#ifdef B64_X86
    if (count >= 11 && shm_avx2()) start = decode_avx2(text, count, out);
#endif
    for (uint64_t q = start; q < count; q += block) {
        uint64_t stop = q + block < count ? q + block : count;
        uint32_t bad = 0;
        uint64_t k = q;
        /* 4-byte stores, each overwriting the previous one's spare byte;
         * the last quartet stores 3 (its next byte may be another task's). */
        for (; k + 1 < stop || (k < stop && stop < count); k++) {
            uint32_t v = quartet(text + 4 * k);
            bad |= v;
            uint32_t bytes = __builtin_bswap32(v << 8);
            memcpy(out + 3 * k, &bytes, 4);
        }
        for (; k < stop; k++) {
            uint32_t v = quartet(text + 4 * k);
            bad |= v;
            out[3 * k] = (uint8_t)(v >> 16);
            out[3 * k + 1] = (uint8_t)(v >> 8);
            out[3 * k + 2] = (uint8_t)v;
        }
        if (bad & BAD)
            for (uint64_t c = 4 * q; c < 4 * stop; c++)
                if (decode_table[0][text[c]] == BAD) return (int64_t)c;
    }
    return -1;
}

typedef struct {
    const unsigned char *text;
    const uint64_t *spans;
    uint64_t count, total, tasks; /* total: quartets of every string */
    uint8_t *out;
    int64_t *results;
} decode_job;

/* The first bad character of string k: the lowest offset any task found. */
static void report_error(int64_t *slot, int64_t at) {
    int64_t seen = __atomic_load_n(slot, __ATOMIC_RELAXED);
    while ((seen < 0 || at < seen) &&
           !__atomic_compare_exchange_n(slot, &seen, at, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Quartets [from, to) of string k. */
static void decode_part(const decode_job *job, uint64_t k, uint64_t from, uint64_t to) {
    const unsigned char *text = job->text + job->spans[4 * k];
    uint64_t quartets = job->spans[4 * k + 1] / 4, size = job->spans[4 * k + 3];
    uint8_t *out = job->out + job->spans[4 * k + 2];
    uint64_t padding = (3 - size % 3) % 3, whole = to;
    shm_pool_prefault((char *)out + 3 * from, (char *)out + (3 * to < size ? 3 * to : size));
    if (to == quartets && padding) whole--; /* the padded quartet: below */
    int64_t bad = whole > from ? decode_quartets(text + 4 * from, whole - from, out + 3 * from)
                               : -1;
    if (bad >= 0) bad += (int64_t)(4 * from);
    if (bad < 0 && whole < to) {
        const unsigned char *q = text + 4 * whole;
        uint32_t v = decode_table[0][q[0]] | decode_table[1][q[1]];
        if (padding == 1) v |= decode_table[2][q[2]];
        if (v & BAD) {
            for (int c = 0; c < 4 - (int)padding; c++)
                if (decode_table[0][q[c]] == BAD) {
                    bad = (int64_t)(4 * whole) + c;
                    break;
                }
        } else if (q[3] != '=' || (padding == 2 && q[2] != '=')) {
            bad = (int64_t)(4 * whole) + (padding == 2 && q[2] != '=' ? 2 : 3);
        } else {
            out[3 * whole] = (uint8_t)(v >> 16);
            if (padding == 1) out[3 * whole + 1] = (uint8_t)(v >> 8);
        }
    }
    if (bad >= 0) report_error(&job->results[2 * k], bad);
    if (any_negative_int32(out, 3 * from, 3 * to < size ? 3 * to : size))
        __atomic_store_n(&job->results[2 * k + 1], 1, __ATOMIC_RELAXED);
}

static void decode_task(void *context, uint64_t task) {
    const decode_job *job = context;
    uint64_t begin = job->total * task / job->tasks, end = job->total * (task + 1) / job->tasks;
    uint64_t base = 0;
    for (uint64_t k = 0; k < job->count && base < end; k++) {
        uint64_t quartets = job->spans[4 * k + 1] / 4;
        if (begin < base + quartets && quartets) {
            uint64_t from = begin > base ? begin - base : 0;
            uint64_t to = end - base < quartets ? end - base : quartets;
            decode_part(job, k, from, to);
        }
        base += quartets;
    }
}

int shm_b64_decode(const char *text, uint64_t text_size, const uint64_t *spans, uint64_t count,
                   uint8_t *out, uint64_t out_size, int64_t *results, int threads) {
    pthread_once(&decode_once, fill_decode_table);
    uint64_t total = 0;
    for (uint64_t k = 0; k < count; k++) {
        uint64_t begin = spans[4 * k], length = spans[4 * k + 1];
        uint64_t at = spans[4 * k + 2], size = spans[4 * k + 3];
        if (begin > text_size || length > text_size - begin || at > out_size ||
            size > out_size - at || size > COUNT_LIMIT || length != shm_b64_encoded_size(size))
            return SHM_B64_E_ARGS;
        results[2 * k] = -1;
        results[2 * k + 1] = 0;
        total += length / 4;
    }
    uint64_t tasks = shm_pool_tasks(threads, 4 * total, CHARS_PER_TASK);
    decode_job job = {(const unsigned char *)text, spans, count, total, tasks, out, results};
    if (total) shm_pool_run(decode_task, &job, tasks);
    return 0;
}

/*
 * shmask binary rows (shmask/binary_rows.py; the schema is in
 * docs/architecture.md, "Binary rows"): a base64 codec (standard alphabet,
 * padded, no line breaks), the binary-rows object and SGLang's meta_info
 * fields written in one pass into an exact-size buffer, and, at the client,
 * a JSON scan that finds the binary-rows objects of a response body and a
 * strict decoder for their big strings. Every long job is split across the
 * shared thread pool (shmask_pool.h): the calling thread and up to
 * `threads` - 1 workers.
 * native/build.py declares these functions to cffi.
 */
#ifndef SHMASK_BINARY_ROWS_H
#define SHMASK_BINARY_ROWS_H

#include <stdint.h>

/* Return codes. */
#define SHM_B64_E_ARGS -1     /* counts that cannot be written (past 2^56) */
#define SHM_B64_E_CAPACITY -2 /* the destination is not the size asked for */
#define SHM_B64_E_SYNTAX -3   /* shm_b64_scan: the body is not JSON (at *error_at) */
#define SHM_B64_E_DEPTH -4    /* shm_b64_scan: nested deeper than SHM_B64_MAX_DEPTH */
#define SHM_B64_MAX_DEPTH 1024

/* Base64 characters of n bytes: 4 * ceil(n / 3). */
uint64_t shm_b64_encoded_size(uint64_t n);

/* Base64 of src[0:n] written to dst[0:shm_b64_encoded_size(n)] (no NUL),
 * split across up to `threads` threads (fewer for small n). For an
 * assembler that places one array's base64 straight into a larger
 * document: dst is where the string's characters go (between its quotes).
 * src and dst must not overlap. */
void shm_b64_encode(const uint8_t *src, uint64_t n, char *dst, int threads);

/* The binary-rows object of `rows` rows holding `nnz` ids, in the bytes
 * shmask.binary_rows writes (keys in schema order, no spaces):
 * {"format":"base64","version":1,"mode":...,"start":S,"rows":R,"nnz":N,
 *  "lengths":"...","status":"...","ids":"...","logprobs":"..."}
 * `status` NULL leaves "status" out. The arrays are little-endian bytes:
 * lengths 4 * rows, status rows, ids 4 * nnz, logprobs 4 * nnz (support)
 * or 4 * rows (selected). With `meta_info` set the object is wrapped as
 * SGLang's two meta_info fields:
 * {"output_token_sampling_mask":{...},"output_token_sampling_mask_length":L}
 * shm_b64_rows_size gives the exact size (0 past 2^56 rows or ids);
 * shm_b64_rows writes exactly that many bytes to `out` (its capacity must
 * be that size) and returns it, or SHM_B64_E_ARGS / SHM_B64_E_CAPACITY.
 * The base64 fields are encoded in parallel, straight into `out`. */
uint64_t shm_b64_rows_size(int meta_info, int support, uint64_t start, uint64_t rows,
                           uint64_t nnz, int with_status, uint64_t length);
int64_t shm_b64_rows(int meta_info, int support, uint64_t start, uint64_t rows, uint64_t nnz,
                     uint64_t length, const uint8_t *lengths, const uint8_t *status,
                     const uint8_t *ids, const uint8_t *logprobs, char *out, uint64_t capacity,
                     int threads);

/* shm_b64_rows' arguments for one document of a batch, and its result. */
typedef struct {
    int meta_info, support;
    uint64_t start, rows, nnz, length;
    const uint8_t *lengths, *status, *ids, *logprobs;
    char *out;
    uint64_t capacity;
    int64_t written; /* set by shm_b64_rows_many: what shm_b64_rows returned */
} shm_b64_rows_job;

/* shm_b64_rows for every job, on up to `threads` threads: an emission's
 * responses in one call, each thread taking whole documents in turn (no
 * split and join per document; with fewer documents than threads each is
 * split across threads / count). A job's failure is its `written` only. */
void shm_b64_rows_many(shm_b64_rows_job *jobs, uint64_t count, int threads);

/* Finds the binary-rows objects of a JSON text: every object whose last
 * "format" member is the string "base64" and last "version" member the
 * number 1, written without escapes. For each (in the order their closing
 * braces appear) found[8 * k .. 8 * k + 7] holds the content spans (begin,
 * end: between the quotes) of its last "lengths", "status", "ids" and
 * "logprobs" members whose values are strings, or -1, -1 for one that is
 * missing or not a string. Returns how many objects there are (those past
 * `capacity` are counted, not stored: call again with more room), or
 * SHM_B64_E_SYNTAX / SHM_B64_E_DEPTH with the offending byte's offset in
 * *error_at. Reads nothing outside text[0:n]. The scan follows strings,
 * escapes and nesting exactly; it does not check what a JSON parser of the
 * rest checks anyway (UTF-8, control characters, escape letters).
 * One exception, for speed: a field string of an object whose "format",
 * "version", "mode" and counts ("rows", "nnz") came before it, as an
 * encoder writes them, is not read: it is taken to end where its length
 * for those counts puts it, when a quote stands there. Such a span is
 * right exactly when it holds only base64 characters (no quote, no
 * backslash): the caller must check that every stored span does
 * (shm_b64_decode does) and trust none of them if one does not. A jumped
 * string that is not stored (a later member of the same name, an object
 * that is not binary rows after all), or a text that the jumps made look
 * malformed, is scanned again reading every string. */
int64_t shm_b64_scan(const char *text, uint64_t n, int64_t *found, uint64_t capacity,
                     uint64_t *error_at);

/* Strict base64 decoding of `count` strings of `text`, in parallel: string
 * k is text[spans[4k] : spans[4k] + spans[4k + 1]], decoded into
 * out[spans[4k + 2] : spans[4k + 2] + spans[4k + 3]]. Its length must be
 * 4 * ceil(size / 3) for its decoded size (else SHM_B64_E_ARGS, as for
 * spans outside text or out): only the alphabet, then exactly the padding
 * that size needs ('=' or "=="). results[2k] is -1, or the offset of the
 * first character that is not valid base64 there; results[2k + 1] is
 * nonzero when some decoded byte at an offset of 3 modulo 4 (the output is
 * taken as starting 4-byte aligned) has its top bit set: a negative int32.
 * Returns 0 or SHM_B64_E_ARGS. */
int shm_b64_decode(const char *text, uint64_t text_size, const uint64_t *spans, uint64_t count,
                   uint8_t *out, uint64_t out_size, int64_t *results, int threads);

#endif

/* Nesting a flat JSON array by row lengths (shmask_json_nest.h). */
#include "shmask_json_nest.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* Row decoding (shmask_decode.h). */
#include "shmask_decode.h"
#include "shmask_internal.h"

#include <string.h>

int64_t shm_decode_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                        uint64_t rows, uint64_t words, uint32_t vocab, int32_t *out,
                        uint64_t out_len) {
    uint64_t in = 0, at = 0, mask_words = shm_bitmask_words(vocab);
    for (uint64_t r = 0; r < rows; r++) {
        int32_t n = lengths[r];
        uint8_t f = flags ? flags[r] : 0;
        /* The rows were validated at open, but they live in shared memory:
         * every bound is checked again, so rewritten rows fail, never overrun. */
        if (n < 0 || (uint64_t)n > out_len - at) return -1;
        if (f == 0) {
            if ((uint64_t)n > words - in) return -1;
            memcpy(out + at, ids + in, (uint64_t)n * sizeof(int32_t));
            in += (uint64_t)n;
        } else if (f == SHM_ROW_BITMASK) {
            if (mask_words > words - in) return -1;
            uint64_t got = 0;
            for (uint64_t w = 0; w < mask_words; w++) {
                uint32_t bits = (uint32_t)ids[in + w];
                while (bits) {
                    uint64_t id = 32 * w + (uint64_t)__builtin_ctz(bits);
                    if (got == (uint64_t)n || id >= vocab) return -1;
                    out[at + got++] = (int32_t)id;
                    bits &= bits - 1;
                }
            }
            if (got != (uint64_t)n) return -1;
            in += mask_words;
        } else if (n) {
            return -1;
        }
        at += (uint64_t)n;
    }
    return (int64_t)at;
}

/*
 * Row decoding (shmask_decode.c).
 */
#ifndef SHMASK_DECODE_H
#define SHMASK_DECODE_H

#include <stdint.h>

/* Every row's support as ascending ids, back to back (out: sum of
 * lengths): ids rows copied, bitmask rows decoded. Rows come from shared
 * memory, so every bound is checked: returns the ids written, or -1 when
 * the rows disagree with their lengths, flags, words or vocab. */
int64_t shm_decode_rows(const int32_t *lengths, const uint8_t *flags, const int32_t *ids,
                        uint64_t rows, uint64_t words, uint32_t vocab, int32_t *out,
                        uint64_t out_len);

#endif

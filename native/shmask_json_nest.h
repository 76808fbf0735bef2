/*
 * Nesting a flat JSON array by row lengths (shmask_json_nest.c).
 */
#ifndef SHMASK_JSON_NEST_H
#define SHMASK_JSON_NEST_H

#include <stdint.h>

/* Response building: turns orjson's flat JSON array "[a,b,c,...]" of
 * numbers into one array per row, "[[a,b],[c],...]", split by `lengths`
 * (numbers never contain ',' or ']'). `out` must hold flat_len + 3 * rows
 * bytes. Returns the bytes written, or -1 if the counts do not match. */
int64_t shm_json_nest(const char *flat, uint64_t flat_len, const int32_t *lengths, uint64_t rows,
                      char *out, uint64_t out_capacity);

#endif

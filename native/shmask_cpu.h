/*
 * shmask CPU dispatch: whether the response writers may use AVX-512 (the
 * float and id conversion of response_json.c, the base64 encoder of
 * binary_rows.c). The CPU decides at the first call; shm_set_avx512 turns
 * it off (or back on where the CPU has it) for tests and measuring
 * (SHMASK_JSON_SIMD). Every AVX-512 path writes the same bytes as the one
 * it replaces.
 */
#ifndef SHMASK_CPU_H
#define SHMASK_CPU_H

/* enable 0 or 1 sets the choice (1 only where the CPU has AVX-512
 * F/DQ/BW/CD/VL), -1 leaves it; returns the choice before the call. */
int shm_set_avx512(int enable);

#endif

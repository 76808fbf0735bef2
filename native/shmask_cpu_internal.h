/* The C core's side of shmask_cpu.h (not declared to cffi). */
#ifndef SHMASK_CPU_INTERNAL_H
#define SHMASK_CPU_INTERNAL_H

#include "shmask_cpu.h"

/* AVX-512 F/DQ/BW/CD/VL may be used (the CPU has them, not turned off). */
int shm_avx512(void);
/* ... and VBMI too (byte permutes: the base64 encoder). */
int shm_avx512_vbmi(void);
/* The CPU has AVX2 (the base64 codec's vector paths; not turned off by
 * shm_set_avx512). */
int shm_avx2(void);

#endif

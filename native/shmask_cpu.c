/* CPU dispatch for the response writers: see shmask_cpu.h. */
#include "shmask_cpu_internal.h"

enum { HAS_AVX512 = 1, HAS_AVX512_VBMI = 2, HAS_AVX2 = 4 };

/* What the CPU has, -1 until first asked: threads that ask first all
 * compute the same value, so whichever store lands is right. */
static int features = -1;
/* Set by shm_set_avx512(0): the AVX-512 paths are off whatever the CPU has.
 * A flag of its own, so no late first detection can undo it. */
static int avx512_off;

static int detect(void) {
    int found = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
        __builtin_cpu_supports("avx512vl"))
        found |= HAS_AVX512 | (__builtin_cpu_supports("avx512vbmi") ? HAS_AVX512_VBMI : 0);
    if (__builtin_cpu_supports("avx2")) found |= HAS_AVX2;
#endif
    return found;
}

static int cpu_features(void) {
    int value = __atomic_load_n(&features, __ATOMIC_RELAXED);
    if (value < 0) {
        value = detect();
        __atomic_store_n(&features, value, __ATOMIC_RELAXED);
    }
    return value;
}

int shm_avx512(void) {
    return !__atomic_load_n(&avx512_off, __ATOMIC_RELAXED) && (cpu_features() & HAS_AVX512);
}

int shm_avx512_vbmi(void) { return shm_avx512() && (cpu_features() & HAS_AVX512_VBMI); }

int shm_avx2(void) { return (cpu_features() & HAS_AVX2) != 0; }

int shm_set_avx512(int enable) {
    int before = shm_avx512();
    if (enable >= 0) __atomic_store_n(&avx512_off, !enable, __ATOMIC_RELAXED);
    return before;
}

/* CPU dispatch for the response writers: see shmask_cpu.h. */
#include "shmask_cpu_internal.h"

/* -1: not asked yet; else 0, 1 (AVX-512) or 3 (AVX-512 and VBMI). Threads
 * that ask first all compute the same value; only one stores it, and only
 * over -1, so a shm_set_avx512 made meanwhile is not undone. */
static int choice = -1;

static int detect(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    int base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
               __builtin_cpu_supports("avx512vl");
    return base ? 1 | (__builtin_cpu_supports("avx512vbmi") ? 2 : 0) : 0;
#else
    return 0;
#endif
}

static int current(void) {
    int value = __atomic_load_n(&choice, __ATOMIC_RELAXED);
    if (value < 0) {
        int unset = -1;
        value = detect();
        if (!__atomic_compare_exchange_n(&choice, &unset, value, 0, __ATOMIC_RELAXED,
                                         __ATOMIC_RELAXED))
            value = unset; /* set meanwhile (shm_set_avx512): that choice stands */
    }
    return value;
}

int shm_avx512(void) { return current() & 1; }

int shm_avx512_vbmi(void) { return (current() & 3) == 3; }

int shm_set_avx512(int enable) {
    int before = shm_avx512();
    if (enable >= 0) __atomic_store_n(&choice, enable ? detect() : 0, __ATOMIC_RELAXED);
    return before;
}

int shm_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int cached = -1; /* benign: every thread computes the same value, nothing sets it */
    int value = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (value < 0) {
        __builtin_cpu_init();
        value = __builtin_cpu_supports("avx2") ? 1 : 0;
        __atomic_store_n(&cached, value, __ATOMIC_RELAXED);
    }
    return value;
#else
    return 0;
#endif
}

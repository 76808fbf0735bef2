/*
 * Guarded mappings (shmask_guard.c).
 */
#ifndef SHMASK_GUARD_H
#define SHMASK_GUARD_H

#include <stdint.h>

/* Guarded mappings. A segment file truncated by another process would kill
 * any process touching its pages with SIGBUS; mappings made here are
 * registered with a SIGBUS handler that replaces the whole mapping with
 * zero pages instead and marks it truncated, so every later check of the
 * ring fails cleanly (StaleChunkError) and the faulting load or store just
 * completes on the zero pages. A handler installed later (faulthandler)
 * sees the fault first; the guard still holds when it re-raises, and
 * shm_guard_front puts the guard back in front (a sigaction call). */
void *shm_map(int fd, uint64_t bytes, int populate, int *errno_out);
void shm_unmap(void *address);
void shm_guard_front(void);
/* 1 when the segment mapped at `address` was cut: a SIGBUS marked it, or its
 * header's magic reads zero (cut and grown back, or declared lost by its
 * producer). */
int shm_mapping_truncated(const void *address);

#endif

/*
 * shmask thread pool: the workers the response writers (JSON rows, the
 * gather of a response's pieces, binary rows) share. Started once per
 * process on first need, never per call; the calling thread always takes
 * tasks too, so a call finishes even when no worker could be started or
 * every worker is busy with another call's tasks. Fork-safe: a child starts
 * over with no workers.
 * Internal to the C core (not declared to cffi).
 */
#ifndef SHMASK_POOL_H
#define SHMASK_POOL_H

#include <stdint.h>

/* One task: `run(context, index)` for index in [0, count). */
typedef void (*shm_pool_task)(void *context, uint64_t index);

/* Runs run(context, i) for every i < count on this thread and up to
 * count - 1 workers (at most SHM_POOL_MAX_WORKERS), and returns when every
 * task has returned. count 1 runs on this thread only, with no locking. */
void shm_pool_run(shm_pool_task run, void *context, uint64_t count);

/* shm_pool_run for tasks that only hand out work to calls of their own
 * (a batch of documents, each written by its own shm_pool_run): the same,
 * but its tasks are not counted as writers by shm_pool_prefault's rule
 * (their calls' tasks are). */
void shm_pool_dispatch(shm_pool_task run, void *context, uint64_t count);

#define SHM_POOL_MAX_WORKERS 63
/* The most tasks a writer splits one call into: this thread + every worker. */
#define SHM_POOL_MAX_TASKS (SHM_POOL_MAX_WORKERS + 1)

/* How many tasks `work` units are worth: `threads` (the caller's setting,
 * clamped to 1..SHM_POOL_MAX_TASKS), but no more than one per `per_task`
 * units (a task's start costs more than a smaller share saves), and 1 at
 * least. */
static inline uint64_t shm_pool_tasks(int threads, uint64_t work, uint64_t per_task) {
    uint64_t tasks = threads < 1 ? 1 : threads > SHM_POOL_MAX_TASKS ? SHM_POOL_MAX_TASKS
                                                                     : (uint64_t)threads;
    uint64_t worth = work / per_task;
    return tasks > worth ? (worth ? worth : 1) : tasks;
}

/* Before a task writes [begin, end) of memory that may be fresh: maps the
 * whole pages inside it with one madvise(MADV_POPULATE_WRITE) instead of a
 * fault per 4 KiB page at first touch (page contents are not changed). A
 * kernel without it (before Linux 5.14) is asked once; then this does
 * nothing. Done only while at most SHM_POOL_PREFAULT_MAX_TASKS tasks of
 * all calls in flight in the process are running or queued (one call's
 * tasks, or several threads' calls each writing its own document): on the VM a
 * gather on 1-2 threads took a third less time; on the H200 host the
 * binary rows on 1 thread 97 -> 82 ms per emission, but on 12 threads the
 * JSON documents 134 -> 215 ms and the binary rows 44.6 -> 52.0 ms (many
 * threads' faults already run in parallel; the madvise calls contend). */
void shm_pool_prefault(char *begin, char *end);

/* Prefaulting is done while at most this many tasks are in flight. */
#define SHM_POOL_PREFAULT_MAX_TASKS 2

#endif

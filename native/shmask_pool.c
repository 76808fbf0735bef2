/* shmask thread pool: see shmask_pool.h. */
#define _DEFAULT_SOURCE /* madvise */
#include "shmask_pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it */
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* Workers wait for batches; a call queues its batch, wakes as many workers
 * as it has tasks beyond its own, and takes tasks itself until none is left
 * unclaimed. (Starting threads per call cost 10-40 us each, on the calling
 * thread, serially: more than a task's work in a chunk of 50 x 1000.) */
typedef struct batch {
    shm_pool_task run;
    void *context;
    uint64_t count, claimed, finished;
    pthread_cond_t done;
    struct batch *next;
} batch;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static batch *pool_queue; /* batches with unclaimed tasks, oldest first */
static int pool_workers;  /* workers started (and alive) in this process */
static pthread_once_t pool_fork_once = PTHREAD_ONCE_INIT;
/* Batches queued so far: a worker out of work watches it for a while
 * before it sleeps. A response writer calls the pool once or twice per
 * request, back to back; a sleeping worker takes tens of microseconds to
 * wake (more from a deep idle state), which left the caller doing most
 * parts itself. */
static atomic_ulong pool_posted;
/* Tasks of every call in flight in this process, started or not: whether
 * prefaulting is worth it (shm_pool_prefault) depends on how many threads
 * write at once, whether they are one call's tasks or several calls' (a
 * batch of documents written one per thread). */
static atomic_ulong pool_running;
#define SPIN_NS 200000 /* 0.2 ms of watching after the last task */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Without the lock: watch pool_posted move past `seen` for up to SPIN_NS.
 * Returns whether it moved (then look for work again before sleeping). */
static int spin_for_work(unsigned long seen) {
    uint64_t until = now_ns() + SPIN_NS;
    for (unsigned i = 0;; i++) {
        if (atomic_load_explicit(&pool_posted, memory_order_acquire) != seen) return 1;
        if ((i & 63) == 63 && now_ns() > until) return 0;
        CPU_RELAX();
    }
}

/* The oldest batch with an unclaimed task (pool_lock held), or NULL. */
static batch *claimable(void) {
    while (pool_queue && pool_queue->claimed == pool_queue->count) pool_queue = pool_queue->next;
    return pool_queue;
}

/* Runs task `index` of `b` without the lock, and counts it done. */
static void run_task(batch *b, uint64_t index) { /* pool_lock held on entry and exit */
    pthread_mutex_unlock(&pool_lock);
    b->run(b->context, index);
    pthread_mutex_lock(&pool_lock);
    if (++b->finished == b->count) pthread_cond_signal(&b->done);
}

static void *pool_worker(void *unused) {
    (void)unused;
    pthread_mutex_lock(&pool_lock);
    int spun = 0; /* spun since the last task: then sleep */
    for (;;) {
        batch *b = claimable();
        if (b) {
            run_task(b, b->claimed++);
            spun = 0;
            continue;
        }
        if (!spun) {
            unsigned long seen = atomic_load_explicit(&pool_posted, memory_order_acquire);
            pthread_mutex_unlock(&pool_lock);
            spin_for_work(seen);
            pthread_mutex_lock(&pool_lock);
            spun = 1;
            continue;
        }
        pthread_cond_wait(&pool_wake, &pool_lock);
        spun = 0;
    }
    return NULL;
}

/* A forked child has none of the parent's workers, and the lock may have
 * been held by one of them at the fork: start over. */
static void pool_prepare_fork(void) { pthread_mutex_lock(&pool_lock); }
static void pool_parent_after_fork(void) { pthread_mutex_unlock(&pool_lock); }
static void pool_child_after_fork(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pool_queue = NULL;
    pool_workers = 0;
    atomic_store(&pool_running, 0); /* calls in flight at the fork are the parent's */
}
static void pool_register_fork(void) {
    pthread_atfork(pool_prepare_fork, pool_parent_after_fork, pool_child_after_fork);
}

/* `counted`: the tasks count toward pool_running (they write output);
 * a dispatcher's tasks (shm_pool_dispatch) do not: the calls they make do. */
static void pool_run(shm_pool_task run, void *context, uint64_t count, int counted) {
    if (count == 0) return;
    pthread_once(&pool_fork_once, pool_register_fork);
    uint64_t weight = counted ? count : 0;
    atomic_fetch_add_explicit(&pool_running, weight, memory_order_relaxed);
    if (count == 1) {
        run(context, 0);
        atomic_fetch_sub_explicit(&pool_running, weight, memory_order_relaxed);
        return;
    }
    batch b = {run, context, count, 0, 0, PTHREAD_COND_INITIALIZER, NULL};
    pthread_mutex_lock(&pool_lock);
    uint64_t wanted = count - 1 > SHM_POOL_MAX_WORKERS ? SHM_POOL_MAX_WORKERS : count - 1;
    while ((uint64_t)pool_workers < wanted) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, pool_worker, NULL) != 0) break;
        pthread_detach(thread);
        pool_workers++;
    }
    batch **tail = &pool_queue;
    while (*tail) tail = &(*tail)->next;
    *tail = &b;
    atomic_fetch_add_explicit(&pool_posted, 1, memory_order_release);
    if (wanted >= (uint64_t)pool_workers)
        pthread_cond_broadcast(&pool_wake);
    else
        for (uint64_t i = 0; i < wanted; i++) pthread_cond_signal(&pool_wake);
    /* This thread runs this batch's tasks as long as any is unclaimed. */
    while (b.claimed < b.count) run_task(&b, b.claimed++);
    while (b.finished < b.count) pthread_cond_wait(&b.done, &pool_lock);
    /* Out of the queue (claimable() drops it only when it looks there). */
    for (batch **link = &pool_queue; *link; link = &(*link)->next) {
        if (*link == &b) {
            *link = b.next;
            break;
        }
    }
    pthread_mutex_unlock(&pool_lock);
    pthread_cond_destroy(&b.done);
    atomic_fetch_sub_explicit(&pool_running, weight, memory_order_relaxed);
}

void shm_pool_run(shm_pool_task run, void *context, uint64_t count) {
    pool_run(run, context, count, 1);
}

void shm_pool_dispatch(shm_pool_task run, void *context, uint64_t count) {
    pool_run(run, context, count, 0);
}

static atomic_int prefault_unsupported;

void shm_pool_prefault(char *begin, char *end) {
    if (atomic_load_explicit(&prefault_unsupported, memory_order_relaxed)) return;
    if (atomic_load_explicit(&pool_running, memory_order_relaxed) > SHM_POOL_PREFAULT_MAX_TASKS)
        return; /* many threads writing at once: their faults overlap anyway */
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = ((uintptr_t)begin + page - 1) & ~(page - 1), last = (uintptr_t)end & ~(page - 1);
    if (last <= first) return;
    if (madvise((void *)first, last - first, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
        atomic_store_explicit(&prefault_unsupported, 1, memory_order_relaxed);
    /* Any other failure (out of memory, a page that cannot be mapped) is
     * left to the writes themselves, as without this call. */
}

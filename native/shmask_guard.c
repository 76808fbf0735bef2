/* Guarded mappings (shmask_guard.h). */
#define _GNU_SOURCE /* MAP_POPULATE, MAP_ANONYMOUS, SA_ONSTACK */
#include "shmask_guard.h"
#include "shmask_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The table of mappings the handler may repair: chunks of slots, linked
 * with atomic pointers, appended (under guards_lock) and never freed, so
 * the handler walks it lock-free and no count of mappings is refused. */
#define GUARD_CHUNK_SLOTS 1024
struct guard {
    _Atomic uintptr_t start; /* 0: free */
    _Atomic uintptr_t end;
    _Atomic uint32_t truncated;
    _Atomic int fd; /* our own descriptor of the file: its size, from a handler */
};
struct guard_chunk {
    struct guard slots[GUARD_CHUNK_SLOTS];
    _Atomic int used; /* slots at or past this index were never used */
    struct guard_chunk *_Atomic next;
};
static struct guard_chunk first_guards;
/* Held only over the table and sigaction, never over mmap or munmap (a
 * MAP_POPULATE of a large ring takes milliseconds, and a fork waits for
 * the lock meanwhile: see guards_prepare_fork). */
static pthread_mutex_t guards_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t guards_fork_once = PTHREAD_ONCE_INIT;
static struct sigaction previous_sigbus;
/* Set once a foreign fault was handed to the previous handler. A handler
 * that re-raises after putting its own predecessor back (faulthandler does,
 * and its predecessor may be us) must not bounce the signal forever: the
 * second time round the process dies, as it would have without shmask. */
static volatile sig_atomic_t sigbus_chained;

/* The next slot ever used, walking every chunk: start with *chunk =
 * &first_guards and *index = 0; NULL at the end. Lock-free (the handler
 * walks the table too). */
static struct guard *next_used_guard(struct guard_chunk **chunk, int *index) {
    while (*chunk) {
        if (*index < atomic_load_explicit(&(*chunk)->used, memory_order_acquire))
            return &(*chunk)->slots[(*index)++];
        *chunk = atomic_load_explicit(&(*chunk)->next, memory_order_acquire);
        *index = 0;
    }
    return NULL;
}

/* Zero pages over the whole mapping (mmap is a plain system call, safe in
 * a handler); the faulting access then completes on them. */
static int replace_with_zeros(struct guard *g, uintptr_t start, uintptr_t end) {
    void *replaced = mmap((void *)start, end - start, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (replaced == MAP_FAILED) return 0;
    atomic_store_explicit(&g->truncated, 1, memory_order_release);
    return 1;
}

/* A SIGBUS that a handler installed after ours re-raised (faulthandler puts
 * its predecessor back, then raise()s): the fault's address is gone, so
 * every mapping whose file is now shorter than it gets zero pages. Returns
 * how many; when one of them was the faulting one, the access completes on
 * them once that handler returns. fstat is async-signal-safe. */
static int replace_cut_mappings(void) {
    int replaced = 0, index = 0;
    struct guard_chunk *chunk = &first_guards;
    for (struct guard *g; (g = next_used_guard(&chunk, &index));) {
        uintptr_t start = atomic_load_explicit(&g->start, memory_order_acquire);
        uintptr_t end = atomic_load_explicit(&g->end, memory_order_acquire);
        int fd = atomic_load_explicit(&g->fd, memory_order_acquire);
        if (!start || fd < 0 || atomic_load_explicit(&g->truncated, memory_order_acquire))
            continue;
        struct stat st;
        if (fstat(fd, &st) != 0 || (uint64_t)st.st_size >= end - start) continue;
        /* Still the same mapping (not unmapped while we looked)? */
        if (atomic_load_explicit(&g->start, memory_order_acquire) != start) continue;
        replaced += replace_with_zeros(g, start, end);
    }
    return replaced;
}

static void on_sigbus(int signum, siginfo_t *info, void *context) {
    if (info && info->si_code > 0) { /* a fault (never a SIGBUS sent with kill()) */
        uintptr_t address = (uintptr_t)info->si_addr;
        int index = 0;
        struct guard_chunk *chunk = &first_guards;
        for (struct guard *g; (g = next_used_guard(&chunk, &index));) {
            uintptr_t start = atomic_load_explicit(&g->start, memory_order_acquire);
            uintptr_t end = atomic_load_explicit(&g->end, memory_order_acquire);
            if (!start || address < start || address >= end) continue;
            if (replace_with_zeros(g, start, end)) return;
            break;
        }
    } else if (info && info->si_code == SI_TKILL && info->si_pid == getpid() &&
               replace_cut_mappings()) {
        return; /* our fault, re-raised (raise()) by a handler in front of ours */
    }
    /* Not ours: what would have happened without shmask. */
    if (sigbus_chained) {
        signal(SIGBUS, SIG_DFL);
        raise(SIGBUS);
        return;
    }
    sigbus_chained = 1;
    if ((previous_sigbus.sa_flags & SA_SIGINFO) && previous_sigbus.sa_sigaction) {
        previous_sigbus.sa_sigaction(signum, info, context);
        return;
    }
    if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
        previous_sigbus.sa_handler(signum);
        return;
    }
    signal(SIGBUS, SIG_DFL);
    raise(SIGBUS);
}

/* Puts our handler in front (the one found there is chained). Called under
 * guards_lock at every mapping and by shm_guard_front. */
static void install_sigbus_handler(void) {
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) return;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    previous_sigbus = current;
    sigaction(SIGBUS, &ours, NULL);
}

/* A fork copies guards_lock as it is: taken by a thread that does not
 * exist in the child, it would block the child's first mapping forever.
 * The fork waits for the lock instead (held for a few loads and stores),
 * and both sides let go of it. */
static void guards_prepare_fork(void) { pthread_mutex_lock(&guards_lock); }
static void guards_after_fork(void) { pthread_mutex_unlock(&guards_lock); }
static void guards_register_fork(void) {
    pthread_atfork(guards_prepare_fork, guards_after_fork, guards_after_fork);
}

static void lock_guards(void) {
    pthread_once(&guards_fork_once, guards_register_fork);
    pthread_mutex_lock(&guards_lock);
}

void shm_guard_front(void) {
    if (!atomic_load_explicit(&first_guards.used, memory_order_acquire)) return; /* nothing mapped */
    lock_guards();
    install_sigbus_handler();
    pthread_mutex_unlock(&guards_lock);
}

/* A free slot, claimed for `mapped` (guards_lock held); NULL when a new
 * chunk cannot be allocated. */
static struct guard *claim_guard(uintptr_t mapped, uint64_t bytes, int fd) {
    struct guard_chunk *chunk = &first_guards;
    for (;;) {
        for (int i = 0; i < GUARD_CHUNK_SLOTS; i++) {
            struct guard *g = &chunk->slots[i];
            if (atomic_load_explicit(&g->start, memory_order_relaxed)) continue;
            atomic_store_explicit(&g->truncated, 0, memory_order_relaxed);
            atomic_store_explicit(&g->fd, fd, memory_order_relaxed);
            atomic_store_explicit(&g->end, mapped + bytes, memory_order_release);
            atomic_store_explicit(&g->start, mapped, memory_order_release);
            if (i >= atomic_load_explicit(&chunk->used, memory_order_relaxed))
                atomic_store_explicit(&chunk->used, i + 1, memory_order_release);
            return g;
        }
        struct guard_chunk *next = atomic_load_explicit(&chunk->next, memory_order_relaxed);
        if (!next) {
            next = calloc(1, sizeof *next); /* zeroed before the handler can see it */
            if (!next) return NULL;
            atomic_store_explicit(&chunk->next, next, memory_order_release);
        }
        chunk = next;
    }
}

void *shm_map(int fd, uint64_t bytes, int populate, int *errno_out) {
    *errno_out = 0;
    /* Our own descriptor (the caller closes its one): it tells the handler
     * the file's size when a fault reaches us re-raised. No fault can come
     * before the mapping is registered: nothing has touched it yet. */
    int own_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own_fd < 0) {
        *errno_out = errno;
        return NULL;
    }
    int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
    void *mapped = mmap(NULL, bytes, PROT_READ | PROT_WRITE, flags, fd, 0);
    if (mapped == MAP_FAILED) {
        *errno_out = errno;
        close(own_fd);
        return NULL;
    }
    lock_guards();
    struct guard *g = claim_guard((uintptr_t)mapped, bytes, own_fd);
    if (g) install_sigbus_handler();
    pthread_mutex_unlock(&guards_lock);
    if (!g) {
        *errno_out = ENOMEM;
        munmap(mapped, bytes);
        close(own_fd);
        return NULL;
    }
    return mapped;
}

void shm_unmap(void *address) {
    uintptr_t start = (uintptr_t)address, end = 0;
    int fd = -1, index = 0;
    struct guard_chunk *chunk = &first_guards;
    lock_guards();
    for (struct guard *g; start && (g = next_used_guard(&chunk, &index));) {
        if (atomic_load_explicit(&g->start, memory_order_relaxed) != start) continue;
        end = atomic_load_explicit(&g->end, memory_order_relaxed);
        /* Forget it first: once unmapped, the range may be mapped again by
         * someone else, whose faults are not ours to paper over. */
        atomic_store_explicit(&g->start, 0, memory_order_release);
        fd = atomic_exchange_explicit(&g->fd, -1, memory_order_acq_rel);
        break;
    }
    pthread_mutex_unlock(&guards_lock);
    if (end) munmap(address, end - start);
    if (fd >= 0) close(fd);
}

int shm_mapping_truncated(const void *address) {
    int index = 0;
    struct guard_chunk *chunk = &first_guards;
    for (struct guard *g; (g = next_used_guard(&chunk, &index));) {
        if (atomic_load_explicit(&g->start, memory_order_acquire) != (uintptr_t)address) continue;
        if (atomic_load_explicit(&g->truncated, memory_order_acquire)) return 1;
        /* Cut and grown back to its size (no fault then: the pages read as
         * zeros), or declared lost by its producer: the magic reads zero. */
        uint64_t bytes = atomic_load_explicit(&g->end, memory_order_acquire) - (uintptr_t)address;
        return bytes >= SHM_HEADER_BYTES &&
               __atomic_load_n(&cseg(address)->magic, __ATOMIC_ACQUIRE) == 0;
    }
    return 0;
}

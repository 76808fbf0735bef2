/*
 * SIGTERM cleanup of the producer's rings (see shmask_exit.h).
 *
 * The table is read inside a signal handler, so it is lock-free: chunks of
 * slots linked with atomic pointers, a chunk allocated (outside any
 * handler) when every slot before it is taken, appended with a CAS and
 * never freed, so any number of rings is covered. A slot is claimed with a
 * CAS FREE -> BUSY, filled, then release-stored READY; the handler copies a
 * READY slot's path and uses it only if the slot's generation did not
 * change meanwhile (seqlock style). A slot belongs to the process that
 * registered it: a forked child neither unlinks its parent's rings nor
 * keeps their slots (it may reuse them).
 */
#define _GNU_SOURCE
#include "shmask_exit.h"

#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXIT_CHUNK_SLOTS 256
enum { SLOT_FREE = 0, SLOT_BUSY = 1, SLOT_READY = 2 };

struct exit_slot {
    _Atomic uint32_t state;
    _Atomic uint32_t generation; /* bumped at every change of the slot */
    _Atomic pid_t pid;
    char path[SHM_EXIT_PATH_BYTES];
};
struct exit_chunk {
    struct exit_slot slots[EXIT_CHUNK_SLOTS];
    struct exit_chunk *_Atomic next;
};
static struct exit_chunk first_chunk;

/* The chunk after `chunk`, appended (zeroed, all slots free) if there is
 * none yet; NULL when it cannot be allocated. */
static struct exit_chunk *next_or_new_chunk(struct exit_chunk *chunk) {
    struct exit_chunk *next = atomic_load_explicit(&chunk->next, memory_order_acquire);
    if (next) return next;
    struct exit_chunk *fresh = calloc(1, sizeof *fresh);
    if (!fresh) return NULL;
    if (atomic_compare_exchange_strong_explicit(&chunk->next, &next, fresh, memory_order_acq_rel,
                                                memory_order_acquire))
        return fresh;
    free(fresh); /* another thread appended one first: `next` is it */
    return next;
}

static int claim(struct exit_slot *slot, pid_t me) {
    uint32_t expected = SLOT_FREE;
    if (atomic_compare_exchange_strong(&slot->state, &expected, SLOT_BUSY)) return 1;
    /* A slot a parent filled before fork() is no longer anyone's here. */
    if (expected == SLOT_READY && atomic_load(&slot->pid) != me) {
        expected = SLOT_READY;
        return atomic_compare_exchange_strong(&slot->state, &expected, SLOT_BUSY);
    }
    return 0;
}

int shm_exit_register(const char *path) {
    size_t length = strlen(path);
    if (length >= SHM_EXIT_PATH_BYTES) return -1;
    pid_t me = getpid();
    int first_index = 0;
    for (struct exit_chunk *chunk = &first_chunk; chunk;
         chunk = next_or_new_chunk(chunk), first_index += EXIT_CHUNK_SLOTS) {
        for (int i = 0; i < EXIT_CHUNK_SLOTS; i++) {
            struct exit_slot *slot = &chunk->slots[i];
            if (!claim(slot, me)) continue;
            atomic_fetch_add(&slot->generation, 1);
            memcpy(slot->path, path, length + 1);
            atomic_store(&slot->pid, me);
            atomic_store_explicit(&slot->state, SLOT_READY, memory_order_release);
            return first_index + i;
        }
    }
    return -1; /* out of memory */
}

void shm_exit_unregister(int index) {
    if (index < 0) return;
    struct exit_chunk *chunk = &first_chunk;
    for (int skip = index / EXIT_CHUNK_SLOTS; chunk && skip > 0; skip--)
        chunk = atomic_load_explicit(&chunk->next, memory_order_acquire);
    if (!chunk) return;
    struct exit_slot *slot = &chunk->slots[index % EXIT_CHUNK_SLOTS];
    if (atomic_load(&slot->pid) != getpid()) return; /* the parent's, after a fork */
    atomic_store(&slot->state, SLOT_BUSY);
    atomic_fetch_add(&slot->generation, 1);
    atomic_store_explicit(&slot->state, SLOT_FREE, memory_order_release);
}

/* Unlinks `slot`'s ring if it is a READY one of process `me` (in a handler). */
static void unlink_if_ours(struct exit_slot *slot, pid_t me) {
    char path[SHM_EXIT_PATH_BYTES];
    uint32_t generation = atomic_load_explicit(&slot->generation, memory_order_acquire);
    if (atomic_load_explicit(&slot->state, memory_order_acquire) != SLOT_READY) return;
    if (atomic_load(&slot->pid) != me) return;
    memcpy(path, slot->path, sizeof path);
    path[sizeof path - 1] = 0;
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load(&slot->state) != SLOT_READY || atomic_load(&slot->generation) != generation)
        return; /* changed while we copied: closed meanwhile */
    unlink(path);
}

static void on_sigterm(int signum) {
    int saved_errno = errno;
    pid_t me = getpid();
    for (struct exit_chunk *chunk = &first_chunk; chunk;
         chunk = atomic_load_explicit(&chunk->next, memory_order_acquire))
        for (int i = 0; i < EXIT_CHUNK_SLOTS; i++) unlink_if_ours(&chunk->slots[i], me);
    /* What the default action would have done: die of the signal. It is
     * blocked while this handler runs, so unblock it after resetting. */
    struct sigaction default_action;
    memset(&default_action, 0, sizeof default_action);
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    sigaction(signum, &default_action, NULL);
    sigset_t just_this;
    sigemptyset(&just_this);
    sigaddset(&just_this, signum);
    raise(signum);
    pthread_sigmask(SIG_UNBLOCK, &just_this, NULL);
    errno = saved_errno;
}

int shm_exit_hook_sigterm(void) {
    struct sigaction current;
    if (sigaction(SIGTERM, NULL, &current) != 0) return -1;
    if (!(current.sa_flags & SA_SIGINFO) && current.sa_handler == on_sigterm) return 1;
    if ((current.sa_flags & SA_SIGINFO) || current.sa_handler != SIG_DFL) return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_handler = on_sigterm;
    ours.sa_flags = SA_RESTART;
    sigemptyset(&ours.sa_mask);
    return sigaction(SIGTERM, &ours, NULL) == 0 ? 1 : -1;
}

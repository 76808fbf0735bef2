/* SIGTERM cleanup of the producer's rings (segment.py).
 *
 * A ring's name must go when its producer dies of SIGTERM's default action;
 * it must stay while a host's own SIGTERM handler drains and the process
 * goes on. The handler is set in C (sigaction works from any thread, so a
 * Writer built on a worker thread is covered) and only over the default
 * action: a host handler or SIG_IGN is left in place, the process keeps its
 * rings, and they go at exit or close. The handler unlinks the registered
 * names of this process (unlink(2) is async-signal-safe), then dies of the
 * signal as the process would have. */
#define SHM_EXIT_PATH_BYTES 128

/* Registers a segment's file path (/dev/shm/<name>) for this process: the
 * slot to unregister it with, or -1 (too long, or no memory for the table,
 * which grows: there is no limit on the number of rings). */
int shm_exit_register(const char *path);
void shm_exit_unregister(int slot);
/* Sets the SIGTERM handler if SIGTERM's action is the default one: 1 when
 * ours is in place, 0 when another action is (left alone), -1 on error. */
int shm_exit_hook_sigterm(void);

"""Response work off the event loop: a bounded thread pool with one lane per
request.

A tokenizer process that folds each emission's chunks into per-request state
and builds response bytes on its asyncio loop stalls the loop for as long as
the rows take to write: health checks go unanswered, streams coalesce into
one event, signals wait. The native JSON writer releases the GIL, so the same
work on worker threads runs beside the loop. `Offload` gives that work:

- **order per key**: jobs submitted with one key (a request id) run one at a
  time, in submission order, so emission k+1 is never folded before emission
  k and a response built in the lane sees a consistent state; jobs of
  different keys run in parallel, up to `threads` at once, round robin (a
  request with a long backlog does not hold a worker for all of it);
- **backpressure**: `put` waits (without blocking the loop) while
  `max_pending` of its jobs are queued or running, so a receive loop that
  awaits `put` stops reading its socket instead of growing a queue without
  bound; `run` (a response for a client waiting on it) takes no slot and
  so never waits behind that feed, only behind its own key's jobs;
- **failures stay with their job**: a job's exception goes to its future
  only; later jobs of the same key and every other key still run (what a
  failed request means is the caller's to decide). Every job's future
  completes, whatever the job raises: an Exception as it was raised, but
  StopIteration (asyncio cannot set it on a Future, so the awaitable would
  never complete) and any BaseException that is not an Exception
  (KeyboardInterrupt, SystemExit, GeneratorExit, CancelledError) become a
  RuntimeError whose ``__cause__`` is the original, as PEP 479 turns a
  coroutine's StopIteration. On a worker those interrupt nothing (signals
  reach the main thread), and passed on as they are they would stop the
  caller's event loop (asyncio re-raises KeyboardInterrupt and SystemExit
  out of ``run``) or read as the caller's own cancellation;
- **shutdown**: `close()` cancels the jobs not started, waits only for the
  ones running (each one fold or one response) and joins the threads. A
  `fold_ref` job that never runs (cancelled, or dropped by `close()`)
  gives its chunk back to the ring unopened (`Reader.discard`), so the
  producer need not wait for the lease.

    offload = Offload(threads=4)
    folded = await offload.put(rid, fold_ref, reader, ref, state.masks.extend)
    body = await offload.run(rid, build_response, state)

`submit` is the thread-level form (a `concurrent.futures.Future`, no bound)
for engines that are not asyncio programs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from .config import Config

if TYPE_CHECKING:
    from .chunk import Chunk
    from .reader import Reader
    from .refs import ChunkRef

T = TypeVar("T")

__all__ = ["Offload", "default_threads", "fold_ref"]

log = logging.getLogger("shmask")


def default_threads() -> int:
    """SHMASK_OFFLOAD_THREADS, else min(8, the cores this process may run on)
    (each worker's JSON writer may itself split a large chunk across
    SHMASK_JSON_THREADS threads). A bad value is a ConfigError naming it."""
    name = "SHMASK_OFFLOAD_THREADS"
    environ = {name: os.environ[name]} if name in os.environ else {}
    return Config.from_env(environ).offload_threads


def fold_ref(reader: Reader, ref: ChunkRef, fold: Callable[[Chunk], T]) -> T:
    """Open `ref`, give the chunk to `fold` and release it when `fold`
    returns (or raises): the job for `Offload.put`, so that a ring record is
    held only while its rows are being written, on a worker thread."""
    with reader.open(ref) as chunk:
        return fold(chunk)


def _job_error(exc: BaseException) -> BaseException:
    """What a job's future carries for `exc` (the module docstring says why
    StopIteration and non-Exception BaseExceptions become RuntimeError)."""
    if isinstance(exc, Exception) and not isinstance(exc, StopIteration):
        return exc
    error = RuntimeError(f"Offload job raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _dropped(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """A job that will never run: a fold_ref job's chunk goes back to the
    ring now rather than at the lease. Never raises (it runs in close() and
    on workers)."""
    if fn is not fold_ref or len(args) != 3:
        return
    reader, ref = args[0], args[1]
    try:
        reader.discard(ref)
    except Exception as exc:  # noqa: BLE001 - a ref that cannot be given back has nothing to give
        log.warning("chunk of a cancelled Offload job not given back: %s: %s",
                    type(exc).__name__, exc)


class _Completions:
    """`Offload.put`'s side in one event loop: its slots, and the jobs that
    ended since the loop last looked, handed over in one callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self.loop = loop
        self.slots = asyncio.Semaphore(max_pending)
        self._lock = threading.Lock()
        self._ended: list[tuple[asyncio.Future, Future]] = []
        self._wake_pending = False

    def ended(self, waiter: asyncio.Future, job: Future) -> None:
        """A job ended (on the thread that ended it: a worker, or close())."""
        with self._lock:
            self._ended.append((waiter, job))
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for these
            pass

    def _hand_over(self) -> None:
        with self._lock:
            ended, self._ended = self._ended, []
            self._wake_pending = False
        for waiter, job in ended:
            self.slots.release()  # the slot is the job's, held until it ended
            if waiter.done():  # the caller cancelled its awaitable
                continue
            if job.cancelled():
                waiter.cancel()
            elif (exc := job.exception()) is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(job.result())


class Offload:
    """A bounded thread pool with per-key order (see the module docstring)."""

    def __init__(self, threads: int | None = None, *, max_pending: int | None = None) -> None:
        threads = default_threads() if threads is None else threads
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        max_pending = 64 * threads if max_pending is None else max_pending
        if type(max_pending) is not int or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.threads = threads
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shmask-offload")
        self._lock = threading.Lock()
        # key -> its jobs not yet started; a key is present while it has a
        # job queued or running, and then exactly one pool task serves it.
        self._lanes: dict[Hashable, collections.deque[tuple[Future, Callable, tuple]]] = {}
        self._closed = False
        self._completions: _Completions | None = None  # put()'s, made in its loop on first use

    def start_workers(self, timeout: float = 10.0) -> None:
        """Start every worker thread now (a ThreadPoolExecutor starts one
        per submit until it has its fill): called at an asyncio program's
        start, so that no request's first job starts a thread on the event
        loop, which waits there until the new thread has run (on a busy
        machine, tens of milliseconds for each). Returns once they have all
        started, or after `timeout` seconds."""
        started = threading.Barrier(self.threads, timeout=timeout)

        def meet() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                started.wait()

        jobs = [self._pool.submit(meet) for _ in range(self.threads)]
        concurrent.futures.wait(jobs, timeout=timeout)

    # -- thread-level ---------------------------------------------------------

    def submit(self, key: Hashable, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on a worker after every job submitted earlier with
        `key` has finished. Never blocks and has no bound (`put` has)."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("Offload is closed")
            idle = key not in self._lanes
            if idle:
                self._lanes[key] = collections.deque()
            self._lanes[key].append((future, fn, args))
        if idle:
            self._pool.submit(self._serve, key)
        return future

    def _serve(self, key: Hashable) -> None:
        # One job of the lane, then back of the pool's queue if more wait:
        # lanes take turns on the workers.
        with self._lock:
            lane = self._lanes[key]
            if not lane:  # close() emptied it after this task was queued
                del self._lanes[key]
                return
            future, fn, args = lane.popleft()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the job's future carries it, nothing else
                future.set_exception(_job_error(exc))
        else:  # cancelled before its turn
            _dropped(fn, args)
        del future, fn, args  # hold no chunk or state while waiting for a turn
        with self._lock:
            if not lane:
                del self._lanes[key]
                return
            if self._closed:  # close() cancels what is queued
                return
        try:
            self._pool.submit(self._serve, key)
        except RuntimeError:  # the pool shut down (close(), or interpreter exit)
            with self._lock:
                stranded = self._lanes.pop(key, None) or ()
            for future, fn, args in stranded:
                future.cancel()
                _dropped(fn, args)

    # -- asyncio --------------------------------------------------------------

    async def put(self, key: Hashable, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`submit` for an event loop's feeder: waits while `max_pending` jobs
        of `put` are queued or running (backpressure), then returns the
        job's future without waiting for it.

        Jobs that end close together reach the loop together: a worker
        wakes the loop only when no wake-up is pending already, and the loop
        then frees every ended job's slot and completes its future in one
        callback (a thread-safe call per job, as `asyncio.wrap_future` makes
        two, costs a busy loop a wake-up each: 64 requests an emission are
        128 of them)."""
        completions = self._completions_for(asyncio.get_running_loop())
        await completions.slots.acquire()
        try:
            job = self.submit(key, fn, *args)
        except BaseException:
            completions.slots.release()
            raise
        waiter: asyncio.Future[T] = completions.loop.create_future()

        def cancel_if_not_started(awaited: asyncio.Future[T]) -> None:
            # Cancelling the awaitable drops a job not yet started; a running
            # job ends on its own and keeps its slot until then.
            if awaited.cancelled():
                job.cancel()

        waiter.add_done_callback(cancel_if_not_started)
        job.add_done_callback(functools.partial(completions.ended, waiter))
        return waiter

    def _completions_for(self, loop: asyncio.AbstractEventLoop) -> _Completions:
        if self._completions is None or self._completions.loop is not loop:
            self._completions = _Completions(loop, self.max_pending)
        return self._completions

    async def run(self, key: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """`submit`, awaited: the result (or the exception) of `fn(*args)`.
        It takes no slot, so it never queues behind `put`'s feeder: use it
        for work bounded by its callers (one response per client at a time).
        Cancelling the await cancels the job if it has not started. Every
        failure of the job completes the await (the module docstring says
        which exceptions become RuntimeError)."""
        return await asyncio.wrap_future(self.submit(key, fn, *args))

    # -- shutdown -------------------------------------------------------------

    def close(self) -> None:
        """Cancel every job not started, wait for the running ones (each is
        one job) and join the threads. Idempotent; `submit` raises after."""
        with self._lock:
            self._closed = True
            queued = [job for lane in self._lanes.values() for job in lane]
            for lane in self._lanes.values():
                lane.clear()
        for future, fn, args in queued:
            future.cancel()
            _dropped(fn, args)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Offload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

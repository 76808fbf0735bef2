"""Several response documents built at once: an emission's responses (one
per request) written in parallel, each whole on one thread.

A tokenizer gets every request's rows of an emission together. Writing them
one after another, each split across the JSON threads, pays a split and a
join per document and leaves the threads idle while the next document's
small Python part runs; giving each thread whole documents pays neither,
and the page faults of the fresh response memory are taken on every
thread at once. The builder (response_json.dumps) releases the GIL for its
native part, so plain Python threads run documents in parallel. That pays
where a document's native part is long against its Python part and the
GIL's hand-offs: a JSON document of 50 x 1000 entries (~2 ms of writing)
yes; binary rows of the same (~0.2 ms of base64) no (on the H200 host no
faster than each document split across the threads, on the 2-core VM 1.7x
slower): binary_rows.encode_meta_info_many makes one native call instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["map_documents"]


def map_documents(build: Callable[[Any, int], T], items: Sequence[Any], threads: int,
                  return_exceptions: bool = False) -> list[T | Exception]:
    """[build(item, threads_each) for item in items] on up to `threads`
    threads, in order. With at least as many items as threads each item is
    built whole by one thread (threads_each 1); fewer items share the
    threads. With `return_exceptions` an item's exception takes its place
    in the list; without, the first failure is raised once every item is
    done (the others' results are then dropped)."""
    if type(threads) is not int or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if not items:
        return []
    each = max(1, threads // len(items))  # threads per item

    def one(item: Any) -> Any:
        try:
            return build(item, each)
        except Exception as exc:  # kept in its place; raised below unless asked for
            return _Failed(exc)

    # On one of the pool's own threads (a builder that builds documents
    # itself) the items run here: waiting on the pool from inside it could
    # leave every thread waiting on work queued behind it.
    if min(threads, len(items)) == 1 or getattr(_worker, "in_pool", False):
        results = list(map(one, items))
    else:
        futures = [_document_pool(threads).submit(one, item) for item in items]
        try:
            results = [future.result() for future in futures]
        except BaseException:
            # KeyboardInterrupt, SystemExit...: no builder may still be
            # reading its chunk's rows once the caller unwinds (and releases
            # them): the ones not started are cancelled, the running awaited.
            for future in futures:
                future.cancel()
            wait(futures)
            raise
    failed = next((r for r in results if isinstance(r, _Failed)), None)
    if failed is not None and not return_exceptions:
        raise failed.exc
    return [r.exc if isinstance(r, _Failed) else r for r in results]


class _Failed:
    """An item's exception, marked apart from the results while they are
    collected (a builder could return an exception object as its value)."""

    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_worker = threading.local()  # in_pool: set on the pools' threads


def _mark_worker() -> None:
    _worker.in_pool = True


def _forget_pools() -> None:
    # A forked child has none of the parent's threads: a pool carried over
    # would queue work that no thread runs.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _document_pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool for writing whole documents on `threads` threads
    (one per thread count asked for; made once, reused by every call)."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="shmask-json",
                                                        initializer=_mark_worker)
        return pool

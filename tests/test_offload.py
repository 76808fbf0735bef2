"""shmask.offload: per-key order, parallel keys, backpressure, failures that
stay with their job, shutdown; and fold_ref on a real ring."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
from conftest import random_chunk

import shmask
from shmask.offload import Offload, default_threads, fold_ref

WAIT_S = 10  # a bound for waits that must not hang; no assertion is on speed


def test_one_key_in_order_and_never_two_at_once():
    log: dict[int, list[int]] = {0: [], 1: [], 2: []}
    running = {key: 0 for key in log}
    overlap = []
    lock = threading.Lock()

    def job(key: int, n: int) -> int:
        with lock:
            running[key] += 1
            overlap.append(running[key])
        time.sleep(random.random() / 2000)
        log[key].append(n)
        with lock:
            running[key] -= 1
        return n

    with Offload(threads=4) as offload:
        futures = [offload.submit(n % 3, job, n % 3, n) for n in range(300)]
        assert [f.result(WAIT_S) for f in futures] == list(range(300))
    for key, done in log.items():
        assert done == list(range(key, 300, 3))
    assert max(overlap) == 1


def test_keys_run_in_parallel():
    # Two jobs that each wait for the other: they finish only if both run
    # at once (on one key they would be serial and the barrier breaks).
    barrier = threading.Barrier(2, timeout=WAIT_S)
    with Offload(threads=2) as offload:
        futures = [offload.submit(key, barrier.wait) for key in ("a", "b")]
        assert sorted(f.result(WAIT_S) for f in futures) == [0, 1]
    barrier = threading.Barrier(2, timeout=0.5)
    with Offload(threads=2) as offload:
        futures = [offload.submit("same", barrier.wait) for _ in range(2)]
        with pytest.raises(threading.BrokenBarrierError):
            futures[0].result(WAIT_S)


def test_start_workers_starts_every_thread_before_any_job():
    """An asyncio program starts the pool's threads at its start, so that no
    request's first job starts one on the event loop: every worker is
    running after the call, and a job submitted after it starts none."""
    def workers(offload: Offload) -> set[int]:
        return {thread.ident for thread in offload._pool._threads}

    with Offload(threads=3) as offload:
        assert workers(offload) == set()
        offload.start_workers()
        started = workers(offload)
        assert len(started) == 3 and all(thread.is_alive() for thread in offload._pool._threads)
        assert offload.submit("k", threading.get_ident).result(WAIT_S) in started
        assert workers(offload) == started


def test_a_failure_stays_with_its_job():
    def fail() -> None:
        raise ValueError("request 3 is broken")

    with Offload(threads=2) as offload:
        broken = offload.submit(3, fail)
        after = offload.submit(3, lambda: "later job of the same key")
        other = offload.submit(4, lambda: "other key")
        with pytest.raises(ValueError, match="request 3 is broken"):
            broken.result(WAIT_S)
        assert after.result(WAIT_S) == "later job of the same key"
        assert other.result(WAIT_S) == "other key"


def test_put_waits_for_a_slot_and_run_does_not():
    async def main() -> None:
        release = threading.Event()
        with Offload(threads=2, max_pending=1) as offload:
            held = await offload.put("a", release.wait, WAIT_S)
            second = asyncio.ensure_future(offload.put("b", lambda: "second"))
            await asyncio.sleep(0.05)
            assert not second.done()  # the one slot is taken: the feeder waits
            # run takes no slot: the other worker serves it meanwhile.
            assert await asyncio.wait_for(offload.run("c", lambda: "run"), WAIT_S) == "run"
            assert not second.done()
            release.set()
            assert await held is True
            assert await (await asyncio.wait_for(second, WAIT_S)) == "second"

    asyncio.run(main())


def test_cancelling_a_put_does_not_free_the_slot_of_a_running_job():
    """The slot is the job's: a feeder that cancels the awaitable of a job
    already running must still wait, or max_pending stops bounding."""
    async def main() -> None:
        release = threading.Event()
        with Offload(threads=1, max_pending=1) as offload:
            held = await offload.put("a", release.wait, WAIT_S)
            await asyncio.sleep(0.05)  # the job is running now
            held.cancel()
            second = asyncio.ensure_future(offload.put("b", lambda: "second"))
            await asyncio.sleep(0.05)
            assert not second.done(), "a cancelled awaitable freed a running job's slot"
            release.set()
            assert await (await asyncio.wait_for(second, WAIT_S)) == "second"

    asyncio.run(main())


def test_run_returns_and_raises():
    async def main() -> None:
        with Offload(threads=2) as offload:
            assert await offload.run("k", sum, [1, 2, 3]) == 6
            with pytest.raises(ZeroDivisionError):
                await offload.run("k", lambda: 1 / 0)
            assert await offload.run("k", len, "abc") == 3

    asyncio.run(main())


def test_close_cancels_queued_jobs_and_waits_for_running_ones():
    started, release = threading.Event(), threading.Event()
    finished = []

    def running_job() -> str:
        started.set()
        release.wait(WAIT_S)
        finished.append(True)
        return "ran"

    offload = Offload(threads=1)
    first = offload.submit("a", running_job)
    queued = [offload.submit(key, lambda: "never") for key in ("a", "b", "c")]
    assert started.wait(WAIT_S)
    threading.Timer(0.1, release.set).start()
    offload.close()  # returns once the running job is done
    assert finished == [True] and first.result(0) == "ran"
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError, match="closed"):
        offload.submit("a", print)
    offload.close()  # idempotent


def test_bad_settings(monkeypatch):
    for threads in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="threads"):
            Offload(threads=threads)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending"):
        Offload(threads=1, max_pending=0)
    monkeypatch.setenv("SHMASK_OFFLOAD_THREADS", "3")
    assert default_threads() == 3
    for raw in ("0", "many", "1000"):
        monkeypatch.setenv("SHMASK_OFFLOAD_THREADS", raw)
        with pytest.raises(ValueError, match="SHMASK_OFFLOAD_THREADS"):
            default_threads()
    monkeypatch.delenv("SHMASK_OFFLOAD_THREADS")
    assert 1 <= default_threads() <= 8


def test_fold_ref_releases_the_chunk(writer, reader):
    rng = np.random.default_rng(7)
    rows = [random_chunk(rng, 5, 40) for _ in range(3)]
    refs = [writer.publish(*r) for r in rows]
    seen: list[shmask.Chunk] = []

    def fold(chunk: shmask.Chunk) -> int:
        assert not chunk.released
        seen.append(chunk)
        if len(seen) == 2:
            raise RuntimeError("fold failed")
        return int(chunk.lengths.sum())

    with Offload(threads=2) as offload:
        futures = [offload.submit("r", fold_ref, reader, ref, fold) for ref in refs]
        assert futures[0].result(WAIT_S) == rows[0][0].sum()
        with pytest.raises(RuntimeError, match="fold failed"):
            futures[1].result(WAIT_S)
        assert futures[2].result(WAIT_S) == rows[2][0].sum()
    assert all(chunk.released for chunk in seen)  # the failed fold's chunk too


class _Custom(BaseException):
    """A BaseException of the caller's own, not an Exception."""


# What a job raises -> what its future carries: Exceptions as raised;
# StopIteration and BaseExceptions that are not Exceptions as a RuntimeError
# caused by them (the module docstring says why).
_FAILURES = [(ValueError, ValueError), (StopAsyncIteration, StopAsyncIteration),
             (StopIteration, RuntimeError), (KeyboardInterrupt, RuntimeError),
             (SystemExit, RuntimeError), (GeneratorExit, RuntimeError),
             (asyncio.CancelledError, RuntimeError), (_Custom, RuntimeError)]


@pytest.mark.parametrize(("raised", "carried"), _FAILURES,
                         ids=[raised.__name__ for raised, _ in _FAILURES])
def test_every_way_a_job_can_fail_completes_its_future(raised, carried):
    """Issue 33 #5: a job raising StopIteration never completed the awaitable
    of run()/put() (asyncio refuses StopIteration on a Future), and one
    raising KeyboardInterrupt or SystemExit stopped the caller's event loop.
    Each form (run, put, submit) must complete with the job's failure within
    a bound, and the loop and the pool go on."""
    def job() -> None:
        raise raised("job failed")

    def check(error: BaseException) -> None:
        assert type(error) is carried
        if carried is not raised:
            assert type(error.__cause__) is raised
            assert raised.__name__ in str(error)

    async def main() -> None:
        with Offload(threads=2) as offload:
            for attempt in ("run", "put"):
                try:
                    if attempt == "run":
                        await asyncio.wait_for(offload.run("k", job), WAIT_S)
                    else:
                        await asyncio.wait_for(await offload.put("k", job), WAIT_S)
                except asyncio.TimeoutError:
                    pytest.fail(f"{attempt}: the job's awaitable never completed")
                except BaseException as error:  # noqa: BLE001 - checked below
                    check(error)
                else:
                    pytest.fail(f"{attempt}: the job's failure was lost")
            # The loop and the pool still serve (the key's lane too).
            assert await asyncio.wait_for(offload.run("k", len, "abc"), WAIT_S) == 3
            future = offload.submit("k", job)
            check(future.exception(WAIT_S))

    asyncio.run(main())


def test_fold_ref_jobs_that_never_run_give_their_chunks_back(writer, reader):
    """A fold_ref job cancelled before its turn (its future, or the await of
    run()), or dropped by close(), gives its chunk back unopened: the
    producer reclaims the ring at once instead of after the lease."""
    rng = np.random.default_rng(11)
    refs = [writer.publish(*random_chunk(rng, 3, 20)) for _ in range(3)]
    folded: list[shmask.Chunk] = []
    release = [threading.Event(), threading.Event()]

    def blocker(turn: int) -> None:
        assert release[turn].wait(WAIT_S)

    async def main() -> None:
        offload = Offload(threads=1)  # one worker: the blocker holds it
        offload.submit("a", blocker, 0)
        cancelled = offload.submit("b", fold_ref, reader, refs[0], folded.append)
        awaited = asyncio.ensure_future(offload.run("c", fold_ref, reader, refs[1],
                                                    folded.append))
        await asyncio.sleep(0)  # run() has submitted its job
        assert cancelled.cancel()
        awaited.cancel()
        with pytest.raises(asyncio.CancelledError):
            await awaited
        after = offload.submit("e", lambda: "after")  # served after "b" and "c" were
        release[0].set()
        assert after.result(WAIT_S) == "after"
        # close() drops a queued job: started in a thread, since it waits
        # for the running blocker, which is let go once the job is dropped.
        offload.submit("a", blocker, 1)
        dropped = offload.submit("d", fold_ref, reader, refs[2], folded.append)
        closing = threading.Thread(target=offload.close)
        closing.start()
        deadline = time.monotonic() + WAIT_S
        while not dropped.cancelled():
            assert time.monotonic() < deadline, "close() did not drop the queued job"
            await asyncio.sleep(0.01)
        release[1].set()
        closing.join(WAIT_S)
        assert not closing.is_alive()

    asyncio.run(main())
    assert folded == []  # none of them ran
    assert reader.stats.discards == 3
    writer.reclaim()
    assert writer.ring_usage()[0] == 0


def test_jobs_that_end_together_wake_the_loop_once():
    """put()'s jobs that end while the loop is busy reach it in one
    thread-safe call (not two per job, as wrap_future makes), and each
    future still gets its own job's result or exception."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        calls = 0
        threadsafe = loop.call_soon_threadsafe

        def counted(*args: object, **kwargs: object) -> asyncio.Handle:
            nonlocal calls
            calls += 1
            return threadsafe(*args, **kwargs)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def job(i: int) -> int:
            if i % 7 == 3:
                raise KeyError(i)
            return i * i

        with Offload(threads=2) as offload:
            futures = [await offload.put(i % 5, job, i) for i in range(50)]
            deadline = time.monotonic() + WAIT_S
            # A lane leaves _lanes after its last job's future is set (and so
            # after that job's hand-over was queued).
            while offload._lanes:
                assert time.monotonic() < deadline, "the jobs did not end"
                time.sleep(0.01)  # the loop is busy: every job ends meanwhile
            results = await asyncio.gather(*futures, return_exceptions=True)
        assert calls == 1, f"{calls} wake-ups of the loop for 50 jobs that ended together"
        for i, result in enumerate(results):
            if i % 7 == 3:
                assert isinstance(result, KeyError) and result.args == (i,)
            else:
                assert result == i * i

    asyncio.run(main())

"""Prometheus metrics: scraped and parsed from the exposition text, in one
process and in prometheus_client's multiprocess mode across real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import forked_answer, random_chunk

import shmask
from shmask import metrics

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def registry():
    registry = prometheus_client.CollectorRegistry()
    metrics.enable(registry)
    yield registry
    metrics.disable()


def test_scrape_counts_producer_and_reader(registry, prefix):
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue("support") for _ in range(4)]
        for _ in range(3):
            writer.append_step(queues, np.full(4, 5, np.int32), np.arange(20, dtype=np.int32),
                               np.zeros(20, np.float32))
        batch = writer.take_batch(queues)
        for ref in list(batch)[:2]:
            reader.open(ref).release()
        assert reader.discard_batch(batch.select([2, 3])) == 2
        with pytest.raises(shmask.ShmaskError):
            reader.open(batch[0])  # released already
        rng = np.random.default_rng(0)
        held = [writer.publish(*random_chunk(rng, 8, 200, vocab=5000)) for _ in range(200)]
        inline = sum(ref.inline for ref in held)
        assert inline > 0, "the 1 MiB ring should have filled"
        reader.discard_batch(held)
        used, capacity = writer.ring_usage()
        ring = (("segment", writer.segment_name),)
        live = _samples(prometheus_client.generate_latest(registry).decode())
    samples = _samples(prometheus_client.generate_latest(registry).decode())
    assert samples[("shmask_producer_chunks_total", ())] == 4 + 200
    assert samples[("shmask_producer_rows_total", ())] == 12 + sum(r.rows for r in held)
    assert samples[("shmask_producer_inline_chunks_total", (("reason", "ring_full"),))] == inline
    assert samples[("shmask_producer_full_ring_waits_total", ())] >= 1
    assert samples[("shmask_reader_opens_total", ())] == 2
    assert samples[("shmask_reader_discards_total", ())] == 2 + 200 - inline
    assert samples[("shmask_reader_invalid_total", ())] + samples[
        ("shmask_reader_stale_total", ())] == 1
    assert live[("shmask_ring_capacity_bytes", ring)] == capacity
    assert live[("shmask_ring_used_bytes", ring)] == used
    assert ("shmask_ring_capacity_bytes", ring) not in samples  # cleared at close


def test_take_batch_counts_what_it_published(prefix):
    """The producer counters (Writer.stats, which the metrics report) after
    takes of queues in both modes, one left empty: the core adds up each
    ring chunk's rows and payload bytes as it publishes them."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        support = writer.open_queue("support")
        selected = [writer.open_queue("selected") for _ in range(2)]
        queues = [support, *selected]
        expected = {"chunks": 0, "rows": 0, "payload_bytes": 0}
        for step in range(3):
            width = step + 2
            writer.append_step([support], np.array([width], np.int32),
                               np.arange(width, dtype=np.int32), np.zeros(width, np.float32))
            writing = selected if step == 0 else selected[:1]
            writer.append_step(writing, np.full(len(writing), 3, np.int32),
                               np.arange(3 * len(writing), dtype=np.int32),
                               np.zeros(len(writing), np.float32))
            batch = writer.take_batch(queues)
            shm = batch.entries[batch.entries["kind"] == shmask.refs.KIND_SHM]
            assert len(shm) == (3 if step == 0 else 2)  # the third queue had no rows
            expected["chunks"] += len(shm)
            expected["rows"] += int(shm["rows"].sum())
            expected["payload_bytes"] += int(shmask.refs.payload_bytes(
                shm["mode"], shm["rows"].astype(np.uint64), shm["words"].astype(np.uint64),
                shm["nnz"]).sum())
            reader.discard_batch(batch)
            assert {key: getattr(writer.stats, key) for key in expected} == expected
        assert expected["rows"] == 3 + 2 * 2 and expected["payload_bytes"] > 0


def test_a_take_counts_ring_chunks_around_a_private_one(prefix):
    """A queue staged in private memory (its row larger than the ring) goes
    inline in the middle of a take: the core's totals of the ring chunks
    on either side of it add up across the calls the take makes (none is
    lost or counted twice), and the inline chunk is counted as inline."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1, max_tokens=1 << 19)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue("selected") for _ in range(3)]
        big = 300_000  # 1.2 MB of ids: no room in a 1 MiB ring
        writer.append_step(queues, np.array([2, big, 3], np.int32),
                           np.arange(5 + big, dtype=np.int32), np.zeros(3, np.float32))
        batch = writer.take_batch(queues)
        kinds = batch.entries["kind"].tolist()
        assert kinds == [shmask.refs.KIND_SHM, shmask.refs.KIND_INLINE, shmask.refs.KIND_SHM]
        every = batch.entries  # the inline entry's counts are its payload's
        stats = writer.stats
        assert (stats.chunks, stats.rows, stats.inline_chunks) == (3, 3, 1)
        assert stats.payload_bytes == int(shmask.refs.payload_bytes(
            every["mode"], every["rows"].astype(np.uint64), every["words"].astype(np.uint64),
            every["nnz"]).sum())
        nnz = []
        for ref in batch:
            with reader.open(ref) as chunk:
                nnz.append(chunk.nnz)
        assert nnz == [2, big, 3]


def test_multiprocess_mode_adds_up_across_processes(tmp_path, prefix):
    """Two producers and a reader, each its own process, with
    PROMETHEUS_MULTIPROC_DIR: the aggregated scrape sums them."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), SHMASK_NAME_PREFIX=prefix)
    producer = textwrap.dedent("""
        import sys, numpy as np, shmask, shmask.metrics
        shmask.metrics.enable()
        with shmask.Writer() as writer:
            queues = [writer.open_queue("selected") for _ in range(3)]
            writer.append_step(queues, np.array([1, 2, 3], np.int32),
                               np.arange(6, dtype=np.int32), np.zeros(3, np.float32))
            sys.stdout.buffer.write(writer.take_batch(queues).to_bytes())
    """)
    batches = [subprocess.run([sys.executable, "-c", producer], env=env, capture_output=True,
                              timeout=60, check=True).stdout for _ in range(2)]
    # The producers have exited (their rings are gone): the reader gets
    # clear errors, counted as stale.
    reader = textwrap.dedent("""
        import sys, shmask, shmask.metrics
        shmask.metrics.enable()
        data = sys.stdin.buffer.read()
        half = len(data) // 2
        with shmask.Reader() as reader:
            for raw in (data[:half], data[half:]):
                for ref in shmask.RefBatch.from_bytes(raw):
                    try:
                        reader.open(ref)
                    except shmask.StaleChunkError:
                        pass
    """)
    assert len(batches[0]) == len(batches[1])
    subprocess.run([sys.executable, "-c", reader], env=env, input=b"".join(batches),
                   timeout=60, check=True)
    scrape = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(generate_latest(registry).decode())
    """)
    text = subprocess.run([sys.executable, "-c", scrape], env=env, capture_output=True,
                          text=True, timeout=60, check=True).stdout
    samples = _samples(text)
    assert samples[("shmask_producer_chunks_total", ())] == 6
    assert samples[("shmask_producer_rows_total", ())] == 6
    assert samples[("shmask_reader_stale_total", ())] == 6


def _ring_gauges(registry) -> dict[str, tuple[float, float]]:
    """segment -> (used, capacity) from a scrape."""
    samples = _samples(prometheus_client.generate_latest(registry).decode())
    out: dict[str, list[float]] = {}
    for (name, labels), value in samples.items():
        if name in ("shmask_ring_used_bytes", "shmask_ring_capacity_bytes"):
            slot = out.setdefault(dict(labels)["segment"], [0.0, 0.0])
            slot[name == "shmask_ring_capacity_bytes"] = value
    return {segment: (used, capacity) for segment, (used, capacity) in out.items()}


def test_two_writers_in_one_process_show_two_rings_and_close_clears_each(registry, prefix):
    small = shmask.Writer(shmask.Config(ring_mb=8, name_prefix=prefix))
    large = shmask.Writer(shmask.Config(ring_mb=16, name_prefix=prefix))
    try:
        for writer in (small, large):
            queue = writer.open_queue("selected")
            writer.append_step([queue], np.array([3], np.int32), np.arange(3, dtype=np.int32),
                               np.zeros(1, np.float32))
            shmask.Reader(writer.config).discard_batch(writer.take_batch([queue]))
        gauges = _ring_gauges(registry)
        assert gauges[small.segment_name][1] == 8 << 20
        assert gauges[large.segment_name][1] == 16 << 20
        assert gauges[small.segment_name][0] > 0  # the chunk's record until reclaimed
        small.close()
        gauges = _ring_gauges(registry)
        assert small.segment_name not in gauges
        assert gauges[large.segment_name][1] == 16 << 20
    finally:
        small.close()
        large.close()
    assert _ring_gauges(registry) == {}


def test_sync_metrics_shows_a_new_ring_before_its_first_emission(registry, prefix):
    with shmask.Writer(shmask.Config(ring_mb=2, name_prefix=prefix)) as writer:
        assert _ring_gauges(registry) == {}
        writer.sync_metrics()
        assert _ring_gauges(registry) == {writer.segment_name: (0, 2 << 20)}


def test_constant_labels_are_added_to_every_metric(prefix):
    registry = prometheus_client.CollectorRegistry()
    metrics.enable(registry, labels={"tp_rank": 1, "dp_rank": "0"})
    try:
        with shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)) as writer:
            queue = writer.open_queue("selected")
            writer.append_step([queue], np.array([2], np.int32), np.arange(2, dtype=np.int32),
                               np.zeros(1, np.float32))
            shmask.Reader(writer.config).discard_batch(writer.take_batch([queue]))
            samples = _samples(prometheus_client.generate_latest(registry).decode())
            rank = (("dp_rank", "0"), ("tp_rank", "1"))
            assert samples[("shmask_producer_chunks_total", rank)] == 1
            assert samples[("shmask_ring_capacity_bytes",
                            tuple(sorted(rank + (("segment", writer.segment_name),))))] == 1 << 20
    finally:
        metrics.disable()
    with pytest.raises(ValueError, match="tp_rank"):
        metrics.enable(registry, labels={"rank": 1})  # other names: the registry has tp_rank
    assert not metrics.enabled()
    with pytest.raises(ValueError, match="segment"):
        metrics.enable(prometheus_client.CollectorRegistry(), labels={"segment": 1})


def test_dead_writer_rings_stay_until_mark_process_dead(tmp_path, prefix):
    """Multiprocess mode: a producer that closed its Writer shows 0; one that
    died without closing keeps its livesum gauges until
    multiprocess.mark_process_dead(pid) removes its files."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), SHMASK_NAME_PREFIX=prefix,
               SHMASK_RING_MB="1")
    producer = textwrap.dedent("""
        import os, sys, shmask, shmask.metrics
        shmask.metrics.enable()
        closed, dying = shmask.Writer(), shmask.Writer()
        closed.sync_metrics(); dying.sync_metrics()
        closed.close()
        print(os.getpid(), closed.segment_name, dying.segment_name, flush=True)
        os._exit(0)   # dies without closing `dying` (its segment is collected below)
    """)
    proc = subprocess.Popen([sys.executable, "-c", producer], env=env, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    pid, closed, dying = out.split()
    scrape = textwrap.dedent("""
        import sys
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        if len(sys.argv) > 1:
            multiprocess.mark_process_dead(int(sys.argv[1]))
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(generate_latest(registry).decode())
    """)

    def capacities(*args: str) -> dict[str, float]:
        text = subprocess.run([sys.executable, "-c", scrape, *args], env=env,
                              capture_output=True, text=True, timeout=60, check=True,
                              start_new_session=True).stdout
        return {dict(labels)["segment"]: value
                for (name, labels), value in _samples(text).items()
                if name == "shmask_ring_capacity_bytes"}

    try:
        assert capacities() == {closed: 0, dying: 1 << 20}
        assert capacities(pid) == {}
    finally:
        # The dead producer's segment: a new Writer collects it.
        with shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)):
            pass


def test_threads_sharing_a_reader_count_every_open_once(registry, prefix):
    """Issue 33 #8: threads sharing one Reader synced its one snapshot
    without a lock, so two syncs could hand over the same increments
    (120,768-122,304 counted for 120,000 opens). Every thread also syncs
    after each open (Reader.sync_metrics), so the syncs overlap all the
    time; the counter must still equal reader.stats exactly."""
    threads, rounds, per_round = 4, 12, 1000
    config = shmask.Config(ring_mb=4, name_prefix=prefix, lease_s=600)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the syncs interleave
    try:
        with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
            queues = [writer.open_queue("selected") for _ in range(per_round)]
            errors: list[BaseException] = []

            def open_share(share: list) -> None:
                try:
                    for ref in share:
                        reader.open(ref).release()
                        reader.sync_metrics()
                except BaseException as exc:  # noqa: BLE001 - shown by the assert below
                    errors.append(exc)

            for _ in range(rounds):
                writer.append_step(queues, np.ones(per_round, np.int32),
                                   np.arange(per_round, dtype=np.int32),
                                   np.zeros(0, np.float32), np.zeros(per_round, np.float32))
                refs = list(writer.take_batch(queues))
                workers = [threading.Thread(target=open_share, args=(refs[i::threads],))
                           for i in range(threads)]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join(60)
                assert not errors and not any(w.is_alive() for w in workers), errors
                writer.reclaim()
            reader.sync_metrics()
            opens = reader.stats.opens
    finally:
        sys.setswitchinterval(switch_interval)
    assert opens == rounds * per_round
    samples = _samples(prometheus_client.generate_latest(registry).decode())
    assert samples[("shmask_reader_opens_total", ())] == opens


def test_a_child_forked_during_a_sync_can_sync(registry, prefix):
    """The sync lock is made anew in a forked child: a fork while another
    thread holds it (mid-sync) must not leave the child's first sync
    blocked forever."""
    with shmask.Reader(shmask.Config(ring_mb=1, name_prefix=prefix)) as reader:
        with metrics._sync_lock:  # held as by another thread mid-sync when the fork comes
            answer = forked_answer(lambda: (reader.sync_metrics(), b"synced")[1], timeout=30)
    assert answer == b"synced"

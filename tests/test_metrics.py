"""Prometheus metrics: scraped and parsed from the exposition text, in one
process and in prometheus_client's multiprocess mode across real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import random_chunk

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
    samples = _samples(prometheus_client.generate_latest(registry).decode())
    assert samples[("shmask_producer_chunks_total", ())] == 4 + 200
    assert samples[("shmask_producer_rows_total", ())] == 12 + sum(r.rows for r in held)
    assert samples[("shmask_producer_inline_chunks_total", (("reason", "ring_full"),))] == inline
    assert samples[("shmask_producer_full_ring_waits_total", ())] >= 1
    assert samples[("shmask_reader_opens_total", ())] == 2
    assert samples[("shmask_reader_discards_total", ())] == 2 + 200 - inline
    assert samples[("shmask_reader_invalid_total", ())] + samples[
        ("shmask_reader_stale_total", ())] == 1
    assert samples[("shmask_ring_capacity_bytes", ())] == capacity
    assert samples[("shmask_ring_used_bytes", ())] == used


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

"""GPU-direct publishing (kernels/direct.py) against a real Writer and Reader.

Without a GPU the kernel runs in Triton's interpreter and writes the ring
through host addresses; with SHMASK_TEST_GPU=1 it runs on CUDA against the
registered ring. Either way every chunk must be bit-identical to what the
CPU path (HostStaging + kernels.publish) sends for the same steps, and to
the rows the kernels produced, through growth (diverted rows), wrap-around,
inline fallback and aborted queues."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from shmask.kernels import HostStaging, capture, compact, publish, publisher_for, sample
from shmask.kernels.direct import DirectPublisher, reference_direct

import shmask
from shmask.errors import InvalidRowsError

GPU = os.environ.get("SHMASK_TEST_GPU") == "1"
DEVICE = "cuda" if GPU else "cpu"
# The long random runs are sized for where they run: hundreds of steps on
# CUDA (make test-gpu), a few under Triton's interpreter (make test), where
# one capture step costs seconds on a busy 2-core machine; the short runs
# take and end requests more often, so each still covers what it claims.
TAKE_P, END_P = (0.1, 0.05) if GPU else (0.3, 0.2)
VOCAB = 2048
MAX_TOKENS = 48  # an OK row is a bitmask iff L > 48 or 32 L >= 2048 (L >= 64)
BATCH = 8


def inputs_pool(count: int, seed: int, batch: int = BATCH) -> list[dict]:
    """capture()'s arguments for steps of mixed forms and statuses: ids rows,
    bitmask rows (past max_tokens, or dense), OVERFLOW (overflow="status"),
    INVALID (sampled outside the support), greedy and SKIPPED (not opted in)."""
    gen = torch.Generator().manual_seed(seed)
    pool = []
    for index in range(count):
        probs = torch.softmax(torch.randn(batch, VOCAB, generator=gen) * 4, -1)
        top_k = torch.tensor([1, 3, 40, 47, 60, 120, 700, 1500][:batch] * (batch // 8 + 1),
                             dtype=torch.int32)[:batch]
        top_k = top_k[torch.randperm(batch, generator=gen)]
        sampled = probs.argmax(1)
        wrong = torch.rand(batch, generator=gen) < 0.1  # INVALID: outside its support
        sampled = torch.where(wrong, (sampled + VOCAB // 2) % VOCAB, sampled)
        opted = torch.rand(batch, generator=gen) > 0.1  # SKIPPED rows
        greedy = torch.rand(batch, generator=gen) < 0.1
        pool.append({"probs": probs.to(DEVICE), "sampled": sampled.to(DEVICE),
                     "top_k": top_k.to(DEVICE), "rows": opted.to(DEVICE),
                     "greedy": greedy.to(DEVICE), "max_tokens": MAX_TOKENS,
                     "overflow": "status" if index % 3 == 0 else "exact"})
    return pool


def rows_pool(count: int, seed: int, batch: int = BATCH) -> list:
    """Captured steps of inputs_pool's mix."""
    return [capture(inputs.pop("probs"), inputs.pop("sampled"), **inputs)
            for inputs in inputs_pool(count, seed, batch)]


def chunk_rows(chunk: shmask.Chunk) -> tuple:
    """A chunk's rows exactly as stored: lengths, flags, id data, logprob bits."""
    flags = chunk.flags if chunk.flags is not None else np.zeros(chunk.rows, np.uint8)
    return (chunk.lengths.tolist(), flags.tolist(), chunk.ids.tolist(),
            np.asarray(chunk.logprobs, np.float32).view(np.uint32).tolist())


def expected_rows(rows: list) -> tuple:
    """What chunk_rows gives for a queue that received `rows` (reference_direct's)."""
    lengths = [r[1] for r in rows]
    flags = [r[0] for r in rows]
    ids = [i for r in rows for i in r[2]]
    bits = np.asarray([v for r in rows for v in r[3]], np.float32).view(np.uint32).tolist()
    return lengths, flags, ids, bits


class Producer:
    """One Writer and its queues, fed by the CPU path or the direct path."""

    def __init__(self, config: shmask.Config, direct: bool, mode: str) -> None:
        self.writer = shmask.Writer(config)
        self.mode = mode
        self.publisher = DirectPublisher(self.writer) if direct else None
        self.staging = HostStaging()
        self.queues = [self.writer.open_queue(mode) for _ in range(BATCH)]

    def step(self, rows) -> None:
        handles = np.array([q.handle for q in self.queues], np.int64)
        if self.publisher is not None:
            self.publisher.publish(handles, rows, self.mode)
        else:
            publish(self.writer, handles, self.staging.fetch(rows, values=self.mode == "support"),
                    self.mode)

    def take(self) -> shmask.RefBatch:
        return self.writer.take_batch(self.queues)

    def replace(self, index: int, abort: bool) -> None:
        if abort:
            self.queues[index].abort()
        else:
            self.queues[index].close()
        self.queues[index] = self.writer.open_queue(self.mode)

    def close(self) -> None:
        self.writer.close()


def read_batch(reader: shmask.Reader, batch: shmask.RefBatch, held: list) -> list:
    """Each chunk's rows; some chunks stay open a while (ring pressure)."""
    out = []
    for ref in batch:
        chunk = reader.open(ref)
        out.append(chunk_rows(chunk))
        held.append(chunk)
    while len(held) > 8 * BATCH:
        release(held.pop(0))
    return out


def table_entry(publisher: DirectPublisher, slot: int):
    """The device-visible table's entry of a queue slot (read only)."""
    from shmask._native import ffi, lib

    table = ffi.cast("char *", publisher._direct.table) + lib.SHM_DIRECT_HEADER_BYTES
    return ffi.cast("shm_direct_entry *", table)[slot]


def release(chunk: shmask.Chunk) -> None:
    try:
        chunk.release()
    except shmask.StaleChunkError:
        pass  # an aborted queue's chunks were given back already


class Twins:
    """The CPU path and the direct path fed the same steps, read by one
    Reader: every take compares both with the kernels' rows."""

    def __init__(self, config: shmask.Config, mode: str) -> None:
        self.mode = mode
        self.cpu, self.gpu = Producer(config, False, mode), Producer(config, True, mode)
        assert self.gpu.publisher is not None and self.gpu.publisher.active
        self.reader = shmask.Reader(config)
        self.held: list = []
        self.pending: list[list] = [[] for _ in range(BATCH)]  # rows per queue since its take
        self.compared = 0
        self.ended = {"closed": 0, "aborted": 0}

    def handles(self) -> np.ndarray:
        return np.array([q.handle for q in self.gpu.queues], np.int64)

    def sent(self, rows) -> None:
        """The direct path has this step's rows: the CPU path gets them too."""
        self.cpu.step(rows)
        for b, row in enumerate(reference_direct(rows, self.mode)):
            if row is not None:
                self.pending[b].append(row)

    def take_and_compare(self, step: int) -> None:
        got_cpu = read_batch(self.reader, self.cpu.take(), self.held)
        got_gpu = read_batch(self.reader, self.gpu.take(), self.held)
        for b in range(BATCH):
            want = expected_rows(self.pending[b]) if self.pending[b] else ([], [], [], [])
            assert got_gpu[b] == got_cpu[b], f"step {step} queue {b}"
            assert got_gpu[b] == want, f"step {step} queue {b}"
            self.compared += len(self.pending[b])
        self.pending = [[] for _ in range(BATCH)]

    def end_one(self, rng: np.random.Generator) -> None:
        """A request ends or is aborted mid-emission; a new one takes its place."""
        b, abort = int(rng.integers(BATCH)), bool(rng.random() < 0.5)
        self.cpu.replace(b, abort)
        self.gpu.replace(b, abort)
        self.pending[b] = []
        self.ended["aborted" if abort else "closed"] += 1

    def close(self) -> None:
        for chunk in self.held:
            release(chunk)
        self.reader.close()
        self.cpu.close()
        self.gpu.close()


def fused_run(config: shmask.Config, mode: str, steps: int, seed: int, step) -> dict:
    """`steps` calls of ``step(rng, into)`` (a kernel called with into=, so
    the direct path's rows come from the kernel itself) through Twins, with
    takes at random (each compared) and requests that end or abort. Returns
    the direct path's stats, every step checked fused, requests closed and
    aborted on the way."""
    rng = np.random.default_rng(seed)
    twins = Twins(config, mode)
    try:
        for index in range(steps):
            twins.sent(step(rng, (twins.gpu.writer, twins.handles(), mode)))
            if rng.random() < TAKE_P or index == steps - 1:
                twins.take_and_compare(index)
            if rng.random() < END_P:
                twins.end_one(rng)
        stats = twins.gpu.publisher.stats
        assert stats["fused_steps"] == stats["direct_steps"] == steps
        assert twins.compared > steps
        assert min(twins.ended.values()) > 0, twins.ended
        return stats
    finally:
        twins.close()


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_direct_rows_equal_cpu_path_over_a_long_random_run(prefix: str, mode: str) -> None:
    """Growth (2-row first buffers), diverted rows, a 1 MiB ring that wraps
    and fills (private staging, inline chunks), closed and aborted queues:
    the direct path's chunks equal the CPU path's and the kernels' rows."""
    # support needs its 200 interpreter steps: a 1 MiB ring (the least) wraps twice at ~150
    steps = 400 if GPU else 200 if mode == "support" else 60
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1, lease_s=60,
                           queue_rows=2, max_tokens=MAX_TOKENS)
    pool = rows_pool(12 if GPU else 6, seed=1)
    rng = np.random.default_rng(7)
    twins = Twins(config, mode)
    try:
        for step in range(steps):
            rows = pool[int(rng.integers(len(pool)))]
            twins.gpu.step(rows)
            twins.sent(rows)
            if rng.random() < 0.08 or step == steps - 1:
                twins.take_and_compare(step)
            if rng.random() < 0.05:
                twins.end_one(rng)
        stats = twins.gpu.publisher.stats
        # The run exercised what it claims: kernel steps, the ring's wrap
        # and its inline fallback; in support mode diverted rows (rows of
        # more values than the room kept per step, MAX_TOKENS); in selected
        # mode the room kept ahead (one row of a whole bitmask per queue per
        # step, growth on the CPU before the launch) means no row diverts.
        assert stats["direct_steps"] == steps
        assert (stats["diverted_rows"] > 0) == (mode == "support")
        if mode == "support":  # selected rows are too small to fill the ring in this run
            ring = twins.gpu.writer.ring_handle
            assert ring.head > 2 * ring.capacity, "the ring wrapped"
            assert twins.gpu.writer.stats.inline_ring_full > 0
        assert twins.compared > steps
        assert min(twins.ended.values()) > 0, twins.ended
    finally:
        twins.close()


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_capture_into_stores_from_its_own_kernel_over_a_long_random_run(
        prefix: str, mode: str) -> None:
    """capture(..., into=) on the GPU-direct path: its write kernel stores
    each row into the ring as it computes it. Every chunk equals what the
    CPU path sends for the same rows, through growth, diverted rows (support
    rows past the room kept), a ring that fills, takes at random and
    requests that end or abort."""
    steps = 300 if GPU else 8
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1, lease_s=60,
                           queue_rows=2, max_tokens=MAX_TOKENS)
    pool = inputs_pool(6, seed=12)

    def step(rng: np.random.Generator, into: tuple):
        inputs = dict(pool[int(rng.integers(len(pool)))])
        return capture(inputs.pop("probs"), inputs.pop("sampled"), **inputs, into=into)

    stats = fused_run(config, mode, steps, 17, step)
    assert (stats["diverted_rows"] > 0) == (mode == "support")


def compact_pool(count: int, seed: int) -> list[dict]:
    """compact()'s arguments for steps of every kind of row: ids rows, bitmask
    rows (past max_tokens, or dense), OVERFLOW (overflow="status"), empty
    rows and SKIPPED rows. Columns of 256 and expand groups of two chunks make
    four expand programs per row (each stores its part of the row); scan
    steps of 4 rows make the claims two blocks."""
    gen = torch.Generator().manual_seed(seed)
    pool = []
    for index in range(count):
        keep = torch.rand(BATCH, 1, generator=gen) ** 3  # row densities from ~0 to 1
        kept = torch.rand(BATCH, VOCAB, generator=gen) < keep * 0.2
        kept[torch.randperm(BATCH, generator=gen)[0]] = False  # an empty row
        logits = torch.where(kept, torch.randn(BATCH, VOCAB, generator=gen), -float("inf"))
        pool.append({"x": logits.to(DEVICE), "rows": (torch.rand(BATCH, generator=gen) > 0.1)
                     .to(DEVICE), "overflow": "status" if index % 3 == 0 else "exact"})
    return pool


def test_compact_into_stores_from_its_expand_kernel_over_a_long_random_run(
        prefix: str) -> None:
    """compact(..., into=) on the GPU-direct path: the scan kernel claims
    each row's place in its queue and the expand kernel's programs store
    their parts of the row there; the row's last program commits it. Every
    chunk equals what the CPU path sends for the same rows, through growth,
    diverted rows, a ring that fills, takes at random and requests that end
    or abort."""
    steps = 300 if GPU else 10
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1, lease_s=60,
                           queue_rows=2, max_tokens=MAX_TOKENS)
    pool = compact_pool(6, seed=15)

    def step(rng: np.random.Generator, into: tuple):
        inputs = pool[int(rng.integers(len(pool)))]
        return compact(inputs["x"], MAX_TOKENS, rows=inputs["rows"],
                       overflow=inputs["overflow"], chunk=256, expand_words=16, scan_rows=4,
                       into=into)

    assert fused_run(config, "support", steps, 16, step)["diverted_rows"] > 0


def test_a_step_the_table_cannot_take_goes_the_cpu_path_in_order(prefix: str) -> None:
    """Two rows of one queue in a step (speculative decoding) take the CPU
    path, after the GPU's earlier rows; a closed queue's handle is refused."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    pool = rows_pool(2, seed=3)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        publisher = DirectPublisher(writer)
        queues = [writer.open_queue() for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        publisher.publish(handles, pool[0])
        repeated = handles.copy()
        repeated[1] = handles[0]
        publisher.publish(repeated, pool[1])
        assert publisher.stats["direct_steps"] == 1 and publisher.stats["cpu_steps"] == 1
        batch = writer.take_batch(queues)
        first, second = reference_direct(pool[0]), reference_direct(pool[1])
        want0 = [r for r in (first[0], second[0], second[1]) if r is not None]
        chunk = reader.open(batch[0])
        assert chunk_rows(chunk) == expected_rows(want0)
        chunk.release()
        for ref in list(batch)[1:]:
            reader.open(ref).release()
        queues[2].close()
        with pytest.raises(InvalidRowsError, match="handle"):
            publisher.publish(handles, pool[0])


def test_close_waits_and_unregisters_and_the_writer_hook_is_removed(prefix: str) -> None:
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    pool = rows_pool(1, seed=4)
    writer = shmask.Writer(config)
    publisher = DirectPublisher(writer)
    queues = [writer.open_queue() for _ in range(BATCH)]
    publisher.publish(np.array([q.handle for q in queues], np.int64), pool[0])
    want = [r for r in reference_direct(pool[0])]
    assert [q.rows for q in queues] == [0 if r is None else 1 for r in want]
    with pytest.raises(ValueError, match="already has a DirectPublisher"):
        DirectPublisher(writer)
    writer.close()
    assert writer.attached is None and not publisher.active and not publisher._registered


def test_no_ring_means_the_cpu_path_with_one_warning(prefix: str, caplog) -> None:
    config = shmask.Config(transport="inline", name_prefix=prefix, max_tokens=MAX_TOKENS)
    pool = rows_pool(1, seed=5)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        with caplog.at_level(logging.WARNING, logger="shmask"):
            publisher = DirectPublisher(writer)
        assert not publisher.active and "no ring" in publisher.reason
        assert sum("GPU-direct publishing is off" in r.message for r in caplog.records) == 1
        queues = [writer.open_queue() for _ in range(BATCH)]
        publisher.publish(np.array([q.handle for q in queues], np.int64), pool[0])
        assert publisher.stats["cpu_steps"] == 1
        batch = writer.take_batch(queues)
        for ref, row in zip(batch, reference_direct(pool[0]), strict=True):
            chunk = reader.open(ref)
            assert chunk_rows(chunk) == (expected_rows([row]) if row else ([], [], [], []))
            chunk.release()


def test_reused_slots_never_receive_rows_into_a_closed_queues_buffer(prefix: str) -> None:
    """Close (or abort) a queue every step, without a take, so slots come
    back (oldest first) while the table is live: each new queue's rows must
    land in its own buffer, never in the buffer its slot had before."""
    STEPS = 300  # noqa: N806 (a queue closed every third step but the takes': 90)
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    pool = rows_pool(3, seed=6, batch=2)
    rng = np.random.default_rng(11)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        publisher = DirectPublisher(writer)
        queues = [writer.open_queue() for _ in range(2)]
        pending: list[list] = [[] for _ in range(2)]
        reused = 0
        seen = {q.slot for q in queues}
        for step in range(STEPS):
            rows = pool[step % len(pool)]
            publisher.publish(np.array([q.handle for q in queues], np.int64), rows)
            for b, row in enumerate(reference_direct(rows)):
                if row is not None:
                    pending[b].append(row)
            if step % 10 == 9:
                for b, ref in enumerate(writer.take_batch(queues)):
                    chunk = reader.open(ref)
                    assert chunk_rows(chunk) == expected_rows(pending[b]), f"step {step}"
                    chunk.release()
                pending = [[] for _ in range(2)]
                writer.reclaim()
                continue
            if step % 3:
                continue  # so that no diversion (a fresh queue's first row) pushes the table
            b = int(rng.integers(2))
            old_slot = queues[b].slot
            if step % 2:
                queues[b].abort()
            else:
                queues[b].close()
            # The GPU gets no room in a closed queue's buffer (its kernel
            # could otherwise write into memory the ring reuses).
            assert table_entry(publisher, old_slot).rows_capacity == 0
            queues[b] = writer.open_queue()
            reused += queues[b].slot in seen  # a slot an earlier queue had
            seen.add(queues[b].slot)
            pending[b] = []
        assert publisher.stats["direct_steps"] == STEPS
        # 90 queues opened over 64 slots: the table wrapped, slots came back
        assert writer.ring_handle.n_queues == 64 and reused >= 20, reused


def test_kernels_publish_of_device_rows_is_gpu_direct_unless_switched_off(prefix: str) -> None:
    """The default an engine gets: kernels.publish(writer, queues, rows) with
    the device Rows goes through the Writer's publisher (made on first use,
    the same one every step); SHMASK_GPU_DIRECT=off sends the same rows
    through the host copy. Both deliver the kernels' rows exactly."""
    pool = rows_pool(3, seed=8)
    delivered = {}
    for setting in ("auto", "off"):
        config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS,
                               gpu_direct=setting)
        with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
            queues = [writer.open_queue() for _ in range(BATCH)]
            for rows in pool:
                assert publish(writer, queues, rows) is None  # statuses stay on the device
            publisher = publisher_for(writer)
            assert publisher is publisher_for(writer)
            assert publisher.active == (setting == "auto")
            assert publisher.stats["direct_steps" if setting == "auto" else "cpu_steps"] == 3
            chunks = [reader.open(ref) for ref in writer.take_batch(queues)]
            delivered[setting] = [chunk_rows(chunk) for chunk in chunks]
            for chunk in chunks:
                chunk.release()
    want = [expected_rows([r for r in rows if r is not None])
            for rows in zip(*(reference_direct(rows) for rows in pool), strict=True)]
    assert delivered["auto"] == delivered["off"] == want


def test_a_closed_writer_and_its_publisher_are_collected(prefix: str) -> None:
    """The publisher kernels.publish makes lives as long as its Writer, not
    longer: once the Writer is closed and dropped, both are collected (GPU
    direct or the CPU path)."""
    import gc
    import weakref

    rows = rows_pool(1, seed=18)[0]
    for setting in ("auto", "off"):
        config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS,
                               gpu_direct=setting)
        writer = shmask.Writer(config)
        queues = [writer.open_queue() for _ in range(BATCH)]
        publish(writer, queues, rows)
        writer_ref, publisher_ref = weakref.ref(writer), weakref.ref(publisher_for(writer))
        writer.close()
        del writer, queues
        gc.collect()
        assert writer_ref() is None and publisher_ref() is None, setting


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_capture_into_publishes_the_rows_it_returns(prefix: str, mode: str) -> None:
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    gen = torch.Generator().manual_seed(9)
    probs = torch.softmax(torch.randn(BATCH, VOCAB, generator=gen) * 4, -1).to(DEVICE)
    sampled = probs.argmax(1)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue(mode) for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        top_k = torch.tensor([1, 5, 40, 60, 700, 2, 3, 9], dtype=torch.int32, device=DEVICE)
        published = [capture(probs, sampled, top_k=top_k, max_tokens=MAX_TOKENS,
                             into=(writer, handles, mode)),
                     sample(probs, 7, top_p=0.9, max_tokens=MAX_TOKENS,
                            into=(writer, handles, mode))]
        if mode == "support":
            published.append(compact(probs, MAX_TOKENS, keep="positive", into=(writer, handles)))
        stats = publisher_for(writer).stats
        assert stats["direct_steps"] == len(published)
        # capture's write kernel and compaction's expand kernel store their
        # rows themselves; sample's top-p-only step may have window rows
        # (written by the window write): its rows are stored once written
        # (kernels/capture.py), by the store kernel.
        assert stats["fused_steps"] == len(published) - 1 and stats["cpu_steps"] == 0
        for b, ref in enumerate(writer.take_batch(queues)):
            chunk = reader.open(ref)
            want = [reference_direct(rows, mode)[b] for rows in published]
            assert chunk_rows(chunk) == expected_rows(want), f"row {b}"
            chunk.release()
        # A wrong into= is refused before any kernel runs.
        with pytest.raises(ValueError, match="selected"):
            compact(probs, MAX_TOKENS, into=(writer, handles, "selected"))
        with pytest.raises(ValueError, match="into must be"):
            capture(probs, sampled, top_k=3, max_tokens=MAX_TOKENS, into=(writer,))
        with pytest.raises(ValueError, match="mode"):
            capture(probs, sampled, top_k=3, max_tokens=MAX_TOKENS, into=(writer, handles, "all"))


def test_a_failed_launch_sends_the_step_by_the_cpu_path_and_turns_direct_off(
        prefix: str, caplog) -> None:
    """If the store kernel cannot be launched (a driver error), that step's
    rows still arrive, in order, and later steps take the CPU path."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    pool = rows_pool(3, seed=10)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue() for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        publisher = DirectPublisher(writer)
        publisher.publish(handles, pool[0])

        def broken(batch: int, support: bool) -> None:
            raise RuntimeError("CUDA error: launch failure")

        publisher._launch = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="shmask"):
            publisher.publish(handles, pool[1])
        assert not publisher.active and "launch" in publisher.reason
        assert writer.attached is None and not publisher._registered
        publisher.publish(handles, pool[2])
        assert publisher.stats["direct_steps"] == 1 and publisher.stats["cpu_steps"] == 2
        for b, ref in enumerate(writer.take_batch(queues)):
            chunk = reader.open(ref)
            want = [r for r in (reference_direct(p)[b] for p in pool) if r is not None]
            assert chunk_rows(chunk) == expected_rows(want), f"queue {b}"
            chunk.release()


def test_a_failed_expand_launch_after_the_scan_cancels_the_step(
        prefix: str, monkeypatch) -> None:
    """compact(..., into=) whose expand kernel cannot be launched after its
    scan kernel claimed the step: the call raises, no row of that step
    reaches a queue, the publisher closes, and the next compact(into=)
    still publishes its rows (by the CPU path)."""
    import importlib

    compaction = importlib.import_module("shmask.kernels.compact")  # the module, not the function

    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    pool = compact_pool(3, seed=17)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue() for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        first = compact(pool[0]["x"], MAX_TOKENS, rows=pool[0]["rows"], into=(writer, handles))
        publisher = publisher_for(writer)
        assert publisher.stats["fused_steps"] == 1

        class Unlaunchable:
            def __getitem__(self, grid: tuple):
                def launch(*args: object, **kwargs: object) -> None:
                    raise RuntimeError("CUDA error: too many resources requested for launch")
                return launch

        with monkeypatch.context() as patch:
            patch.setattr(compaction, "expand_kernel", Unlaunchable())
            with pytest.raises(RuntimeError, match="too many resources"):
                compact(pool[1]["x"], MAX_TOKENS, rows=pool[1]["rows"], into=(writer, handles))
        assert not publisher.active and "compaction" in publisher.reason
        assert writer.attached is None and not publisher._registered
        last = compact(pool[2]["x"], MAX_TOKENS, rows=pool[2]["rows"], into=(writer, handles))
        assert publisher.stats["cpu_steps"] == 1
        for b, ref in enumerate(writer.take_batch(queues)):
            chunk = reader.open(ref)
            want = [r for r in (reference_direct(first)[b], reference_direct(last)[b]) if r]
            assert chunk_rows(chunk) == expected_rows(want), f"queue {b}"
            chunk.release()


def test_the_core_launches_only_kernels_whose_parameters_it_knows() -> None:
    """The store kernel is launched by the core's cuLaunchKernel only when
    its compiled signature is what the core passes (the table, the arrival
    counter, then NULL scratch pointers); anything else (scratch memory, a
    cluster launch, other parameters) stays with Triton's launcher, and says
    why. Without a CUDA driver in the process the launch fails cleanly."""
    from types import SimpleNamespace

    from shmask.kernels.direct import _native_launcher

    from shmask._native import lib

    good = [".param .u32 _direct_kernel_param_0",  # the table below 2^31: Triton makes it u32
            ".param .u64 .ptr .global .align 1 _direct_kernel_param_1",
            ".param .u64 .ptr .global .align 1 _direct_kernel_param_2"]

    def compiled(params: list[str], **changes: object) -> SimpleNamespace:
        ptx = ".version 8.0\n.visible .entry _direct_kernel(\n\t" + ",\n\t".join(params) + "\n)\n{\n}"
        metadata = {"num_warps": 4, "warp_size": 32, "shared": 0, "global_scratch_size": 0,
                    "profile_scratch_size": 0, "num_ctas": 1, **changes}
        return SimpleNamespace(metadata=SimpleNamespace(**metadata), asm={"ptx": ptx},
                               function=0x1234, _init_handles=lambda: None)

    arrivals = torch.zeros(1, dtype=torch.int64)
    launch, why = _native_launcher(lib, compiled(good), 1 << 20, arrivals)
    assert launch is not None and why == ""
    refused = [
        (compiled(good, global_scratch_size=128), "scratch"),
        (compiled(good, num_ctas=2), "cluster"),
        (compiled(good[:1]), "parameters"),
        (compiled([good[1], ".param .u32 _direct_kernel_param_1"]), "parameters"),
        (compiled([".param .b8 _direct_kernel_param_0[16]", good[1]]), "parameters"),
        (SimpleNamespace(metadata=None, asm={}), "PTX"),
    ]
    for kernel, reason in refused:
        launch_other, why = _native_launcher(lib, kernel, 1 << 20, arrivals)
        assert launch_other is None and reason in why, why
    if not torch.cuda.is_available():  # no driver loaded: refused, nothing launched
        with pytest.raises(RuntimeError, match="cuLaunchKernel"):
            launch(8, 0)
        assert lib.shm_direct_launch(0x1234, 8, 128, 0, 0, 1 << 20, 0, 3) == lib.SHM_E_DIRECT_LAUNCH


def test_queues_are_sized_from_the_rows_seen_so_a_first_emission_grows_twice(prefix: str) -> None:
    """Room kept a row ahead must not mean a relocation every few steps: a
    new queue's first buffer holds one row of the largest size (nothing is
    known yet), the next growth sizes it for the rest of its rows at the
    size rows have (2 growths, not one per doubling), and after a take the
    next buffer fits the next emission (no growth)."""
    STEPS = 20  # noqa: N806 (growth by doubling would be 5 growths a queue)
    config = shmask.Config(ring_mb=4, name_prefix=prefix, max_tokens=MAX_TOKENS)
    probs = torch.softmax(torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(14))
                          * 4, -1).to(DEVICE)
    rows = capture(probs, probs.argmax(1), top_k=40, max_tokens=MAX_TOKENS)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue() for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        publisher = DirectPublisher(writer)
        for _ in range(STEPS):
            publisher.publish(handles, rows)
        assert publisher.stats["grown"] == 2 * BATCH
        reader.discard_batch(writer.take_batch(queues))
        for _ in range(STEPS):
            publisher.publish(handles, rows)
        assert publisher.stats["grown"] == 2 * BATCH and publisher.stats["diverted_rows"] == 0
        want = reference_direct(rows)
        for b, ref in enumerate(writer.take_batch(queues)):
            chunk = reader.open(ref)
            assert chunk_rows(chunk) == expected_rows([want[b]] * STEPS), f"queue {b}"
            chunk.release()


def test_a_row_a_take_grows_each_queue_once(prefix: str) -> None:
    """vLLM's shape: one row a queue, then the take, every step. The buffer
    a take gives for the next emission holds a row of the largest size the
    publisher asks room for, so only the first step grows (a growth is a
    relocation in the ring and native time on the engine's thread); once
    the publisher is gone, buffers are sized from the rows again."""
    config = shmask.Config(ring_mb=4, name_prefix=prefix, max_tokens=MAX_TOKENS)
    probs = torch.softmax(torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(15))
                          * 4, -1).to(DEVICE)
    # Rows of 5-40 ids (support mode, ids rows: 40 < 64 words): each step
    # asks room for the largest, more than a small queue's own quarter of
    # slack, so both of the step's floors (id words and values) count.
    top_k = torch.tensor([5 + 5 * b for b in range(BATCH)], device=DEVICE)
    rows = capture(probs, probs.argmax(1), top_k=top_k, max_tokens=MAX_TOKENS)
    want = reference_direct(rows)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue() for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        publisher = DirectPublisher(writer)
        for _ in range(6):
            publisher.publish(handles, rows)
            batch = writer.take_batch(queues)
            for b, ref in enumerate(batch):
                chunk = reader.open(ref)
                assert chunk_rows(chunk) == expected_rows([want[b]]), f"queue {b}"
                chunk.release()
        assert publisher.stats["grown"] == BATCH and publisher.stats["diverted_rows"] == 0
        direct_records = batch.entries["record_bytes"].copy()
        # Once the publisher is gone the CPU path sizes buffers from its own
        # rows again: after one take of 3-id rows, records are that small.
        publisher.close()
        for _ in range(2):
            writer.append_step(handles, np.full(BATCH, 3, np.int32),
                               np.arange(3 * BATCH, dtype=np.int32), np.zeros(3 * BATCH, np.float32))
            batch = writer.take_batch(queues)
            reader.discard_batch(batch)
        assert np.all(batch.entries["record_bytes"] < direct_records)


def small_compact_rows(vocab: int, lengths: list[int], seed: int):
    """compact() rows of the given support sizes at vocabulary ``vocab``
    (kernel max_tokens MAX_TOKENS): a row of L < V / 32 travels as L ids."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.full((len(lengths), vocab), -float("inf"))
    for b, length in enumerate(lengths):
        x[b, torch.randperm(vocab, generator=gen)[:length]] = torch.randn(length, generator=gen)
    return x.to(DEVICE)


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_gpu_direct_never_half_lands_a_step(prefix: str, setting: str) -> None:
    """Issue 17, item 11. Rows from a kernel called with max_tokens above the
    Writer's SHMASK_MAX_TOKENS: an ids row too long for the transport used to
    divert alone on the GPU-direct path (the other rows landed, that one was
    lost, RowQueue.rows raised later). Every path now refuses the whole step
    before anything is stored, naming both values: kernels.publish of device
    Rows and compact(..., into=), GPU-direct or not. Where no ids row can be
    that long (32 L < V bounds it too), the same rows are taken."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=8, gpu_direct=setting)
    x = small_compact_rows(VOCAB, [3, 20, 5, 0], seed=19)  # row 1: 20 ids > 8
    rows = compact(x, MAX_TOKENS)
    assert rows.forms.tolist() == [0, 0, 0, 0] and rows.lengths.tolist() == [3, 20, 5, 0]
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue() for _ in range(4)]
        handles = np.array([q.handle for q in queues], np.int64)
        for attempt in (lambda: publish(writer, handles, rows),
                        lambda: compact(x, MAX_TOKENS, into=(writer, handles))):
            with pytest.raises(InvalidRowsError, match=r"max_tokens=48(.|\n)*SHMASK_MAX_TOKENS=8"):
                attempt()
            assert [q.rows for q in queues] == [0, 0, 0, 0], "nothing of the step lands"
        # V = 256: an ids row holds at most 7 ids (32 L < V), within 8: taken.
        small = compact(small_compact_rows(256, [3, 7, 40, 0], seed=20), MAX_TOKENS)
        assert small.forms.tolist() == [0, 0, 1, 0]
        publish(writer, handles, small)
        assert publisher_for(writer).active == (setting == "auto")
        for ref, row in zip(writer.take_batch(queues), reference_direct(small), strict=True):
            with reader.open(ref) as chunk:
                assert chunk_rows(chunk) == expected_rows([row])
    assert writer.closed


def test_gpu_direct_never_half_lands_a_step_of_another_vocabulary(prefix: str) -> None:
    """Issue 17, item 11: a queue holding a bitmask row of one vocabulary
    gets a bitmask row of another in a step (which the CPU path refuses
    whole): the GPU-direct path used to store the step's other rows and
    divert that one, to be refused later. Now the step takes the CPU path
    and is refused whole."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    first = compact(small_compact_rows(VOCAB, [100, 3], seed=21), MAX_TOKENS)
    other = compact(small_compact_rows(VOCAB // 2, [100, 3], seed=22), MAX_TOKENS)
    assert first.forms.tolist() == other.forms.tolist() == [1, 0]
    with shmask.Writer(config) as writer:
        queues = [writer.open_queue() for _ in range(2)]
        handles = np.array([q.handle for q in queues], np.int64)
        publish(writer, handles, first)
        assert publisher_for(writer).active and [q.rows for q in queues] == [1, 1]
        with pytest.raises(InvalidRowsError, match="vocab"):
            publish(writer, handles, other)
        assert [q.rows for q in queues] == [1, 1], "nothing of the step lands"


def test_gpu_direct_writer_close_always_closes(prefix: str) -> None:
    """Issue 17, item 11: when the publisher's close raises (rows it could
    not append after the last kernel, a device error), Writer.close() used
    to raise before closing anything, leaving the segment in /dev/shm and
    the Writer open. Now the ring is unregistered, the Writer closed and
    its segment unlinked; then the error is raised."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=MAX_TOKENS)
    writer = shmask.Writer(config)
    try:
        queues = [writer.open_queue() for _ in range(BATCH)]
        publisher = publisher_for(writer)
        publish(writer, queues, rows_pool(1, seed=23)[0])
        assert publisher.active and publisher.stats["direct_steps"] == 1

        def failing_settle(pull: bool) -> None:
            raise InvalidRowsError("the last step's diverted rows could not be appended")

        publisher._settle = failing_settle  # type: ignore[method-assign]
        segment = "/dev/shm" + writer.segment_name
        assert os.path.exists(segment)
        with pytest.raises(InvalidRowsError, match="diverted"):
            writer.close()
        assert writer.closed and not os.path.exists(segment)
        assert writer.attached is None and not publisher.active and not publisher._registered
        writer.close()  # closed: nothing more to do
    finally:
        if not writer.closed:
            writer.close()


CPU_ONLY_PUBLISH = """
import os, sys, numpy as np, torch
assert "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()
import shmask
from shmask.kernels import compact, publish, publisher_for, reference_direct
config = shmask.Config(ring_mb=1, name_prefix=sys.argv[1], max_tokens=48)
x = torch.full((3, 2048), -float("inf"))
x[0, [5, 9]] = 1.0
x[1, :100] = 0.5
with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
    queues = [writer.open_queue() for _ in range(3)]
    rows = compact(x, 48)
    publish(writer, queues, rows)
    publisher = publisher_for(writer)
    assert "TRITON_INTERPRET" not in os.environ
    print("active", publisher.active, publisher.stats["cpu_steps"], publisher.stats["direct_steps"])
    print("reason", publisher.reason)
    for ref, row in zip(writer.take_batch(queues), reference_direct(rows), strict=True):
        with reader.open(ref) as chunk:
            assert chunk.lengths.tolist() == ([row[1]] if row else []), (chunk.lengths, row)
            assert chunk.ids.tolist() == (row[2] if row else [])
print("ok")
"""


@pytest.mark.skipif(GPU, reason="a CPU-only host's case (make test runs it); a hidden GPU's "
                    "host runs its kernels in the interpreter of whatever Triton it has")
def test_publish_on_a_cpu_only_host_takes_the_cpu_path(prefix: str) -> None:
    """Issue 17, item 17: on a host without CUDA, kernels.publish of device
    Rows (SHMASK_GPU_DIRECT=auto) ran the store kernel in Triton's
    interpreter (~100 ms a step) where docs/kernels.md promises the CPU path
    (well under a millisecond). Without CUDA and without TRITON_INTERPRET=1
    set by the host, the publisher takes the CPU path and says why; the rows
    arrive exactly. (These tests set TRITON_INTERPRET=1: the explicit
    opt-in that runs the direct path in the interpreter.)"""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU-only host, even on a GPU machine
    done = subprocess.run([sys.executable, "-c", CPU_ONLY_PUBLISH, prefix], env=env,
                          capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "active False 1 0", done.stdout
    assert "no CUDA device" in lines[1] and lines[-1] == "ok", done.stdout

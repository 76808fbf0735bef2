"""Regression tests for the lifecycle and safety defects of issue 7, each
with the reproduction that showed it: real processes, real /dev/shm."""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import assert_chunk_equal, random_chunk

import shmask
from shmask.refs import KIND_SHM, ChunkRef
from shmask.segment import _LIVE, collect_garbage, list_segments, segment_alive

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


def _path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def _plant(prefix: str, uid_in_name: int, owner: int | None = None, lock: bool = False,
           size: int = 0) -> tuple[str, int]:
    """A file with a segment's name; optionally owned by someone else or
    locked like a producer's. Returns (name, fd)."""
    name = f"/{prefix}-{uid_in_name}-1-{secrets.token_hex(8)}"
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    if size:
        os.ftruncate(fd, size)
    if owner is not None:
        os.fchown(fd, owner, owner)
    if lock:
        fcntl.flock(fd, fcntl.LOCK_EX)
    old = time.time() - 3600  # old enough for any age-based rule to fire
    os.utime(_path(name), (old, old))
    return name, fd


def _run(code: str, prefix: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = "import os, sys, time, numpy as np, shmask\n" + textwrap.dedent(code)
    env = dict(os.environ, SHMASK_NAME_PREFIX=prefix)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, env=env)


# ------------------------------------------------- 1. the janitor's proof


def test_gc_never_removes_a_segment_whose_lock_is_held(prefix):
    """A ring still being created (no header yet, old mtime) is alive as long
    as its creator holds the lock; the same file unlocked is garbage."""
    name, fd = _plant(prefix, os.getuid(), lock=True, size=8192)
    try:
        assert segment_alive(name)
        assert name not in collect_garbage(prefix)
        shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)).close()  # janitor too
        assert os.path.exists(_path(name))
    finally:
        os.close(fd)  # the "producer" dies: its lock goes with its descriptor
    assert not segment_alive(name)
    assert collect_garbage(prefix) == [name]
    assert not os.path.exists(_path(name))


def test_reader_start_removes_rings_of_sigkilled_producers(prefix):
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time, shmask
            w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix={prefix!r}))
            print(w.segment_name, flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert os.path.exists(_path(name)) and segment_alive(name)
    shmask.Reader(shmask.Config(name_prefix=prefix)).close()
    assert os.path.exists(_path(name)), "a live producer's ring must survive a Reader start"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    shmask.Reader(shmask.Config(name_prefix=prefix)).close()
    assert not os.path.exists(_path(name)), "a Reader start must remove a SIGKILLed ring"


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_producer_in_another_pid_namespace_survives_gc(prefix):
    proc = subprocess.Popen(
        ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", textwrap.dedent(f"""
            import time, shmask
            w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix={prefix!r}))
            print(w.segment_name, flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name = proc.stdout.readline().strip()
        assert name, "the namespaced producer did not start"
        assert collect_garbage(prefix) == []
        shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)).close()
        assert os.path.exists(_path(name)), "a live producer in another PID namespace was removed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while segment_alive(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert collect_garbage(prefix) == [name]


@needs_root
def test_files_of_other_users_are_never_touched_nor_fatal(prefix):
    """A file owned by another uid, under a name claiming ours (or uid 0):
    our Writer, Reader, ls and gc neither fail nor remove it."""
    planted = [_plant(prefix, os.getuid(), owner=NOBODY, size=8192),
               _plant(prefix, 0, owner=NOBODY, size=8192)]
    try:
        for _name, fd in planted:
            os.close(fd)
        assert collect_garbage(prefix) == []
        assert all(info.name not in {n for n, _ in planted} for info in list_segments(prefix))
        with shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)) as writer:
            ref = writer.publish(np.array([1], np.int32), np.array([7], np.int32),
                                 np.array([-0.5], np.float32))
            with shmask.Reader(shmask.Config(name_prefix=prefix)) as reader:
                with reader.open(ref) as chunk:
                    assert chunk.ids.tolist() == [7]
        for name, _ in planted:
            assert os.path.exists(_path(name)), f"{name} of another user was removed"
        with pytest.raises(shmask.StaleChunkError, match="belongs to uid"):
            shmask.Reader(shmask.Config(name_prefix=prefix)).open(
                ChunkRef(KIND_SHM, 2, planted[0][0], 1, 0, 64, 0, 0, None))
    finally:
        for name, _ in planted:
            os.unlink(_path(name))


# ---------------------------------------------------------------- 3. SIGBUS


def test_a_step_copied_from_a_truncated_ring_fails_each_request_cleanly(prefix):
    """vLLM's frontend copies a step's references in one native call
    (Reader.copy_ref_table): with the ring cut under it, the call survives
    (the guarded mapping reads as zeros), copies nothing, and every request
    fails alone, saying the segment was truncated."""
    result = _run(f"""
        from types import SimpleNamespace
        from shmask.adapters import vllm as va
        config = shmask.Config(ring_mb=1, name_prefix={prefix!r})
        writer, reader = shmask.Writer(config), shmask.Reader(config)
        publisher = va.MaskPublisher(writer, mask_lists=va._MaskLists)
        resolver = va.MaskResolver(reader, mask_lists=va._MaskLists)
        def step():
            rows = [np.arange(5 + i, dtype=np.int32) for i in range(8)]
            offsets = np.cumsum([0] + [r.size for r in rows])
            masks = publisher.publish_step(va._MaskLists(np.concatenate(rows), offsets, None))
            return [SimpleNamespace(request_id=f"r{{i}}", finish_reason=None, error=None,
                                    new_sampling_mask=masks.slice_request(i, 1))
                    for i in range(8)]
        first = step()
        print("before:", resolver.resolve_outputs(first), [o.new_sampling_mask.token_ids.size
                                                           for o in first])
        outputs = step()
        os.truncate("/dev/shm" + writer.segment_name, 0)
        failed = resolver.resolve_outputs(outputs)
        print("failed:", len(failed), sorted({{o.error.message.split("(")[1].split(":")[0]
                                             for o in outputs}}))
        print("survived")
    """, prefix)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "before: [] [5, 6, 7, 8, 9, 10, 11, 12]" in result.stdout
    assert "failed: 8 ['StaleChunkError']" in result.stdout
    assert "survived" in result.stdout


def test_truncated_segment_does_not_kill_reader_or_producer(prefix):
    """os.truncate of the ring under a held chunk: to_lists raises, opens
    raise, the producer carries on inline; nobody dies of SIGBUS."""
    result = _run(f"""
        from shmask.errors import ShmaskError
        config = shmask.Config(ring_mb=1, name_prefix={prefix!r}, full_wait_ms=5)
        writer, reader = shmask.Writer(config), shmask.Reader(config)
        rng = np.random.default_rng(0)
        queues = [writer.open_queue("support") for _ in range(4)]
        handles = np.array([q.handle for q in queues], np.int64)
        def step():
            lengths = rng.integers(1, 50, 4).astype(np.int32)
            ids = rng.integers(0, 1000, int(lengths.sum())).astype(np.int32)
            writer.append_step(handles, lengths, ids, np.zeros(ids.size, np.float32))
        for _ in range(5):
            step()
        batch = writer.take_batch(queues)
        held = reader.open(batch[0])
        for _ in range(5):
            step()
        os.truncate("/dev/shm" + writer.segment_name, 0)
        try:
            held.to_lists()
            print("to_lists returned rows")
        except ShmaskError as exc:
            print("held:", type(exc).__name__)
        try:
            reader.open(batch[1])
            print("open returned rows")
        except ShmaskError as exc:
            print("open:", type(exc).__name__)
        for _ in range(5):
            step()                        # the producer touches the cut pages
        after = writer.take_batch(queues)
        for _ in range(3):
            step()
        final = writer.take_batch(queues)
        inline = [ref.inline for ref in final]
        with shmask.Reader(config) as other:
            rows = [other.open(ref).rows for ref in final]
        print("inline after truncation:", all(inline), rows)
        writer.close()
        print("survived")
    """, prefix)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    out = result.stdout
    assert "survived" in out
    assert "held: StaleChunkError" in out
    assert "open: StaleChunkError" in out
    assert "inline after truncation: True [3, 3, 3, 3]" in out


# What a child does around a truncation, with faulthandler enabled before
# shmask sets its guard or after it (then faulthandler's handler is in front
# of the guard, as with faulthandler.enable() called by a server later).
FAULTHANDLER_CUT = textwrap.dedent("""
    import faulthandler
    from shmask.errors import ShmaskError
    def cut_with_faulthandler(prefix, when, first):
        if when == "before":
            faulthandler.enable()
        config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=5)
        writer, reader = shmask.Writer(config), shmask.Reader(config)
        queues = [writer.open_queue("support") for _ in range(3)]
        def step():
            writer.append_step(queues, np.array([2, 1, 3], np.int32),
                               np.arange(6, dtype=np.int32), np.zeros(6, np.float32))
        step()
        chunk = reader.open(writer.take_batch(queues)[0])
        step()
        if when == "after":         # (pytest enabled it already: disable() first)
            faulthandler.disable()
            faulthandler.enable()
        elif when == "behind its back":  # as native code installing a handler would
            faulthandler.enable.__wrapped__()
        os.truncate("/dev/shm" + writer.segment_name, 0)
        def read():
            try:
                print("read:", chunk.to_lists())
            except ShmaskError as exc:
                print("read:", type(exc).__name__)
        def write():
            for _ in range(3):
                step()                  # touches the cut pages
            refs = writer.take_batch(queues)
            step()
            print("write:", [reader.open(ref).to_lists()[0] for ref in writer.take_batch(queues)])
        for action in ((read, write) if first == "reader" else (write, read)):
            action()
        writer.close()
        print("survived")
""")


@pytest.mark.parametrize("when", ["after", "before", "behind its back"])
@pytest.mark.parametrize("first", ["reader", "producer"])
def test_faulthandler_enabled_after_the_guard_does_not_defeat_it(prefix, when, first):
    """faulthandler.enable() (or disable()) puts the guard back in front; a
    handler installed behind shmask's back sees the SIGBUS first and
    re-raises it after putting the guard back: still the guard's. No death,
    StaleChunkError, rows after the cut inline and whole."""
    result = _run(FAULTHANDLER_CUT + f"cut_with_faulthandler({prefix!r}, {when!r}, {first!r})\n",
                  prefix)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "read: StaleChunkError" in result.stdout, result.stdout
    assert "write: [[[0, 1]], [[2]], [[3, 4, 5]]]" in result.stdout, result.stdout
    assert "survived" in result.stdout
    if when != "behind its back":  # the guard was in front: faulthandler saw nothing
        assert "Fatal Python error" not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("pytest_faulthandler", [True, False])
def test_faulthandler_enabled_after_the_guard_does_not_defeat_it_under_pytest(
        prefix, tmp_path, pytest_faulthandler):
    """The same inside a pytest run, with pytest's own faulthandler (enabled
    before shmask exists) and without it."""
    test_file = tmp_path / "test_cut.py"
    test_file.write_text("import os, numpy as np, shmask\n" + FAULTHANDLER_CUT
                         + f"\ndef test_cut():\n    cut_with_faulthandler({prefix!r}, 'after', "
                         "'reader')\n")
    plugins = [] if pytest_faulthandler else ["-p", "no:faulthandler"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             *plugins, str(test_file)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, (result.returncode, result.stdout[-2000:])
    assert "read: StaleChunkError" in result.stdout and "1 passed" in result.stdout


def test_a_foreign_sigbus_still_kills_with_faulthandler_in_front(prefix, tmp_path):
    """faulthandler enabled after the guard re-raises a fault outside
    shmask's mappings: the guard finds no cut mapping and the process dies."""
    result = _run(f"""
        import faulthandler, mmap
        writer = shmask.Writer(shmask.Config(ring_mb=1, name_prefix={prefix!r}))
        faulthandler.enable()
        path = {str(tmp_path / "file")!r}
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, 8192)
        os.ftruncate(fd, 0)
        m[4096]
        print("survived a foreign SIGBUS?!")
    """, prefix, timeout=60)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stdout[-500:])


@pytest.mark.parametrize("cut", ["whole file", "past the header"])
def test_a_ring_truncated_and_grown_back_never_yields_rows(config, cut):
    """Cut, then given its size back (no SIGBUS: the pages read as zeros):
    the rows staged in the ring are lost, and their readers are told so,
    never handed zeros as rows; rows appended later are whole."""
    writer, reader = shmask.Writer(config), shmask.Reader(config)
    try:
        queues = [writer.open_queue("support") for _ in range(3)]
        writer.take_batch(queues)  # the producer's once-a-second fstat is spent
        writer.append_step(queues, np.zeros(3, np.int32), np.zeros(0, np.int32),
                           np.zeros(0, np.float32), status=np.full(3, 2))  # INVALID rows
        path = _path(writer.segment_name)
        size = os.stat(path).st_size
        os.truncate(path, 0 if cut == "whole file" else 4096)
        os.truncate(path, size)
        batch = writer.take_batch(queues)
        for i, ref in enumerate(batch):
            for who in (reader, shmask.Reader(config)):
                with pytest.raises(shmask.StaleChunkError):
                    chunk = who.open(ref)
                    pytest.fail(f"chunk {i} ({ref!r}) yielded rows {chunk.to_lists()}")
        writer.append_step(queues, np.array([1, 2, 0], np.int32), np.array([4, 5, 6], np.int32),
                           np.zeros(3, np.float32))
        got = [reader.open(ref).to_lists()[0] for ref in writer.take_batch(queues)]
        assert got == [[[4]], [[5, 6]], [[]]]
    finally:
        reader.close()
        writer.close()


# ---------------------------------------- 4. producer geometry is its own


def test_rewritten_header_cannot_steer_the_producer(writer, reader):
    """A reader maps the ring writable; a capacity rewritten in the header
    must not change where the producer writes."""
    rng = np.random.default_rng(4)
    first = writer.publish(*random_chunk(rng, 3, 10))
    reader.open(first).release()
    header = np.frombuffer(reader._attach(first.segment).segment.buffer, np.uint64)
    header[2] = 1 << 40  # capacity, byte 16
    moved, capacity = 0, writer.config.ring_capacity_bytes
    while moved < 3 * capacity:  # wrap around several times
        want = random_chunk(rng, int(rng.integers(1, 20)), 200, vocab=5000)
        ref = writer.publish(*want)
        moved += ref.record_bytes
        with reader.open(ref) as chunk:
            assert_chunk_equal(chunk, *want)
    assert writer.stats.inline_chunks == 0


# ---------------------------------------------- 5. one wait per call at most


def test_full_ring_waits_once_per_call_not_once_per_queue(prefix):
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=100)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        rng = np.random.default_rng(5)
        held = []
        while True:  # fill the ring with chunks nobody releases
            ref = writer.publish(*random_chunk(rng, 8, 200, vocab=5000))
            if ref.inline:
                break
            held.append(ref)
        queues = [writer.open_queue("support") for _ in range(32)]
        lengths = np.full(32, 100, np.int32)
        ids = np.arange(3200, dtype=np.int32) % 5000
        start = time.monotonic()
        writer.append_step(queues, lengths, ids, np.zeros(ids.size, np.float32))
        elapsed = time.monotonic() - start
        # 32 waits of 100 ms would be 3.2 s; one wait is 0.1 s (x3 for noise).
        assert elapsed < 0.3, f"append_step over 32 queues on a full ring took {elapsed:.2f} s"
        batch = writer.take_batch(queues)
        for i, ref in enumerate(batch):
            assert ref.inline
            with reader.open(ref) as chunk:
                np.testing.assert_array_equal(chunk.ids, ids[100 * i:100 * (i + 1)])
        reader.discard_batch(held)


# ----------------------------------------- 6. atomic, validated, mixed steps


def test_append_step_is_all_or_nothing(writer):
    queues = [writer.open_queue("support") for _ in range(3)]
    lengths = np.array([2, 2, 9000], np.int32)  # row 2 exceeds SHMASK_MAX_TOKENS
    ids = np.zeros(9004, np.int32)
    with pytest.raises(shmask.InvalidRowsError, match="row 2"):
        writer.append_step(queues, lengths, ids, np.zeros(9004, np.float32))
    assert [q.rows for q in queues] == [0, 0, 0], "rows 0-1 must not be committed"


def test_closed_unknown_and_foreign_handles_are_rejected(config, writer):
    live, closed = writer.open_queue("support"), writer.open_queue("support")
    closed.close()
    reopened = writer.open_queue("support")  # likely the same slot, new generation
    other = shmask.Writer(config)
    try:
        foreign = other.open_queue("support")
        for bad in (closed.handle, 12345, foreign.handle, -1):
            handles = np.array([live.handle, bad], np.int64)
            with pytest.raises(shmask.InvalidRowsError, match="not the handle of an open RowQueue"):
                writer.append_step(handles, np.array([1, 1], np.int32), np.array([5, 6], np.int32),
                                   np.array([0.0, 0.0], np.float32))
            assert live.rows == 0 and reopened.rows == 0
        with pytest.raises(shmask.InvalidRowsError):
            writer.append_step(np.array([5, 6], np.int32), np.array([1, 1], np.int32),
                               np.array([5, 6], np.int32), np.zeros(2, np.float32))
        assert foreign.rows == 0
    finally:
        other.close()


def test_one_step_mixes_selected_and_support_requests(writer, reader):
    support, selected = writer.open_queue("support"), writer.open_queue("selected")
    queues = [support, selected, support]
    lengths = np.array([2, 3, 1], np.int32)
    ids = np.array([10, 11, 20, 21, 22, 30], np.int32)
    logprobs = np.array([-1, -2, 9, 9, 9, -3], np.float32)  # 9: not read (selected row)
    picked = np.array([9, -0.25, 9], np.float32)  # selected row's value at index 1
    with pytest.raises(shmask.InvalidRowsError, match="selected_logprobs"):
        writer.append_step(queues, lengths, ids, logprobs)
    writer.append_step(queues, lengths, ids, logprobs, selected_logprobs=picked)
    batch = writer.take_batch([support, selected])
    with reader.open(batch[0]) as chunk:
        assert chunk.to_lists() == ([[10, 11], [30]], [[-1.0, -2.0], [-3.0]])
    with reader.open(batch[1]) as chunk:
        assert chunk.to_lists() == ([[20, 21, 22]], [-0.25])


def test_selected_rows_refuse_per_entry_logprobs(writer):
    queue = writer.open_queue("selected")
    with pytest.raises(shmask.InvalidRowsError, match=r"shape \[B\]"):
        writer.append_step([queue, queue], np.array([2, 1], np.int32),
                           np.array([1, 2, 3], np.int32), np.zeros(3, np.float32))
    assert queue.rows == 0


# ------------------------------------------------------ 7. aborted requests


def test_tokenizer_discards_without_opening(writer, reader):
    rng = np.random.default_rng(7)
    refs = [writer.publish(*random_chunk(rng, 4, 30)) for _ in range(20)]
    assert writer.ring_usage()[0] > 0
    assert reader.discard_batch(shmask.RefBatch.from_refs(refs)) == 20
    writer.reclaim()
    assert writer.ring_usage()[0] == 0
    assert reader.discard_batch(refs) == 0, "a second discard gives nothing back"
    with pytest.raises(shmask.ShmaskError):
        reader.open(refs[0])


def test_producer_abort_gives_back_published_chunks(writer, reader):
    keep, aborted = writer.open_queue("support"), writer.open_queue("support")
    refs = []
    for step in range(3):
        writer.append_step([keep, aborted], np.array([1, 2], np.int32),
                           np.array([step, 7, 8], np.int32), np.zeros(3, np.float32))
        refs.append(writer.take_batch([keep, aborted]))
    writer.append_step([aborted], np.array([1], np.int32), np.array([9], np.int32),
                       np.zeros(1, np.float32))
    assert aborted.abort() == 3
    assert writer.stats.aborted_chunks == 3
    for batch in refs:
        with pytest.raises(shmask.StaleChunkError):
            reader.open(batch[1])
        with reader.open(batch[0]) as chunk:  # the other request is untouched
            assert chunk.rows == 1
    writer.reclaim()
    assert keep.rows == 0 and aborted.closed


# --------------------------------------------------------- 8. smaller ones


def test_lease_expiry_warning_is_rate_limited(prefix, caplog):
    config = shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=0.001)
    caplog.set_level(logging.WARNING, logger="shmask")
    with shmask.Writer(config) as writer:
        rng = np.random.default_rng(8)
        for _ in range(200):
            writer.publish(*random_chunk(rng, 2, 5))
            time.sleep(0.002)
            writer.reclaim()
        assert writer.stats.expired >= 150
    lines = [r for r in caplog.records if "SHMASK_LEASE_S" in r.getMessage()]
    assert 1 <= len(lines) <= 2, f"{len(lines)} warning lines for {writer.stats.expired} expiries"


def test_queue_rows_is_bounded():
    with pytest.raises(shmask.ConfigError, match="SHMASK_QUEUE_ROWS"):
        shmask.Config.from_env({"SHMASK_QUEUE_ROWS": "1048576"})


def test_first_buffer_guess_is_bounded(prefix):
    """The largest accepted SHMASK_QUEUE_ROWS with max-length rows asks for
    a bounded first buffer, not rows x length entries."""
    config = shmask.Config(ring_mb=64, name_prefix=prefix, queue_rows=1 << 16)
    with shmask.Writer(config) as writer:
        queue = writer.open_queue("support")
        n = config.max_tokens
        writer.append_step([queue], np.array([n], np.int32), np.zeros(n, np.int32),
                           np.zeros(n, np.float32))
        used, capacity = writer.ring_usage()
        assert used <= capacity // 8, f"first buffer took {used} of {capacity} bytes"
        assert not queue.take().inline, "the first buffer must fit the ring, not go private"


@pytest.mark.parametrize("field, value", [
    ("position", "12"), ("position", -64), ("position", 1 << 70), ("rows", 2.5),
    ("nnz", None), ("record_bytes", -1), ("epoch", 1 << 80),
])
def test_hand_built_refs_of_wrong_types_raise_invalid_ref(writer, reader, field, value):
    ref = writer.publish(np.array([1], np.int32), np.array([3], np.int32),
                         np.array([0.0], np.float32))
    forged = ChunkRef(ref.kind, ref.mode, ref.segment, ref.epoch, ref.position,
                      ref.record_bytes, ref.rows, ref.nnz, None)
    setattr(forged, field, value)
    with pytest.raises((shmask.InvalidRefError, shmask.StaleChunkError)):
        reader.open(forged)
    reader.open(ref).release()


def test_building_a_config_leaves_logger_levels_alone():
    logger = logging.getLogger("shmask")
    before = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        shmask.Config.from_env({"SHMASK_LOG_LEVEL": "ERROR"})
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


def test_sigterm_cleanup_does_not_take_the_registry_lock():
    """The SIGTERM handler runs between two bytecodes of the main thread,
    which may hold the registry's lock: cleanup must not wait for it."""
    done = threading.Event()
    with _LIVE._lock:
        worker = threading.Thread(target=lambda: (_LIVE.unlink_all(), done.set()), daemon=True)
        worker.start()
        assert done.wait(5), "unlink_all blocked on the registry lock"


def test_inline_warning_counts_every_chunk_and_its_reason(prefix, caplog):
    """One line per interval, counting every inline chunk since the last,
    split by reason; a chunk inline by configuration is not warned about."""
    caplog.set_level(logging.WARNING, logger="shmask")
    config = shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=1)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        rng = np.random.default_rng(9)
        held = []
        while len(held) < 3 or not held[-1].inline:
            held.append(writer.publish(*random_chunk(rng, 8, 200, vocab=5000)))
        for _ in range(5):  # more ring-full chunks within the same interval
            held.append(writer.publish(*random_chunk(rng, 8, 200, vocab=5000)))
        big = 300_000  # more entries than a 1 MiB ring holds
        held.append(writer.publish(np.array([big // 100] * 100, np.int32),
                                   np.zeros(big, np.int32), np.zeros(big, np.float32)))
        stats = writer.stats
        assert stats.inline_chunks == stats.inline_ring_full + stats.inline_oversize
        assert stats.inline_oversize == 1 and stats.inline_ring_full >= 6
        lines = [r.getMessage() for r in caplog.records if "sent inline" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("1 chunk(s)"), lines
        writer._inline_warning.last = -1e9  # as if the interval had passed
        held.append(writer.publish(*random_chunk(rng, 8, 200, vocab=5000)))
        assert held[-1].inline
        reader.discard_batch(held)
    lines = [r.getMessage() for r in caplog.records if "sent inline" in r.getMessage()]
    # The second line counts every chunk since the first, by reason.
    since = stats.inline_chunks - 1
    assert len(lines) == 2 and lines[1].startswith(f"{since} chunk(s)"), lines
    assert f"{stats.inline_ring_full - 1} ring full" in lines[1] and "1 oversize" in lines[1]
    with shmask.Writer(shmask.Config(transport="inline")) as writer:
        writer.publish(np.array([1], np.int32), np.array([2], np.int32), np.zeros(1, np.float32))
        assert writer.stats.inline_configured == 1
    assert len([r for r in caplog.records if "sent inline" in r.getMessage()]) == 2


def test_a_queue_repeated_in_one_step_gets_its_rows_in_order(writer, reader):
    """Speculative decoding appends several positions of one request per step."""
    a, b = writer.open_queue("support"), writer.open_queue("support")
    handles = np.array([a.handle, b.handle, a.handle, a.handle], np.int64)
    lengths = np.array([1, 2, 2, 1], np.int32)
    ids = np.array([1, 20, 21, 2, 3, 4], np.int32)
    writer.append_step(handles, lengths, ids, ids.astype(np.float32))
    writer.append_step(handles[:1], lengths[:1], np.array([5], np.int32), np.zeros(1, np.float32))
    batch = writer.take_batch([a, b])
    with reader.open(batch[0]) as chunk:
        assert chunk.to_lists()[0] == [[1], [2, 3], [4], [5]]
    with reader.open(batch[1]) as chunk:
        assert chunk.to_lists()[0] == [[20, 21]]


def test_forked_child_does_not_keep_a_dead_producers_ring(prefix):
    """The child of a fork is not the producer: once the producer is
    SIGKILLed its ring is collectable though the child lives on."""
    # Parent and child report on separate pipes (stdout, stderr): one pipe
    # shared by both can interleave their lines when output is unbuffered.
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time, shmask
        w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix={prefix!r}))
        child = os.fork()
        if child == 0:
            print("child", file=sys.stderr, flush=True)  # its at-fork hooks have run by now
            time.sleep(30)
            os._exit(0)
        print(w.segment_name, child, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait for the child to run too: until its at-fork hook has closed its
    # copy of the lock, the ring is (rightly) not collectable.
    name, child = proc.stdout.readline().split()
    assert proc.stderr.readline().split() == ["child"]
    try:
        assert segment_alive(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(int(child), 0)  # the child is still running
        assert collect_garbage(prefix) == [name]
    finally:
        try:
            os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------- found in review, each proven


def test_held_chunk_outlives_the_readers_view_of_its_segment(prefix):
    """A tokenizer still holding a chunk when the reader forgets the segment
    (its producer died and a new one appeared, or Reader.close()) can still
    read, check and release it."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix)
    first, reader = shmask.Writer(config), shmask.Reader(config)
    queue = first.open_queue("support")
    queue.append(np.array([1, 2, 3], np.int32), np.array([-0.1, -0.2, -0.3], np.float32))
    chunk = reader.open(queue.take())
    first.close()
    with shmask.Writer(config) as second:
        other = second.open_queue("support")
        other.append(np.array([7], np.int32), np.array([-0.7], np.float32))
        reader.open(other.take()).release()  # attaching it forgets the dead segment
        assert chunk.to_lists()[0] == [[1, 2, 3]]
        chunk.release()
        held = reader.open(second.publish(np.array([1], np.int32), np.array([5], np.int32),
                                          np.zeros(1, np.float32)))
        reader.close()
        assert held.to_lists()[0] == [[5]]
        held.release()


def test_a_foreign_sigbus_still_kills_after_faulthandler_wraps_ours(prefix, tmp_path):
    """faulthandler re-raises after putting its predecessor (us) back: the
    signal must not bounce between the two forever."""
    result = _run(f"""
        import faulthandler, mmap
        config = shmask.Config(ring_mb=1, name_prefix={prefix!r})
        first = shmask.Writer(config)
        faulthandler.enable()
        second = shmask.Writer(config)
        path = {str(tmp_path / "file")!r}
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, 8192)
        os.ftruncate(fd, 0)
        m[4096]  # a real fault outside shmask's mappings
        print("survived a foreign SIGBUS?!")
    """, prefix, timeout=60)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stdout[-500:])
    assert result.stderr.count("Bus error") <= 2, "the signal bounced between handlers"


def test_a_stale_handle_stays_stale_through_many_reopenings(writer):
    old = writer.open_queue("support")
    stale = old.handle
    old.close()
    for _ in range((1 << 16) - 1):  # a 16-bit generation wraps here (close bumped it once)
        writer.open_queue("support").close()
    victim = writer.open_queue("support")
    with pytest.raises(shmask.InvalidRowsError):
        writer.append_step(np.array([stale], np.int64), np.array([1], np.int32),
                           np.array([11], np.int32), np.zeros(1, np.float32))
    assert victim.rows == 0


def test_rows_of_a_truncated_ring_never_travel_as_zeros(prefix):
    result = _run(f"""
        config = shmask.Config(ring_mb=1, name_prefix={prefix!r}, full_wait_ms=1)
        writer, reader = shmask.Writer(config), shmask.Reader(config)
        lossy, other = writer.open_queue("selected"), writer.open_queue("selected")
        for value in (-1.0, -2.0):
            lossy.append(np.array([5], np.int32), value)
        other.append(np.array([6], np.int32), -9.0)
        os.truncate("/dev/shm" + writer.segment_name, 0)
        writer.take_batch([other])           # notices: the ring is dead
        for value in (-3.0, -4.0, -5.0):     # grows the queue out of the dead ring
            for _ in range(40):
                lossy.append(np.array([7], np.int32), value)
        try:
            chunk = reader.open(lossy.take())
            print("rows:", chunk.to_lists())
        except shmask.StaleChunkError:
            print("stale")
        lossy.append(np.array([8], np.int32), -6.0)   # later chunks are whole, inline
        ref = lossy.take()
        print("after:", ref.inline, reader.open(ref).to_lists())
    """, prefix)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stale" in result.stdout and "rows:" not in result.stdout, result.stdout
    assert "after: True ([[8]], [-6.0])" in result.stdout


@pytest.mark.parametrize("bad", [np.array([2**31 + 5], np.int64), np.array([-(2**31) - 1]),
                                 np.array([1.5])])
def test_ids_that_do_not_fit_int32_are_refused(writer, bad):
    queue = writer.open_queue("support")
    with pytest.raises(shmask.InvalidRowsError, match="ids"):
        writer.append_step([queue], np.array([1]), bad, np.zeros(1, np.float32))
    with pytest.raises(shmask.InvalidRowsError, match="lengths"):
        writer.append_step([queue], np.array([2**32 + 1], np.int64), np.array([3]),
                           np.zeros(1, np.float32))
    assert queue.rows == 0


@pytest.mark.parametrize("field, value", [("position", -1), ("position", 1 << 64),
                                          ("segment", None), ("rows", "x")])
def test_discarding_malformed_refs_raises_invalid_ref(writer, reader, field, value):
    ref = writer.publish(np.array([1], np.int32), np.array([3], np.int32),
                         np.zeros(1, np.float32))
    forged = ChunkRef(ref.kind, ref.mode, ref.segment, ref.epoch, ref.position,
                      ref.record_bytes, ref.rows, ref.nnz, None)
    setattr(forged, field, value)
    with pytest.raises(shmask.InvalidRefError):
        reader.discard(forged)
    with pytest.raises(shmask.InvalidRefError):
        reader.discard_batch([forged, 1])
    reader.discard(ref)


def test_sigterm_unlinks_when_the_first_writer_was_built_off_the_main_thread(prefix):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import threading, time, shmask
        config = shmask.Config(ring_mb=1, name_prefix={prefix!r})
        made = []
        worker = threading.Thread(target=lambda: made.append(shmask.Writer(config)))
        worker.start(); worker.join()
        main = shmask.Writer(config)
        print(made[0].segment_name, main.segment_name, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(names) == 2 and all(os.path.exists(_path(n)) for n in names)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not any(os.path.exists(_path(n)) for n in names)


@pytest.mark.parametrize("mode", [1.5, float("nan"), "text", None])
def test_inline_refs_with_a_mode_of_the_wrong_type_are_refused(prefix, mode):
    with shmask.Writer(shmask.Config(transport="inline")) as writer:
        ref = writer.publish(np.array([1], np.int32), np.array([3], np.int32),
                             np.zeros(1, np.float32), mode="selected")
    forged = ChunkRef(ref.kind, mode, ref.segment, ref.epoch, ref.position, ref.record_bytes,
                      ref.rows, ref.nnz, ref.payload)
    with pytest.raises(shmask.InvalidRefError, match="mode"):
        shmask.Reader(shmask.Config(transport="inline")).open(forged)


def test_attaching_a_cut_segment_says_it_was_truncated(writer, prefix):
    """A reader that first meets a ring after someone cut its file short
    (the header page intact) is told so, not handed a malformed-ref error."""
    ref = writer.publish(np.array([1], np.int32), np.array([3], np.int32),
                         np.zeros(1, np.float32))
    os.truncate(_path(writer.segment_name), 4096 + 8192)
    with pytest.raises(shmask.StaleChunkError, match="truncated"):
        shmask.Reader(shmask.Config(name_prefix=prefix)).open(ref)

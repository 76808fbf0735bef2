"""Segment lifecycle with real processes: permissions, unlink on close,
exit and SIGTERM, the janitor, and readers that never unlink."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import leftover_segments, run_child

import shmask
from shmask.segment import collect_garbage, list_segments


def _spawn(code: str, prefix: str) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys, time, shmask
        w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix={prefix!r}))
        print(w.segment_name, flush=True)
    """) + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def _shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def test_segment_is_private_and_preallocated(writer):
    info = os.stat(_shm_path(writer.segment_name))
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    assert info.st_size == 4096 + writer.config.ring_capacity_bytes
    assert info.st_blocks * 512 >= info.st_size, "backing must be allocated up front"


def test_close_unlinks(config):
    writer = shmask.Writer(config)
    path = _shm_path(writer.segment_name)
    assert os.path.exists(path)
    writer.close()
    assert not os.path.exists(path)


def test_exit_unlinks(prefix):
    proc = _spawn("sys.exit(0)", prefix)
    name = proc.stdout.readline().strip()
    assert proc.wait(timeout=30) == 0
    assert name and not os.path.exists(_shm_path(name))


def test_sigterm_unlinks_and_still_terminates(prefix):
    proc = _spawn("time.sleep(60)", prefix)
    name = proc.stdout.readline().strip()
    assert os.path.exists(_shm_path(name))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not os.path.exists(_shm_path(name))


def test_gc_removes_segments_of_dead_producers_only(prefix, writer):
    proc = _spawn("time.sleep(60)", prefix)
    name = proc.stdout.readline().strip()
    listed = {s.name: s for s in list_segments(prefix)}
    assert listed[name].alive and listed[writer.segment_name].alive
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=30)
    assert os.path.exists(_shm_path(name))
    removed = collect_garbage(prefix)
    assert removed == [name]
    assert os.path.exists(_shm_path(writer.segment_name)), "a live producer's segment stays"


def test_new_writer_collects_garbage(prefix):
    proc = _spawn("time.sleep(60)", prefix)
    name = proc.stdout.readline().strip()
    proc.kill()
    proc.wait(timeout=30)
    with shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)):
        assert not os.path.exists(_shm_path(name))


def test_reader_process_exit_does_not_unlink(writer):
    """Readers never register segments with multiprocessing's resource tracker."""
    import numpy as np

    ref = writer.publish(np.array([2], np.int32), np.array([3, 9], np.int32),
                         np.array([-0.5, -1.5], np.float32))
    code = textwrap.dedent("""
        import multiprocessing, sys, shmask
        multiprocessing.set_start_method("spawn")
        ref = shmask.ChunkRef.from_bytes(bytes.fromhex(sys.argv[1]))
        with shmask.Reader().open(ref) as chunk:
            assert chunk.ids.tolist() == [3, 9], chunk.ids
    """)
    subprocess.run([sys.executable, "-c", code, ref.to_bytes().hex()], check=True, timeout=60)
    assert os.path.exists(_shm_path(writer.segment_name))
    assert writer.publish(np.array([1], np.int32), np.array([1], np.int32),
                          np.array([0.0], np.float32)).rows == 1


def test_too_small_dev_shm_fails_at_creation(prefix):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    too_big_mb = 1 << (free // 2**20).bit_length()  # the next power of two above free space
    with pytest.raises(shmask.SegmentError, match="SHMASK_RING_MB"):
        shmask.Writer(shmask.Config(ring_mb=too_big_mb, name_prefix=prefix))
    assert not leftover_segments(prefix)


def test_reader_of_vanished_segment_gets_stale_error(config, reader):
    import numpy as np

    writer = shmask.Writer(config)
    ref = writer.publish(np.array([1], np.int32), np.array([5], np.int32), np.array([0.0], np.float32))
    writer.close()
    time.sleep(0.01)
    with pytest.raises(shmask.StaleChunkError):
        reader.open(ref)


GUARDED_MAPPINGS = 1100  # past the SIGBUS guard's first chunk of 1,024 slots


def test_guard_covers_more_than_1024_mappings(prefix):
    """The guard's table grows (it had 1,024 fixed slots: the 1,025th
    mapping failed with "Too many open files"): 1,100 mappings of one ring,
    the file cut, and a read through the last mapping gets zero pages and a
    truncated segment, not a SIGBUS."""
    code = textwrap.dedent(f"""
        import os, resource, sys, shmask
        from shmask.segment import Segment
        needed = {GUARDED_MAPPINGS} + 256  # the guard keeps a descriptor per mapping
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard < needed:
            print("skip: RLIMIT_NOFILE's hard limit is", hard)
            sys.exit(0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
        writer = shmask.Writer(shmask.Config(ring_mb=1, name_prefix={prefix!r}))
        segments = [Segment.attach(writer.segment_name) for _ in range({GUARDED_MAPPINGS})]
        os.truncate("/dev/shm/" + writer.segment_name.lstrip("/"), 0)
        last = segments[-1]
        print(last.buffer[8192] == b"\\0", last.truncated)
        for segment in segments:
            segment.close()
        writer.close()
    """)
    done = run_child([sys.executable, "-c", code], dict(os.environ), timeout=120)
    if done.stdout.startswith("skip"):
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stdout

"""Scheduler -> detokenizer -> tokenizers as real OS processes over zmq, with
every row checked by the tokenizers against the seeded workload."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SESSION_PREFIX, children_of, running

PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"


def run_pipeline(tmp_path, *args: str, **env: str):
    summary = tmp_path / "summary.json"
    environ = {**os.environ, "SHMASK_NAME_PREFIX": SESSION_PREFIX, "SHMASK_RING_MB": "16", **env}
    result = subprocess.run(
        [sys.executable, str(PIPELINE), "--timeout", "120", "--summary-json", str(summary), *args],
        env=environ, capture_output=True, text=True, timeout=180,
    )
    stats = json.loads(summary.read_text()) if summary.exists() else None
    return result, stats


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_three_processes_move_every_row_intact(tmp_path, mode):
    result, stats = run_pipeline(tmp_path, "--requests", "24", "--tokens", "130", "--top-k", "64",
                                 "--mode", mode, "--tokenizers", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert stats["mismatches"] == 0
    assert stats["rows"] == stats["expected_rows"] > 0
    assert stats["inline_chunks"] == 0, "a 16 MiB ring holds this workload"
    # only references crossed the sockets: far fewer bytes than the rows
    assert stats["scheduler"]["socket_bytes"] * 50 < stats["scheduler"]["payload_bytes"]


def test_full_ring_falls_back_inline_across_processes(tmp_path):
    result, stats = run_pipeline(tmp_path, "--requests", "16", "--tokens", "120", "--top-k", "400",
                                 SHMASK_RING_MB="1", SHMASK_FULL_WAIT_MS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert stats["mismatches"] == 0 and stats["rows"] == stats["expected_rows"]
    assert stats["inline_chunks"] > 0


def test_inline_transport_across_processes(tmp_path):
    result, stats = run_pipeline(tmp_path, "--requests", "8", "--tokens", "60", "--top-k", "32",
                                 SHMASK_TRANSPORT="inline")
    assert result.returncode == 0, result.stdout + result.stderr
    assert stats["mismatches"] == 0 and stats["inline_chunks"] == stats["chunks"] > 0


def test_the_check_catches_wrong_rows(tmp_path):
    """The tokenizers' check is real: checking against another seed fails."""
    result, stats = run_pipeline(tmp_path, "--requests", "4", "--tokens", "60", "--top-k", "16",
                                 "--check-seed", "1")
    assert result.returncode == 1
    assert stats["mismatches"] == stats["rows"] > 0


# -- a process of the pipeline dies ---------------------------------------------
# A workload of minutes, so every process is mid-way when one is killed.
LONG = ["--requests", "64", "--tokens", "20000", "--top-k", "100", "--tokenizers", "2"]
DEATH_EXIT_S = 5.0  # generous for a busy 2-core machine: the pipeline hears a death at once


@pytest.mark.parametrize("victim", ["producer.py", "detokenizer.py", "consumer.py"])
def test_a_dead_process_ends_the_pipeline_naming_it(prefix, victim):
    """One of the pipeline's processes SIGKILLed mid-way: the pipeline does
    not wait for it (nor for the others, which can no longer finish), but
    exits 1 within seconds with one line naming the dead process and its
    signal, no traceback, no process and no ring left behind."""
    from conftest import leftover_segments

    environ = {**os.environ, "SHMASK_NAME_PREFIX": prefix, "SHMASK_RING_MB": "16"}
    process = subprocess.Popen([sys.executable, str(PIPELINE), "--timeout", "120", *LONG],
                               env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        # Under way: every script's process started and the producer's ring made.
        while len(children_of(process.pid)) < 3 or not leftover_segments(prefix):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the pipeline did not start"
            time.sleep(0.1)
        time.sleep(1.0)  # rows are moving
        os.kill(children_of(process.pid)[victim][0], signal.SIGKILL)
        killed = time.monotonic()
        out, err = process.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, (out, err)
    assert "Traceback" not in err, err
    assert f"{victim} (pid " in err and "SIGKILL" in err, err
    assert took < DEATH_EXIT_S, (took, err)
    with pytest.raises(ProcessLookupError):  # the other processes are gone too
        os.killpg(process.pid, 0)
    assert leftover_segments(prefix) == []  # the producer's ring, however it died


def test_children_go_with_a_killed_pipeline(prefix):
    """The pipeline itself SIGKILLed: none of its processes outlives it,
    waiting forever on a peer or on the word to exit (each asked the kernel
    for SIGTERM when it dies), and the producer's ring goes with them."""
    from conftest import leftover_segments

    environ = {**os.environ, "SHMASK_NAME_PREFIX": prefix, "SHMASK_RING_MB": "16"}
    process = subprocess.Popen([sys.executable, str(PIPELINE), "--timeout", "120", *LONG],
                               env=environ, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(children := children_of(process.pid)) < 3 or not leftover_segments(prefix):
            assert process.poll() is None, "the pipeline ended early"
            assert time.monotonic() < deadline, "the pipeline did not start"
            time.sleep(0.1)
        time.sleep(1.0)  # rows are moving: the producer's Writer is made
        pids = [pid for same_script in children.values() for pid in same_script]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 10
        while alive := [pid for pid in pids if running(pid)]:
            assert time.monotonic() < deadline, f"processes outlived the pipeline: {alive}"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert leftover_segments(prefix) == []

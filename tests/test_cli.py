from __future__ import annotations

import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmask", *args], capture_output=True, text=True,
                          timeout=60, env={"SHMASK_RING_MB": "64", "COLUMNS": "200", "PATH": ""})


def test_ls_shows_a_live_segment(writer):
    result = _cli("ls")
    assert result.returncode == 0
    assert writer.segment_name in result.stdout


def test_doctor_reports_native_core_and_shm():
    result = _cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "native core" in result.stdout and "loaded" in result.stdout and "/dev/shm" in result.stdout


def test_gc_runs():
    result = _cli("gc", "--prefix", "shmnothing")
    assert result.returncode == 0 and "0 segment(s) removed" in result.stdout

"""The SGLang benchmarks still run, at tiny sizes, against the installed
SGLang 0.5.23: benchmarks/sglang_responses.py (released vs patched response
JSON; it exits 1 on any byte mismatch) and benchmarks/sglang_capture.py
--smoke (the patched capture's paths under the interpreter)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """In a process group of its own, killed whole on a timeout or an interrupt."""
    proc = subprocess.Popen(command, cwd=REPO / "benchmarks", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command[1]} ran past {timeout} s:\n{(out + err)[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.timeout(300)
def test_sglang_responses_benchmark_runs_byte_identical():
    done = _run([sys.executable, "sglang_responses.py", "--requests", "4", "--repeats", "1"], 280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "byte mismatches: 0" in done.stdout, done.stdout[-2000:]


@pytest.mark.timeout(300)
def test_sglang_capture_benchmark_smoke_runs_every_path():
    done = _run([sys.executable, "sglang_capture.py", "--smoke"], 280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for path in ("patched, past cap status", "top_p 0.9 selected"):
        assert path in done.stdout, done.stdout[-2000:]

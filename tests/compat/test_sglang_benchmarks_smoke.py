"""The SGLang benchmarks still run, at tiny sizes, against the installed
SGLang 0.5.23: benchmarks/sglang_responses.py (released vs patched response
JSON; it exits 1 on any byte mismatch) and benchmarks/sglang_capture.py
--smoke (the patched capture's paths under the interpreter)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(300)
def test_sglang_responses_benchmark_runs_byte_identical(run_child):
    done = run_child([sys.executable, str(BENCHMARKS / "sglang_responses.py"), "--requests", "4",
                      "--repeats", "1"], dict(os.environ), timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "byte mismatches: 0" in done.stdout, done.stdout[-2000:]


@pytest.mark.timeout(300)
def test_sglang_capture_benchmark_smoke_runs_every_path(run_child):
    done = run_child([sys.executable, str(BENCHMARKS / "sglang_capture.py"), "--smoke"],
                     dict(os.environ), timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for path in ("patched, past cap status", "top_p 0.9 selected"):
        assert path in done.stdout, done.stdout[-2000:]

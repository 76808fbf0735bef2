"""benchmarks/vllm_step.py still runs, at tiny sizes, through the installed
vLLM 0.33.0's own modules: both paths, every request's ids counted at the
frontend (the script asserts that), and the ratios printed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["lists", "arrays"])
def test_vllm_step_benchmark_runs_both_paths(run_child, form):
    done = run_child([sys.executable, str(BENCHMARKS / "vllm_step.py"), "--steps", "3",
                      "--requests", "8", "--support", "50", "--format", form],
                     dict(os.environ), timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for line in ("vLLM 0.33.0 as released", "patched (shmask)", "patched / released"):
        assert line in done.stdout, done.stdout[-2000:]


@pytest.mark.timeout(300)
def test_vllm_gpu_step_benchmark_runs_every_path(run_child):
    """benchmarks/vllm_gpu_step.py at tiny sizes: vLLM's own compaction
    kernel and tolists (the installed files, loaded as the GPU machine loads
    its copy), the CPU-published and the GPU-published paths, every
    request's ids checked against vLLM's by the script; here in Triton's
    interpreter (the store kernel too: TRITON_INTERPRET=1)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = run_child([sys.executable, str(BENCHMARKS / "vllm_gpu_step.py"), "--smoke"], env,
                     timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "every request's ids checked (84 slices)" in done.stdout, done.stdout[-2000:]
    assert "patched, GPU / released" in done.stdout
    assert "'direct_steps': 7" in done.stdout, done.stdout[-2000:]  # every GPU step stored by the kernel

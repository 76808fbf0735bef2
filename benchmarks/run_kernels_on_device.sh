#!/usr/bin/env bash
# One device call (issues 3, 9): the kernel tests on the GPU, then the benchmark.
# Usage (device tool, repository root): bash benchmarks/run_kernels_on_device.sh [benchmark args]
# shmask itself is not installed there (its transport needs a compiled module),
# so a shim package exposes only kernels/ as shmask.kernels.
set -uo pipefail
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT" /tmp/shim/shmask
: > /tmp/shim/shmask/__init__.py
ln -sfn "$PWD/kernels" /tmp/shim/shmask/kernels
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1 SHMASK_TEST_GPU=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # From another directory: `python -m` puts the cwd first on sys.path, and the
  # repository's own shmask/ would shadow the shim.
  repo=$PWD
  (cd /tmp && python3 -m pytest -q --noconftest -p no:cacheprovider -W ignore \
    --rootdir "$repo" "$repo"/tests/test_kernel_*.py) 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
fi
python3 benchmarks/kernels.py "$@" 2>&1 | tee "$OUT/kernels.txt"

#!/usr/bin/env bash
# One device call (issues 3, 9, 20): the kernel tests on the GPU, then a benchmark.
# Usage (device tool, repository root): bash benchmarks/run_kernels_on_device.sh [benchmark args]
# BENCH=capture_bf16 runs benchmarks/capture_bf16.py (issue 20's table) instead of
# benchmarks/kernels.py; SKIP_TESTS=1 skips the tests.
# shmask itself is not installed there (its transport needs a compiled module),
# so a shim package exposes only kernels/ (and the modules of shmask it
# imports: errors, layout, device_port) as shmask.kernels.
set -uo pipefail
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT" /tmp/shim/shmask
: > /tmp/shim/shmask/__init__.py
ln -sfn "$PWD/kernels" /tmp/shim/shmask/kernels
for module in errors layout device_port; do  # what kernels/ imports of shmask
  ln -sfn "$PWD/shmask/$module.py" /tmp/shim/shmask/$module.py
done
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
if [ "${BENCH:-kernels}" = capture_bf16 ]; then
  (cd benchmarks && python3 capture_bf16.py --json "$OUT/capture_bf16.json" "$@") 2>&1 \
    | tee "$OUT/capture_bf16.txt"
else
  python3 benchmarks/kernels.py "$@" 2>&1 | tee "$OUT/kernels.txt"
fi

#!/usr/bin/env bash
# FlashInfer's headers, taken from its released wheel, for benchmarks/flashinfer_ref.py
# (issue 35): the device has nvcc but no network and no registry, so the headers travel
# with the working tree (device tool: carry=[".device"]; /.device/ is git-ignored).
#
# Usage (repository root, a machine that reaches the registry):
#   bash benchmarks/flashinfer_fetch.sh [DEST]     DEST defaults to .device/flashinfer
# Leaves DEST/include/flashinfer/*.cuh, FlashInfer's vendored CCCL under DEST/cccl
# (its JIT puts that CCCL ahead of the CUDA toolkit's, so we compile against the same),
# cuRAND's headers under DEST/curand/include (sampling.cuh includes curand_kernel.h,
# which a toolkit without the cuRAND component lacks: this machine's does; the device
# part of cuRAND is headers only, nothing to link), DEST/VERSION (the two pins, one a
# line) and DEST/WHEEL_SHA256 (of both wheels).
# Idempotent: a DEST that already holds these versions is left as it is.
set -euo pipefail
FLASHINFER_VERSION=0.7.4  # newest flashinfer-python on the registry when this was written
CURAND_VERSION=10.4.0.35  # cuRAND of CUDA 13.0.0, the device's toolkit
DEST=${1:-.device/flashinfer}
versions="flashinfer-python==$FLASHINFER_VERSION
nvidia-curand==$CURAND_VERSION"

if [ -f "$DEST/VERSION" ] && [ "$(cat "$DEST/VERSION")" = "$versions" ] \
    && [ -f "$DEST/include/flashinfer/sampling.cuh" ] \
    && [ -f "$DEST/curand/include/curand_kernel.h" ]; then
  echo "flashinfer $FLASHINFER_VERSION headers already in $DEST"
  exit 0
fi

if [ -x .venv/bin/pip ]; then pip=(.venv/bin/pip); else pip=(python3 -m pip); fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# --no-deps: only the wheels' headers are needed, not torch & co. cuRAND's wheel is
# per platform; its headers are the same in every one.
"${pip[@]}" download -q --no-deps "flashinfer-python==$FLASHINFER_VERSION" -d "$tmp"
"${pip[@]}" download -q --no-deps --only-binary=:all: --platform manylinux_2_27_x86_64 \
  "nvidia-curand==$CURAND_VERSION" -d "$tmp"
wheel=$(ls "$tmp"/flashinfer_python-"$FLASHINFER_VERSION"-*.whl)
curand_wheel=$(ls "$tmp"/nvidia_curand-"$CURAND_VERSION"-*.whl)
# The wheel keeps its headers under flashinfer/data/: include/ (FlashInfer's own)
# and cccl/{cub,libcudacxx/include,thrust} (what its JIT adds with -I).
# Only headers are unpacked: the whole FlashInfer wheel is ~700 MB of sources and cubins.
python3 - "$tmp/x" "$wheel" "$curand_wheel" <<'PY'
import sys, zipfile
for path in sys.argv[2:]:
    with zipfile.ZipFile(path) as wheel:
        wanted = [n for n in wheel.namelist() if n.startswith(
            ("flashinfer/data/include/", "flashinfer/data/cccl/", "nvidia/cu13/include/curand"))]
        wheel.extractall(sys.argv[1], members=wanted)
PY
[ -f "$tmp/x/flashinfer/data/include/flashinfer/sampling.cuh" ] \
  || { echo "no flashinfer/data/include/flashinfer/sampling.cuh in $wheel" >&2; exit 1; }

# Staged beside DEST and moved into place whole, so an interrupted run leaves no
# half-filled DEST that the check above would accept.
mkdir -p "$(dirname "$DEST")"
stage=$(mktemp -d "$(dirname "$DEST")/.flashinfer-stage.XXXXXX")
trap 'rm -rf "$tmp" "$stage"' EXIT
mv "$tmp/x/flashinfer/data/include" "$stage/include"
mv "$tmp/x/flashinfer/data/cccl" "$stage/cccl"
mkdir -p "$stage/curand"
mv "$tmp/x/nvidia/cu13/include" "$stage/curand/include"
(cd "$tmp" && sha256sum "$(basename "$wheel")" "$(basename "$curand_wheel")") > "$stage/WHEEL_SHA256"
echo "$versions" > "$stage/VERSION"
rm -rf "$DEST"
chmod 755 "$stage"  # mktemp made it 0700
mv "$stage" "$DEST"
echo "flashinfer $FLASHINFER_VERSION headers in $DEST ($(du -sh "$DEST" | cut -f1))"

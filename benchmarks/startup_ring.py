"""Issue 36, item 4: what an SGLang scheduler rank reserves at start.

Before: ``start_scheduler`` made the rank's Writer (its SHMASK_RING_MB ring)
at start: "before" times that Writer() alone. Now: no ring until the first
request for masks, which gets an inline Writer at once while the ring is
made on another thread. Each measurement in a fresh child process, three
times: the start-up call's time and the /dev/shm bytes at start; now also
the first request's Writer, the time until the ring is ready (from that
request) and /dev/shm once it is.

    .venv/bin/python benchmarks/startup_ring.py     (SHMASK_RING_MB: default 1024)
"""

from __future__ import annotations

import subprocess
import sys

COMMON = r"""
import os, time, types
os.environ["SHMASK_NAME_PREFIX"] = "startup36"

def shm_bytes():
    return sum(os.stat("/dev/shm/" + name).st_blocks * 512 for name in os.listdir("/dev/shm")
               if name.startswith("startup36"))
"""

BEFORE = COMMON + r"""
import shmask
began = time.perf_counter()
writer = shmask.Writer()
start = time.perf_counter() - began
print(f"start {start * 1e3:.2f} ms, /dev/shm {shm_bytes()} B")
writer.close()
"""

NOW = COMMON + r"""
from shmask.adapters import sglang
args = types.SimpleNamespace(sampling_mask_max_tokens=4096, enable_metrics=False)
began = time.perf_counter()
sglang.start_scheduler(args)
start = time.perf_counter() - began
at_start = shm_bytes()
began = time.perf_counter()
rows = sglang.SamplingMaskRows("selected")
first = time.perf_counter() - began
ring = sglang.ring_ready(120)
ready = time.perf_counter() - began
print(f"start {start * 1e3:.2f} ms, /dev/shm {at_start} B; first request {first * 1e3:.2f} ms;"
      f" ring ready {ready * 1e3:.0f} ms after it, /dev/shm {shm_bytes()} B")
rows.close()
sglang._ends["inline"].close()
ring.close()
"""


def main() -> None:
    for name, code in (("before (the ring made at start)", BEFORE), ("now", NOW)):
        for _ in range(3):
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=300, check=True)
            print(f"{name}: {done.stdout.strip()}")


if __name__ == "__main__":
    main()

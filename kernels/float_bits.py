"""Device functions and constants on the bits of float32 values and of
bitmask words, shared by compaction's and capture's kernels.

A key is a float32's bits read as an int32: for finite w >= 0 keys order as
the values do, so a cutoff on w is a cutoff on keys, and read unsigned every
NaN and negative value (sign bit set) lies above +inf's key.
"""

from __future__ import annotations

import triton
import triton.language as tl

SMALLEST_POSITIVE = tl.constexpr(1.401298464324817e-45)  # float32 bits 1, a subnormal
INF_KEY = tl.constexpr(0x7F800000)  # float bits of +inf: a floor no candidate reaches
NEG_ZERO_KEY = tl.constexpr(-0x80000000)  # float bits of -0.0 as an int32


@triton.jit
def popcount(x):
    """Set bits of each uint32 (SWAR; no libdevice, so it also runs interpreted)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def log_any(x):
    """ln x for every x >= 0, subnormal x too: Triton's log on NVIDIA GPUs
    is libdevice's with flush-to-zero, which takes a subnormal for 0 (and
    gives -inf), so such an x is scaled by 2^24 first and 24 ln 2 taken off."""
    tiny = x < 1.1754943508222875e-38  # below float32's smallest normal
    return tl.log(tl.where(tiny, x * 16777216.0, x)) - tl.where(tiny, 16.635532333438686, 0.0)

"""How the kernels are launched: compiled or interpreted, chained by
programmatic dependent launch (PDL) or not, and the launch options that
follow (``launch_pdl``, ``maxnreg``).

PDL (sm90+, compiled): a kernel launched with ``launch_pdl`` may start
while the kernel before it runs; every kernel calls :func:`after_previous`
before it reads what the kernels before wrote, so the chain stays ordered.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import launch_plan
from .launch_plan import ON_ROCM, compiled_for_nvidia, launches_interpreted

# compiled_for_nvidia and launches_interpreted live in launch_plan, whose
# per-call check uses them: a test or benchmark that patches them patches
# them there.

__all__ = ["after_previous", "compiled_for_nvidia", "launch", "launch_options",
           "launches_interpreted", "multiprocessors", "pdl_default", "register_cap"]


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, reported to a plan's recording
    (kernels/launch_plan.py) when one is on. Runtime arguments go by
    position, constexprs and launch options by keyword."""
    compiled = kernel[grid](*args, **kwargs)
    launch_plan.record(launch_plan.Launch(kernel, grid, args, kwargs, compiled))


def pdl_default(device: torch.device) -> bool:
    """Programmatic dependent launch where the GPU has it (NVIDIA sm90+, not
    ROCm, whose gfx9 parts report major 9 too) and the kernels are compiled
    (Triton's interpreter has no grid dependencies)."""
    return (device.type == "cuda" and not ON_ROCM and not launches_interpreted()
            and _capability(device)[0] >= 9)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch option of a kernel chained to the one before (``pdl``)."""
    return {"launch_pdl": True} if pdl else {}


def register_cap(nvidia: bool, registers: int) -> dict[str, int]:
    """The launch option capping a kernel's registers a thread (NVIDIA's
    compiled kernels only): more programs resident on each multiprocessor."""
    return {"maxnreg": registers} if nvidia else {}


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def after_previous(PDL: tl.constexpr):
    """Programmatic dependent launch (a kernel launched with ``launch_pdl``
    may start while the kernel before it runs): wait until the kernels
    before have finished and their writes are visible, then let the next
    kernel launch. Every program calls it before it reads what they wrote
    or writes anything, and before it exits, so that a kernel finishes
    only after those before it (the kernel after relies on that). Reads of
    the call's inputs, which no kernel of the chain writes, may come first,
    and so may reads from L2 (``.cg``) of what a kernel two or more launches
    back wrote: it finished before the kernel before this one began."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

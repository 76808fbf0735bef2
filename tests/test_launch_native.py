"""A plan's launches made by the native core (kernels/launch_plan.py's
NativeLaunches, native/shmask_launch.c): what each cuLaunchKernelEx gets
must be what Triton 3.6's launcher gives it (make_launcher: every runtime
argument as the C type its signature names, floats as their storage bits,
then the global and profile scratch pointers; the block is 32 x warps; PDL
and cooperative launches as attributes 6 and 2). The driver here is a
stand-in built from C in this file, whose cuLaunchKernelEx records what it
gets (no GPU on this machine); on the H200 the real driver runs the real
kernels and tests/test_rows_every_path.py::test_planned_calls_match_tritons_path
compares their rows with Triton's path."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from shmask.kernels import launch_plan
from shmask.kernels.launch import launch

from shmask._native import ffi, lib

STAND_IN_DRIVER = r"""
#include <stdint.h>
#include <string.h>
typedef struct { int id; char pad[4]; union { char bytes[64]; int value; } value; } attribute;
typedef struct {
    unsigned gx, gy, gz, bx, by, bz, shared; void *stream; attribute *attrs; unsigned n_attrs;
} config;
#define CALLS 16
int calls, fail_at = -1, fail_code;
unsigned want_params[CALLS];
uint64_t functions[CALLS], streams[CALLS];
unsigned dims[CALLS][7], n_attrs[CALLS];
int attr_ids[CALLS][4], attr_values[CALLS][4];
uint8_t params[CALLS][32][8];
int cuLaunchKernelEx(const config *c, void *f, void **p, void **extra) {
    if (calls == fail_at) return fail_code;
    if (calls >= CALLS || extra) return 1;
    int i = calls++;
    functions[i] = (uint64_t)(uintptr_t)f;
    streams[i] = (uint64_t)(uintptr_t)c->stream;
    unsigned d[7] = {c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shared};
    memcpy(dims[i], d, sizeof d);
    n_attrs[i] = c->n_attrs;
    for (unsigned a = 0; a < c->n_attrs && a < 4; a++) {
        attr_ids[i][a] = c->attrs[a].id;
        attr_values[i][a] = c->attrs[a].value.value;
    }
    for (unsigned k = 0; k < want_params[i] && k < 32; k++) memcpy(params[i][k], p[k], 8);
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds the native core, so one is here"
    folder = tmp_path_factory.mktemp("driver")
    (folder / "driver.c").write_text(STAND_IN_DRIVER)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(folder / "driver.so"),
                    str(folder / "driver.c")], check=True, timeout=120)
    return ctypes.CDLL(str(folder / "driver.so"))


def reset(driver: ctypes.CDLL, want: list[int]) -> None:
    ctypes.c_int.in_dll(driver, "calls").value = 0
    ctypes.c_int.in_dll(driver, "fail_at").value = -1
    for index, count in enumerate(want):
        (ctypes.c_uint * 16).in_dll(driver, "want_params")[index] = count


def address(driver: ctypes.CDLL) -> int:
    return ctypes.cast(driver.cuLaunchKernelEx, ctypes.c_void_p).value or 0


def cells(driver: ctypes.CDLL, call: int, count: int) -> list[bytes]:
    table = ((ctypes.c_uint8 * 8) * 32 * 16).in_dll(driver, "params")
    return [bytes(table[call][k]) for k in range(count)]


@dataclass
class Param:
    name: str
    default: Any = None


@dataclass
class Source:
    signature: dict[str, str]


class Launcher:
    """Triton 3.6's CudaLauncher, as far as a plan looks at it."""

    def __init__(self, pdl: bool = True, scratch: int = 0) -> None:
        self.launch_cooperative_grid, self.launch_pdl = False, pdl
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.c_calls: list = []

    def launch(self, *args: Any) -> None:
        self.c_calls.append(args)

    def __call__(self, *args: Any) -> None:
        raise AssertionError("a kernel without scratch is launched through its C function")


@dataclass
class Compiled:
    function: int
    signature: dict[str, str]
    packed_metadata: tuple = (4, 1, 1024)
    run: Launcher = field(default_factory=Launcher)

    def __post_init__(self) -> None:
        self.src = Source(self.signature)


class Kernel:
    def __init__(self, signature: dict[str, str], function: int, **compiled: Any) -> None:
        self.__name__ = f"kernel_{function}"
        self.params = [Param(name) for name in signature]
        self.compiled = Compiled(function, signature, **compiled)

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.compiled


# The first kernel: a pointer slot, a held workspace pointer, an i32, an
# fp32, an i64, a bool (i1) and a constexpr (by keyword, as the kernels
# pass them: not a parameter); the second: a view into a slot (a byte
# offset), a bf16, an fp16 and a u8.
FIRST = {"x": "*fp32", "ws": "*i32", "n": "i32", "scale": "fp32", "big": "i64", "flag": "i1",
         "BLOCK": "constexpr"}
SECOND = {"out": "*i32", "half": "bf16", "h": "fp16", "small": "u8"}


def one_call(first: Kernel, second: Kernel, slots: list[torch.Tensor], held: torch.Tensor) -> None:
    launch(first, (3, 2), slots[0], held, 7, 0.1, 1 << 40, True, BLOCK=128)
    launch(second, (5,), slots[1][4:], 1.5, -2.25, 200)


def planned(first: Kernel, second: Kernel, held: torch.Tensor) -> launch_plan.Plan:
    plans = launch_plan.Plans("test")
    for _ in range(2):
        slots = [torch.zeros(16), torch.zeros(16, dtype=torch.int32)]
        with launch_plan.recording() as launches:
            one_call(first, second, slots, held)
        plans.recorded("key", launches, slots)
    plan = plans.ready("key")
    assert plan is not None
    return plan


@pytest.fixture
def triton_36(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.0")


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def test_each_launch_gets_what_tritons_launcher_gives_it(driver, triton_36) -> None:
    first, second = Kernel(FIRST, 0x1111), Kernel(SECOND, 0x2222, packed_metadata=(8, 1, 0),
                                                  run=Launcher(pdl=False))
    held = torch.zeros(4, dtype=torch.int32)
    plan = planned(first, second, held)
    assert plan.native is not None
    plan.native.launch_fn = address(driver)
    slots = [torch.zeros(16), torch.zeros(16, dtype=torch.int32)]
    reset(driver, [6 + 2, 4 + 2])
    plan.replay(launch_plan.pointers(slots), stream=0xABC)
    assert ctypes.c_int.in_dll(driver, "calls").value == 2
    assert list((ctypes.c_uint64 * 16).in_dll(driver, "functions")[:2]) == [0x1111, 0x2222]
    assert list((ctypes.c_uint64 * 16).in_dll(driver, "streams")[:2]) == [0xABC, 0xABC]
    dims = ((ctypes.c_uint * 7) * 16).in_dll(driver, "dims")
    assert list(dims[0]) == [3, 2, 1, 128, 1, 1, 1024]  # grid, 32 x 4 warps, shared
    assert list(dims[1]) == [5, 1, 1, 256, 1, 1, 0]
    n_attrs = (ctypes.c_uint * 16).in_dll(driver, "n_attrs")
    ids = ((ctypes.c_int * 4) * 16).in_dll(driver, "attr_ids")
    values = ((ctypes.c_int * 4) * 16).in_dll(driver, "attr_values")
    assert (n_attrs[0], ids[0][0], values[0][0]) == (1, 6, 1)  # PDL: programmatic serialization
    assert n_attrs[1] == 0
    pad = b"\0" * 4
    assert cells(driver, 0, 8) == [
        u64(slots[0].data_ptr()), u64(held.data_ptr()), struct.pack("<i", 7) + pad,
        struct.pack("<f", 0.1) + pad, struct.pack("<q", 1 << 40), b"\1" + b"\0" * 7,
        u64(0), u64(0)]  # the scratch pointers, NULL
    bf16 = struct.unpack("<I", struct.pack("<f", 1.5))[0] >> 16
    assert cells(driver, 1, 6) == [
        u64(slots[1].data_ptr() + 4 * 4), struct.pack("<H", bf16) + b"\0" * 6,
        struct.pack("<e", -2.25) + b"\0" * 6, b"\xc8" + b"\0" * 7, u64(0), u64(0)]
    # the next call's tensors replace this call's, nothing else changes
    again = [torch.zeros(32), torch.zeros(32, dtype=torch.int32)]
    reset(driver, [8, 6])
    plan.replay(launch_plan.pointers(again), stream=1)
    assert cells(driver, 0, 2) == [u64(again[0].data_ptr()), u64(held.data_ptr())]
    assert cells(driver, 1, 1) == [u64(again[1].data_ptr() + 16)]
    assert not first.compiled.run.c_calls and not second.compiled.run.c_calls


def test_without_a_loaded_driver_the_steps_launch_in_python(triton_36) -> None:
    """No libcuda.so.1 in this process (this machine): the core launches
    nothing and says so, and the plan's steps go through Triton's C launch
    function as before, from then on."""
    try:  # on a CUDA host torch has loaded the driver: the real one would launch
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        pytest.skip("this process has loaded a CUDA driver (the other tests use a stand-in)")
    except OSError:
        pass
    first, second = Kernel(FIRST, 1), Kernel(SECOND, 2)
    plan = planned(first, second, torch.zeros(4, dtype=torch.int32))
    assert plan.native is not None and plan.native.launch_fn == 0
    slots = [torch.zeros(16), torch.zeros(16, dtype=torch.int32)]
    plan.replay(launch_plan.pointers(slots), stream=3)
    assert plan.native is None
    assert len(first.compiled.run.c_calls) == 1 and len(second.compiled.run.c_calls) == 1
    assert first.compiled.run.c_calls[0][9 + 4] == slots[0].data_ptr()  # after the 13 heads


def test_a_cuda_error_names_the_launch_that_failed(driver, triton_36) -> None:
    first, second = Kernel(FIRST, 1), Kernel(SECOND, 2)
    plans = launch_plan.Plans("test")
    slots = [torch.zeros(16), torch.zeros(16, dtype=torch.int32)]
    held = torch.zeros(4, dtype=torch.int32)
    for _ in range(2):
        with launch_plan.recording() as launches:
            one_call(first, second, slots, held)
        plans.recorded("key", launches, slots)
    plan = plans.ready("key")
    assert plan is not None and plan.native is not None
    plan.native.launch_fn = address(driver)
    reset(driver, [8, 6])
    ctypes.c_int.in_dll(driver, "fail_at").value = 1
    ctypes.c_int.in_dll(driver, "fail_code").value = 700
    with pytest.raises(RuntimeError, match=r"kernel_2 \(launch 2 of 2\).*CUDA error 700"):
        plans.replay("key", plan, launch_plan.pointers(slots), 0)
    assert ctypes.c_int.in_dll(driver, "calls").value == 1  # the first was made
    assert not plans.wants_recording("key")  # Triton's path from then on


@pytest.mark.parametrize("odd", ["scratch", "cluster", "tensordesc", "version"])
def test_launches_the_core_cannot_pack_stay_in_python(odd: str, monkeypatch) -> None:
    import triton

    monkeypatch.setattr(triton, "__version__", "3.7.0" if odd == "version" else "3.6.0")
    signature = {**SECOND, "desc": "tensordesc<fp32[16]>"} if odd == "tensordesc" else SECOND
    kernel = Kernel(signature, 9, run=Launcher(scratch=64 if odd == "scratch" else 0),
                    packed_metadata=(4, 2, 0) if odd == "cluster" else (4, 1, 0))
    record = launch_plan.Launch(kernel, (1,), (), {}, kernel.compiled)
    assert launch_plan.native_refusal([record]) is not None
    assert launch_plan.native_refusal([launch_plan.Launch(
        Kernel(SECOND, 9), (1,), (), {}, Kernel(SECOND, 9).compiled)]) is (
            None if odd != "version" else launch_plan.native_refusal([record]))


def test_a_plan_that_does_not_hold_together_launches_nothing(driver) -> None:
    """The core checks every hole and parameter against the argument bytes
    before it writes or launches anything."""
    steps = ffi.new("shm_launch_step[]", 2)
    for step in steps:
        step.grid_x = step.grid_y = step.grid_z = 1
        step.threads, step.n_params = 32, 1
    args = ffi.new("uint8_t[]", 16)
    pointers = ffi.new("uint64_t[]", [0x1000])
    holes = ffi.new("shm_launch_hole[]", 1)
    failed = ffi.new("uint32_t *")

    def run(byte: int, slot: int, args_bytes: int = 16, first_param: int = 1) -> int:
        reset(driver, [1, 1])
        steps[1].first_param = first_param  # its one parameter's cell: bytes 8 on
        holes[0].byte, holes[0].slot, holes[0].offset = byte, slot, 8
        return lib.shm_launch_plan(steps, 2, args, args_bytes, holes, 1, pointers, 1, 0,
                                   address(driver), failed)

    assert run(8, 0) == lib.SHM_OK
    assert ctypes.c_int.in_dll(driver, "calls").value == 2
    assert bytes(ffi.buffer(args, 16))[8:] == u64(0x1008)
    for bad in (run(9, 0), run(8, 1), run(0, 0, args_bytes=8), run(0, 0, first_param=2)):
        assert bad == lib.SHM_E_LAUNCH_PLAN
        assert ctypes.c_int.in_dll(driver, "calls").value == 0

"""Eager calls in microseconds of host time (issue 35): a call's launches,
recorded once per call shape and then replayed through the compiled
kernels' own launchers.

Why: a launch through Triton's ``JITFunction.run`` binds and specializes
every argument and computes a cache key, 10-31 us a launch
(benchmarks/launch_overhead.py); a capture makes 5-10 launches, and with
the Python around them an eager call took 450-1,200 us of host time on the
H200's host. Engines call the sampler eagerly, on the scheduler's thread,
after the CUDA-graphed forward: that time is the step's.

How. An entry point (capture and sample: kernels/capture.py; compact:
kernels/compact.py) computes a *shape key*: every argument that decides its
launches' grids, integers, constexprs and Triton's specializations (dtypes,
shapes, strides, the settings' kinds, the 16-byte alignment of each
per-call tensor, the device, the stream, the thread, the values of
kernels/tuning.py). The tensors a call brings or allocates (inputs,
settings, the result) are its *slots*; anything else a launch gets (the
thread's workspace, kernels/capture_workspace.py) must be the same object
from call to call, and the plan holds it.

- The first call of a key takes Triton's path with its launches recorded
  (:func:`.launch.launch` reports each to the recording).
- The second does too; the plan built from the first recording is kept
  only if, fed the second call's slots, it makes exactly the second call's
  launches: the same compiled kernels, grids and options, every argument
  equal, or the same byte offset into the same slot. Otherwise the key is
  never planned (a call whose launches carry something per call that the
  key does not name stays on Triton's path).
- Later calls replay: per launch, the compiled kernel's launcher with the
  recorded arguments and this call's slot pointers; or, where every launch
  is one the core can make as Triton 3.6's launcher makes it (no scratch
  memory, no cluster; arguments of the kinds its C launcher packs), all of
  them in one native call (NativeLaunches, native/shmask_launch.c): the
  arguments packed once into bytes, the call's pointers written in, one
  cuLaunchKernelEx a launch. H200: 10-25% less host time a call than the
  launches one Python call each (benchmarks/results/h200_issue35_round4_host_*).
- A native plan whose call's tensors are at addresses it has replayed
  before (an engine's buffers that stay put, the kept results) launches
  them as one CUDA graph it keeps (_Graphs): one cuGraphLaunch in place of
  a cuLaunchKernelEx a launch. H100: about half the host time of an eager
  call (benchmarks/results/h100_s29_host_graphs.txt). The call stays
  eager: a graph only stands for launches the plan would make with those
  same arguments, and the caller captures nothing.

So every launch of an entry point's stages must go through
:func:`.launch.launch` (a torch op or a launch made otherwise would be
missing from the replay, and no recording shows it), and anything a stage
computes on the host from the call's values must be in the key.

Triton's path is taken whenever a replay could differ from it: the
interpreter or no NVIDIA GPU (no compiled launcher), launch hooks installed
(a profiler wants to see launches), a CUDA graph being captured, a
tensor on another device than the current one, ``SHMASK_KERNEL_PLANS=0``,
or a Triton whose internals a plan does not know (any error while
building one: the key is not planned, logged once).
"""

from __future__ import annotations

import logging
import operator
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.driver import driver

from . import tuning

log = logging.getLogger(__name__)

# Triton's runtime knobs (3.4 on; the ``kernels`` extra asks 3.6): the interpreter switch, the
# debug mode and the launch hooks, each read at every call through the
# object kept here (looking it up is a third of the reading's cost)
_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)
ON_ROCM = torch.version.hip is not None
PLANS_KEPT = 256  # call shapes kept per entry point: an engine's batch sizes
# Whether a plan's launches go through the native core where they can
# (NativeLaunches) or one Python call each: read at each replay, so that
# benchmarks/host_time.py compares the two in one process.
NATIVE_LAUNCHES = True
# Whether a plan launched from the core replays an address set it has met
# before as one CUDA graph (_Graphs): read at each replay, for the same
# comparison.
GRAPHS = True
GRAPH_AFTER = 2  # an address set becomes a graph at its second replay
GRAPHS_KEPT = 4  # graphs a plan keeps (kept results alternate between two)
GRAPH_FAILURES = 3  # failed captures after which a plan makes no more graphs
_NOT_PLANNED = object()


@dataclass(frozen=True)
class Launch:
    """One launch as Triton's path made it: the kernel, its grid, its
    positional and keyword arguments, and the compiled kernel Triton ran."""

    kernel: Any  # triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    compiled: Any  # triton CompiledKernel


_recording = threading.local()


def record(launch: Launch) -> None:
    """Called by launch.launch after each launch: kept if a recording is on."""
    launches = getattr(_recording, "launches", None)
    if launches is not None:
        launches.append(launch)


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """The launches made inside the block, on this thread."""
    launches: list[Launch] = []
    outer = getattr(_recording, "launches", None)
    _recording.launches = launches
    try:
        yield launches
    finally:
        _recording.launches = outer


def plans_enabled() -> bool:
    """SHMASK_KERNEL_PLANS off (0, false, no, off, any case) sends every
    launch through Triton's path; read at each call."""
    value = os.environ.get("SHMASK_KERNEL_PLANS")
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")


def hooks_active() -> bool:
    """Whether Triton would call launch hooks (a profiler): a replay would
    skip them. A Triton whose hooks are not HookChains counts as hooked."""
    if _RUNTIME is None:
        return True
    for hook in (getattr(_RUNTIME, "launch_enter_hook", None),
                 getattr(_RUNTIME, "launch_exit_hook", None)):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launches_interpreted() -> bool:
    """Whether Triton runs launches in its interpreter. From Triton 3.4 on
    (the ``kernels`` extra asks 3.6) that is the knob ``runtime.interpret``,
    the one Triton itself reads: kernels/__init__ sets it when it chose the
    interpreter, and otherwise it reads TRITON_INTERPRET at each access. A
    Triton without the knob (older than the floor) interprets as
    TRITON_INTERPRET said when it was imported: the variable is then the
    answer."""
    if _RUNTIME is not None:
        return bool(_RUNTIME.interpret)
    return os.environ.get("TRITON_INTERPRET") == "1"


def compiled_for_nvidia(x: torch.Tensor) -> bool:
    """Whether kernels on x run compiled for an NVIDIA GPU (PTX and its
    launch options), not in Triton's interpreter or on ROCm."""
    return x.is_cuda and not ON_ROCM and not launches_interpreted()


def call_stream(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(current device, current stream, thread) for a call on ``tensor``'s
    device that a plan may serve (the device and stream as Triton's
    launches take them; a plan is filled in place, so it serves one
    thread); None where the call must take Triton's path (see the module
    docstring). Every eager call asks: each check is a read of a kept
    object or of one variable (its cost is the call's, issue 35)."""
    if not compiled_for_nvidia(tensor) or not plans_enabled() or hooks_active():
        return None
    if getattr(_RUNTIME, "debug", False):
        return None  # Triton's debug mode recompiles kernels with checks: its own path
    if torch.cuda.is_current_stream_capturing():
        return None
    active = driver.active
    device = active.get_current_device()
    if tensor.device.index != device:
        return None  # Triton launches on the current device's stream: its own path
    return device, active.get_current_stream(device), threading.get_ident()


def tuning_state() -> tuple[Any, ...]:
    """The values of kernels/tuning.py's constants: launches pass them as
    constexprs, so a plan belongs to one set of them (tests and benchmarks
    change them at run time)."""
    return _TUNING_VALUES(vars(tuning))


_TUNING_VALUES = operator.itemgetter(*(name for name in vars(tuning) if name.isupper()))


def _bound_values(launch: Launch) -> list[Any]:
    """The kernel's arguments in signature order, as JITFunction.run hands
    them to the launcher (positional, then keywords and defaults)."""
    params = launch.kernel.params
    values = list(launch.args)
    for param in params[len(values):]:
        values.append(launch.kwargs.get(param.name, param.default))
    return values


def _slot_of(value: Any, slots: Sequence[torch.Tensor | None]) -> tuple[int, int] | None:
    """(slot index, byte offset) of a tensor argument: the slot that starts
    where it starts, else the slot whose elements' bytes hold its start (a
    view into a result's allocation); None when it lies in none. Only the
    bytes a slot's own elements span count, not the rest of its storage:
    two settings cut from one user buffer are two slots, not one slot and
    an offset that a later call's tensors need not keep."""
    if not isinstance(value, torch.Tensor):
        return None
    address = value.data_ptr()
    starts = [None if slot is None else slot.data_ptr() for slot in slots]
    if address in starts:
        return starts.index(address), 0
    for index, (slot, start) in enumerate(zip(slots, starts, strict=True)):
        if slot is not None and start is not None and start < address < start + _span(slot):
            return index, address - start
    return None


def _span(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(),
                                                            strict=True))
    return (last + 1) * tensor.element_size()


class _Step:
    """One launch of a plan: the compiled kernel's launcher, its grid and
    function, the arguments with per-call pointers left as slot positions.

    Triton 3.6's launcher is a Python ``__call__`` (it allocates the global
    and profile scratch a kernel asks for) around a C function taking
    ``(grid, stream, function, cooperative, pdl, global scratch, profile
    scratch, metadata, launch metadata, enter hook, exit hook, *args)``;
    a kernel that asks for no scratch is launched through that C function
    directly (about 1.5 us a launch less), any other kernel or Triton
    through the launcher."""

    __slots__ = ("run", "grid", "head", "values", "holes", "held")

    def __init__(self, launch: Launch, slots: Sequence[torch.Tensor | None]) -> None:
        compiled = launch.compiled
        grid = (*launch.grid, 1, 1)
        self.grid = (grid[0], grid[1], grid[2])
        launcher = compiled.run
        direct = _direct_launch(launcher)
        self.head: tuple[Any, ...]
        if direct is not None:
            self.run = direct
            self.head = (*self.grid, 0, compiled.function, bool(launcher.launch_cooperative_grid),
                         bool(launcher.launch_pdl), None, None, compiled.packed_metadata, None,
                         None, None)
        else:
            self.run = launcher
            self.head = (*self.grid, 0, compiled.function, compiled.packed_metadata, None, None,
                         None)
        self.values: list[Any] = []
        self.holes: list[tuple[int, int, int]] = []  # (position, slot, byte offset)
        # tensors passed by address that are no slot (the thread's
        # workspace): held here, so no address the plan keeps is ever freed
        self.held: list[torch.Tensor] = []
        for position, value in enumerate(_bound_values(launch)):
            where = _slot_of(value, slots)
            if where is not None:
                self.holes.append((position, *where))
                value = 0
            elif isinstance(value, torch.Tensor):
                self.held.append(value)
                value = value.data_ptr()
            self.values.append(value)

    @property
    def function(self) -> Any:
        return self.head[4]

    def arguments(self, pointers: Sequence[int]) -> list[Any]:
        """The launch's arguments with the slots at ``pointers``: the
        step's own list, filled in place (a plan serves one thread: its key
        names the thread's workspace)."""
        values = self.values
        for position, slot, offset in self.holes:
            values[position] = pointers[slot] + offset
        return values

    def launch(self, pointers: Sequence[int], stream: int) -> None:
        g0, g1, g2, _, *rest = self.head
        self.run(g0, g1, g2, stream, *rest, *self.arguments(pointers))


def _direct_launch(launcher: Any) -> Any:
    """The C launch function under Triton 3.6's CudaLauncher, where a call
    to it is exactly what the launcher's ``__call__`` makes: no scratch
    memory asked for (its allocations are the only work it adds) and the
    attributes of that version; None otherwise (the launcher is called)."""
    if not triton.__version__.startswith("3.6."):
        return None
    needed = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size",
              "profile_scratch_size")
    if not all(hasattr(launcher, name) for name in needed):
        return None
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    return launcher.launch


# ------------------------------------------------------------ native launches

# How Triton 3.6's launcher hands each runtime argument to cuLaunchKernelEx
# (its make_launcher: the C type its signature names, a float as the bits
# of its storage type): the struct format of those bytes. bf16 is packed
# apart (the high half of the float32's bits, as Triton does).
_PACKED = {"i1": "<b", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "u1": "<B",
           "u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "fp16": "<e", "fp32": "<f",
           "f32": "<f", "fp64": "<d"}
_SCRATCH_PARAMS = 2  # every 3.6 kernel ends with its global and profile scratch pointers


def _packed(kind: str, value: Any) -> bytes:
    """One runtime argument's bytes, in an 8-byte cell (what the kernel
    reads is the type's size from the cell's start: little-endian)."""
    if kind.startswith("*"):
        return struct.pack("<Q", 0 if value is None else int(value))
    if kind == "bf16":
        return struct.pack("<H", struct.unpack("<I", struct.pack("<f", value))[0] >> 16).ljust(8, b"\0")
    return struct.pack(_PACKED[kind], value).ljust(8, b"\0")


def native_refusal(launches: Sequence[Launch]) -> str | None:
    """Why these launches cannot be made by the core (None: they can):
    only launches whose every argument is packed as Triton 3.6's launcher
    packs it (the launch functions _direct_launch accepts, no scratch
    memory, no cluster, no tensor descriptor) go there."""
    for launch in launches:
        compiled = launch.compiled
        if _direct_launch(compiled.run) is None:
            return "not Triton 3.6's launcher of a kernel without scratch memory"
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        metadata = compiled.packed_metadata
        if not isinstance(signature, dict) or len(signature) != len(launch.kernel.params):
            return "no signature on the compiled kernel"
        if not (isinstance(metadata, tuple) and len(metadata) == 3 and metadata[1] == 1):
            return "a cluster launch, or metadata other than (warps, ctas, shared)"
        kinds = [kind for kind in signature.values() if kind != "constexpr"]
        if any(not isinstance(kind, str) or not (kind.startswith("*") or kind in _PACKED
                                                   or kind == "bf16") for kind in kinds):
            return f"an argument of a kind the core does not pack: {kinds}"
        if len(kinds) + _SCRATCH_PARAMS > _native().SHM_LAUNCH_MAX_PARAMS:
            return "more parameters than the core takes"
    return None


def _native() -> Any:
    from shmask._native import lib

    return lib


class NativeLaunches:
    """A plan's launches made by one call of the core's shm_launch_plan
    (native/shmask_launch.c): each step's parameters packed once into one
    byte array as Triton's launcher packs them, the call's tensor addresses
    written into their cells at each replay, then every cuLaunchKernelEx in
    one loop, with the configuration and attributes Triton gives them."""

    def __init__(self, launches: Sequence[Launch], steps: Sequence[_Step], n_slots: int,
                 launch_fn: int = 0) -> None:
        from shmask._native import ffi

        self._lib = _native()
        # cuLaunchKernelEx's address; 0: the driver this process loaded (tests
        # point it at a stand-in driver)
        self.launch_fn = launch_fn
        cells: list[bytes] = []
        holes: list[tuple[int, int, int]] = []
        specs: list[tuple[int, ...]] = []
        self.names: list[str] = []
        for launch, step in zip(launches, steps, strict=True):
            compiled = launch.compiled
            kinds = list(compiled.src.signature.values())
            first = len(cells)
            hole_at = {position: (slot, offset) for position, slot, offset in step.holes}
            for position, (kind, value) in enumerate(zip(kinds, step.values, strict=True)):
                if kind == "constexpr":
                    continue
                if position in hole_at:
                    holes.append((8 * len(cells), *hole_at[position]))
                cells.append(_packed(kind, value))
            cells.extend(_packed("*", None) for _ in range(_SCRATCH_PARAMS))
            warps, _, shared = compiled.packed_metadata
            launcher = compiled.run
            specs.append((int(step.function), *step.grid, 32 * int(warps), int(shared),
                          int(bool(launcher.launch_pdl)), int(bool(launcher.launch_cooperative_grid)),
                          first, len(cells) - first))
            self.names.append(getattr(launch.kernel, "__name__", repr(launch.kernel)))
        self._args = ffi.new("uint8_t[]", b"".join(cells) or b"\0")
        self._args_bytes = 8 * len(cells)
        self._steps = ffi.new("shm_launch_step[]", len(specs))
        for index, spec in enumerate(specs):
            cell = self._steps[index]
            (cell.function, cell.grid_x, cell.grid_y, cell.grid_z, cell.threads,
             cell.shared_bytes, cell.pdl, cell.cooperative, cell.first_param,
             cell.n_params) = spec
        self._n_steps = len(specs)
        self._holes = ffi.new("shm_launch_hole[]", max(len(holes), 1))
        for index, (byte, slot, offset) in enumerate(holes):
            cell = self._holes[index]
            cell.byte, cell.slot, cell.offset = byte, slot, offset
        self._n_holes = len(holes)
        self._pointers = ffi.new("uint64_t[]", max(n_slots, 1))
        self._n_pointers = n_slots
        self._failed = ffi.new("uint32_t *")

    def arguments(self) -> bytes:
        """The packed parameter bytes as the last launch had them (tests)."""
        from shmask._native import ffi

        return bytes(ffi.buffer(self._args, self._args_bytes))

    def launch(self, pointers: Sequence[int], stream: int) -> bool:
        """The launches with the slots at ``pointers``; False (nothing
        launched) where this process has no CUDA driver loaded; a CUDA error
        raises, naming the kernel (the launches before it were made)."""
        held = self._pointers
        held[0:len(pointers)] = pointers  # (one call: cffi's slice assignment)
        rc = self._lib.shm_launch_plan(
            self._steps, self._n_steps, self._args, self._args_bytes, self._holes,
            self._n_holes, held, self._n_pointers, stream, self.launch_fn, self._failed)
        if rc == 0:
            return True
        if rc == self._lib.SHM_E_LAUNCH_PLAN:
            return False
        step = self._failed[0]
        raise RuntimeError(f"shmask: cuLaunchKernelEx of {self.names[step]} (launch {step + 1} "
                           f"of {self._n_steps}) failed with CUDA error {-1000 - rc}")

    def capture(self, pointers: Sequence[int], capture_stream: int) -> int:
        """The launches with the slots at ``pointers`` as one instantiated
        CUDA graph (its handle), recorded on ``capture_stream``; nothing
        runs. Raises where the driver cannot (the caller keeps launching)."""
        from shmask._native import ffi

        if self.launch_fn:
            raise _NoGraphs("a stand-in driver's launches are not captured")
        held = self._pointers
        held[0:len(pointers)] = pointers
        made = ffi.new("uint64_t *")
        rc = self._lib.shm_launch_plan_graph(
            self._steps, self._n_steps, self._args, self._args_bytes, self._holes,
            self._n_holes, held, self._n_pointers, capture_stream, made, self._failed)
        if rc == self._lib.SHM_E_LAUNCH_PLAN:
            raise _NoGraphs("the loaded CUDA driver has no graph API")
        if rc != 0:
            raise RuntimeError(f"shmask: a plan's launches could not become a CUDA graph "
                               f"(CUDA error {-1000 - rc})")
        return int(made[0])


class _NoGraphs(Exception):
    """This process's driver makes no graphs (said at debug level)."""


class _Graphs:
    """A plan's CUDA graphs, one per address set (issue 35): an eager call
    costs the host a cuLaunchKernelEx a launch (about 2 us each, 5-10 a
    call); a graph of the same launches costs one cuGraphLaunch. A graph
    holds its kernels' arguments as they were captured, the call's tensor
    addresses among them, so it serves only calls whose slots are at those
    addresses (the key says everything else about them): an engine's
    buffers that stay put from step to step and the kept results
    (kernels/rows.py), which alternate between two. An address set becomes
    a graph at its GRAPH_AFTER-th replay (a set met once, a fresh input
    each step, costs no capture), at most GRAPHS_KEPT a plan, the least
    recently used freed. A driver without graphs, a failed graph launch or
    GRAPH_FAILURES failed captures leave the plan to its launches from
    then on; a set whose capture failed is launched one by one this time
    and may be captured when it is met again."""

    def __init__(self, native: NativeLaunches) -> None:
        self.native = native
        self.graphs: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.seen: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.broken = False
        self.failures = 0  # captures that failed
        self.captured = 0  # graphs made (tests, benchmarks)
        self.launched = 0  # calls served by a graph

    def launch(self, pointers: Sequence[int], stream: int) -> bool:
        """The plan's launches as this address set's graph, on ``stream``;
        False where they must be launched one by one (nothing launched)."""
        if self.broken:
            return False
        addresses = tuple(pointers)
        graph = self.graphs.get(addresses)
        if graph is None:
            graph = self._made(addresses)
            if graph is None:
                return False
        else:
            self.graphs.move_to_end(addresses)
        rc = self.native._lib.shm_graph_launch(graph, stream)
        if rc != 0:
            self.close()
            if rc == self.native._lib.SHM_E_LAUNCH_PLAN:
                return False
            raise RuntimeError(f"shmask: cuGraphLaunch of a plan's graph failed with CUDA "
                               f"error {-1000 - rc}")
        self.launched += 1
        return True

    def _made(self, addresses: tuple[int, ...]) -> int | None:
        """This address set's graph once it is met often enough, else None."""
        met = self.seen.pop(addresses, 0) + 1
        if met < GRAPH_AFTER:
            self.seen[addresses] = met
            while len(self.seen) > 4 * GRAPHS_KEPT:
                self.seen.popitem(last=False)
            return None
        try:
            # one capture at a time in the process: the capture stream is
            # one per device, and a stream captures one graph at a time
            # (the core runs without the GIL)
            with _CAPTURE_LOCK:
                graph = self.native.capture(addresses, _capture_stream())
        except _NoGraphs as why:
            log.debug("shmask plan: launches stay one by one (%s)", why)
            self.close()
            return None
        except Exception as exc:  # noqa: BLE001 - a failed capture launches one by one
            self.failures += 1
            log.debug("shmask plan: a capture failed (%s)", exc)
            if self.failures >= GRAPH_FAILURES:
                self.close()
            return None
        self.captured += 1
        self.graphs[addresses] = graph
        while len(self.graphs) > GRAPHS_KEPT:
            self.native._lib.shm_graph_destroy(self.graphs.popitem(last=False)[1])
        return graph

    def close(self) -> None:
        """Free every graph; the plan launches one by one from then on."""
        self.broken = True
        graphs, self.graphs = self.graphs, OrderedDict()
        for graph in graphs.values():
            self.native._lib.shm_graph_destroy(graph)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - at exit the driver may be gone first
            pass


_CAPTURE_STREAMS: dict[int, int] = {}  # device -> the stream captures are recorded on
_CAPTURE_LOCK = threading.Lock()  # held around a capture (and the stream's making)


def _capture_stream() -> int:
    """The current device's capture stream (made once, in its context)."""
    from shmask._native import ffi

    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        made = ffi.new("uint64_t *")
        rc = _native().shm_capture_stream(made)
        if rc != 0:
            raise RuntimeError(f"shmask: no stream to capture a plan's graph on (code {rc})")
        stream = _CAPTURE_STREAMS[device] = int(made[0])
    return stream


def pointers(slots: Sequence[torch.Tensor | None]) -> list[int]:
    """The slots' addresses (0 for an absent slot)."""
    return [0 if slot is None else slot.data_ptr() for slot in slots]


def slots_key(addresses: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a call shape's key says of its slots: each one's address modulo
    16 (Triton specializes pointers on 16-byte alignment) and, where two
    slots are one tensor, the index of the first slot at each one's address
    (two settings equal as scalars share one constant tensor: a plan made so
    would hand the first's pointer to both); () when all are apart."""
    apart = len(set(addresses)) == len(addresses)
    return (tuple(map((15).__and__, addresses)),
            () if apart else tuple(map(list(addresses).index, addresses)))


class _Unplanned(Exception):
    """A recording that a plan must not replay (said at debug level)."""


class Plan:
    """A call shape's launches, replayable with another call's slots."""

    def __init__(self, launches: Sequence[Launch], slots: Sequence[torch.Tensor | None]) -> None:
        if any(getattr(launch.kernel, "pre_run_hooks", None) for launch in launches):
            raise _Unplanned("a kernel has pre-run hooks, which only Triton's path runs")
        self.steps = [_Step(launch, slots) for launch in launches]
        # One native call for every launch where the core can make them as
        # Triton's launcher would (else the steps, one Python call each).
        self.native: NativeLaunches | None = None
        self.graphs: _Graphs | None = None
        why = native_refusal(launches)
        if why is None:
            self.native = NativeLaunches(launches, self.steps, len(slots))
            self.graphs = _Graphs(self.native)
        else:
            log.debug("shmask plan: launches stay in Python (%s)", why)

    def matches(self, launches: Sequence[Launch], slots: Sequence[torch.Tensor | None]) -> bool:
        """Whether replaying with ``slots`` makes exactly ``launches``."""
        if len(launches) != len(self.steps):
            return False
        addresses = pointers(slots)
        for step, launch in zip(self.steps, launches, strict=True):
            if launch.compiled.function != step.function or (*launch.grid, 1, 1)[:3] != step.grid:
                return False
            actual = [v.data_ptr() if isinstance(v, torch.Tensor) else v
                      for v in _bound_values(launch)]
            expected = list(step.arguments(addresses))
            if len(actual) != len(expected) or any(
                    type(a) is not type(e) or a != e for a, e in zip(actual, expected, strict=True)):
                return False
        return True

    def replay(self, pointers: Sequence[int], stream: int) -> None:
        """The launches, with the slots at ``pointers`` (pointers(slots))."""
        if self.native is not None and NATIVE_LAUNCHES:
            if GRAPHS and self.graphs is not None and self.graphs.launch(pointers, stream):
                return
            if self.native.launch(pointers, stream):
                return
            self.native = None  # no driver in this process: nothing was launched
        for step in self.steps:
            step.launch(pointers, stream)


class Plans:
    """An entry point's plans by shape key (at most PLANS_KEPT, least
    recently used dropped), each key's state: one recording awaiting its
    check, a Plan, or not planned."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._states: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._warned = False
        self.replayed = 0  # calls served by a plan (tests, benchmarks)

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def ready(self, key: Hashable) -> Plan | None:
        with self._lock:
            state = self._states.get(key)
            if not isinstance(state, Plan):
                return None
            self._states.move_to_end(key)
            self.replayed += 1
            return state

    def replay(self, key: Hashable, plan: Plan, addresses: Sequence[int], stream: int) -> None:
        """plan.replay; a launch that raises leaves the key to Triton's path
        from then on (the error goes to the caller)."""
        try:
            plan.replay(addresses, stream)
        except BaseException:
            with self._lock:
                self._states[key] = _NOT_PLANNED
            raise

    def launch(self, key: Hashable, slots: Sequence[torch.Tensor | None],
               addresses: Sequence[int], stream: int, launches: Callable[[], Any]) -> None:
        """A call of ``key``: its plan replayed with ``addresses`` (the
        slots'), or ``launches()`` on Triton's path, recorded only while the
        key may still become a plan (a key never planned costs no record)."""
        plan = self.ready(key)
        if plan is not None:
            self.replay(key, plan, addresses, stream)
        elif not self.wants_recording(key):
            launches()
        else:
            with recording() as made:
                launches()
            self.recorded(key, made, slots)

    def wants_recording(self, key: Hashable) -> bool:
        return self._states.get(key) is not _NOT_PLANNED

    def recorded(self, key: Hashable, launches: Sequence[Launch],
                 slots: Sequence[torch.Tensor | None]) -> None:
        """A call of ``key`` took Triton's path with these launches: the
        first becomes a candidate plan, the second confirms or refuses it."""
        with self._lock:
            state = self._states.get(key)
            try:
                if state is None:
                    self._states[key] = (Plan(launches, slots), None)
                elif isinstance(state, tuple):
                    plan = state[0]
                    self._states[key] = plan if plan.matches(launches, slots) else _NOT_PLANNED
                    if self._states[key] is _NOT_PLANNED:
                        log.debug("shmask %s: call shape not planned (launches differ): %r",
                                  self.name, key)
            except _Unplanned as why:
                self._states[key] = _NOT_PLANNED
                log.debug("shmask %s: call shape not planned (%s): %r", self.name, why, key)
            except Exception as exc:  # a Triton whose internals differ: never planned
                self._states[key] = _NOT_PLANNED
                log.debug("shmask %s: call shape not planned", self.name, exc_info=True)
                if not self._warned:
                    self._warned = True
                    log.warning("shmask %s: eager launches stay on Triton's path (%s: %s)",
                                self.name, type(exc).__name__, exc)
            self._states.move_to_end(key)
            while len(self._states) > PLANS_KEPT:
                self._states.popitem(last=False)

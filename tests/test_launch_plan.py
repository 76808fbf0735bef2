"""Plans (kernels/launch_plan.py): a call shape's launches recorded twice,
kept only when the second call's launches are the first's with the new
call's tensors put in, then replayed through the compiled kernels'
launchers. Here the kernels are stand-ins that record what their
launchers get (a compiled launcher needs an NVIDIA GPU); the real kernels'
replays are compared with Triton's path on the GPU in
tests/test_rows_every_path.py::test_planned_calls_match_tritons_path."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from shmask.kernels import launch_plan
from shmask.kernels.launch import launch


@dataclass
class Param:
    name: str
    default: Any = None


@dataclass
class Compiled:
    """A compiled kernel: its launcher records the arguments it gets."""

    function: int
    packed_metadata: tuple = (32, 4)
    calls: list = field(default_factory=list)

    def run(self, *args: Any) -> None:
        self.calls.append(args)


class Kernel:
    """A JITFunction: kernel[grid](*args) runs its one compiled kernel."""

    def __init__(self, names: list[str], function: int = 7) -> None:
        self.params = [Param(n, default=3 if n == "N" else None) for n in names]
        self.compiled = Compiled(function)
        self.direct: list = []

    def __getitem__(self, grid: tuple[int, ...]):
        def run(*args: Any, **kwargs: Any) -> Compiled:
            self.direct.append((grid, args, kwargs))
            return self.compiled
        return run


def call(kernel: Kernel, slots: list[torch.Tensor], held: torch.Tensor, *, n: int = 5) -> None:
    """One 'call': two launches of ``kernel``, with the call's slots (an
    input, a view into a result), a held workspace tensor and ints."""
    launch(kernel, (4, 2), slots[0], held, n, N=16)
    launch(kernel, (4,), slots[1][8:], slots[0], 3, N=16)


def made(plans: launch_plan.Plans, key: Any, kernel: Kernel, slots: list[torch.Tensor],
         held: torch.Tensor, **kwargs: Any) -> None:
    with launch_plan.recording() as launches:
        call(kernel, slots, held, **kwargs)
    plans.recorded(key, launches, slots)


def fresh() -> list[torch.Tensor]:
    return [torch.zeros(64), torch.zeros(64, dtype=torch.int32)]


def test_a_confirmed_plan_replays_with_the_new_calls_pointers() -> None:
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    assert plans.ready("k") is None  # one recording: not yet a plan
    made(plans, "k", kernel, fresh(), held)
    plan = plans.ready("k")
    assert plan is not None
    slots = fresh()
    kernel.compiled.calls.clear()
    plan.replay(launch_plan.pointers(slots), stream=99)
    first, second = kernel.compiled.calls
    # grid (padded to 3), stream, function, metadata, no hooks, then every
    # argument in signature order: slots by address, held tensors too, ints
    # and the constexpr as recorded
    assert first == (4, 2, 1, 99, 7, (32, 4), None, None, None,
                     slots[0].data_ptr(), held.data_ptr(), 5, 16)
    assert second == (4, 1, 1, 99, 7, (32, 4), None, None, None,
                      slots[1].data_ptr() + 8 * 4, slots[0].data_ptr(), 3, 16)


class CudaLauncher:
    """Triton 3.6's launcher: __call__ around a C ``launch`` function."""

    def __init__(self, scratch: int) -> None:
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.c_calls: list = []
        self.py_calls: list = []

    def launch(self, *args: Any) -> None:
        self.c_calls.append(args)

    def __call__(self, *args: Any) -> None:
        self.py_calls.append(args)


@pytest.mark.parametrize("scratch", [0, 128])
def test_tritons_c_launch_is_called_directly_where_it_is_all_a_launch_does(
        monkeypatch: pytest.MonkeyPatch, scratch: int) -> None:
    """On Triton 3.6, a kernel that asks for no scratch memory is launched
    through the C function its launcher calls, with the arguments the
    launcher would give it; one that asks for scratch through the launcher
    (which allocates it)."""
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    launcher = CudaLauncher(scratch)
    kernel.compiled.run = launcher  # type: ignore[method-assign]
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    made(plans, "k", kernel, fresh(), held)
    plan = plans.ready("k")
    assert plan is not None
    slots = fresh()
    plan.replay(launch_plan.pointers(slots), stream=5)
    arguments = (slots[0].data_ptr(), held.data_ptr(), 5, 16)
    if scratch:
        assert not launcher.c_calls
        assert launcher.py_calls[0] == (4, 2, 1, 5, 7, (32, 4), None, None, None, *arguments)
    else:
        assert not launcher.py_calls
        assert launcher.c_calls[0] == (4, 2, 1, 5, 7, False, True, None, None, (32, 4), None,
                                       None, None, *arguments)


def test_a_call_whose_launches_differ_is_never_planned() -> None:
    """An int that changed, or a tensor that is neither a slot nor the same
    held one, makes the second recording differ: Triton's path for good."""
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    for second in ({"n": 6}, {"held": torch.zeros(16)}):
        plans = launch_plan.Plans("test")
        made(plans, "k", kernel, fresh(), held)
        made(plans, "k", kernel, fresh(), second.get("held", held), n=second.get("n", 5))
        assert plans.ready("k") is None
        assert not plans.wants_recording("k")


def test_slots_cut_from_one_buffer_stay_separate_slots() -> None:
    """Two slots that share a storage (settings cut from one user buffer)
    are matched by their own start, not as an offset into the first: a
    later call whose tensors are separate gets each pointer right."""
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    plans = launch_plan.Plans("test")

    def shared() -> list[torch.Tensor]:
        both = torch.zeros(128, dtype=torch.int32)
        return [both[:64].view(torch.float32), both[64:]]

    made(plans, "k", kernel, shared(), held)
    made(plans, "k", kernel, shared(), held)
    plan = plans.ready("k")
    assert plan is not None
    slots = fresh()  # separate allocations now
    kernel.compiled.calls.clear()
    plan.replay(launch_plan.pointers(slots), stream=1)
    assert kernel.compiled.calls[1][9] == slots[1].data_ptr() + 8 * 4
    assert kernel.compiled.calls[1][10] == slots[0].data_ptr()


def test_another_compiled_kernel_or_grid_is_not_the_plan() -> None:
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    kernel.compiled = Compiled(function=8)  # Triton specialized differently
    made(plans, "k", kernel, fresh(), held)
    assert plans.ready("k") is None


def test_a_triton_without_the_expected_internals_stays_on_its_path(caplog) -> None:
    class Odd(Kernel):
        def __getitem__(self, grid):
            return lambda *a, **k: object()  # no run, function, packed_metadata

    plans = launch_plan.Plans("test")
    with caplog.at_level(logging.WARNING):
        made(plans, "k", Odd(["x", "y", "n", "N"]), fresh(), torch.zeros(16))
        made(plans, "j", Odd(["x", "y", "n", "N"]), fresh(), torch.zeros(16))
    assert not plans.wants_recording("k") and not plans.wants_recording("j")
    assert len([r for r in caplog.records if "Triton's path" in r.getMessage()]) == 1


def test_plans_keep_the_most_recent_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_plan, "PLANS_KEPT", 3)
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    plans = launch_plan.Plans("test")
    for key in range(5):
        made(plans, key, kernel, fresh(), held)
        made(plans, key, kernel, fresh(), held)
    assert [plans.ready(key) is not None for key in range(5)] == [False, False, True, True, True]


def test_recording_is_per_thread_and_nests() -> None:
    import threading

    kernel = Kernel(["x", "y", "n", "N"])
    with launch_plan.recording() as outer:
        launch(kernel, (1,), 1, 2, 3)
        with launch_plan.recording() as inner:
            launch(kernel, (2,), 1, 2, 3)
        thread = threading.Thread(target=lambda: launch(kernel, (3,), 1, 2, 3))
        thread.start()
        thread.join()
        launch(kernel, (4,), 1, 2, 3)
    assert [x.grid for x in outer] == [(1,), (4,)] and [x.grid for x in inner] == [(2,)]
    assert len(kernel.direct) == 4  # every launch ran, recorded or not


def test_launch_hooks_send_calls_to_tritons_path() -> None:
    import triton

    hook = triton.knobs.runtime.launch_enter_hook
    assert not launch_plan.hooks_active()

    def profiler(metadata: Any) -> None:
        pass

    hook.add(profiler)
    try:
        assert launch_plan.hooks_active()
    finally:
        hook.remove(profiler)
    assert not launch_plan.hooks_active()


def test_no_plans_without_a_compiled_gpu_or_when_turned_off(monkeypatch) -> None:
    assert launch_plan.call_stream(torch.zeros(4)) is None  # the CPU: the interpreter
    monkeypatch.delenv("SHMASK_KERNEL_PLANS", raising=False)
    assert launch_plan.plans_enabled()  # unset: on
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")
    assert not launch_plan.plans_enabled()
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "1")
    assert launch_plan.plans_enabled()


def test_a_key_says_which_slots_are_one_tensor() -> None:
    """Two settings equal as scalars share one constant tensor: a plan
    made from such calls must not serve a call whose settings are two
    tensors (it would hand the first's pointer to both)."""
    one, other = torch.zeros(4), torch.zeros(4)
    shared = launch_plan.slots_key(launch_plan.pointers([one, one, None]))
    apart = launch_plan.slots_key(launch_plan.pointers([one, other, None]))
    assert shared != apart
    assert apart == launch_plan.slots_key(launch_plan.pointers([other, one, None]))
    # which slots share, not only that some do
    assert (launch_plan.slots_key(launch_plan.pointers([one, one, other]))
            != launch_plan.slots_key(launch_plan.pointers([one, other, other])))


def test_a_replay_that_raises_leaves_the_key_to_tritons_path() -> None:
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    made(plans, "k", kernel, fresh(), held)
    plan = plans.ready("k")
    assert plan is not None

    def broken(*args: Any) -> None:
        raise RuntimeError("launch failed")

    plan.steps[1].run = broken
    with pytest.raises(RuntimeError, match="launch failed"):
        plans.replay("k", plan, launch_plan.pointers(fresh()), stream=0)
    assert plans.ready("k") is None and not plans.wants_recording("k")


def test_a_plan_holds_what_it_keeps_by_address() -> None:
    """A tensor a launch gets that is no slot (the workspace) is held by
    the plan: its address can never be freed and reused under it."""
    import gc
    import weakref

    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    watch = weakref.ref(held)
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    made(plans, "k", kernel, fresh(), held)
    del held
    kernel.direct.clear()  # (the stand-in kernel's own record of its calls)
    gc.collect()
    assert watch() is not None and plans.ready("k") is not None
    plans.clear()
    gc.collect()
    assert watch() is None


def test_kernels_with_pre_run_hooks_are_not_planned() -> None:
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    kernel.pre_run_hooks = [lambda *a, **k: None]
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    assert not plans.wants_recording("k")


def test_a_key_never_planned_is_not_recorded_again() -> None:
    """Plans.launch: Triton's path for a refused key runs its launches
    without a recording (a key never planned costs no record a call)."""
    kernel, held = Kernel(["x", "y", "n", "N"]), torch.zeros(16)
    plans = launch_plan.Plans("test")
    made(plans, "k", kernel, fresh(), held)
    made(plans, "k", kernel, fresh(), held, n=6)  # differs: never planned
    recorded: list = []
    real = plans.recorded
    plans.recorded = lambda *a: (recorded.append(a), real(*a))  # type: ignore[method-assign]
    slots = fresh()
    kernel.direct.clear()
    plans.launch("k", slots, launch_plan.pointers(slots), 0,
                 lambda: call(kernel, slots, held))
    assert len(kernel.direct) == 2 and not recorded  # launched, not recorded
    plans.launch("j", slots, launch_plan.pointers(slots), 0,
                 lambda: call(kernel, slots, held))
    assert len(recorded) == 1  # a new key is recorded


class GraphDriver:
    """A plan's native launches as _Graphs sees them: capture() returns a
    new graph handle (or raises, as a driver without graphs does) and the
    core's shm_graph_launch / shm_graph_destroy record what they get (the
    real driver's graphs run on the GPU: tests/test_rows_every_path.py)."""

    SHM_E_LAUNCH_PLAN = -34

    def __init__(self) -> None:
        self.captures: list[tuple[int, ...]] = []
        self.launches: list[tuple[int, int]] = []
        self.destroyed: list[int] = []
        self.capture_fails: Exception | None = None
        self.launch_rc = 0
        self._lib = self

    def capture(self, pointers, capture_stream: int) -> int:
        assert launch_plan._CAPTURE_LOCK.locked()  # one capture at a time in the process
        if self.capture_fails:
            raise self.capture_fails
        self.captures.append(tuple(pointers))
        return 1000 + len(self.captures)

    def shm_graph_launch(self, graph: int, stream: int) -> int:
        self.launches.append((graph, stream))
        return self.launch_rc

    def shm_graph_destroy(self, graph: int) -> int:
        self.destroyed.append(graph)
        return 0


def test_an_address_set_becomes_a_graph_at_its_second_replay(monkeypatch) -> None:
    """A set met once is launched one by one (no capture for a fresh input
    each step); from its second replay on it is one graph launch; at most
    GRAPHS_KEPT graphs a plan, the least recently used freed."""
    monkeypatch.setattr(launch_plan, "_capture_stream", lambda: 77)
    driver = GraphDriver()
    graphs = launch_plan._Graphs(driver)  # type: ignore[arg-type]
    assert not graphs.launch([1, 2], stream=5) and driver.captures == []
    assert graphs.launch([1, 2], stream=5) and driver.captures == [(1, 2)]
    assert graphs.launch([1, 2], stream=6) and driver.launches == [(1001, 5), (1001, 6)]
    assert not graphs.launch([3, 4], stream=5)  # another set: met once
    for n in range(launch_plan.GRAPHS_KEPT):
        graphs.launch([10, n], stream=5)
        graphs.launch([10, n], stream=5)
    assert len(graphs.graphs) == launch_plan.GRAPHS_KEPT
    assert driver.destroyed == [1001]  # the least recently used
    assert (1, 2) not in graphs.graphs and graphs.launched == 2 + launch_plan.GRAPHS_KEPT


def test_a_driver_without_graphs_leaves_the_plan_to_its_launches(monkeypatch) -> None:
    monkeypatch.setattr(launch_plan, "_capture_stream", lambda: 77)
    driver = GraphDriver()
    graphs = launch_plan._Graphs(driver)  # type: ignore[arg-type]
    driver.capture_fails = launch_plan._NoGraphs("no graph API")
    assert not graphs.launch([1, 2], stream=5)
    assert not graphs.launch([1, 2], stream=5)  # no graphs: launched one by one
    driver.capture_fails = None
    assert not graphs.launch([1, 2], stream=5) and not graphs.launch([1, 2], stream=5)
    assert driver.captures == [] and driver.launches == []


def test_a_failed_capture_is_tried_again_a_few_times(monkeypatch) -> None:
    """A capture that fails with a CUDA error launches that call one by one
    and leaves the plan its graphs; GRAPH_FAILURES of them end its graphs."""
    monkeypatch.setattr(launch_plan, "_capture_stream", lambda: 77)
    driver = GraphDriver()
    graphs = launch_plan._Graphs(driver)  # type: ignore[arg-type]
    driver.capture_fails = RuntimeError("CUDA error 900")
    graphs.launch([1, 2], stream=5)
    assert not graphs.launch([1, 2], stream=5)  # the capture failed
    driver.capture_fails = None
    graphs.launch([1, 2], stream=5)
    assert graphs.launch([1, 2], stream=5) and driver.captures == [(1, 2)]
    driver.capture_fails = RuntimeError("CUDA error 900")
    for n in range(launch_plan.GRAPH_FAILURES - 1):  # the first failure was above
        graphs.launch([3, n], stream=5)
        assert not graphs.launch([3, n], stream=5)
        assert graphs.broken == (n == launch_plan.GRAPH_FAILURES - 2)
    assert driver.destroyed == [1001]
    assert not graphs.launch([1, 2], stream=5)


def test_a_graph_launch_that_fails_raises_and_frees_the_graphs(monkeypatch) -> None:
    monkeypatch.setattr(launch_plan, "_capture_stream", lambda: 77)
    driver = GraphDriver()
    graphs = launch_plan._Graphs(driver)  # type: ignore[arg-type]
    graphs.launch([1, 2], stream=5)
    graphs.launch([1, 2], stream=5)
    driver.launch_rc = -1000 - 700  # CUDA error 700
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        graphs.launch([1, 2], stream=5)
    assert driver.destroyed == [1001] and not graphs.launch([1, 2], stream=5)

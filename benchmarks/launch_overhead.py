"""Host time of the Triton launches of one eager capture()/sample() call, and
of a prototype cached launch path (issue 35), measured on a CPU without a GPU.

    /tmp/sassvenv/bin/python benchmarks/launch_overhead.py [--reps 30]

Run it with a venv holding the device's Triton (3.6) and the CPU torch, the
one benchmarks/sass_compare.py uses: the tree's ``kernels/`` is imported as
the package ``kernels``, every launch of capture(top_p=0.9),
capture(top_k=1000) and sample(top_p=0.9) at B = 256, V = 151936 (fp32) is
recorded with the launch decisions of a CUDA sm_90 device (``pdl_default``,
``compiled_for_nvidia``: on), then each is replayed, with the same argument
objects, through Triton's own ``JITFunction.run``, its kernel compiled for
sm_90 (Triton's disk cache) and held in Triton's in-memory kernel cache.

What is stubbed, and nothing else:
- ``triton.runtime.driver.active`` is a stand-in driver: ``get_current_device``
  returns 0 and ``get_current_stream`` 0 (on the device: torch.cuda's
  current_device, a Python function, and _cuda_getCurrentRawStream, a C
  call); the target is GPUTarget("cuda", 90, 32); loading a cubin
  (``utils.load_binary``) returns placeholder handles.
- launcher "none": the compiled kernel's launcher (``CompiledKernel.run``) is
  a Python no-op: the time is JITFunction.run's Python up to the launcher.
- launcher "C": Triton's own CudaLauncher (its Python ``__call__`` and the
  generated C module: argument parsing, ``data_ptr()`` of every tensor, the
  launch enter/exit hook calls), built against a stub libcuda.so.1 compiled
  here whose functions (cuPointerGetAttribute, cuCtxGetCurrent,
  cuLaunchKernelEx, ...) return CUDA_SUCCESS and do nothing: everything up
  to the driver.
- "no launches": JITFunction.run replaced by a no-op, as /tmp/host_probe.py
  does: the Python of capture() outside Triton.

The cached path (:class:`CachedLaunch`) is a prototype, not shmask code: per
launch site and shape it keeps the compiled kernel, grid, launcher and the
specialization Triton chose, and per call only reads the pointers, checks
the properties Triton specializes on (dtype, 16-byte alignment of each
pointer; type range, == 1 and divisibility by 16 of each int) and calls the
launcher; anything else falls back to JITFunction.run. Checked here: on
perturbed arguments (a pointer off 16-byte alignment, another dtype, an int
that becomes 1, changes divisibility or leaves the i32 range, and changes
that keep every property) it accepts exactly where Triton's own cache key
is the compiled kernel's; its int rule matches Triton's specialization at
the boundaries of every integer range; with a launch hook installed it
falls back. Exit status 1 if a decision disagrees.

Times: each variant's fastest of --reps batches of 20 calls, the variants'
batches interleaved (a shared machine only adds time). Triton builds its
launcher modules into its cache (~/.triton/cache) as on a GPU machine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCH = 256
VOCAB = 151_936
MAX_TOKENS = 8192
PROBE_VOCAB = 8192  # /tmp/host_probe.py's shape for the Python outside Triton
STUB_LIBCUDA = r"""
/* Every driver entry point Triton's CUDA launcher calls: success, no work. */
typedef unsigned long long u64;
int cuCtxGetCurrent(void **ctx) { *ctx = (void *)1; return 0; }
int cuCtxSetCurrent(void *ctx) { return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = 0; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = (void *)1; return 0; }
int cuPointerGetAttribute(void *data, int attribute, u64 ptr) { *(u64 *)data = ptr; return 0; }
int cuGetErrorString(int error, const char **text) { *text = "stub"; return 0; }
int cuFuncSetAttribute(void *function, int attribute, int value) { return 0; }
int cuLaunchKernelEx(const void *config, void *function, void **params, void **extra) { return 0; }
"""


@dataclass
class Launch:
    """One recorded launch: kernel[grid](*args, **kwargs)."""

    fn: Any  # triton JITFunction
    args: tuple
    kwargs: dict[str, Any]
    grid: tuple[int, ...]


class StubDriver:
    """What JITFunction.run and CompiledKernel ask of the active driver."""

    def __init__(self, launcher_cls: Any, target: Any) -> None:
        self.launcher_cls = launcher_cls
        self.target = target
        self.get_current_device = lambda: 0
        self.get_current_stream = lambda device: 0
        self.utils = types.SimpleNamespace(
            load_binary=lambda name, cubin, shared, device: (object(), 1, 0, 0, 1024),
            get_device_properties=lambda device: {"max_shared_mem": 232448})

    def get_current_target(self) -> Any:
        return self.target


def build_stub_libcuda(folder: Path) -> Path:
    """A libcuda.so.1 (soname too) of no-op driver calls, loaded globally so
    that the launchers' dlopen("libcuda.so.1") finds it."""
    source = folder / "stub_cuda.c"
    source.write_text(STUB_LIBCUDA)
    library = folder / "libcuda.so.1"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(library), str(source)], check=True)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return library


def patch_sm90_decisions(modules: list[types.ModuleType]) -> None:
    """The launch decisions of a CUDA sm_90 device, wherever imported."""
    decisions = {"pdl_default": lambda device: True, "compiled_for_nvidia": lambda x: True}
    for module in modules:
        for name, decision in decisions.items():
            if hasattr(module, name):
                setattr(module, name, decision)


def workloads(kernels: Any, torch: Any, vocab: int) -> dict[str, Callable[[], Any]]:
    probs = torch.empty(BATCH, vocab, dtype=torch.float32)
    tokens = torch.zeros(BATCH, dtype=torch.int64)
    return {
        "capture top_p=0.9": lambda: kernels.capture(probs, tokens, top_p=0.9, max_tokens=MAX_TOKENS),
        "capture top_k=1000": lambda: kernels.capture(probs, tokens, top_k=1000, max_tokens=MAX_TOKENS),
        "sample top_p=0.9": lambda: kernels.sample(probs, 7, top_p=0.9, max_tokens=MAX_TOKENS),
    }


def record(jit: Any, call: Callable[[], Any]) -> list[Launch]:
    """The launches one call makes, JITFunction.run replaced by a recorder."""
    launches: list[Launch] = []
    real_run = jit.JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs, tuple(grid)))

    jit.JITFunction.run = run
    try:
        call()
    finally:
        jit.JITFunction.run = real_run
    return launches


def per_call_us(call: Callable[[], Any], reps: int) -> float:
    """Microseconds a call: see :func:`fastest_us`."""
    return fastest_us({"call": (lambda: None, call)}, reps)["call"]


def fastest_us(variants: dict[str, tuple[Callable[[], None], Callable[[], Any]]], reps: int,
               inner: int = 20) -> dict[str, float]:
    """Microseconds a call of each variant (prepare, call) in its fastest of
    ``reps`` batches of ``inner`` calls, the variants' batches interleaved
    (prepare runs, untimed, before each batch): on a shared machine other
    work only adds time, and slow spells hit every variant alike."""
    best = dict.fromkeys(variants, float("inf"))
    for prepare, call in variants.values():
        prepare()
        call()
    for _ in range(reps):
        for name, (prepare, call) in variants.items():
            prepare()
            start = time.perf_counter()
            for _ in range(inner):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / inner * 1e6)
    return best


# The integer types Triton gives an int argument (the first range that holds
# it): each range, less the one before.
INT_RANGES = {"i32": [(-2**31, 2**31 - 1)],
              "i64": [(-2**63, -2**31 - 1), (2**31, 2**63 - 1)],
              "u64": [(2**63, 2**64 - 1)]}


def int_refused(a: str, kind: str, attr: str | None) -> str:
    """Python condition, true when the int named ``a`` would not get
    Triton's specialization (kind, attr): another integer type, the value 1
    (a constexpr then), or another divisibility by 16 ("D": divisible)."""
    inside = " or ".join(f"{low} <= {a} <= {high}" for low, high in INT_RANGES[kind])
    check = {"D": f" or {a} & 15", "": f" or not {a} & 15", None: ""}[attr]
    return f"type({a}) is not int or {a} == 1 or not ({inside}){check}"


def check_int_rule() -> int:
    """int_refused agrees with Triton's own specialization of ints at the
    boundaries of its ranges (the recorded launches have only i32 ints):
    the number of (value, specialization) pairs compared."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    near = [v + d for v in (0, 1, 16, 2**31, -2**31, 2**63, -2**63, 2**64 - 16)
            for d in (-17, -16, -1, 0, 1, 15, 16)]
    values: list[Any] = [v for v in near if -2**63 <= v < 2**64] + [True, False, 1.0]
    specializations = {native_specialize_impl(BaseBackend, v, False, True, True) for v in values}
    specializations = {s for s in specializations if s[0] in INT_RANGES}
    compared = 0
    for kind, attr in specializations:
        refused = eval(f"lambda a: {int_refused('a', kind, attr)}")  # noqa: S307 - our own text
        for value in values:
            same = native_specialize_impl(BaseBackend, value, False, True, True) == (kind, attr)
            assert refused(value) != same, f"int rule wrong for {value!r} under {(kind, attr)}"
            compared += 1
    return compared


class CachedLaunch:
    """One launch site at one shape and settings: what JITFunction.run
    computes, computed once. ``launch(*args)`` takes the site's positional
    arguments (its keyword arguments are its constexprs and options, fixed
    per site), reads each pointer once, checks every property Triton's
    specialization depends on, and calls the compiled kernel's launcher;
    when any differs (or a hook is installed) it calls JITFunction.run."""

    def __init__(self, launch: Launch) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        fn, args, kwargs = launch.fn, launch.args, launch.kwargs
        assert all(name not in fn.arg_names or fn.params[fn.arg_names.index(name)].is_constexpr
                   for name in kwargs), "runtime arguments are passed by position"
        self.fn, self.kwargs, self.grid = fn, kwargs, launch.grid
        self.runtime = knobs.runtime
        self.driver = driver.active
        self.device = self.driver.get_current_device()
        # warmup: compiles (or finds) the kernel, launches nothing
        self.kernel = fn.run(*args, grid=launch.grid, warmup=True, **kwargs)
        self.key = self.triton_key(args)
        _, specialization, _ = self.bind(args)
        self.debug = self.runtime.debug
        self.launcher = self.kernel.run
        self.function = self.kernel.function
        self.packed_metadata = self.kernel.packed_metadata
        grid = (*launch.grid, 1, 1)[:3]
        self.head = (grid[0], grid[1], grid[2])
        self.pack = self.make_pack(fn, args, kwargs, specialization)

    def bind(self, args: tuple) -> tuple[Any, list, dict]:
        """Triton's binder on these arguments, with the options run() adds."""
        from triton import knobs

        kwargs = dict(self.kwargs)
        kwargs["debug"] = kwargs.get("debug", self.fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = self.fn.device_caches[self.device][4]
        return binder(*args, **kwargs)

    def triton_key(self, args: tuple) -> str:
        """The key under which JITFunction.run finds the compiled kernel."""
        from triton.runtime.jit import compute_cache_key

        _, specialization, options = self.bind(args)
        return compute_cache_key(self.fn.device_caches[self.device][1], specialization, options)

    @staticmethod
    def make_pack(fn: Any, args: tuple, kwargs: dict[str, Any],
                  specialization: list) -> Callable[..., tuple | None]:
        """A function of the site's positional arguments returning the
        launcher's argument tuple (pointers as ints), or None where Triton
        would specialize differently. Generated, as Triton's binder is: one
        straight line per argument."""
        names = [f"a{i}" for i in range(len(args))]
        lines = [f"def pack({', '.join(names)}):"]
        namespace: dict[str, Any] = {}
        out = []
        for i, param in enumerate(fn.params):
            kind, attr = specialization[i]
            if i >= len(args):  # a keyword constexpr or a default: fixed per site
                value = kwargs.get(param.name, param.default)
                namespace[f"c{i}"] = value
                out.append(f"c{i}")
                continue
            a = names[i]
            if kind == "constexpr":  # an int equal to 1, or None
                namespace[f"c{i}"] = args[i]
                lines.append(f"    if type({a}) is not type(c{i}) or {a} != c{i}: return None")
                out.append(a)
            elif kind.startswith("*"):
                namespace[f"t{i}"] = args[i].dtype
                check = {"D": f" or p{i} & 15", "": f" or not p{i} & 15", None: ""}[attr]
                lines.append(f"    p{i} = {a}.data_ptr()")
                lines.append(f"    if {a}.dtype is not t{i}{check}: return None")
                out.append(f"p{i}")
            elif kind in INT_RANGES:
                lines.append(f"    if {int_refused(a, kind, attr)}: return None")
                out.append(a)
            elif kind == "u1":
                lines.append(f"    if type({a}) is not bool: return None")
                out.append(a)
            elif kind == "fp32":
                lines.append(f"    if type({a}) is not float: return None")
                out.append(a)
            else:
                raise NotImplementedError(f"argument {param.name}: specialization {kind!r}")
        lines.append(f"    return ({', '.join(out)},)")
        exec("\n".join(lines), namespace)  # noqa: S102 - generated from the signature above
        return namespace["pack"]

    def launch(self, *args: Any) -> bool:
        """Launches; True on the cached path, False after falling back."""
        runtime = self.runtime
        packed = self.pack(*args)
        if (packed is None or runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
                or runtime.debug is not self.debug or self.fn.pre_run_hooks):
            self.fn.run(*args, grid=self.grid, warmup=False, **self.kwargs)
            return False
        g0, g1, g2 = self.head
        self.launcher(g0, g1, g2, self.driver.get_current_stream(self.device), self.function,
                      self.packed_metadata, None, None, None, *packed)
        return True


def perturbations(launch: Launch, torch: Any) -> list[tuple[str, tuple]]:
    """Argument lists that keep or change what Triton specializes on."""
    args = launch.args
    out = [("same arguments", args)]
    out.append(("fresh tensors, same shapes", tuple(
        torch.empty_like(a) if isinstance(a, torch.Tensor) else a for a in args)))
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel() > 8]
    ints = [i for i, a in enumerate(args) if type(a) is int]

    def replaced(i: int, value: Any) -> tuple:
        return args[:i] + (value,) + args[i + 1:]

    for i in sorted({tensors[0], tensors[-1]} if tensors else set()):
        out.append((f"tensor #{i} one element off its start (not 16-byte aligned)",
                    replaced(i, args[i].view(-1)[1:])))
        other = torch.int64 if args[i].dtype != torch.int64 else torch.float64
        out.append((f"tensor #{i} of another dtype",
                    replaced(i, torch.empty(args[i].shape, dtype=other))))
    for i in ints[:2]:
        value = args[i]
        out.append((f"int #{i} {value} -> 1", replaced(i, 1)))
        flip = value + 1 if value % 16 == 0 else value + 16 - value % 16
        out.append((f"int #{i} {value} -> {flip} (divisibility by 16)", replaced(i, flip)))
        same = value + 16 if value + 16 != 1 else value + 32
        out.append((f"int #{i} {value} -> {same} (same properties)", replaced(i, same)))
        out.append((f"int #{i} {value} -> 2**31 (i64)", replaced(i, 2**31)))
    return out


def measure(launch: Launch, c_launcher: Any, reps: int) -> dict[str, float]:
    """us a launch, through JITFunction.run and through the cached path,
    with the kernel's launcher a no-op ("none") and Triton's C launcher
    ("C"); and the C launcher alone, its arguments prebuilt ("C alone")."""
    kernel = c_launcher.kernel
    variants: dict[str, tuple[Callable[[], None], Callable[[], Any]]] = {}
    for mode, launcher in (("none", lambda *a: None), ("C", c_launcher.run)):
        def prepare(launcher: Any = launcher) -> None:
            kernel._run = launcher

        prepare()
        cached = CachedLaunch(launch)
        assert cached.launch(*launch.args), "the cached path refused its own arguments"
        variants[f"run {mode}"] = (prepare, lambda: launch.fn.run(
            *launch.args, grid=launch.grid, warmup=False, **launch.kwargs))
        variants[f"cached {mode}"] = (prepare, functools.partial(cached.launch, *launch.args))
    packed = cached.pack(*launch.args)
    assert packed is not None
    prebuilt = (*cached.head, 0, cached.function, cached.packed_metadata, None, None, None, *packed)
    variants["C alone"] = (lambda: None, lambda: c_launcher.run(*prebuilt))
    return fastest_us(variants, reps)


def check_decisions(launch: Launch, torch: Any) -> tuple[int, list[str]]:
    """Whether the cached path accepts exactly the arguments for which
    Triton's own cache key is the compiled kernel's: (agreements, the
    disagreements described)."""
    cached = CachedLaunch(launch)
    agree, disagree = 0, []
    for what, variant in perturbations(launch, torch):
        accepts = cached.pack(*variant) is not None
        same_kernel = cached.triton_key(variant) == cached.key
        if accepts == same_kernel:
            agree += 1
        else:
            disagree.append(f"{launch.fn.__name__}: {what}: cached path accepts: {accepts}, "
                            f"Triton's key the same: {same_kernel}")
    return agree, disagree


def check_fallback(launch: Launch, knobs: Any) -> None:
    """With a launch hook installed the cached path defers to
    JITFunction.run, which calls the hook (through the C launcher)."""
    seen: list[Any] = []
    cached = CachedLaunch(launch)
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        assert not cached.launch(*launch.args), "the cached path ignored a launch hook"
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(seen) == 1, f"launch hook called {len(seen)} times"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30,
                        help="timed batches of 20 calls each (the fastest counts)")
    args = parser.parse_args()
    # launches are recorded here, never replayed from a plan (kernels/launch_plan.py)
    os.environ["SHMASK_KERNEL_PLANS"] = "0"

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sass_compare import import_tree, kernel_modules

    kernels = import_tree(ROOT)
    import torch
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.driver import driver

    int_pairs = check_int_rule()
    patch_sm90_decisions(kernel_modules())
    launches = {name: record(jit, call) for name, call in workloads(kernels, torch, VOCAB).items()}

    # capture()'s Python outside Triton, as /tmp/host_probe.py measures it
    real_run = jit.JITFunction.run
    jit.JITFunction.run = lambda self, *a, grid, warmup, **k: None
    outside = {vocab: {name: per_call_us(call, args.reps)
                       for name, call in workloads(kernels, torch, vocab).items()}
               for vocab in (PROBE_VOCAB, VOCAB)}
    jit.JITFunction.run = real_run

    results: dict[str, list[dict[str, float]]] = {}
    agree, disagree = 0, list[str]()
    with tempfile.TemporaryDirectory(prefix="launch_overhead_") as stub_dir:
        build_stub_libcuda(Path(stub_dir))
        knobs.nvidia.libcuda_path = stub_dir
        driver.set_active(StubDriver(CudaLauncher, GPUTarget("cuda", 90, 32)))
        c_launchers: dict[Any, Any] = {}  # compiled kernel -> its C launcher
        for name, site_launches in launches.items():
            print(f"{name}: {len(site_launches)} kernels (sm_90, from Triton's cache "
                  "or compiled now)", flush=True)
            results[name] = []
            for launch in site_launches:
                kernel = launch.fn.run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
                kernel._init_handles()  # builds Triton's launcher against the stub libcuda
                c_launcher = c_launchers.setdefault(
                    kernel, types.SimpleNamespace(kernel=kernel, run=kernel._run))
                results[name].append(measure(launch, c_launcher, args.reps))
                n, bad = check_decisions(launch, torch)
                agree, disagree = agree + n, disagree + bad
                check_fallback(launch, knobs)

    modes = ("run none", "cached none", "run C", "cached C", "C alone")
    print("\nPer launch, us of host time (fastest batch of 20 calls; B=256, V=151936, fp32, "
          "sm_90 launch decisions)")
    print("| call | kernel | args | JITFunction.run, launcher no-op | cached, launcher no-op "
          "| JITFunction.run + C launcher | cached + C launcher | C launcher alone |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, timings in results.items():
        for launch, timing in zip(launches[name], timings, strict=True):
            print(f"| {name} | {launch.fn.__name__} | {len(launch.args)} | "
                  + " | ".join(f"{timing[m]:.1f}" for m in modes) + " |")
    print(f"\nPer call, us of host time. Outside Triton: capture()'s own Python, launches no-op'd "
          f"(as /tmp/host_probe.py), at V={PROBE_VOCAB} (host_probe's shape) and at V={VOCAB}, "
          f"where CPU tensors make the big allocations cost more than the GPU's caching "
          f"allocator would; totals use V={PROBE_VOCAB}.")
    print(f"| call | launches | outside Triton, V={PROBE_VOCAB} | outside Triton, V={VOCAB} "
          "| launches: JITFunction.run + C launcher | launches: cached + C launcher "
          "| total eager | total cached | launches' share of eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, timings in results.items():
        eager = sum(t["run C"] for t in timings)
        cached_sum = sum(t["cached C"] for t in timings)
        base = outside[PROBE_VOCAB][name]
        print(f"| {name} | {len(timings)} | {base:.0f} | {outside[VOCAB][name]:.0f} | {eager:.0f} "
              f"| {cached_sum:.0f} | {base + eager:.0f} | {base + cached_sum:.0f} "
              f"| {eager / (base + eager):.0%} |")
    for line in disagree:
        print(f"DISAGREE {line}")
    print(f"\ncached path vs Triton's cache key on perturbed arguments: {agree} agree, "
          f"{len(disagree)} disagree; the int rule agrees with Triton's on {int_pairs} "
          "(boundary value, specialization) pairs; with a launch hook installed every launch "
          "fell back to JITFunction.run, which called the hook")
    if disagree:
        sys.exit(1)


if __name__ == "__main__":
    main()

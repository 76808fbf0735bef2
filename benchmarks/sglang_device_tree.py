"""SGLang 0.5.23's sampler module on a machine without SGLang (issue 36): the
GPU machine has torch, triton and numpy but no SGLang and no package index.

    python benchmarks/sglang_device_tree.py [--out .device/sglang_tree.zip]

packs, from this venv's site-packages, the files that loading the released
and the patched `sglang.srt.layers.sampler` (tests/compat/_sglang_sampler.py),
publishing SGLang's runtime context, building a real SamplingBatchInfo and
running `Sampler.forward` actually open, into one zip; then checks the zip
alone is enough (a `python -S` child that sees only the zip, the packages
the device has and this repository runs `sglang_capture.py --sglang-module
ZIP --smoke`). `load(ZIP)` (sglang_capture.py's --sglang-module) unpacks it
and returns both sampler modules.

How the closure is found: a child `python -S` runs `sglang_capture.py
--sglang-module installed --smoke` with only the device's packages
(DEVICE_PACKAGES, symlinked from the venv) on sys.path; an import hook
serves every other module from the venv and an audit hook records every
file opened there. Packed: the modules imported (sys.modules) and the other
files read (package data, dist-info metadata). It runs twice: as here (CPU),
and with torch told it has an H200 (`fake_cuda`, the whole run), so the
imports SGLang makes only under `is_cuda()` are recorded too; and since a
real GPU still takes branches a fake one does not (an H100 imported a
quantization module neither run had), every module beside one recorded in
SGLang's own packages is packed as well. The venv's
compiled packages are cp311 builds (the device runs Python 3.12):
WHEELS (imported unconditionally) come from their cp312 manylinux wheels
(pip download, this venv's versions; only the files used, and the bundled
libraries their extension modules need); PURE_FALLBACK are packed without
their extension modules; every other one is invisible to the child (no
module, no dist-info), as on the device, so an optional import takes its
"not installed" branch and a hard one fails the pack.

Stubbed (STUBS; a stub's functions raise and its classes cannot be made,
so none can stand in for real work; each only where the real package is
not importable):
  - sgl_kernel, SGLang's CUDA extension (built for another torch: it cannot
    load on the device): the names SGLang's modules import from it at module
    level under `is_cuda()`. The sampler calls two, top_k_renorm_prob and
    top_p_renorm_prob (the FlashInfer branch's mask capture): they are
    FlashInfer's top_k_renorm_probs / top_p_renorm_probs (the kernels
    sgl_kernel's are) built from FlashInfer's headers by flashinfer_ref.py,
    and `route_kernels` rebinds the sampler's two lazy flashinfer.sampling
    imports (top_k_top_p_sampling_from_probs, min_p_sampling_from_probs) to
    that library's samplers (seed SEED, deterministic). On a CPU tensor
    (--smoke) the four are sort-based torch references instead.
  - tvm_ffi, the loader of SGLang's JIT CUDA kernels (none on the sampler's
    path), and sentencepiece (InternVL's tokenizer): imported at module
    level, used by nothing here; 3.3 MB and 1.7 MB of wheels.
  - torchvision (tests/compat/conftest.py's: InterpolationMode only).

The local check runs Python 3.11: there the zip's cp312 extension modules
cannot load, so its copy of the tree gets this venv's cp311 builds of the
same versions beside them (the device never sees those).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
COMPAT = REPO / "tests" / "compat"
DEFAULT_ZIP = REPO / ".device" / "sglang_tree.zip"
# What the device has without the zip (torch 2.11 and its dependencies,
# numpy, triton; .device/setup.sh's wheels: shmask's own dependencies).
# typing_extensions is torch's: torch imports it before the tree is on sys.path.
DEVICE_PACKAGES = (
    "torch", "torchgen", "functorch", "triton", "numpy", "numpy.libs", "filelock",
    "typing_extensions.py", "setuptools", "_distutils_hack", "pkg_resources", "sympy", "mpmath",
    "networkx", "jinja2", "markupsafe", "fsspec",
    "cffi", "_cffi_backend", "pycparser", "posix_ipc", "zmq", "pyzmq.libs", "orjson", "msgspec",
    "rich", "markdown_it", "mdurl", "pygments",
    # shmask as setup.sh installs it (editable: shmask.kernels is kernels/)
    "__editable__.shmask-0.1.0.pth", "__editable___shmask_0_1_0_finder.py")
# Compiled packages packed without their extension modules: these import a
# pure-Python implementation when it is missing, and sglang's own (Rust:
# the radix tree, gRPC, the HTTP server) are not on the sampler's path.
PURE_FALLBACK = ("aiohttp", "multidict", "yarl", "frozenlist", "propcache", "pyyaml",
                 "charset_normalizer", "sglang")
# Compiled packages SGLang's modules import unconditionally on the sampler's
# path: packed from their cp312 manylinux wheels (pip download, same version
# as this venv's).
WHEELS = ("psutil", "pybase64", "pydantic_core", "regex", "safetensors", "tokenizers", "pillow")
# Folders SGLang's modules check exist at import (os.stat, which no audit
# event reports): packed empty. sglang.kernels.jit's CUDA sources are
# compiled only when a JIT kernel is called, and none is on the sampler's path.
EMPTY_DIRS = ("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/")
SAMPLER = "sglang/srt/layers/sampler.py"
PATCHED_SAMPLER = "shmask_patched/sampler.py"  # in the zip: for a machine without GNU patch
FAKE_CUDA_VARIABLE = "SHMASK_BENCH_FAKE_CUDA"  # SHMASK_BENCH_ names are free (shmask.config)


# ------------------------------------------------------------------ stubs

def _raises(module: str, name: str) -> Any:
    def stubbed(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{module}.{name} is a stub (benchmarks/sglang_device_tree.py "
                                  "STUBS): not on the sampler's path")
    stubbed.__name__ = name
    return stubbed


def _stubbed_class(module: str, name: str, base: type = object) -> type:
    """A class SGLang's modules name at import (a base class, an annotation);
    making one raises."""
    return type(name, (base,), {"__init__": _raises(module, name), "__module__": module})


# module -> {name: what it holds}; None: a function that raises when called.
# Only the names SGLang's modules on the sampler's import path take from them
# at import (found by recording: a missing one fails the pack with "cannot
# import name").
# what the recording's machine had not, whatever this one has (install_stubs)
RECORDING_LACKED = ("sentencepiece", "torchvision")
STUBS: dict[str, dict[str, Any]] = {
    # SGLang's CUDA extension, built for another torch (it cannot load):
    # what modules import under is_cuda(); the sampler's two renorms are routed
    # (below), every other name raises
    "sgl_kernel": {name: None for name in (
        "int8_scaled_mm", "moe_sum_reduce", "moe_sum", "fused_add_rmsnorm",
        "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "rmsnorm", "top_k_renorm_prob",
        "top_p_renorm_prob")},
    "sgl_kernel.quantization": {name: None for name in (
        "ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")},
    # the loader of SGLang's JIT CUDA kernels (none on the sampler's path; its
    # sources are not packed): the base class of the all-reduce's handles
    "tvm_ffi": {"Object": _stubbed_class("tvm_ffi", "Object"),
                "Module": _stubbed_class("tvm_ffi", "Module")},
    # InternVL's tokenizer (sglang.srt.configs.internvl imports it)
    "sentencepiece": {},
}


class _Stub(types.ModuleType):
    """A module holding only its STUBS names."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{self.__name__}.{name} is not in the stub "
                             "(benchmarks/sglang_device_tree.py STUBS)")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops: set[str]) -> None:
        self.tops = tops  # those not importable here

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in STUBS and name.partition(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        for name, value in STUBS[module.__name__].items():
            setattr(module, name, _raises(module.__name__, name) if value is None else value)
        if module.__name__ == "sgl_kernel":
            module.__dict__.update(_ROUTES)


def install_stubs() -> None:
    """STUBS for the packages not importable here, and torchvision
    (tests/compat/conftest.py's). transformers is asked first whether
    sentencepiece and torchvision are installed (it caches the answers)
    with both hidden from importlib (a None in sys.modules: find_spec
    answers None), so that it sees the recording's machine, which had
    neither, whatever this one has: on one that has them (the device's
    image) it would import what the tree lacks (its PIL has no ImageDraw,
    its transformers no sentencepiece tokenizer module). Both then stay
    stubbed: sentencepiece by STUBS, torchvision by conftest."""
    if any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        return
    hidden = [name for name in RECORDING_LACKED if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    from transformers.utils import import_utils

    import_utils.is_sentencepiece_available()
    import_utils.is_torchvision_available()
    tops = {name.partition(".")[0] for name in STUBS}
    missing = {top for top in tops if importlib.util.find_spec(top) is None}
    sys.meta_path.insert(0, _StubFinder(missing))
    if "sentencepiece" in hidden:
        del sys.modules["sentencepiece"]  # the stub finder serves it from here on
    if str(COMPAT) not in sys.path:
        sys.path.append(str(COMPAT))
    import conftest  # noqa: F401  (tests/compat: stubs torchvision at import)


# --------------------------------------------- the sampler's FlashInfer kernels

_FLASHINFER: list[Any] = []  # flashinfer_ref.FlashInferSampling, loaded at first use
SEED = 0  # every draw: the released and patched forwards draw the same tokens


def _flashinfer() -> Any:
    if not _FLASHINFER:
        import flashinfer_ref

        library = flashinfer_ref.load()
        if library is None:
            raise RuntimeError("FlashInfer's kernels are not built (flashinfer_ref.load): "
                               "the sampler's FlashInfer branch cannot run")
        _FLASHINFER.append(library)
    return _FLASHINFER[0]


def _sort_cut(probs: Any, top_k: Any = None, top_p: Any = None) -> Any:
    """CPU reference: probs with only each row's top-k and/or top-p set kept
    (cutoffs on the same probabilities: FlashInfer's joint order)."""
    import torch

    ordered, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(probs.shape[1]).view(1, -1) < top_k.view(-1, 1)
    if top_p is not None:
        keep &= ordered.cumsum(-1) - ordered < top_p.view(-1, 1) * ordered.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, ordered * keep)


def _renorm(cut: Any) -> Any:
    return cut / cut.sum(-1, keepdim=True)


def top_k_renorm_prob(probs: Any, top_k: Any) -> Any:
    if probs.is_cuda:
        return _flashinfer().top_k_renorm_probs(probs, top_k)
    return _renorm(_sort_cut(probs, top_k=top_k))


def top_p_renorm_prob(probs: Any, top_p: Any) -> Any:
    if probs.is_cuda:
        return _flashinfer().top_p_renorm_probs(probs, top_p)
    return _renorm(_sort_cut(probs, top_p=top_p))


def _draw(cut: Any) -> Any:
    import torch

    generator = torch.Generator().manual_seed(SEED)
    return torch.multinomial(cut, 1, generator=generator)[:, 0].to(torch.int32)


def top_k_top_p_sampling_from_probs(probs: Any, top_k: Any, top_p: Any, indices: Any = None,
                                    filter_apply_order: str = "top_k_first",
                                    deterministic: bool = True, **_: Any) -> Any:
    """FlashInfer's Python API (what SGLang's LazyImport resolves to); SGLang
    calls it with filter_apply_order="joint", the only order routed here."""
    assert indices is None and filter_apply_order == "joint", filter_apply_order
    if probs.is_cuda:
        return _flashinfer().top_k_top_p_sampling_from_probs(probs, top_k, top_p, SEED,
                                                             deterministic=deterministic)
    return _draw(_sort_cut(probs, top_k, top_p))


def min_p_sampling_from_probs(probs: Any, min_p: Any, indices: Any = None,
                              deterministic: bool = True, **_: Any) -> Any:
    assert indices is None
    if probs.is_cuda:
        return _flashinfer().min_p_sampling_from_probs(probs, min_p, SEED,
                                                       deterministic=deterministic)
    top = probs.max(-1, keepdim=True).values
    return _draw(probs * (probs >= min_p.view(-1, 1) * top))


_ROUTES = {"top_k_renorm_prob": top_k_renorm_prob, "top_p_renorm_prob": top_p_renorm_prob}


def route_kernels(module: types.ModuleType) -> None:
    """The sampler module's FlashInfer-branch names: sgl_kernel's two renorms
    (on a CUDA build imported from the stub, which holds these same
    functions) and its two lazy flashinfer.sampling imports. A build without
    CUDA binds none of them (SGLang runs only its pytorch backend there):
    bound here too, so that --smoke runs the FlashInfer branch on the CPU."""
    for name, function in {**_ROUTES, "min_p_sampling_from_probs": min_p_sampling_from_probs,
                           "top_k_top_p_sampling_from_probs": top_k_top_p_sampling_from_probs}.items():
        setattr(module, name, function)


# ---------------------------------------------------------- torch on an H200

@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Make a CPU torch say it has an H200 (CUDA 13.0, sm 9.0) for the block,
    so that SGLang takes its `is_cuda()` branches (at import, and in its
    runtime context's resolution) as on the device. The pack's recording and
    check enter it for the whole run ($SHMASK_BENCH_FAKE_CUDA=1: `load`);
    tensors stay on the CPU, so no kernel runs on the fake device."""
    import torch

    properties = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200", gcnArchName="",
                                       total_memory=141 << 30, multi_processor_count=132)
    fakes = {"is_available": lambda: True, "device_count": lambda: 1,
             "current_device": lambda: 0, "get_device_capability": lambda device=None: (9, 0),
             "get_device_name": lambda device=None: "NVIDIA H200",
             "get_device_properties": lambda device=None: properties}
    saved = {name: getattr(torch.cuda, name) for name in fakes}
    saved_version = torch.version.cuda
    for name, fake in fakes.items():
        setattr(torch.cuda, name, fake)
    torch.version.cuda = "13.0"
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.cuda, name, real)
        torch.version.cuda = saved_version


# --------------------------------------------------------------- loading

def unpack(source: str | os.PathLike[str]) -> Path:
    """The directory holding `sglang/`: `source` itself, or the zip unpacked
    once into a temporary folder keyed by its digest."""
    source = Path(source)
    if source.is_dir():
        return source.resolve()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"shmask-sglang-tree-{digest}"
    if not (target / ".complete").is_file():
        partial = Path(tempfile.mkdtemp(prefix=f"{target.name}-"))
        with zipfile.ZipFile(source) as archive:
            archive.extractall(partial)
        (partial / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
    return target


def load(source: str | None) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """(released sampler module, patched one, tests/compat/_sglang_sampler)
    from the tree `source` (a zip or a directory; None: the SGLang this
    Python imports). The tree goes first on sys.path, so its
    sglang-0.5.23.dist-info is the distribution the harness patches from."""
    if source is not None:
        tree = unpack(source)
        if "sglang" in sys.modules and not sys.modules["sglang"].__file__.startswith(str(tree)):
            raise RuntimeError(f"sglang was imported from {sys.modules['sglang'].__file__} "
                               f"before the tree {tree}")
        sys.path.insert(0, str(tree))
    if os.environ.get(FAKE_CUDA_VARIABLE) == "1":  # the pack's CUDA recording and check
        fake_cuda().__enter__()  # for the rest of the process: SGLang's runtime too
    install_stubs()
    import _sglang_sampler as harness

    released = harness.load_sampler_module(patched=False)
    if shutil.which("patch") is None and source is not None:
        patched = _prepatched(harness, tree)
    else:
        patched = harness.load_sampler_module(patched=True)
    for module in (released, patched):
        route_kernels(module)
    return released, patched, harness


def _prepatched(harness: types.ModuleType, tree: Path) -> types.ModuleType:
    """No GNU patch here: the patched sampler.py the pack made, if made from
    this repository's patch (its section's digest)."""
    section = _sampler_section(harness.PATCH)
    recorded = json.loads((tree / PATCHED_SAMPLER).with_suffix(".json").read_text())
    if recorded["section_sha256"] != hashlib.sha256(section.encode()).hexdigest():
        raise RuntimeError(f"{tree / PATCHED_SAMPLER} was made from another sglang.patch; "
                           "re-pack (benchmarks/sglang_device_tree.py) or install GNU patch")
    return harness._import_file("sglang.srt.layers._sampler_shmask_patched",
                                tree / PATCHED_SAMPLER)


def _sampler_section(patch: Path) -> str:
    from shmask.integrate import split_patch

    (section,) = [s.text for s in split_patch(patch) if s.path == SAMPLER]
    return section


# --------------------------------------------------------------- packing

def _site() -> Path:
    import numpy

    return Path(numpy.__file__).resolve().parents[1]


def _dists(site: Path) -> dict[str, tuple[str, set[str], bool]]:
    """dist-info folder -> (project name, its top-level names, compiled?)."""
    found = {}
    for info in site.glob("*.dist-info"):
        record = info / "RECORD"
        files = [line.split(",")[0] for line in record.read_text().splitlines()] \
            if record.is_file() else []
        tops = {f.split("/")[0].removesuffix(".py") for f in files
                if not f.startswith(("../", info.name)) and ".dist-info/" not in f}
        tops = {t.split(".")[0] if t.endswith(".so") else t for t in tops}
        found[info.name] = (info.name.split("-")[0].lower(), tops,
                            any(f.endswith(".so") for f in files))
    return found


def device_site(site: Path, into: Path) -> Path:
    """A folder of symlinks to the venv's DEVICE_PACKAGES and their
    dist-info: what the device's Python finds without the zip."""
    into.mkdir(parents=True, exist_ok=True)
    wanted = {name.removesuffix(".py") for name in DEVICE_PACKAGES}
    for name in DEVICE_PACKAGES:
        if (site / name).exists():
            (into / name).symlink_to(site / name)
    for name in os.listdir(site):  # extension modules at the top (posix_ipc, _cffi_backend)
        if name.endswith(".so") and name.split(".")[0] in wanted:
            (into / name).symlink_to(site / name)
    for info, (project, tops, _) in _dists(site).items():
        if tops & wanted or project == "shmask":
            (into / info).symlink_to(site / info)
    return into


class _VenvRecorder(importlib.abc.MetaPathFinder):
    """The record child's import hook: what sys.path lacks comes from the
    venv's site-packages, except compiled packages (invisible, or without
    their extension modules: PURE_FALLBACK)."""

    def __init__(self, site: Path) -> None:
        self.site = str(site)
        dists = _dists(site)
        devices = {name.removesuffix(".py") for name in DEVICE_PACKAGES}
        self.hidden_tops: set[str] = set()
        self.hidden_dists: set[str] = set()
        self.no_extensions: set[str] = set()
        for info, (project, tops, compiled) in dists.items():
            if tops & devices:
                self.hidden_dists.add(info)  # the device site has it
            elif compiled and project in PURE_FALLBACK:
                self.no_extensions |= tops
            elif compiled and project not in WHEELS:
                self.hidden_tops |= tops
                self.hidden_dists.add(info)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        top = name.partition(".")[0]
        if path is None:
            if importlib.machinery.PathFinder.find_spec(name, sys.path) is not None:
                return None  # the device site, this repository, the stdlib
            if top in self.hidden_tops:
                return None  # not installed (sys.path has not got it either)
            path = [self.site]
        elif not any(str(p).startswith(self.site) for p in path):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and (spec.origin or "").endswith(".so") and top in self.no_extensions:
            raise ModuleNotFoundError(f"No module named {name!r} (its extension modules "
                                      "are not packed)", name=name)
        return spec

    def find_distributions(self, context: Any = None) -> Iterator[Any]:
        import importlib.metadata as metadata

        context = context or metadata.DistributionFinder.Context()
        venv = metadata.DistributionFinder.Context(name=context.name, path=[self.site])
        for dist in metadata.MetadataPathFinder().find_distributions(venv):
            if Path(str(dist._path)).name not in self.hidden_dists:  # type: ignore[attr-defined]
                yield dist


def _record_child(site: str, out: str, capture_args: list[str]) -> None:
    """In a `python -S` child (`_run`): run sglang_capture.py with
    capture_args, recording the venv files it opens; write their list to `out`."""
    opened: set[str] = set()

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(site):
            opened.add(args[0])

    sys.meta_path.insert(2, _VenvRecorder(Path(site)))  # after the builtin and frozen importers
    sys.addaudithook(audit)  # after: the recorder reads every RECORD
    import runpy

    sys.argv = [str(BENCH / "sglang_capture.py"), *capture_args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
    finally:
        # the modules imported, and the other files read (package data,
        # dist-info); not the sources only read: transformers' lazy modules
        # read every file of transformers/models to list its names
        files = {f for f in opened if not f.endswith(".py") and "__pycache__" not in f}
        files |= {m.__file__ for m in list(sys.modules.values())
                  if (getattr(m, "__file__", None) or "").startswith(site)}
        Path(out).write_text(json.dumps(sorted(files)))


def _run(base: Path, script: Path, args: list[str], fake: bool, cwd: Path) -> int:
    """`python -S` running `script` with only the stdlib and the folder
    `base` (device_site: its .pth files too, so shmask is the editable
    install setup.sh makes) on sys.path, Triton's interpreter, a bare
    environment; with `fake`, SGLang is imported as on a CUDA machine."""
    boot = (f"import runpy, site, sys; site.addsitedir({str(base)!r}); "
            f"sys.argv = {[str(script), *args]!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if fake:
        env[FAKE_CUDA_VARIABLE] = "1"
    return subprocess.run([sys.executable, "-S", "-c", boot], env=env, cwd=cwd,
                          timeout=900).returncode


def fetch_wheels(site: Path, into: Path) -> dict[str, Path]:
    """project -> its cp312 manylinux x86-64 wheel, this venv's version
    (pip download into `into`, once)."""
    into.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for info, (project, _, _) in _dists(site).items():
        if project not in WHEELS:
            continue
        version = info.removesuffix(".dist-info").split("-")[1]
        found = sorted(into.glob(f"{project}-{version}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                            "cp", "--platform", "manylinux2014_x86_64", "--platform",
                            "manylinux_2_28_x86_64", "-d", str(into), f"{project}=={version}"],
                           check=True)
            found = sorted(into.glob(f"{project}-{version}-*.whl"))
        wheels[project] = found[-1]
    missing = set(WHEELS) - set(wheels)
    if missing:
        raise SystemExit(f"not in this venv: {sorted(missing)}")
    return wheels


def wheel_entries(wheel: zipfile.ZipFile, used: set[str]) -> list[zipfile.ZipInfo]:
    """What to take from a cp312 wheel: the files the recording used (the
    venv's names; a cp311 extension module's name read as cp312), the
    dist-info, and the bundled libraries (auditwheel's <project>.libs) that
    the extension modules taken need (readelf's NEEDED, recursively)."""
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}-"
    used = {name.replace(tag, "cpython-312-") for name in used}
    entries = {entry.filename: entry for entry in wheel.infolist()}
    libraries = {Path(name).name: name for name in entries if ".libs/" in name}
    taken = {name for name in entries if name in used or ".dist-info/" in name}
    pending = [name for name in taken if ".so" in Path(name).name]
    while pending:
        with tempfile.NamedTemporaryFile() as binary:
            binary.write(wheel.read(pending.pop()))
            binary.flush()
            dynamic = subprocess.run(["readelf", "-d", binary.name], capture_output=True,
                                     text=True, check=True).stdout
        for line in dynamic.splitlines():
            needed = line.partition("Shared library: [")[2].rstrip("]")
            if needed in libraries and libraries[needed] not in taken:
                taken.add(libraries[needed])
                pending.append(libraries[needed])
    return [entries[name] for name in sorted(taken)]


def pack(out: Path, wheel_dir: Path) -> Path:
    work = Path(tempfile.mkdtemp(prefix="shmask-sglang-pack-"))
    try:
        return _pack(out, wheel_dir, _site(), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pack(out: Path, wheel_dir: Path, site: Path, work: Path) -> Path:
    base = device_site(site, work / "device-site")
    files: set[str] = set()
    for fake in (False, True):
        listing = work / f"files-{int(fake)}.json"
        if _run(base, Path(__file__).resolve(), ["_record", str(site), str(listing), "--",
                                                 "--sglang-module", "installed", "--smoke"],
                fake, work):
            raise SystemExit(f"recording failed ({'fake CUDA' if fake else 'CPU'})")
        files |= set(json.loads(listing.read_text()))
    # the venv's files, relative: those of WHEELS' projects come from their
    # wheels instead; a dist-info read at all gets its METADATA (a valid dist)
    from_wheels = set()
    for info, (project, tops, _) in _dists(site).items():
        if project in WHEELS:
            from_wheels |= tops | {info}
    names = {str(Path(f).relative_to(site)) for f in files if Path(f).is_file()}
    wheel_names = {n for n in names if n.split("/")[0] in from_wheels
                   or n.split("/")[0].split(".")[0] in from_wheels}
    names -= wheel_names
    # SGLang's own sibling modules of every package it imported from: the
    # device's real CUDA takes branches the recording's fake one may not (on
    # the H100, fp8_kernel's per_tensor_quant_fp8 was not in the zip)
    for package in {str(Path(n).parent) for n in names if n.startswith("sglang/")}:
        names |= {str(f.relative_to(site)) for f in (site / package).glob("*.py")}
    names |= {n.split("/")[0] + "/METADATA" for n in names if ".dist-info/" in n.split("/")[0] + "/"}
    names.add(next(p.name for p in site.glob("sglang-*.dist-info")) + "/METADATA")
    # the patched sampler for a device without GNU patch
    patched = work / "patched"
    (patched / "sglang/srt/layers").mkdir(parents=True)
    shutil.copy(site / SAMPLER, patched / SAMPLER)
    section = _sampler_section(REPO / "shmask" / "integrations" / "sglang.patch")
    subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "-d", str(patched)], input=section,
                   text=True, check=True, capture_output=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # LZMA: 17.0 MB (13.5 before the sibling modules; deflate took 16.1 then):
    # the device's transfer is 64 MiB in all
    with zipfile.ZipFile(out, "w", zipfile.ZIP_LZMA) as archive:
        for name in sorted(names):
            archive.write(site / name, name)
        for name in EMPTY_DIRS:
            archive.writestr(name, "")
        for wheel in fetch_wheels(site, wheel_dir).values():
            with zipfile.ZipFile(wheel) as source:
                for entry in wheel_entries(source, wheel_names):
                    data = source.read(entry)
                    entry.compress_type = zipfile.ZIP_LZMA  # after reading it as stored
                    archive.writestr(entry, data)
        archive.write(patched / SAMPLER, PATCHED_SAMPLER)
        archive.writestr(str(Path(PATCHED_SAMPLER).with_suffix(".json")), json.dumps(
            {"section_sha256": hashlib.sha256(section.encode()).hexdigest()}))
    return out


def sizes(archive: Path) -> list[tuple[str, int]]:
    """(top-level name, compressed bytes) in the zip, largest first."""
    by_top: dict[str, int] = {}
    with zipfile.ZipFile(archive) as source:
        for entry in source.infolist():
            top = entry.filename.split("/")[0]
            top = "dist-info" if top.endswith(".dist-info") else top
            by_top[top] = by_top.get(top, 0) + entry.compress_size
    return sorted(by_top.items(), key=lambda item: -item[1])


def check(archive: Path, machine_has: Path | None = None) -> None:
    """The zip alone: a `python -S` child with only the device's packages,
    this repository and the zip's files runs the smoke (CPU, then fake CUDA);
    ``machine_has``: a folder of packages (and their dist-info) the child's
    machine has besides, as the device's image has torchvision and
    sentencepiece where the recording had neither.
    This Python is 3.11: the zip's cp312 extension modules (WHEELS) cannot
    load here, so the check's copy of the tree gets this venv's builds of
    the same versions beside them (cp311 names; the device never sees them)."""
    work = Path(tempfile.mkdtemp(prefix="shmask-sglang-check-"))
    try:
        _check(archive, _site(), work, machine_has)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check(archive: Path, site: Path, work: Path, machine_has: Path | None) -> None:
    base = device_site(site, work / "device-site")
    if machine_has is not None:
        for entry in machine_has.iterdir():
            (base / entry.name).symlink_to(entry.resolve())
    tree = work / "tree"
    with zipfile.ZipFile(archive) as source:
        source.extractall(tree)
    for info, (project, _, _) in _dists(site).items():
        if project in WHEELS and sys.version_info[:2] != (3, 12):
            for line in (site / info / "RECORD").read_text().splitlines():
                name = line.split(",")[0]
                if ".so" in Path(name).name and not (tree / name).exists():
                    (tree / name).parent.mkdir(parents=True, exist_ok=True)
                    (tree / name).symlink_to(site / name)
    for fake in (False, True):
        if _run(base, BENCH / "sglang_capture.py", ["--sglang-module", str(tree), "--smoke"],
                fake, work):
            raise SystemExit(f"the zip alone failed ({'fake CUDA' if fake else 'CPU'})")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_record":
        _record_child(sys.argv[2], sys.argv[3], sys.argv[5:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_ZIP)
    parser.add_argument("--wheels", type=Path, default=Path(tempfile.gettempdir()) / "shmask-cp312-wheels",
                        help="where the cp312 wheels of WHEELS are downloaded (kept)")
    parser.add_argument("--check-only", action="store_true", help="check an existing zip")
    parser.add_argument("--machine-has", type=Path,
                        help="a folder of packages the checked machine has besides (the device's "
                             "torchvision and sentencepiece, say)")
    args = parser.parse_args()
    if not args.check_only:
        pack(args.out, args.wheels)
        with zipfile.ZipFile(args.out) as archive:
            print(f"{args.out}: {args.out.stat().st_size / 1e6:.2f} MB, "
                  f"{len(archive.namelist())} files; largest (MB compressed): " + ", ".join(
                      f"{top} {size / 1e6:.2f}" for top, size in sizes(args.out)[:12]))
    check(args.out, args.machine_has)
    print("checked: the zip alone loads and runs both samplers (CPU and fake CUDA)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FlashInfer's sampling kernels as a baseline the benchmarks can call (issue 35).

No flashinfer install: benchmarks/flashinfer_launcher.cu calls FlashInfer's own
host launchers from the headers of its released wheel (fetched into
.device/flashinfer by benchmarks/flashinfer_fetch.sh; the device tool carries
that folder with carry=[".device"]), nvcc compiles it once into a cache folder,
and ctypes calls it with torch's pointers and current stream.

    sampling = load()            # None, with a one-line reason, where it cannot run
    ids = sampling.top_p_sampling_from_probs(probs, 0.9, seed=0)

What each call costs, as in FlashInfer's Python API (flashinfer/sampling.py),
so that a timing of it is a timing of what a FlashInfer user pays:
  - outputs are allocated per call with torch.empty (ids int32 [B], `valid`
    bool [B], renormed probs [B, V]), and so is top_p_renorm_probs' scratch
    (AIR top-p's counters, histograms and candidate buffers: 14.3 MB at
    B = 256, V = 151936);
  - top_k_renorm_probs' radix row states (1 MiB, must start zeroed; the
    kernel's last CTA re-zeroes them) are zeroed once per device and stream
    and kept, as FlashInfer keeps them; under CUDA graph capture each call gets
    its own zeroed buffer, as in FlashInfer.
Settings are a scalar for every row or a [B] tensor (float32 for top_p and
min_p, int32 for top_k) on the device of probs. Scalars are range-checked here;
tensor values are not (that would cost a device sync), and pass to the kernels
as they are, as in FlashInfer. A scalar p travels as float32 (the kernels'
type). Samplers default to deterministic=True, FlashInfer's default.

`python benchmarks/flashinfer_ref.py` checks each function on a GPU against
sort-based torch references; `--build-only` compiles and exits (needs nvcc and
the headers, no GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import numbers
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
LAUNCHER_SOURCE = BENCH_DIR / "flashinfer_launcher.cu"
DEFAULT_INCLUDE = BENCH_DIR.parent / ".device" / "flashinfer"
INCLUDE_VARIABLE = "SHMASK_BENCH_FLASHINFER_INCLUDE"  # SHMASK_BENCH_ names are free (shmask.config)
ARCH = "sm_90a"  # the H200 the benchmarks run on
ROW_STATES_BYTES = 1 << 20  # FlashInfer's _ROW_STATES_NBYTES (flashinfer/topk.py)
# The kernels index probs with uint32 row * vocab + column.
MAX_ELEMENTS = 2**32 - 1
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


class FlashInferUnavailable(RuntimeError):
    """What is missing for the baseline: headers, nvcc or a CUDA device."""


def nvcc_flags(include: Path, arch: str = ARCH) -> list[str]:
    """FlashInfer's JIT flags for its sampling module (flashinfer/jit/core.py,
    cpp_ext.py): its vendored CCCL with -I, ahead of the toolkit's; its own
    headers with -isystem, which also keeps their warnings out of our log."""
    return [
        "-std=c++17", "-O3", "-DNDEBUG", "-use_fast_math", "--expt-relaxed-constexpr",
        "-static-global-template-stub=false", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
        f"-I{include / 'cccl' / 'cub'}", f"-I{include / 'cccl' / 'libcudacxx' / 'include'}",
        f"-I{include / 'cccl' / 'thrust'}",
        "-isystem", str(include / "include"), "-isystem", str(include / "curand" / "include"),
    ]


def find_include(include: str | os.PathLike[str] | None = None) -> Path:
    """The folder flashinfer_fetch.sh filled: `include`, else $SHMASK_BENCH_FLASHINFER_INCLUDE,
    else .device/flashinfer beside the repository root."""
    chosen = Path(include or os.environ.get(INCLUDE_VARIABLE) or DEFAULT_INCLUDE)
    if not (chosen / "include" / "flashinfer" / "sampling.cuh").is_file():
        raise FlashInferUnavailable(
            f"no FlashInfer headers in {chosen} (run: bash benchmarks/flashinfer_fetch.sh)")
    return chosen


def find_nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [shutil.which("nvcc")]
    if cuda_home:
        candidates.append(str(Path(cuda_home) / "bin" / "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise FlashInferUnavailable("no nvcc on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin")


def build(include: str | os.PathLike[str] | None = None,
          build_dir: str | os.PathLike[str] | None = None, arch: str = ARCH) -> Path:
    """The launcher's .so, compiled if missing. The default folder is keyed by
    the .cu, the header versions and the flags, so that editing any of them
    rebuilds and nothing stale is loaded."""
    headers = find_include(include)
    flags = nvcc_flags(headers, arch)
    if build_dir is None:
        key = hashlib.sha256(LAUNCHER_SOURCE.read_bytes())
        key.update((headers / "VERSION").read_bytes())
        key.update("\0".join(flags).encode())
        build_dir = Path(tempfile.gettempdir()) / f"shmask-flashinfer-{key.hexdigest()[:16]}"
    library = Path(build_dir) / "flashinfer_launcher.so"
    if library.is_file():
        return library
    nvcc = find_nvcc()
    library.parent.mkdir(parents=True, exist_ok=True)
    # Written under a private name and renamed: a concurrent build or an
    # interrupted one never leaves a partial .so under the name load() trusts.
    partial = library.with_name(f".{library.name}.{os.getpid()}")
    command = [nvcc, *flags, str(LAUNCHER_SOURCE), "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed ({done.returncode}): {' '.join(command)}\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")
    os.replace(partial, library)
    return library


def load(include: str | os.PathLike[str] | None = None,
         build_dir: str | os.PathLike[str] | None = None) -> FlashInferSampling | None:
    """FlashInferSampling, or None (the reason printed on one line) where the
    headers, a CUDA device or (for a first build) nvcc are missing. A failed
    compile raises: that is a bug to see, not a missing tool."""
    try:
        find_include(include)
        if not torch.cuda.is_available():
            raise FlashInferUnavailable("no CUDA device visible to torch")
        return FlashInferSampling(build(include, build_dir))
    except FlashInferUnavailable as missing:
        print(f"flashinfer baseline unavailable: {missing}")
        return None


# --------------------------------------------------------------- arguments

def check_probs(probs: object) -> tuple[int, int]:
    """(batch, vocab) of a contiguous float32 [B, V] CUDA tensor, or an error
    naming what is wrong. Device last, so the shape checks run anywhere."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D [batch, vocab], got shape {tuple(probs.shape)}")
    if probs.dtype != torch.float32:
        raise ValueError(f"probs must be float32 (the baseline is built for it), got {probs.dtype}")
    if not probs.is_contiguous():
        raise ValueError(f"probs must be contiguous, got strides {probs.stride()}")
    batch, vocab = probs.shape
    if not 1 <= batch <= _UINT32_MAX or not 1 <= vocab <= _UINT32_MAX:
        raise ValueError(f"probs must have batch and vocab in [1, {_UINT32_MAX}], "
                         f"got shape {tuple(probs.shape)}")
    if batch * vocab > MAX_ELEMENTS:
        raise ValueError(f"probs has {batch * vocab} elements, more than FlashInfer's kernels "
                         f"index ({MAX_ELEMENTS}: uint32 row * vocab)")
    return batch, vocab


def check_on_cuda(probs: torch.Tensor) -> None:
    if probs.device.type != "cuda":
        raise ValueError(f"probs must be on a CUDA device, got {probs.device}")


def check_setting(name: str, value: object, probs: torch.Tensor, low: float, high: float,
                  *, integer: bool, low_open: bool = False) -> tuple[torch.Tensor | None, float]:
    """(tensor or None, scalar) for the launcher: a [B] tensor of the kernel's
    dtype on probs' device, or a scalar in the range; nothing is converted."""
    batch = probs.shape[0]
    dtype = torch.int32 if integer else torch.float32
    if isinstance(value, torch.Tensor):
        if value.dtype != dtype or value.shape != (batch,) or not value.is_contiguous():
            raise ValueError(f"{name} as a tensor must be contiguous {dtype} of shape ({batch},), "
                             f"got {value.dtype} of shape {tuple(value.shape)}"
                             f"{'' if value.is_contiguous() else ', not contiguous'}")
        if value.device != probs.device:
            raise ValueError(f"{name} is on {value.device}, probs on {probs.device}")
        return value, 0
    # An integer (numpy's too) for top_k, an int or a float for p; never a bool.
    number: float
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, float) and not integer:
        number = value
    else:
        raise TypeError(f"{name} must be {'an int' if integer else 'a float'} or a "
                        f"{dtype} tensor of shape ({batch},), got {value!r}")
    inside = (low < number if low_open else low <= number) and number <= high
    if not inside:  # also catches NaN
        raise ValueError(f"{name}={value!r} is out of range: accepted "
                         f"{'(' if low_open else '['}{low}, {high}]")
    return None, number


def check_seed(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= int(value) <= _UINT64_MAX:
        raise ValueError(f"{name}={value!r} is out of range: accepted [0, 2**64 - 1]")
    return int(value)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# --------------------------------------------------------------- the calls

class FlashInferSampling:
    """The launcher's functions on torch tensors (see the module docstring)."""

    def __init__(self, library: str | os.PathLike[str]) -> None:
        self._lib = ctypes.CDLL(str(library))
        ptr, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
        f32, size, flag = ctypes.c_float, ctypes.c_size_t, ctypes.c_bool
        signatures: dict[str, tuple[type, list[type]]] = {
            "shmask_fi_top_p_renorm_workspace_bytes": (size, [u32, u32]),
            "shmask_fi_radix_row_state_bytes": (size, []),
            "shmask_fi_error_string": (ctypes.c_char_p, [ctypes.c_int]),
            "shmask_fi_top_p_renorm_probs": (ctypes.c_int, [ptr, ptr, ptr, u32, f32, u32, ptr, ptr]),
            "shmask_fi_top_k_renorm_probs":
                (ctypes.c_int, [ptr, ptr, ptr, u32, u32, u32, ptr, size, ptr]),
            "shmask_fi_top_p_sampling_from_probs":
                (ctypes.c_int, [ptr, ptr, ptr, ptr, u32, f32, u32, flag, u64, u64, ptr]),
            "shmask_fi_top_k_sampling_from_probs":
                (ctypes.c_int, [ptr, ptr, ptr, ptr, u32, u32, u32, flag, u64, u64, ptr]),
            "shmask_fi_min_p_sampling_from_probs":
                (ctypes.c_int, [ptr, ptr, ptr, ptr, u32, f32, u32, flag, u64, u64, ptr]),
            "shmask_fi_top_k_top_p_sampling_from_probs":
                (ctypes.c_int,
                 [ptr, ptr, ptr, ptr, ptr, u32, ctypes.c_int32, f32, u32, flag, u64, u64, ptr]),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(self._lib, name)
            function.restype, function.argtypes = restype, argtypes
        # (device index, stream handle) -> zeroed radix row states; see the module docstring.
        self._row_states: dict[tuple[int, int], torch.Tensor] = {}

    def _launch(self, name: str, probs: torch.Tensor, *args: object) -> None:
        """Calls shmask_fi_<name> with probs' device current and torch's
        current stream of it appended, raising on a non-zero cudaError_t."""
        with torch.cuda.device(probs.device):
            stream = torch.cuda.current_stream(probs.device).cuda_stream
            status = getattr(self._lib, f"shmask_fi_{name}")(*args, stream)
        if status != 0:
            reason = self._lib.shmask_fi_error_string(status).decode()
            raise RuntimeError(f"FlashInfer {name} failed: cudaError {status} ({reason})")

    def _row_states_for(self, probs: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8, device=probs.device)
        key = (probs.device.index or 0, torch.cuda.current_stream(probs.device).cuda_stream)
        if key not in self._row_states:
            self._row_states[key] = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8,
                                                device=probs.device)
        return self._row_states[key]

    def top_p_renorm_probs(self, probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
        """probs zeroed outside each row's top-p set and renormalized: a new tensor."""
        batch, vocab = check_probs(probs)
        top_p_arr, top_p_val = check_setting("top_p", top_p, probs, 0.0, 1.0, integer=False,
                                             low_open=True)
        check_on_cuda(probs)
        renormed = torch.empty_like(probs)
        workspace = torch.empty(self._lib.shmask_fi_top_p_renorm_workspace_bytes(batch, vocab),
                                dtype=torch.uint8, device=probs.device)
        self._launch("top_p_renorm_probs", probs, probs.data_ptr(), renormed.data_ptr(),
                     _pointer(top_p_arr), batch, top_p_val, vocab, workspace.data_ptr())
        return renormed

    def top_k_renorm_probs(self, probs: torch.Tensor, top_k: int | torch.Tensor) -> torch.Tensor:
        """probs zeroed outside each row's top-k set and renormalized: a new tensor."""
        batch, vocab = check_probs(probs)
        top_k_arr, top_k_val = check_setting("top_k", top_k, probs, 1, vocab, integer=True)
        check_on_cuda(probs)
        renormed = torch.empty_like(probs)
        row_states = self._row_states_for(probs)
        self._launch("top_k_renorm_probs", probs, probs.data_ptr(), renormed.data_ptr(),
                     _pointer(top_k_arr), batch, int(top_k_val), vocab, row_states.data_ptr(),
                     row_states.numel())
        return renormed

    def _sample(self, name: str, probs: torch.Tensor, settings: list[object], seed: int,
                offset: int, deterministic: bool, return_valid: bool
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        seed, offset = check_seed("seed", seed), check_seed("offset", offset)
        check_on_cuda(probs)
        batch, vocab = probs.shape
        ids = torch.empty(batch, dtype=torch.int32, device=probs.device)
        valid = torch.empty(batch, dtype=torch.bool, device=probs.device)
        self._launch(name, probs, probs.data_ptr(), ids.data_ptr(), valid.data_ptr(), *settings,
                     bool(deterministic), seed, offset)
        return (ids, valid) if return_valid else ids

    def top_p_sampling_from_probs(self, probs: torch.Tensor, top_p: float | torch.Tensor,
                                  seed: int, offset: int = 0, *, deterministic: bool = True,
                                  return_valid: bool = False
                                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One id per row (int32 [B]) drawn from the row's top-p set; with
        return_valid, also FlashInfer's `valid` (False where a row had no support)."""
        batch, vocab = check_probs(probs)
        top_p_arr, top_p_val = check_setting("top_p", top_p, probs, 0.0, 1.0, integer=False,
                                             low_open=True)
        return self._sample("top_p_sampling_from_probs", probs,
                            [_pointer(top_p_arr), batch, top_p_val, vocab],
                            seed, offset, deterministic, return_valid)

    def top_k_sampling_from_probs(self, probs: torch.Tensor, top_k: int | torch.Tensor,
                                  seed: int, offset: int = 0, *, deterministic: bool = True,
                                  return_valid: bool = False
                                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        batch, vocab = check_probs(probs)
        top_k_arr, top_k_val = check_setting("top_k", top_k, probs, 1, vocab, integer=True)
        return self._sample("top_k_sampling_from_probs", probs,
                            [_pointer(top_k_arr), batch, int(top_k_val), vocab],
                            seed, offset, deterministic, return_valid)

    def min_p_sampling_from_probs(self, probs: torch.Tensor, min_p: float | torch.Tensor,
                                  seed: int, offset: int = 0, *, deterministic: bool = True,
                                  return_valid: bool = False
                                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Drawn from the tokens with prob >= min_p * the row's largest prob."""
        batch, vocab = check_probs(probs)
        min_p_arr, min_p_val = check_setting("min_p", min_p, probs, 0.0, 1.0, integer=False)
        return self._sample("min_p_sampling_from_probs", probs,
                            [_pointer(min_p_arr), batch, min_p_val, vocab],
                            seed, offset, deterministic, return_valid)

    def top_k_top_p_sampling_from_probs(self, probs: torch.Tensor, top_k: int | torch.Tensor,
                                        top_p: float | torch.Tensor, seed: int, offset: int = 0,
                                        *, deterministic: bool = True, return_valid: bool = False
                                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's joint kernel (filter_apply_order="joint"): drawn from
        the tokens in both the top-k and the top-p set of the row as given."""
        batch, vocab = check_probs(probs)
        top_k_arr, top_k_val = check_setting("top_k", top_k, probs, 1, vocab, integer=True)
        top_p_arr, top_p_val = check_setting("top_p", top_p, probs, 0.0, 1.0, integer=False,
                                             low_open=True)
        return self._sample("top_k_top_p_sampling_from_probs", probs,
                            [_pointer(top_k_arr), _pointer(top_p_arr), batch, int(top_k_val),
                             top_p_val, vocab],
                            seed, offset, deterministic, return_valid)


# --------------------------------------------------------------- self-check on a GPU

# Cumulative masses are summed in a different order by the kernels (fp32) and
# by the reference (fp64): a token whose mass above it is this close to top_p
# may fall either side of the boundary, and is accepted both ways (in the
# flattest row, s = 0.5, top_p = 0.9: 51 tokens of the 118,907 kept).
MASS_TOLERANCE = 1e-4


def _mass_and_count_above(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the probability mass and the number of tokens strictly
    greater than it in its row (the quantities FlashInfer's pivots compare)."""
    ascending = probs.double().sort(dim=1).values
    prefix = ascending.cumsum(dim=1)
    at_or_below = torch.searchsorted(ascending, probs.double(), right=True)
    mass_at_or_below = prefix.gather(1, at_or_below - 1)
    return prefix[:, -1:] - mass_at_or_below, probs.shape[1] - at_or_below


def _per_row(value: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    return (value.double() if isinstance(value, torch.Tensor)
            else torch.full((batch,), float(value), dtype=torch.float64, device=device))[:, None]


def _reference_sets(probs: torch.Tensor, top_p: float | torch.Tensor | None = None,
                    top_k: int | torch.Tensor | None = None,
                    min_p: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(surely kept, kept or dropped within rounding) for the limits given."""
    batch, device = probs.shape[0], probs.device
    mass_above, count_above = _mass_and_count_above(probs)
    sure = torch.ones_like(probs, dtype=torch.bool)
    either = torch.zeros_like(sure)
    if top_p is not None:
        p = _per_row(top_p, batch, device)
        sure &= mass_above < p
        either |= (mass_above - p).abs() <= MASS_TOLERANCE
    if top_k is not None:
        k = _per_row(top_k, batch, device)
        sure &= count_above < k
        kth = probs.topk(int(k.max()), dim=1).values.gather(1, k.long() - 1)
        either |= probs == kth  # ties with the k-th value
    if min_p is not None:
        pivot = probs.max(dim=1, keepdim=True).values * _per_row(min_p, batch, device).float()
        sure &= probs >= pivot
        either |= (probs - pivot).abs() <= 1e-6 * pivot
    return sure, either


def _check_renorm(name: str, renormed: torch.Tensor, probs: torch.Tensor,
                  sure: torch.Tensor, either: torch.Tensor) -> bool:
    kept = renormed > 0
    wrong = (kept != sure) & ~either
    sums = renormed.double().sum(dim=1)
    # Each kept prob divided by the kept mass, the kernel's own kept set (so the
    # boundary does not count twice); relative, as values run from 1e-6 to 1.
    expected = probs.double() / (probs.double() * kept).sum(1, keepdim=True)
    value_error = ((renormed.double() - expected).abs() / expected)[kept].max().item()
    ok = wrong.sum().item() == 0 and (sums - 1).abs().max().item() < 1e-4 and value_error < 1e-4
    print(f"{name:44s} {'ok  ' if ok else 'FAIL'} kept/row {kept.sum(1).tolist()}, "
          f"outside the reference set {int(wrong.sum())} (boundary-equal {int((kept != sure).sum())}), "
          f"max |sum - 1| {(sums - 1).abs().max().item():.1e}, max relative value error {value_error:.1e}")
    return ok


def _check_samples(name: str, draw, sure: torch.Tensor, either: torch.Tensor,
                   draws: int = 64) -> bool:
    outside, invalid = 0, 0
    for seed in range(draws):
        ids, valid = draw(seed)
        allowed = (sure | either).gather(1, ids.long()[:, None])[:, 0]
        outside += int((~allowed).sum())
        invalid += int((~valid).sum())
    ok = outside == 0 and invalid == 0
    print(f"{name:44s} {'ok  ' if ok else 'FAIL'} {draws} draws x {sure.shape[0]} rows: "
          f"ids outside the support {outside}, invalid {invalid}")
    return ok


def self_check(sampling: FlashInferSampling, vocab: int = 151_936) -> bool:
    """Each function against sort-based torch references on softmax(randn * s),
    s from flat to peaked; scalar and per-row settings."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    scales = torch.tensor([0.5, 2.0, 5.0, 10.0], device="cuda")[:, None]
    probs = torch.softmax(torch.randn(4, vocab, device="cuda", generator=generator) * scales, dim=1)
    top_p_rows = torch.tensor([0.5, 0.9, 0.95, 1.0], device="cuda")
    top_k_rows = torch.tensor([1, 20, 1000, vocab], dtype=torch.int32, device="cuda")
    min_p_rows = torch.tensor([0.0, 0.05, 0.1, 0.5], device="cuda")
    results = []
    for top_p in (0.9, top_p_rows):
        label = "per-row" if isinstance(top_p, torch.Tensor) else f"{top_p}"
        sets = _reference_sets(probs, top_p=top_p)
        results.append(_check_renorm(f"top_p_renorm_probs top_p={label}",
                                     sampling.top_p_renorm_probs(probs, top_p), probs, *sets))
        results.append(_check_samples(
            f"top_p_sampling_from_probs top_p={label}",
            lambda s, p=top_p: sampling.top_p_sampling_from_probs(probs, p, s, return_valid=True),
            *sets))
    for top_k in (50, top_k_rows):
        label = "per-row" if isinstance(top_k, torch.Tensor) else f"{top_k}"
        sets = _reference_sets(probs, top_k=top_k)
        results.append(_check_renorm(f"top_k_renorm_probs top_k={label}",
                                     sampling.top_k_renorm_probs(probs, top_k), probs, *sets))
        results.append(_check_samples(
            f"top_k_sampling_from_probs top_k={label}",
            lambda s, k=top_k: sampling.top_k_sampling_from_probs(probs, k, s, return_valid=True),
            *sets))
    for min_p in (0.1, min_p_rows):
        label = "per-row" if isinstance(min_p, torch.Tensor) else f"{min_p}"
        results.append(_check_samples(
            f"min_p_sampling_from_probs min_p={label}",
            lambda s, m=min_p: sampling.min_p_sampling_from_probs(probs, m, s, return_valid=True),
            *_reference_sets(probs, min_p=min_p)))
    for top_k, top_p in ((50, 0.9), (top_k_rows, top_p_rows)):
        label = "per-row" if isinstance(top_k, torch.Tensor) else f"{top_k}, top_p={top_p}"
        results.append(_check_samples(
            f"top_k_top_p_sampling_from_probs top_k={label}",
            lambda s, k=top_k, p=top_p: sampling.top_k_top_p_sampling_from_probs(
                probs, k, p, s, return_valid=True),
            *_reference_sets(probs, top_p=top_p, top_k=top_k)))
    # top_k = 1 leaves one token: every draw must be the argmax.
    ids, _ = sampling.top_k_sampling_from_probs(probs, 1, seed=7, return_valid=True)
    argmax_ok = bool((ids.long() == probs.argmax(dim=1)).all())
    print(f"{'top_k_sampling_from_probs top_k=1 is argmax':44s} {'ok  ' if argmax_ok else 'FAIL'}")
    results.append(argmax_ok)
    # Below 2048 tokens FlashInfer's top-p renorm takes its ternary-search kernel.
    small = probs[:, :1000].contiguous() / probs[:, :1000].sum(dim=1, keepdim=True)
    results.append(_check_renorm("top_p_renorm_probs top_p=0.9, vocab 1000",
                                 sampling.top_p_renorm_probs(small, 0.9), small,
                                 *_reference_sets(small, top_p=0.9)))
    torch.cuda.synchronize()
    return all(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-only", action="store_true",
                        help="compile the launcher (nvcc and headers needed, no GPU) and exit")
    parser.add_argument("--include", help=f"the fetched folder (default ${INCLUDE_VARIABLE} "
                                          f"or {DEFAULT_INCLUDE})")
    parser.add_argument("--build-dir", help="where the .so goes (default: a cache under /tmp)")
    args = parser.parse_args(argv)
    if args.build_only:
        try:
            library = build(args.include, args.build_dir)
        except FlashInferUnavailable as missing:
            print(f"flashinfer baseline unavailable: {missing}")
            return 1
        version = (find_include(args.include) / "VERSION").read_text().split()[0]
        print(f"{library} ({library.stat().st_size / 1e6:.1f} MB, {version}, {ARCH})")
        return 0
    sampling = load(args.include, args.build_dir)
    if sampling is None:
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{(find_include(args.include) / 'VERSION').read_text().split()[0]}")
    return 0 if self_check(sampling) else 1


if __name__ == "__main__":
    sys.exit(main())

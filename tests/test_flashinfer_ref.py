"""benchmarks/flashinfer_ref.py on a machine without a GPU: its argument
checks and its refusal without headers. Compiling the launcher is not tested
here (about 80 s of CPU with nvcc, and the headers come from the network):
`python benchmarks/flashinfer_ref.py --build-only` does that, and the module's
own __main__ checks the kernels on a GPU."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "flashinfer_ref.py"
_SPEC = importlib.util.spec_from_file_location("flashinfer_ref", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
flashinfer_ref = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(flashinfer_ref)

PROBS = torch.full((4, 100), 0.01)


@pytest.mark.parametrize("probs,message", [
    ([[0.5, 0.5]], "must be a torch.Tensor, got list"),
    (torch.full((100,), 0.01), r"must be 2-D \[batch, vocab\], got shape \(100,\)"),
    (PROBS.double(), "must be float32 .* got torch.float64"),
    (PROBS.half(), "must be float32 .* got torch.float16"),
    (torch.full((100, 4), 0.01).t(), r"must be contiguous, got strides \(1, 4\)"),
    (torch.empty(0, 100), r"batch and vocab in \[1, 4294967295\], got shape \(0, 100\)"),
])
def test_bad_probs_are_named(probs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        flashinfer_ref.check_probs(probs)


def test_probs_off_cuda_are_refused_after_the_shape_checks():
    assert flashinfer_ref.check_probs(PROBS) == (4, 100)
    with pytest.raises(ValueError, match="must be on a CUDA device, got cpu"):
        flashinfer_ref.check_on_cuda(PROBS)


P = {"integer": False, "low_open": True}  # top_p: (0, 1]
K = {"integer": True}  # top_k: [1, V]


@pytest.mark.parametrize("name,value,low,high,kind,message", [
    ("top_p", 0.0, 0.0, 1.0, P, r"top_p=0.0 is out of range: accepted \(0.0, 1.0\]"),
    ("top_p", 1.5, 0.0, 1.0, P, r"top_p=1.5 is out of range: accepted \(0.0, 1.0\]"),
    ("top_p", math.nan, 0.0, 1.0, P, r"top_p=nan is out of range"),
    ("top_p", "0.9", 0.0, 1.0, P, "top_p must be a float .* got '0.9'"),
    ("min_p", -0.1, 0.0, 1.0, {"integer": False}, r"min_p=-0.1 is out of range: accepted \[0.0, 1.0\]"),
    ("top_k", 0, 1, 100, K, r"top_k=0 is out of range: accepted \[1, 100\]"),
    ("top_k", 101, 1, 100, K, r"top_k=101 is out of range: accepted \[1, 100\]"),
    ("top_k", 2.0, 1, 100, K, "top_k must be an int .* got 2.0"),  # not rounded
    ("top_k", True, 1, 100, K, "top_k must be an int .* got True"),
    ("top_k", torch.ones(4, dtype=torch.int64), 1, 100, K,
     r"contiguous torch.int32 of shape \(4,\), got torch.int64 of shape \(4,\)"),  # not cast
    ("top_p", torch.ones(3), 0.0, 1.0, P,
     r"torch.float32 of shape \(4,\), got torch.float32 of shape \(3,\)"),
    ("top_p", torch.ones(8)[::2], 0.0, 1.0, P, "not contiguous"),
])
def test_bad_settings_name_the_value_and_the_range(name, value, low, high, kind, message):
    with pytest.raises((TypeError, ValueError), match=message):
        flashinfer_ref.check_setting(name, value, PROBS, low, high, **kind)


def test_good_settings_pass_through_unconverted():
    rows = torch.full((4,), 0.9)
    assert flashinfer_ref.check_setting("top_p", rows, PROBS, 0.0, 1.0, **P) == (rows, 0)
    assert flashinfer_ref.check_setting("top_p", 1, PROBS, 0.0, 1.0, **P) == (None, 1)
    assert flashinfer_ref.check_setting("top_k", 100, PROBS, 1, 100, **K) == (None, 100)
    assert flashinfer_ref.check_setting("min_p", 0.0, PROBS, 0.0, 1.0, integer=False) == (None, 0.0)


@pytest.mark.parametrize("seed,message", [
    (-1, r"seed=-1 is out of range: accepted \[0, 2\*\*64 - 1\]"),
    (2**64, r"seed=18446744073709551616 is out of range"),
    (1.0, "seed must be an int, got 1.0"),
])
def test_bad_seeds_are_named(seed, message):
    with pytest.raises((TypeError, ValueError), match=message):
        flashinfer_ref.check_seed("seed", seed)


def test_load_without_headers_says_why_and_returns_none(tmp_path, capsys):
    assert flashinfer_ref.load(include=tmp_path, build_dir=tmp_path / "build") is None
    out = capsys.readouterr().out
    assert out == (f"flashinfer baseline unavailable: no FlashInfer headers in {tmp_path} "
                   "(run: bash benchmarks/flashinfer_fetch.sh)\n")
    assert not (tmp_path / "build").exists()

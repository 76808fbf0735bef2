"""Argument checks at the kernels' boundary, and the per-row tensors that
scalar settings become. Bad input is refused with the bad value and the
accepted range before any kernel runs; per-row tensors are taken as they
are (checking device values would cost a host sync per step).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .rows import bitmask_words, values_capacity

OVERFLOW_POLICIES = ("exact", "status")


def check_overflow(overflow: str) -> str:
    """"exact" (no row dropped) or "status" (rows past max_tokens OVERFLOW)."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    return overflow


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_matrix(x: torch.Tensor, name: str) -> torch.Tensor:
    """A [B, V] float matrix with unit stride along V."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, V], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have V >= 1 columns, got {x.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x


def check_max_tokens(max_tokens: int, rows: int, vocab: int, overflow: str) -> int:
    """max_tokens, once the int32 offsets of the largest possible result are
    known to fit."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    check_overflow(overflow)
    entries = values_capacity(rows, vocab, max_tokens, overflow)
    if max(entries, rows * bitmask_words(vocab)) >= 2**31:
        raise ValueError(
            f"B = {rows} rows of up to {entries // max(rows, 1)} values (V = {vocab}, "
            f"max_tokens = {max_tokens}, overflow={overflow!r}) need {entries} entries; "
            "it must stay below 2**31 (int32 offsets): split the batch"
        )
    return max_tokens


def per_row(
    value: torch.Tensor | int | float | bool | None,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    name: str,
    default: float | int | bool,
    low: float | None = None,
    high: float | None = None,
    stream: int | None = None,
    accept: tuple[torch.dtype, ...] = (),
) -> torch.Tensor:
    """Broadcast a scalar to [B] or check a [B] tensor.

    Range checks run on Python scalars only: checking a device tensor would
    cost a host sync per step. Out-of-range tensor values are clamped by the
    kernels' rules (documented per kernel). ``stream``: as constant_rows'.
    ``accept``: other dtypes the kernels read as they are, so a tensor of
    one of them is handed on without a cast (a launch and an allocation of
    host time per call: an engine's int64 top_k or bool greedy).
    """
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")
        if value.dtype in accept:
            dtype = value.dtype
        return as_contiguous(value, dtype, device)
    if not isinstance(value, numbers.Real):  # a 0-d array, a string, a list...
        raise TypeError(f"{name} must be a number or a tensor of shape ({batch},), "
                        f"got {type(value).__name__}")
    if low is not None and not (low <= value):
        raise ValueError(f"{name}={value!r} is out of range; accepted: >= {low}")
    if high is not None and not (value <= high):
        raise ValueError(f"{name}={value!r} is out of range; accepted: <= {high}")
    return constant_rows(value, batch, dtype, device, stream)


def as_contiguous(value: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value.to(device=device, dtype=dtype).contiguous()``: the tensor
    itself where it already is one (as those return it), checked without
    their two dispatches, a few us of an eager call's host time."""
    if value.dtype == dtype and value.device == device and value.is_contiguous():
        return value
    return value.to(device=device, dtype=dtype).contiguous()


# Broadcast scalars, kept per (value, batch, dtype, device, stream): the
# kernels only read them, so one tensor serves every call with that setting
# and no call pays a fill launch for it (benchmarks/kernels_notes.md).
_CONSTANT_ROWS: dict[tuple[Any, ...], torch.Tensor] = {}
_CONSTANT_ROWS_KEPT = 64


def constant_rows(value: Any, batch: int, dtype: torch.dtype, device: torch.device,
                  stream: int | None = None) -> torch.Tensor:
    """torch.full((batch,), value) that callers only read, made once per
    setting and stream. Not kept while a CUDA graph is being captured (its
    fill would run only when the graph is replayed). ``stream``: the current
    stream where the caller knows it and knows no graph is being captured
    (an eager call's launch_plan.call_stream): asking torch again costs a
    few microseconds of host time a setting (issue 35)."""
    device = torch.device(device)
    if stream is None:
        stream = 0
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return torch.full((batch,), value, dtype=dtype, device=device)
            stream = torch.cuda.current_stream(device).cuda_stream
    key = (value, type(value), batch, dtype, device, stream)
    rows = _CONSTANT_ROWS.get(key)
    if rows is None:
        if len(_CONSTANT_ROWS) >= _CONSTANT_ROWS_KEPT:
            _CONSTANT_ROWS.clear()
        rows = _CONSTANT_ROWS[key] = torch.full((batch,), value, dtype=dtype, device=device)
    return rows


def row_mask(rows: torch.Tensor | None, batch: int, device: torch.device,
             stream: int | None = None) -> torch.Tensor:
    """Opt-in mask as [B] (nonzero = materialise the row): the caller's bool
    mask itself where it is contiguous on ``device`` (the kernels read it as
    it is: no cast launched a call), else a contiguous bool copy on
    ``device``; int8 ones for no mask; ``stream`` as constant_rows'."""
    if rows is None:
        return constant_rows(1, batch, torch.int8, device, stream)
    if rows.shape != (batch,):
        raise ValueError(f"rows must be a bool mask of shape ({batch},), got {tuple(rows.shape)}")
    if rows.dtype != torch.bool:
        raise TypeError(f"rows must be a bool mask, got {rows.dtype}")
    return as_contiguous(rows, torch.bool, torch.device(device))

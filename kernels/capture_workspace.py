"""What the stages of one capture or sample call share: its settings as
per-row tensors (:class:`CaptureSettings`) and its scratch memory
(:class:`CaptureWorkspace`, named arrays carved from a few allocations),
and the layout of a window row's bracket record.

A call's workspace is views of scratch kept per thread, stream and V
(:meth:`CaptureWorkspace.allocate`; an eager call allocates nothing for
it, and its addresses repeat, which plans rely on: kernels/launch_plan.py):
every array is written by one stage and read by later ones (each field
says which), and every array a stage accumulates into is cleared by an
earlier stage of the same call. A call without window rows
(:func:`may_be_window`) gets empty window arrays: no kernel of such a call
reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from . import tuning
from .checks import per_row, row_mask
from .rows import release_results

# A window row's bracket record: BRACKET int32 values a row, written by the
# window bracket (B_LO .. B_WIDE) and the window mark (the refined bracket
# with min-p's floor under it, B_FINAL_LO and B_FINAL_HI, what resolve
# searches).
BRACKET = tl.constexpr(7)
B_LO, B_HI, B_TARGET, B_FLOOR, B_WIDE, B_FINAL_LO, B_FINAL_HI = (tl.constexpr(k)
                                                                  for k in range(7))


def may_be_on(setting: Any, on: Callable[[Any], bool]) -> bool:
    """Whether a setting may turn its cutoff on in some row: ``on(value)``
    for a scalar, always for a [B] tensor (no host sync), never for None."""
    if setting is None:
        return False
    return isinstance(setting, torch.Tensor) or bool(on(setting))


def may_be_window(top_k: torch.Tensor | int | None, top_p: torch.Tensor | float | None,
                  min_p: torch.Tensor | float | None, vocab: int) -> bool:
    """Whether some row may be a window row: top-k off and top-p on, or
    top-k and top-p off and min-p on (a min-p support can hold every id of
    a flat row): known from scalars, assumed for [B] tensors (no host
    sync)."""
    k_may_be_off = top_k is None or isinstance(top_k, torch.Tensor) or not 1 <= top_k < vocab
    p_may_be_off = top_p is None or isinstance(top_p, torch.Tensor) or not top_p < 1.0
    return bool(k_may_be_off and (may_be_on(top_p, lambda p: p < 1.0)
                                  or (p_may_be_off and may_be_on(min_p, lambda m: m > 0.0))))


@dataclass
class CaptureSettings:
    """A call's settings as the kernels read them ([B] tensors), and what its
    arguments say before any kernel runs (no host sync): which sums the
    candidate mark may need and whether window rows may occur."""

    top_k: torch.Tensor  # int32[B] or the caller's int64[B]; off where < 1 or >= V
    top_p: torch.Tensor  # float32[B]; off where 1
    min_p: torch.Tensor  # float32[B]; off where 0
    greedy: torch.Tensor  # int8[B] or the caller's bool[B]
    opt_in: torch.Tensor  # bool[B] (the caller's mask), or int8 ones for none: rows materialised
    sequential: bool  # order "sequential": top-p's target is a share of the top-k mass
    need_mass: bool  # some row may have top-p on
    need_max: bool  # some row may have min-p on or be greedy
    # window rows (a top-p support of thousands of ids, bracketed by pivot
    # masses, or a min-p-only one, whose cutoff the row's max gives;
    # written by the window write; sample's drawn in resolve)
    window: bool

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The per-row tensors' dtypes that may vary (a compiled kernel and
        so a plan is made for each)."""
        return self.top_k.dtype, self.greedy.dtype, self.opt_in.dtype

    @classmethod
    def of(cls, batch: int, vocab: int, device: torch.device, *,
           top_k: torch.Tensor | int | None, top_p: torch.Tensor | float | None,
           min_p: torch.Tensor | float | None, greedy: torch.Tensor | bool | None,
           rows: torch.Tensor | None, sequential: bool,
           stream: int | None = None) -> CaptureSettings:
        """Checked per-row settings (scalars broadcast once and kept; a call
        whose settings are all scalars gets the same object again, for its
        stream, without a check or lookup per setting). ``stream``: the
        current stream where the caller knows it (not capturing a graph)."""
        key: tuple[Any, ...] | None = None
        if rows is None and not any(isinstance(v, torch.Tensor)
                                    for v in (top_k, top_p, min_p, greedy)):
            stream = _stream_of(device) if stream is None else stream
            if stream is not None:
                key = (batch, vocab, device, stream, sequential, top_k, type(top_k), top_p,
                       type(top_p), min_p, type(min_p), greedy, type(greedy))
                try:
                    kept = _SETTINGS.get(key)
                except TypeError:  # an unhashable setting: per_row names it below
                    kept = key = None
                if kept is not None:
                    return kept
        made = cls(
            top_k=per_row(top_k, batch, torch.int32, device, "top_k", 0, stream=stream,
                          accept=(torch.int64,)),
            top_p=per_row(top_p, batch, torch.float32, device, "top_p", 1.0, low=0.0, high=1.0,
                          stream=stream),
            min_p=per_row(min_p, batch, torch.float32, device, "min_p", 0.0, low=0.0, high=1.0,
                          stream=stream),
            greedy=per_row(greedy, batch, torch.int8, device, "greedy", False, stream=stream,
                           accept=(torch.bool,)),
            opt_in=row_mask(rows, batch, device, stream),
            sequential=sequential,
            need_mass=may_be_on(top_p, lambda p: p < 1.0),
            need_max=may_be_on(min_p, lambda m: m > 0.0) or may_be_on(greedy, bool),
            window=may_be_window(top_k, top_p, min_p, vocab),
        )
        if key is not None:
            if len(_SETTINGS) >= _SETTINGS_KEPT:
                _SETTINGS.clear()
            _SETTINGS[key] = made
        return made


# All-scalar settings by (batch, V, device, stream, order, values): their
# tensors are constant_rows', which the kernels only read
_SETTINGS: dict[tuple[Any, ...], CaptureSettings] = {}
_SETTINGS_KEPT = 64


def _stream_of(device: torch.device | str) -> int | None:
    """The current stream of a CUDA device (0 for another device); None
    while a CUDA graph is being captured (nothing is kept then)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    if torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.current_stream(device).cuda_stream


def _carve(buffer: torch.Tensor, **sizes: int) -> dict[str, torch.Tensor]:
    """Consecutive arrays of the sizes given, in order, from the start of
    ``buffer`` (int32), each at a multiple of 16 bytes from it (the
    alignment Triton specializes pointers on)."""
    arrays, start = {}, 0
    for name, size in sizes.items():
        arrays[name] = buffer[start:start + size]
        start += -(-size // 4) * 4
    return arrays


def _carved_size(**sizes: int) -> int:
    return sum(-(-size // 4) * 4 for size in sizes.values())


@dataclass
class CaptureWorkspace:
    """Scratch memory of one call, by stage. ``n_chunks`` = ceil(V / CHUNK);
    per-chunk arrays hold row b's chunk c at b * n_chunks + c."""

    n_chunks: int
    # bound (per row): the candidates' floor key, whether a window row;
    # a window row's pivots, and the wide-bracket list's count and the
    # interleaved mark's counts (cleared)
    lo: torch.Tensor  # int32[B]
    window: torch.Tensor  # int32[B]
    pivots: torch.Tensor  # int32[B * WINDOW_PIVOTS]
    wide_count: torch.Tensor  # int32[1]
    done: torch.Tensor  # int32[B]: the interleaved mark's count of a row's programs (cleared)
    # window bracket (per row): the bracket record, refining keys, wide rows
    bracket: torch.Tensor  # int32[B * BRACKET]; the window mark adds the final bracket
    refine_keys: torch.Tensor  # int32[B * WINDOW_REFINE]
    wide_rows: torch.Tensor  # int32[B], the first wide_count listed
    # candidate mark (per chunk): candidates' bitmask and count, exact sums
    bits: torch.Tensor  # int32[B * n_chunks * CHUNK / 32]; the window mark rewrites window rows'
    counts: torch.Tensor  # int32[B * n_chunks]; likewise
    sums: torch.Tensor  # float32[B * n_chunks]: mass of the finite w >= 0 (top-p rows)
    maxes: torch.Tensor  # float32[B * n_chunks]: max w (min-p and greedy rows)
    pivot_mass: torch.Tensor  # float32[B * n_chunks * WINDOW_PIVOTS]: mass at or above each pivot
    # window refine and mark (per chunk)
    refine_mass: torch.Tensor  # float32[B * n_chunks * WINDOW_REFINE]
    above_count: torch.Tensor  # int32[B * n_chunks]: ids above the final bracket
    above_mass: torch.Tensor  # float32[B * n_chunks]: their mass
    # expand (row b's at [b * V, b * V + n_b)): candidates in ascending id order
    cand_ids: torch.Tensor  # int32[B * V]
    cand_vals: torch.Tensor  # float32[B * V]
    # resolve: per chunk, a window row's support ids in the chunks before
    before: torch.Tensor  # int32[B * n_chunks]
    # resolve (per row): cutoff key, log Z, candidates kept (the whole-row
    # fallback rewrites them), whether the window write writes the row; the
    # rows' sizes, lengths, statuses, forms and selected logprobs are the
    # call's result (Rows), not scratch
    cutoff: torch.Tensor  # int32[B]
    n_cand: torch.Tensor  # int32[B]
    window_ok: torch.Tensor  # int32[B]
    logz: torch.Tensor  # float32[B]

    @classmethod
    def allocate(cls, batch: int, vocab: int, device: torch.device, window: bool,
                 stream: int | None = None) -> CaptureWorkspace:
        """The workspace of a call: views of scratch kept per thread, device,
        stream and V (grown to the largest batch seen, a power
        of two), so an eager call allocates nothing for it; fresh arrays
        while a CUDA graph is being captured (its replays must own them).
        The calls of one thread on one stream run in order on the GPU, so
        they can share scratch; another thread or stream gets its own.
        ``window`` False: the window rows' arrays empty. ``stream``: the
        current stream where the caller knows it (not capturing a graph)."""
        stream = _stream_of(device) if stream is None else stream
        if stream is None:
            return cls.carve(batch, vocab, device, window, cls.scratch(batch, vocab, device))
        key = (threading.get_ident(), device, stream, vocab)
        kept = _KEPT.get(key)
        if kept is None or kept.capacity < batch:
            with _KEPT_LOCK:  # (other threads grow and drop theirs)
                if kept is not None or len(_KEPT) >= SCRATCH_KEPT:
                    # the oldest scratch (or this one, outgrown) goes; plans
                    # drop the workspaces they hold, so its memory is freed
                    _KEPT.pop(key if kept is not None else next(iter(_KEPT)), None)
                    on_scratch_grown()
                capacity = max(16, triton.next_power_of_2(batch))
                kept = _KEPT[key] = _Kept(capacity, cls.scratch(capacity, vocab, device), {})
        ws = kept.views.get((batch, window))
        if ws is None:
            ws = kept.views[(batch, window)] = cls.carve(batch, vocab, device, window,
                                                         kept.buffers)
        return ws

    @staticmethod
    def scratch(batch: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Allocations that hold a workspace of up to ``batch`` rows (window
        arrays included): the small arrays, the bitmask, the candidates."""
        n_chunks = triton.cdiv(vocab, tuning.CHUNK)
        cells = batch * n_chunks
        return (torch.empty(_carved_size(**_small_sizes(batch, cells, True)), dtype=torch.int32,
                            device=device),
                torch.empty(cells * (tuning.CHUNK // 32), dtype=torch.int32, device=device),
                torch.empty(batch * vocab, dtype=torch.int32, device=device),
                torch.empty(batch * vocab, dtype=torch.float32, device=device))

    @classmethod
    def carve(cls, batch: int, vocab: int, device: torch.device, window: bool,
              buffers: tuple[torch.Tensor, ...]) -> CaptureWorkspace:
        """The named arrays of a ``batch``-row workspace, from ``buffers``
        (scratch() of at least ``batch`` rows)."""
        n_chunks = triton.cdiv(vocab, tuning.CHUNK)
        cells = batch * n_chunks
        small, bits, cand_ids, cand_vals = buffers
        floats = ("sums", "maxes", "above_mass", "pivot_mass", "refine_mass", "logz")
        arrays = {name: array.view(torch.float32) if name in floats else array
                  for name, array in _carve(small, **_small_sizes(batch, cells, window)).items()}
        return cls(n_chunks=n_chunks, bits=bits[:cells * (tuning.CHUNK // 32)],
                   cand_ids=cand_ids[:batch * vocab], cand_vals=cand_vals[:batch * vocab],
                   **arrays)


def _small_sizes(batch: int, cells: int, window: bool) -> dict[str, int]:
    """The workspace's small arrays in carving order (int32 elements);
    ``window`` False: the window rows' arrays empty."""
    rows_w = batch if window else 0  # a window array's rows
    cells_w = cells if window else 0
    return dict(
        lo=batch, window=batch, bracket=BRACKET.value * rows_w,
        pivots=tuning.WINDOW_PIVOTS * rows_w, refine_keys=tuning.WINDOW_REFINE * rows_w,
        wide_rows=rows_w, wide_count=1, done=rows_w,
        counts=cells, sums=cells, maxes=cells, before=cells_w, above_count=cells_w,
        above_mass=cells_w, pivot_mass=tuning.WINDOW_PIVOTS * cells_w,
        refine_mass=tuning.WINDOW_REFINE * cells_w,
        cutoff=batch, n_cand=batch, window_ok=batch, logz=batch)


@dataclass
class _Kept:
    """A thread's scratch on one stream: its capacity in rows, its
    allocations, and the workspaces carved from them by (batch, window)."""

    capacity: int
    buffers: tuple[torch.Tensor, ...]
    views: dict[tuple[int, bool], CaptureWorkspace]


_KEPT: dict[tuple[Any, ...], _Kept] = {}
SCRATCH_KEPT = 8  # (thread, device, stream, V) scratches kept at once, oldest dropped
_KEPT_LOCK = threading.Lock()
_GROWN: list[Callable[[], None]] = []


def on_scratch_grown(callback: Callable[[], None] | None = None) -> None:
    """Register ``callback`` (plans holding workspaces drop them when the
    scratch they view is replaced), or, without one, call every callback."""
    if callback is not None:
        _GROWN.append(callback)
        return
    for call in _GROWN:
        call()


def release_scratch() -> None:
    """Drop every kept workspace and kept result (tests; a process that
    wants the memory back)."""
    _KEPT.clear()
    release_results()
    on_scratch_grown()

"""Capture: the support a sampler drew from, with its logprobs, per row.

Semantics (every comparison on the float32 value of the probability ``w``)
---------------------------------------------------------------------------
Cutoffs are thresholds: every token whose ``w`` ties the value at a cutoff is
kept, so the support can be larger than ``top_k``.

* top-k (active when ``1 <= top_k < V``): ``t_k`` = the k-th largest ``w``.
* top-p (active when ``top_p < 1``): with ``w`` sorted descending and
  cumulative mass ``c``, ``t_p`` = the value at the first position where
  ``c >= top_p * M``; ``M`` is the row's total mass (joint) or the mass kept
  by top-k (sequential). Equivalently the largest ``t`` with
  ``mass(w >= t) >= top_p * M``.
* min-p (active when ``min_p > 0``): ``t_m = min_p * max(w)`` (the same in both
  orders, since renormalising does not change ratios to the maximum).
* support = ``{i : w_i > 0 and w_i >= max(t_k, t_p, t_m)}``.
* order ``"joint"``: every cutoff on the same probabilities. ``"sequential"``:
  top-k, renormalise, top-p, renormalise, min-p; only top-p's target mass
  differs.
* ``logprob_i = log(w_i / Z)``, ``Z = sum of w over the support``; the
  selected logprob is ``log(w_y / Z)`` from the same ``Z``.
* greedy rows: support = ``{y}``, logprob 0.
* status, first match wins: INVALID (a NaN, inf or negative ``w`` in the row,
  ``y`` outside ``[0, V)`` or outside the support, ``Z == 0``, a non-finite
  logprob), SKIPPED (row not opted in: thresholds and the selected logprob are
  still computed, no id is written), OVERFLOW (``overflow="status"`` only:
  support larger than ``max_tokens``, no id written), OK.
* an OK row travels in the cheaper exact form (see :class:`.rows.Form`):
  its ids while ``32 L < V`` and ``L <= max_tokens``, else its bitmask; its
  logprobs in both forms.

Masses are float32 sums in the kernel and float64 in the reference; a top-p
target within rounding (about 1e-6 relative) of a cumulative mass may fall on
either side.

Stages, in the order :func:`run_capture` calls them, each a module holding
its kernels beside its launcher (the call's settings and scratch arrays:
kernels/capture_workspace.py; tuning constants: kernels/tuning.py):
1. bound (capture_bound.py; program per row): reads a sample of the row (8
   blocks of 1024 columns spread over it; the whole row when V <= 8192) and
   sets the candidates' floor lo, under every cutoff (top-k: the sampled
   key with 1.25x its share of k above it, plus slack; top-p: the key whose
   sampled mass share reaches min(top_p + P_MARGIN, (1 + top_p) / 2), and
   for a top-p-only row no higher than the key keeping P_KEEP sampled ids'
   share; min-p: min_p x the sampled max; top-k <= K_FLOOR_ONLY: top-k's
   and min-p's floors alone). The mass estimates count the sample's
   largest value once, not 1/share times, when no other sampled id ties it
   (SAMPLE_HEAVY: most likely the row's only one of its size). The bound
   skips searches whose floor would not be used: a top-k <= K_FLOOR_ONLY
   row's top-p floor, and a top-p-only row's mass floors where its count
   floor (P_KEEP) already holds the mass floor's share and keeps too few
   ids for a window row (peaked rows). A window row (top-k off, top-p on, a support
   the sample puts past WINDOW_MIN ids) gets 8 pivots instead, around
   the key whose sampled share reaches top_p, spread by the width of [lo, hi)
   (hi: the key whose sampled share reaches top_p - P_MARGIN;
   _window_pivots), the inner ones by the standard error of the sample's
   share estimate (_inner_span). A min-p-only row (top-k and top-p off) whose sample
   puts past WINDOW_MIN ids above min-p's floor is a window row with no
   pivots: its cutoff, min_p x the row's max, is exact once 2 has the max,
   and 2b-6 take its support as a top-p window row's above its bracket (a
   flat row keeps nearly every id: one program a row could not write it).
2. candidate mark (capture_mark.py; program per 8192-column chunk): one
   read of ``probs``: the candidates as a bitmask and their count (every bad
   value, NaN, inf or negative, is a candidate: resolve finds them there; a
   window row's are left to 2d), and only the exact sums a row's settings
   need (mass for top-p, max for min-p/greedy; a window row's mass above
   each pivot).
2b. window bracket (capture_window.py, as 2c and 2d; launched, like them,
   only when some row may be top-p only; program per row): the exact masses
   above a window row's 8 pivots place its top-p cutoff between two of them
   (the bracket); a bracket outside the inner pivots (a sample that missed)
   is wide, and gets 8 refining keys inside it; the wide rows are listed.
2c. window refine (a fixed grid of programs sharing out the listed rows'
   chunks): the mass above 8 keys inside each wide bracket.
2d. window mark (program per chunk, window rows only): a wide bracket
   narrowed by those masses, min-p's key a floor, one read rewrites the
   row's candidates as its bad values and the ids in the bracket, and sums
   the count and mass of those above it.
3. expand (compaction's expand kernel, compact.py): ascending candidate ids
   and values, row-local.
4. resolve (capture_resolve.py; program per row): exact cutoffs by bisection
   over the float bits of the candidates (held in registers when they fit),
   then a check that the sampled range held them (a cutoff at or above lo).
   A row that fails the check narrows each missed cutoff over its whole row
   (_row_floor: passes counting and summing the ids above 7 probes, until
   the ids above the floor fit in FLOOR_FIT or four passes), one pass
   rewrites its candidates as every id at or above the floor, and the
   searches run again over them (a sequential row whose top-k missed: 31
   passes a cutoff, exact). A window row's candidates are the ids of its
   bracket (2d), so its cutoff is exact, never a fallback; resolve also
   counts its support in each chunk. Then ``Z`` (past the first
   RESOLVE_BLOCK candidates, block by block, the same in capture and
   sample), the selected logprob or, for :mod:`.sample`, the draw
   (sample_draw.py: an exponential race over the candidates; a window
   row's by inverse transform over its bracket's part and its chunks'
   masses above the bracket, reading only the chunk it falls in); status,
   length, form.
5. write (capture_write.py, as 6; program per row): the support's logprobs
   at offsets[b] and its ids or bitmask words at id_offsets[b], both
   computed from the lengths and forms of the rows before (a bitmask row is
   zeroed, then each run of support ids in one word is OR-ed by a segmented
   scan and stored once). A window row gets only its offsets here:
6. window write (launched only when some row may be top-p only; program per
   chunk): one contiguous read of a window row's chunk writes its support's
   bitmask words (or ids) and ``log(w) - log(Z)`` at the row's offsets plus
   the counts of the chunks before, which resolve found.

On sm90+ GPUs every kernel is launched as a programmatic dependent of the
one before (after_previous): it starts while that one ends and waits for it
before reading what it wrote; reads of ``probs``, and from L2 of what a
kernel two or more launches back wrote, may come first.

``into=``: a call that cannot have window rows stores each row into the
ring from the write kernel as it computes it (GPU-direct); one that may
publishes its rows after the window write (the store kernel), so a row's
bits are the same on every path (tests/test_rows_every_path.py).
"""

from __future__ import annotations

from typing import Any

import torch

from . import launch_plan, tuning
from .capture_bound import launch_bound
from .capture_interleave import launch_interleaved_mark
from .capture_mark import launch_candidate_mark
from .capture_resolve import launch_resolve
from .capture_window import launch_window
from .capture_workspace import CaptureSettings, CaptureWorkspace, on_scratch_grown
from .capture_write import launch_window_write, launch_write
from .checks import as_contiguous, check_matrix, check_max_tokens, per_row
from .compact import launch_expand_local
from .direct import claim_step, launching, publish_into
from .host import check_into
from .launch import pdl_default
from .rows import Rows, Status, empty_rows, pack_rows

__all__ = ["ORDERS", "capture", "reference_capture", "top_p_within_rounding"]

ORDERS = ("joint", "sequential")


def check_order(order: str) -> str:
    """"joint" (every cutoff on the same probabilities) or "sequential"."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order


def run_capture(
    probs: torch.Tensor,
    *,
    sampled: torch.Tensor | None,
    seeds: torch.Tensor | int | None,
    top_k: torch.Tensor | int | None,
    top_p: torch.Tensor | float | None,
    min_p: torch.Tensor | float | None,
    max_tokens: int,
    order: str,
    rows: torch.Tensor | None,
    greedy: torch.Tensor | bool | None,
    overflow: str,
    into: tuple[Any, ...] | None = None,
) -> Rows:
    """Shared launcher of capture() (``sampled``) and sample() (``seeds``):
    the arguments checked before any kernel runs, then the stages."""
    probs = check_matrix(probs, "probs")
    check_order(order)
    batch, vocab = probs.shape
    device = probs.device
    check_max_tokens(max_tokens, batch, vocab, overflow)
    target = check_into(into, True, max_tokens, vocab)  # refused before any kernel runs
    # A call shape's launches replay from a plan after two calls
    # (kernels/launch_plan.py); a call whose write kernel stores into a
    # claimed GPU-direct step (into=, no window rows) always takes Triton's.
    where = launch_plan.call_stream(probs)
    stream = None if where is None else where[1]
    settings = CaptureSettings.of(
        batch, vocab, device, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy, rows=rows,
        sequential=order == "sequential", stream=stream)
    tokens, seed_rows = _tokens_and_seeds(sampled, seeds, batch, device, stream)
    result, buffers = empty_rows(batch, vocab, max_tokens, overflow, device, selected=True,
                                tokens=seed_rows is not None, reuse=where)
    if tokens is None:
        tokens = result.tokens
    assert tokens is not None
    ws = CaptureWorkspace.allocate(batch, vocab, device, settings.window, stream=stream)
    support = target is None or target[2] == "support"
    # Every kernel of the call is a programmatic dependent of the one
    # before (sm90+, compiled): it launches while that one ends, issues its
    # reads of probs, then waits for it (after_previous).
    pdl = pdl_default(device)
    if where is None or not (target is None or settings.window):
        _launch_stages(probs, settings, ws, tokens, seed_rows, max_tokens, overflow, result,
                       target, support, pdl)
        return publish_into(target, result) if target is not None and settings.window else result
    slots = (probs, tokens, seed_rows, settings.top_k, settings.top_p, settings.min_p,
             settings.greedy, settings.opt_in, *buffers)
    addresses = launch_plan.pointers(slots)
    key = (*where, id(ws), probs.dtype, batch, vocab, probs.stride(0), tokens.dtype,
           settings.dtypes, seed_rows is None, settings.sequential, settings.need_mass, settings.need_max,
           settings.window, max_tokens, overflow, support, pdl,
           launch_plan.slots_key(addresses), launch_plan.tuning_state())
    _PLANS.launch(key, slots, addresses, where[1], lambda: _launch_stages(
        probs, settings, ws, tokens, seed_rows, max_tokens, overflow, result, None, support, pdl))
    return publish_into(target, result)


_PLANS = launch_plan.Plans("capture")
on_scratch_grown(_PLANS.clear)


def _launch_stages(
    probs: torch.Tensor, settings: CaptureSettings, ws: CaptureWorkspace, tokens: torch.Tensor,
    seed_rows: torch.Tensor | None, max_tokens: int, overflow: str, result: Rows,
    target: tuple[Any, Any, str] | None, support: bool, pdl: bool,
) -> None:
    """The stages' launches in order; ``target`` with no window rows: the
    write kernel stores each row into the claimed GPU-direct step (then
    published: the caller returns ``result`` as it is)."""
    batch, vocab = probs.shape
    launch_bound(probs, settings, ws, pdl)
    interleaved = settings.window and tuning.MARK_INTERLEAVE != 0
    if interleaved:  # the candidate mark, the window bracket and most of the window mark
        launch_interleaved_mark(probs, settings, ws, pdl)
    else:
        launch_candidate_mark(probs, settings, ws, pdl)
    if settings.window:
        launch_window(probs, settings, ws, pdl, interleaved=interleaved)
    launch_expand_local(probs, ws.bits, ws.counts, ws.n_chunks, ws.cand_ids, ws.cand_vals,
                        pdl=pdl)
    launch_resolve(probs, settings, ws, tokens, seed_rows, result, max_tokens, overflow, pdl)
    # into= on the GPU-direct path: the table is prepared for this step now
    # and the write kernel stores each row into the ring as it computes it;
    # a call that may have window rows (their data are the window write's)
    # publishes its rows once they are all written, so that every path
    # gives a row the same bits.
    direct = None if settings.window else claim_step(target, batch, vocab)
    with launching(direct, "capture's write kernel"):
        launch_write(probs, settings, ws, tokens, result, direct, support=support,
                     pdl=pdl)
    if settings.window:
        launch_window_write(probs, ws, result, pdl)
    if direct is not None:
        direct.launched(result)
    elif target is not None and not settings.window:
        publish_into(target, result)


def _tokens_and_seeds(
    sampled: torch.Tensor | None, seeds: torch.Tensor | int | None, batch: int,
    device: torch.device, stream: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """capture() (no seeds): the sampled tokens (int32 as they are, any
    other integer dtype as int64) and no seeds;
    sample(): no tokens yet (the result holds room for them) and the
    per-row seeds."""
    if seeds is not None:
        return None, per_row(seeds, batch, torch.int64, device, "seeds", 0, stream=stream)
    if not isinstance(sampled, torch.Tensor) or sampled.shape != (batch,):
        raise ValueError(f"sampled must be an integer tensor of shape ({batch},)")
    if sampled.dtype.is_floating_point or sampled.dtype == torch.bool:
        raise TypeError(f"sampled must hold integer token ids, got {sampled.dtype}")
    # int32 (SGLang's drawn tokens) is read as it is: no cast launched a call
    dtype = sampled.dtype if sampled.dtype == torch.int32 else torch.int64
    return as_contiguous(sampled, dtype, device), None


def capture(
    probs: torch.Tensor,
    sampled: torch.Tensor,
    *,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    max_tokens: int,
    order: str = "joint",
    rows: torch.Tensor | None = None,
    greedy: torch.Tensor | bool | None = None,
    overflow: str = "exact",
    into: tuple[Any, ...] | None = None,
) -> Rows:
    """Support, support logprobs and selected logprob of each row.

    ``probs`` [B, V] float32/bf16/fp16 (the sampler's probabilities after
    temperature; need not sum to 1), ``sampled`` int[B] the drawn tokens.
    ``top_k`` int (<= 0 or >= V: off), ``top_p`` float in [0, 1] (1: off),
    ``min_p`` float in [0, 1] (0: off), each a scalar or a [B] tensor.
    ``rows`` bool[B] opts rows in for materialisation; ``greedy`` bool[B].
    ``overflow`` and the output capacity as in :func:`.compact.compact`.
    Returns :class:`Rows` with ``values`` = support logprobs and
    ``selected_logprob`` (NaN for INVALID rows).
    ``into=(writer, handles)`` (or ``(writer, handles, mode)``, mode
    "support" by default) also publishes the rows to those RowQueues, row b
    to ``handles[b]``: GPU-direct where CUDA is present (``kernels.publish``).
    """
    return run_capture(probs, sampled=sampled, seeds=None, top_k=top_k, top_p=top_p,
                       min_p=min_p, max_tokens=max_tokens, order=order, rows=rows,
                       greedy=greedy, overflow=overflow, into=into)


# ---------------------------------------------------------------- reference


def reference_support(
    probs: torch.Tensor, top_k: torch.Tensor | int | None, top_p: torch.Tensor | float | None,
    min_p: torch.Tensor | float | None, order: str, compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort-based support: (support bool[B, V], bad bool[B], w float32[B, V])."""
    batch, vocab = probs.shape
    device = probs.device
    k = per_row(top_k, batch, torch.int64, device, "top_k", 0)
    p = per_row(top_p, batch, torch.float32, device, "top_p", 1.0, low=0.0, high=1.0)
    mp = per_row(min_p, batch, torch.float32, device, "min_p", 0.0, low=0.0, high=1.0)
    w = probs.float()
    bad = ~((w >= 0) & torch.isfinite(w)).all(1)
    w = torch.where(bad[:, None], torch.zeros_like(w), w)
    vals = w.sort(dim=1, descending=True).values
    k_on = (k >= 1) & (k < vocab)
    t_k = torch.where(k_on, vals.gather(1, (k - 1).clamp(0, vocab - 1)[:, None])[:, 0], 0.0)
    wd = w.to(compute_dtype)
    mass = wd.sum(1)
    if order == "sequential":
        mass = torch.where(k_on, (wd * (w >= t_k[:, None])).sum(1), mass)
    target = p.to(compute_dtype) * mass
    cums = vals.to(compute_dtype).cumsum(1)
    first = (cums < target[:, None]).sum(1)  # first position with cums >= target
    t_p = vals.gather(1, first.clamp(max=vocab - 1)[:, None])[:, 0]
    t_p = torch.where((p < 1) & (first < vocab), t_p, 0.0)
    t_m = torch.where(mp > 0, mp * w.max(1).values, 0.0)
    cutoff = torch.maximum(torch.maximum(t_k, t_p), t_m)
    support = (w >= cutoff[:, None]) & (w > 0)
    return support, bad, w


def reference_capture(
    probs: torch.Tensor,
    sampled: torch.Tensor,
    *,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    max_tokens: int,
    order: str = "joint",
    rows: torch.Tensor | None = None,
    greedy: torch.Tensor | bool | None = None,
    overflow: str = "exact",
    compute_dtype: torch.dtype = torch.float64,
) -> Rows:
    """Plain-torch capture (full sort per row) with the semantics of :func:`capture`."""
    probs = check_matrix(probs, "probs")
    check_order(order)
    batch, vocab = probs.shape
    device = probs.device
    check_max_tokens(max_tokens, batch, vocab, overflow)
    support, bad, w = reference_support(probs, top_k, top_p, min_p, order, compute_dtype)
    is_greedy = per_row(greedy, batch, torch.bool, device, "greedy", False)
    opted = torch.ones(batch, dtype=torch.bool, device=device) if rows is None else rows
    y = sampled.to(device=device, dtype=torch.int64)
    y_ok = (y >= 0) & (y < vocab)
    y_safe = y.clamp(0, vocab - 1)[:, None]
    w_y = w.gather(1, y_safe)[:, 0].to(compute_dtype)
    wd = w.to(compute_dtype)
    z = (wd * support).sum(1)
    in_support = y_ok & support.gather(1, y_safe)[:, 0]
    selected = torch.log(w_y) - torch.log(z)
    invalid = bad | ~in_support | ~(z > 0) | ~torch.isfinite(selected)
    invalid = torch.where(is_greedy, bad | ~y_ok, invalid)
    selected = torch.where(is_greedy, 0.0, selected)
    sizes = torch.where(is_greedy, 1, support.sum(1))
    over = (sizes > max_tokens) & (overflow == "status")
    status = torch.where(over, Status.OVERFLOW, Status.OK)
    status = torch.where(opted, status, Status.SKIPPED)
    status = torch.where(invalid, Status.INVALID, status).to(torch.int32)
    greedy_mask = torch.zeros_like(support)
    greedy_mask.scatter_(1, y_safe, True)
    kept = torch.where(is_greedy[:, None], greedy_mask, support)
    logprobs = torch.log(wd) - torch.log(z)[:, None]
    logprobs = torch.where(is_greedy[:, None], 0.0, logprobs)
    selected = torch.where(invalid, float("nan"), selected).float()
    return pack_rows(kept, logprobs, status, sizes, max_tokens, selected)


def top_p_within_rounding(
    probs: torch.Tensor, support: torch.Tensor, top_p: torch.Tensor | float, rel: float = 1e-6
) -> torch.Tensor:
    """bool[B]: whether each row's support (bool [B, V]) is the top-p support
    (top-p only, joint) of its row for some target within ``rel`` x the
    row's mass of ``top_p`` x its mass, in float64: every w at or above its
    smallest kept value is kept (ties too), the mass with that value reaches
    ``target - rel M`` and the mass above it falls short of ``target + rel M``.
    The kernel sums masses in float32, so a target that close to a
    cumulative mass may fall on either side of it (the module docstring)."""
    batch = probs.shape[0]
    p = per_row(top_p, batch, torch.float32, probs.device, "top_p", 1.0, low=0.0, high=1.0)
    w = probs.double()
    w = torch.where(torch.isfinite(w) & (w > 0), w, 0.0)
    mass = w.sum(1)
    target = p.double() * mass
    smallest = torch.where(support, w, float("inf")).min(1).values[:, None]
    prefix = ((w >= smallest) & (w > 0)) == support
    with_it = (w * (w >= smallest)).sum(1)
    above = (w * (w > smallest)).sum(1)
    return (prefix.all(1) & support.any(1) & (with_it >= target - rel * mass)
            & (above < target + rel * mass))

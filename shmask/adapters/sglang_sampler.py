"""SGLang 0.5.23's sampler on shmask's capture kernels (issue 36, item 1).

Released SGLang captures the sampling mask of the opted-in rows with a
renormalising pass per cutoff (FlashInfer's ``top_k_renorm_prob`` and
``top_p_renorm_prob``; the pytorch backend's full sort), then
``torch.topk(weights, k=cap, sorted=True)`` over every captured row to pack
the fixed-capacity ``SamplingMaskOutput`` (``Sampler._build_sampling_mask_output``
in sglang/srt/layers/sampler.py). The patched sampler skips all of that:

- ``pending_capture`` (called where ``_sample_from_probs`` would start its
  capture) only notes the probabilities and the batch's settings, so the
  draw runs as released, without the capture's extra work (the pytorch
  backend no longer asks its sampler for the filtered, fully sorted rows);
- ``sampling_mask_output`` (called by ``_build_sampling_mask_output``, after
  the draw and the TP token sync) runs ``shmask.kernels.capture`` on the
  opted-in rows with the drawn tokens (``overflow="status"``, or
  ``"exact"`` when rows may pass the cap: below; ``max_tokens`` =
  ``--sampling-mask-max-tokens``) and
  ``shmask.kernels.fixed_rows`` to lay the rows out as the released
  ``SamplingMaskOutput``: ids by descending weight, ties by ascending id
  (``SHMASK_ROW_ORDER=engine``, the default; ``ascending``: by id). Its
  statuses are all-reduced over the TP and CP groups as released, so every
  replica makes the same abort decision. Everything after it (the host
  copy, ``materialize_sampling_mask_output``, the rows' queues, pipeline
  parallelism, disaggregation) is SGLang's, unchanged.

Semantics kept from each sampler branch (docs/integrations/sglang.md):
FlashInfer's joint top-k/top-p (every cutoff on the same probabilities,
``order="joint"``); its min-p branch renormalises after top-k and top-p
(``order="sequential"``); the pytorch backend's cutoffs are joint too.
Where released SGLang and shmask differ: shmask keeps every id tied with
a cutoff value (the pytorch backend cuts ties by sort position), its top-p
boundary is ``mass(w >= t) >= top_p * M`` in float32, and its logprobs are
``log(w / Z)`` with ``Z`` summed in the kernel's order (a last-bit
difference from SGLang's own sum is possible). Lengths of rows that are not
OK are 0 (released SGLang fills them; nothing reads them).

Top-p-only masks (issue 36, item 2): ``sampling_mask_refusal`` is the
patched scheduler's admission rule (bounded supports admitted, the full
vocabulary refused with what to set); rows longer than the cap reach their
requests whole with ``SHMASK_PAST_CAP=exact`` (``Spill``: fixed-size
bitmasks beside the released fields, which keep those rows OVERFLOW;
``materialize_spilled`` is the patched start of SGLang's
``materialize_sampling_mask_output``; shmask/adapters/sglang_spill.py).

The draw (``SHMASK_DRAW=shmask``, opt-in): ``shmask_draw`` (called just
after ``pending_capture``) draws the whole batch's tokens with
``shmask.kernels.sample``, which captures the opted-in rows' supports in
the same pass; ``sampling_mask_output`` then lays out those rows instead
of capturing again (unless the TP token sync or a grammar may still change
a token: then it captures with the final tokens). Seeds: a request's
``sampling_seed`` with its position (the same seed and position draw the
same token), else fresh ones from torch's generator each step.

``SHMASK_CAPTURE=engine`` keeps SGLang's own capture (``pending_capture``
returns None). Greedy batches keep SGLang's own builder (one id per row, no
capture to do), and so do devices the kernels do not run on.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import admission
from ..config import Config

__all__ = ["FixedRows", "ShmaskCapture", "Spill", "fixed_capture", "materialize_spilled",
           "pending_capture", "sampling_mask_output", "sampling_mask_refusal", "shmask_draw"]


class ShmaskCapture(NamedTuple):
    """What ``_sample_from_probs`` hands to ``_build_sampling_mask_output``
    in place of SGLang's filtered weights: the probabilities the sampler
    drew from and the settings to capture them with."""

    probs: torch.Tensor
    sampling_info: Any
    order: str
    # SGLang's forward replaces this field with None when the TP token sync
    # or a grammar may change the drawn token; the capture always reads the
    # final tokens, so it needs no value of its own.
    selected_weight: None = None
    # shmask's draw (SHMASK_DRAW=shmask): its Rows (the capture made with it)
    # and the arguments it was asked (_Drawn)
    drawn: Any = None


@functools.cache
def _settings() -> Config:
    return Config.from_env()


def pending_capture(probs: torch.Tensor, sampling_info: Any,
                    simple_sampling_case: bool) -> ShmaskCapture | None:
    """A capture to run after the draw, or None: SGLang captures as released
    (no row opted in, ``SHMASK_CAPTURE=engine``, or a device the kernels do
    not run on)."""
    if sampling_info.sampling_mask_batch_indices is None:
        return None
    if _settings().capture != "shmask" or probs.device.type not in ("cuda", "cpu"):
        return None
    from sglang.srt.runtime_context import get_exec

    backend = get_exec().kernel.sampling_backend
    sequential = (not simple_sampling_case and backend in ("flashinfer", "intel_xpu")
                  and bool(sampling_info.need_min_p_sampling))
    return ShmaskCapture(probs, sampling_info, "sequential" if sequential else "joint")


class Spill(NamedTuple):
    """The opted-in rows that may be longer than the capacity (their
    ``top_k`` exceeds it: top-p-only rows above all), in fixed-size form
    (``shmask.kernels.fixed_rows.spill_rows``)."""

    rows: tuple[int, ...]  # positions among the opted-in rows
    value_rows: tuple[int, ...]  # each one's row of ``values``, or -1 (selected mode)
    lengths: torch.Tensor  # int32 [C]; 0 unless OK and past the capacity
    bits: torch.Tensor  # int32 [C, ceil(V / 32)]
    values: torch.Tensor | None  # float32 [S, V], ascending by id, zeros past the length


class FixedRows(NamedTuple):
    """The opted-in rows as SGLang's fixed-capacity tensors (R rows)."""

    token_ids: torch.Tensor  # int32 [R, cap]
    lengths: torch.Tensor  # int32 [R]; 0 unless OK
    selected_logprobs: torch.Tensor  # float32 [R]
    support_logprobs: torch.Tensor  # float32 [R, cap]
    statuses: torch.Tensor  # int32 [R]: 0 OK, 1 OVERFLOW, 2 INVALID
    spill: Spill | None = None  # rows past the capacity (SHMASK_PAST_CAP=exact)


def _spill_candidates(info: Any, cap: int, vocab: int,
                      past_cap: str) -> tuple[list[int], list[int], list[int]]:
    """(positions among the opted-in rows, their batch rows, their rows of
    spilled values or -1) of the opted-in rows whose top_k exceeds ``cap``:
    host lists SGLang keeps per request, so no sync. Rows with a finite
    top_k <= cap cannot pass it except by ties, which stay OVERFLOW as
    released (a bitmask per row of every batch would cost V / 8 bytes of
    copy a row a step)."""
    if cap >= vocab or past_cap != "exact":
        return [], [], []
    top_ks = info.sampling_mask_top_ks
    opted = [b for b, wanted in enumerate(info.return_sampling_masks) if wanted]
    positions = [p for p, b in enumerate(opted) if top_ks[b] > cap]
    if not positions:
        return [], [], []
    batch_rows = [opted[p] for p in positions]
    support = info.return_sampling_support_logprobs
    value_rows: list[int] = []
    count = 0
    for b in batch_rows:
        value_rows.append(count if support[b] else -1)
        count += bool(support[b])
    return positions, batch_rows, value_rows


class _Plan(NamedTuple):
    """What a capture (or shmask's draw) of the opted-in rows is asked:
    the capacity, the rows that may pass it (``_spill_candidates``) and the
    kernel's keyword arguments."""

    cap: int
    positions: list[int]
    candidates: list[int]
    value_rows: list[int]
    kwargs: dict[str, Any]


def _plan(probs: torch.Tensor, info: Any, max_tokens: int, past_cap: str | None) -> _Plan:
    batch, vocab = probs.shape
    cap = min(max_tokens, vocab)
    positions, candidates, value_rows = _spill_candidates(
        info, cap, vocab, _settings().past_cap if past_cap is None else past_cap)
    batch_rows = info.sampling_mask_batch_indices
    opted = None
    if batch_rows.numel() != batch:
        opted = torch.zeros(batch, dtype=torch.bool, device=probs.device)
        opted.index_fill_(0, batch_rows, True)
    kwargs = dict(top_k=info.top_ks if info.need_top_k_sampling else None,
                  top_p=info.top_ps if info.need_top_p_sampling else None,
                  min_p=info.min_ps if info.need_min_p_sampling else None,
                  max_tokens=cap, rows=opted, overflow="exact" if positions else "status")
    return _Plan(cap, positions, candidates, value_rows, kwargs)


class _Drawn(NamedTuple):
    """shmask_draw's result for sampling_mask_output: its rows and the
    plan they were drawn with (made once a step)."""

    rows: Any
    plan: _Plan


def fixed_capture(probs: torch.Tensor, tokens: torch.Tensor, info: Any, *, order: str,
                  max_tokens: int, row_order: str, past_cap: str | None = None,
                  drawn: _Drawn | None = None) -> FixedRows:
    """shmask's capture of the rows ``info.sampling_mask_batch_indices`` of
    ``probs`` (with the drawn ``tokens``), laid out as SGLang lays out its
    own: the kernels' part of :func:`sampling_mask_output`, which needs
    nothing of SGLang (benchmarks/sglang_capture.py runs it on the H200).
    ``drawn``: :func:`shmask_draw`'s rows and plan (the same arguments),
    laid out instead of a capture.

    Rows longer than the capacity are OVERFLOW in the fixed fields; those
    of the spill candidates (:func:`_spill_candidates`) also come whole in
    ``spill`` (``past_cap``: SHMASK_PAST_CAP's value, from the settings
    when None)."""
    from shmask.kernels import Status, capture
    from shmask.kernels.fixed_rows import fixed_rows

    if drawn is not None:
        rows, plan = drawn
    else:
        plan = _plan(probs, info, max_tokens, past_cap)
        rows = capture(probs, tokens, order=order, **plan.kwargs)
    cap = plan.cap
    spill = None
    if plan.positions:
        device = probs.device
        lengths, bits, values = _spill(rows, plan.candidates, plan.value_rows, cap, device)
        spill = Spill(tuple(plan.positions), tuple(plan.value_rows), lengths, bits, values)
        # past the capacity: OVERFLOW in the fixed fields (spill has them whole)
        # (a row's length is 0 unless it is OK)
        rows = dataclasses.replace(
            rows, status=rows.status.masked_fill(rows.lengths > cap, Status.OVERFLOW))
    batch_rows = info.sampling_mask_batch_indices
    ids, values, lengths = fixed_rows(rows, probs, batch_rows, cap, row_order)
    assert rows.selected_logprob is not None  # capture() always sets it
    return FixedRows(ids, lengths, rows.selected_logprob.index_select(0, batch_rows), values,
                     rows.status.index_select(0, batch_rows), spill)


# (seed, position) -> the draw's seed: positions stay below 2^24 (a context)
_SEED_STRIDE = 1 << 24


def shmask_draw(probs: torch.Tensor, sampling_info: Any, positions: torch.Tensor | None,
                pending: ShmaskCapture | None) -> tuple[torch.Tensor, ShmaskCapture] | None:
    """(the batch's tokens, ``pending`` with the draw's rows) from
    ``shmask.kernels.sample`` with the capture's own arguments, so the
    opted-in rows' supports come from the draw's pass; None where SGLang
    draws (``SHMASK_DRAW=engine``, the default, or no shmask capture
    pending). A row the kernel finds INVALID (NaN or negative weights,
    zero mass) has no token; it gets id 0, and an opted-in one's status
    makes the scheduler abort its request, as released."""
    if pending is None or _settings().draw != "shmask":
        return None
    from sglang.srt.runtime_context import get_exec

    from shmask.kernels import sample

    info = sampling_info
    max_tokens = int(get_exec().features.sampling_mask_max_tokens)
    plan = _plan(probs, info, max_tokens, _past_cap())
    rows = sample(probs, _seeds(info, positions, probs), order=pending.order, **plan.kwargs)
    assert rows.tokens is not None  # sample() always sets them
    return rows.tokens.clamp(min=0), pending._replace(drawn=_Drawn(rows, plan))


def _seeds(info: Any, positions: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor:
    """int64 [B]: a request's sampling_seed with its position, or fresh
    seeds from torch's generator (the one SGLang's own draws use)."""
    seed = getattr(info, "sampling_seed", None)
    if seed is None or positions is None:
        return torch.randint(0, 1 << 62, (probs.shape[0],), dtype=torch.int64,
                             device=probs.device)
    return seed.to(torch.int64) * _SEED_STRIDE + positions.to(torch.int64)


def _spill(rows: Any, candidates: list[int], value_rows: list[int], cap: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    from shmask.kernels.fixed_rows import spill_rows

    both = _device_rows(tuple(candidates), tuple(value_rows), device)
    bits, lengths, values = spill_rows(rows, both[0], cap, both[1],
                                       sum(v >= 0 for v in value_rows))
    return lengths, bits, values


@functools.lru_cache(maxsize=8)
def _device_rows(candidates: tuple[int, ...], value_rows: tuple[int, ...],
                 device: torch.device) -> torch.Tensor:
    """int32 [2, C] on the device: a decode batch keeps its requests step
    after step, so one copy serves many steps (never written: read-only).
    The copy is from pinned memory: a pageable one would make the host wait
    for the GPU's queue (the sampler's host must stay ahead of the GPU)."""
    return torch.tensor([candidates, value_rows], dtype=torch.int32,
                        pin_memory=device.type == "cuda").to(device, non_blocking=True)


def sampling_mask_output(sampler: Any, batch_next_token_ids: torch.Tensor,
                         pending: ShmaskCapture, support_capture_indices: Any) -> Any:
    """The released ``SamplingMaskOutput`` of the opted-in rows, from
    shmask's capture of ``pending`` with the final drawn tokens (a
    ``SpilledSamplingMaskOutput`` when rows may pass the capacity)."""
    from sglang.srt.layers.logits_processor import SamplingMaskOutput

    info = pending.sampling_info
    # the draw's rows hold unless the TP sync or a grammar may still change a token
    drawn = None if _tokens_may_change(sampler, info) else pending.drawn
    fixed = fixed_capture(pending.probs, batch_next_token_ids, info, order=pending.order,
                          max_tokens=int(sampler.sampling_mask_max_tokens),
                          row_order=_settings().row_order, past_cap=_past_cap(), drawn=drawn)
    _agree_on_statuses(sampler, fixed.statuses)
    released = {
        "token_ids": fixed.token_ids,
        "lengths": fixed.lengths,
        "selected_logprobs": fixed.selected_logprobs,
        "support_logprobs": (None if support_capture_indices is None
                             else fixed.support_logprobs.index_select(0, support_capture_indices)),
        "statuses": fixed.statuses,
    }
    if fixed.spill is None:
        return SamplingMaskOutput(**released)
    from .sglang_spill import SpilledSamplingMaskOutput

    spill = fixed.spill
    return SpilledSamplingMaskOutput(**released, spill_rows=spill.rows,
                                     spill_value_rows=spill.value_rows,
                                     spill_lengths=spill.lengths, spill_bits=spill.bits,
                                     spill_values=spill.values)


def _tokens_may_change(sampler: Any, info: Any) -> bool:
    """SGLang's own condition for its token sync across TP ranks
    (``Sampler._sync_token_ids_across_tp``), read from the sampler's module."""
    module = sys.modules.get(type(sampler).__module__)
    sync = getattr(module, "SYNC_TOKEN_IDS_ACROSS_TP", True)  # unknown: assume it may
    return bool(sync or info.grammars)


def _past_cap() -> str:
    """SHMASK_PAST_CAP, except in a PD prefill server: there the first row
    reaches the decode server through SGLang's metadata buffer, one row of
    ``cap`` entries per request (sglang/srt/disaggregation/utils.py), so a
    row past the cap is OVERFLOW (its request aborts, as released) rather
    than a row the buffer cannot hold."""
    from sglang.srt.runtime_context import get_disagg

    try:
        prefill = get_disagg().disaggregation_mode == "prefill"
    except ValueError:  # no published runtime context: not a server
        prefill = False
    return "status" if prefill else _settings().past_cap


def materialize_spilled(reqs: Any, output: Any) -> bool:
    """SGLang's ``materialize_sampling_mask_output`` for an output with rows
    past the capacity (False, doing nothing, for any other output): the
    same per-request host rows, statuses and support-row counting as
    released, and each spilled row whole, its ids ascending (decoded from
    its bitmask), OK. A spilled row whose status the TP/CP all-reduce made
    INVALID stays INVALID; a bitmask whose popcount is not the row's length
    makes the row INVALID (its request aborts) rather than return a wrong row."""
    from .sglang_spill import SpilledSamplingMaskOutput

    out = output.sampling_mask_output
    if not isinstance(out, SpilledSamplingMaskOutput) or out.num_accept_tokens is not None:
        return False
    overflow, invalid = 1, 2  # SamplingMaskStatus
    batch_indices = [i for i, req in enumerate(reqs) if req.return_sampling_mask]
    lengths = out.lengths.tolist()
    statuses = out.statuses.tolist()
    if len(batch_indices) != len(lengths):
        raise ValueError(f"{len(lengths)} sampling-mask rows for {len(batch_indices)} "
                         "requests that asked for one")
    token_ids = out.token_ids.cpu().numpy()
    selected = out.selected_logprobs.cpu().numpy()
    support = None if out.support_logprobs is None else out.support_logprobs.cpu().numpy()
    spilled = {row: c for c, row in enumerate(out.spill_rows)}
    assert out.spill_lengths is not None and out.spill_bits is not None
    spill_lengths = out.spill_lengths.tolist()
    spill_bits = out.spill_bits.cpu().numpy()
    spill_values = None if out.spill_values is None else out.spill_values.cpu().numpy()
    masks: list[Any] = [None] * len(reqs)
    logprobs: list[Any] = [None] * len(reqs)
    status_by_batch: list[Any] = [None] * len(reqs)
    support_row = 0
    for row, b in enumerate(batch_indices):
        wants_support = reqs[b].sampling_logprobs_mode == "support"
        status, length = int(statuses[row]), int(lengths[row])
        c = spilled.get(row)
        if c is not None and status == overflow and spill_lengths[c] > 0:
            ids = np.flatnonzero(np.unpackbits(spill_bits[c].view(np.uint8), bitorder="little"))
            value_row = out.spill_value_rows[c]
            if len(ids) != spill_lengths[c] or (wants_support and (value_row < 0 or spill_values is None)):
                status = invalid
            else:
                status = 0
                masks[b] = ids.astype(np.int32)
                logprobs[b] = (spill_values[value_row, :len(ids)]  # type: ignore[index]
                               if wants_support else selected[row:row + 1])
        elif status == 0:
            masks[b] = token_ids[row, :length]
            logprobs[b] = (support[support_row, :length]  # type: ignore[index]
                           if wants_support else selected[row:row + 1])
        status_by_batch[b] = status
        support_row += wants_support
    output.next_token_sampling_mask_idx = masks
    output.next_token_sampling_logprobs = logprobs
    output.next_token_sampling_mask_status = status_by_batch
    output.sampling_mask_output = None
    return True


def sampling_mask_refusal(req: Any, cap: int) -> str | None:
    """Why the scheduler refuses a request that asks for sampling masks,
    given its normalised SamplingParams (top_k -1 is SGLang's TOP_K_ALL),
    or None to admit it. ``cap`` is --sampling-mask-max-tokens. The rule
    is ``shmask.admission.sampling_mask_refusal`` (the example server's
    too), with this server's SHMASK_CAPTURE and SHMASK_PAST_CAP (a PD
    prefill server: "status", ``_past_cap``)."""
    params = req.sampling_params
    return admission.sampling_mask_refusal(
        top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, cap=cap,
        vocab=getattr(req, "vocab_size", None), capture=_settings().capture,
        past_cap=_past_cap())


def _agree_on_statuses(sampler: Any, statuses: torch.Tensor) -> None:
    """Every replica makes the same abort decision: the worst status of
    each row over the TP group, then the CP group (as released SGLang)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    for group in (sampler.tp_sync_group, sampler.cp_sync_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(statuses, op=dist.ReduceOp.MAX, group=group)

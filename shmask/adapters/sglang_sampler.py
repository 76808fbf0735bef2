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
  opted-in rows with the drawn tokens (``overflow="status"``,
  ``max_tokens`` = ``--sampling-mask-max-tokens``) and
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

``SHMASK_CAPTURE=engine`` keeps SGLang's own capture (``pending_capture``
returns None). Greedy batches keep SGLang's own builder (one id per row, no
capture to do), and so do devices the kernels do not run on.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from ..config import Config

__all__ = ["FixedRows", "ShmaskCapture", "fixed_capture", "pending_capture",
           "sampling_mask_output"]


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


class FixedRows(NamedTuple):
    """The opted-in rows as SGLang's fixed-capacity tensors (R rows)."""

    token_ids: torch.Tensor  # int32 [R, cap]
    lengths: torch.Tensor  # int32 [R]; 0 unless OK
    selected_logprobs: torch.Tensor  # float32 [R]
    support_logprobs: torch.Tensor  # float32 [R, cap]
    statuses: torch.Tensor  # int32 [R]: 0 OK, 1 OVERFLOW, 2 INVALID


def fixed_capture(probs: torch.Tensor, tokens: torch.Tensor, info: Any, *, order: str,
                  max_tokens: int, row_order: str) -> FixedRows:
    """shmask's capture of the rows ``info.sampling_mask_batch_indices`` of
    ``probs`` (with the drawn ``tokens``), laid out as SGLang lays out its
    own: the kernels' part of :func:`sampling_mask_output`, which needs
    nothing of SGLang (benchmarks/sglang_capture.py runs it on the H200)."""
    from shmask.kernels import capture
    from shmask.kernels.fixed_rows import fixed_rows

    batch_rows = info.sampling_mask_batch_indices
    batch, vocab = probs.shape
    opted = None
    if batch_rows.numel() != batch:
        opted = torch.zeros(batch, dtype=torch.bool, device=probs.device)
        opted.index_fill_(0, batch_rows, True)
    rows = capture(
        probs, tokens,
        top_k=info.top_ks if info.need_top_k_sampling else None,
        top_p=info.top_ps if info.need_top_p_sampling else None,
        min_p=info.min_ps if info.need_min_p_sampling else None,
        max_tokens=max_tokens, order=order, rows=opted, overflow="status")
    ids, values, lengths = fixed_rows(rows, probs, batch_rows, min(max_tokens, vocab), row_order)
    assert rows.selected_logprob is not None  # capture() always sets it
    return FixedRows(ids, lengths, rows.selected_logprob.index_select(0, batch_rows), values,
                     rows.status.index_select(0, batch_rows))


def sampling_mask_output(sampler: Any, batch_next_token_ids: torch.Tensor,
                         pending: ShmaskCapture, support_capture_indices: Any) -> Any:
    """The released ``SamplingMaskOutput`` of the opted-in rows, from
    shmask's capture of ``pending`` with the final drawn tokens."""
    from sglang.srt.layers.logits_processor import SamplingMaskOutput

    fixed = fixed_capture(pending.probs, batch_next_token_ids, pending.sampling_info,
                          order=pending.order, max_tokens=int(sampler.sampling_mask_max_tokens),
                          row_order=_settings().row_order)
    _agree_on_statuses(sampler, fixed.statuses)
    return SamplingMaskOutput(
        token_ids=fixed.token_ids,
        lengths=fixed.lengths,
        selected_logprobs=fixed.selected_logprobs,
        support_logprobs=(None if support_capture_indices is None
                          else fixed.support_logprobs.index_select(0, support_capture_indices)),
        statuses=fixed.statuses,
    )


def _agree_on_statuses(sampler: Any, statuses: torch.Tensor) -> None:
    """Every replica makes the same abort decision: the worst status of
    each row over the TP group, then the CP group (as released SGLang)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    for group in (sampler.tp_sync_group, sampler.cp_sync_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(statuses, op=dist.ReduceOp.MAX, group=group)

"""Sample with capture: draw each row's token and capture its support from the
same thresholds in the same kernel, so the two can never disagree.

The draw (device code in kernels/sample_draw.py, run by capture's resolve
stage) gives each id of the support of :func:`.capture.capture`'s semantics
the probability ``w_i / Z``, in one of two ways by the row's kind:

* a row whose support lies among its candidates (top-k rows, peaked
  top-p rows): an exponential race (equivalent to Gumbel-max), token =
  argmax ``w_i / E_i`` with ``E_i = -log(u_i)`` and ``u_i`` component ``i mod
  4`` of Philox4x32-10 at (``seeds[b]``, ``i div 4``);
* a window row (a top-p-only or min-p-only support of thousands of ids,
  its candidates only the ids around its cutoff): inverse transform, one
  53-bit uniform of Philox at (``seeds[b]``, 2^30) placed in the support's
  mass laid out as the bracket's ids at or above the cutoff, then each
  chunk's ids above the bracket, ascending.

Either way the token depends only on the row's seed, its probabilities and
its settings, not on the batch around it. Use a new seed per step (for
example a hash of request seed and step). Greedy rows take the smallest id
among the maxima. Tokens of INVALID rows are -1.

The torch reference draws from ``torch.Generator`` streams, so it matches the
kernel in distribution, not draw by draw.
"""

from __future__ import annotations

from typing import Any

import torch

from .capture import reference_capture, reference_support, run_capture
from .checks import check_matrix, per_row
from .rows import Rows, Status

__all__ = ["reference_sample", "sample"]


def sample(
    probs: torch.Tensor,
    seeds: torch.Tensor | int,
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
    """Sampled tokens (``Rows.tokens`` int32[B]) and their captured support.

    Arguments as :func:`.capture.capture`, with ``seeds`` int64[B] (or one
    int for every row) in place of ``sampled``. Every row is sampled; ``rows``
    only chooses which supports are materialised; ``into`` publishes them.
    """
    return run_capture(probs, sampled=None, seeds=seeds, top_k=top_k, top_p=top_p,
                       min_p=min_p, max_tokens=max_tokens, order=order, rows=rows,
                       greedy=greedy, overflow=overflow, into=into)


def reference_sample(
    probs: torch.Tensor,
    seeds: torch.Tensor | int,
    *,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    max_tokens: int,
    order: str = "joint",
    rows: torch.Tensor | None = None,
    greedy: torch.Tensor | bool | None = None,
    overflow: str = "exact",
) -> Rows:
    """Plain-torch sample with capture: an exponential race per row on a
    ``torch.Generator`` seeded with the row's seed (CPU streams)."""
    probs = check_matrix(probs, "probs")
    batch, vocab = probs.shape
    seeds = per_row(seeds, batch, torch.int64, torch.device("cpu"), "seeds", 0)
    is_greedy = per_row(greedy, batch, torch.bool, torch.device("cpu"), "greedy", False)
    support, bad, w = reference_support(probs, top_k, top_p, min_p, order)
    w = w.cpu()
    support = support.cpu()
    tokens = torch.empty(batch, dtype=torch.int64)
    for b in range(batch):
        gen = torch.Generator().manual_seed(int(seeds[b]))
        race = torch.empty(vocab).exponential_(generator=gen)
        if is_greedy[b]:
            tokens[b] = int(torch.argmax(w[b]))  # first maximum
        else:
            score = torch.where(support[b], w[b] / race, -1.0)
            tokens[b] = int(torch.argmax(score)) if support[b].any() else -1
    result = reference_capture(probs, tokens.to(probs.device), top_k=top_k, top_p=top_p,
                               min_p=min_p, max_tokens=max_tokens, order=order, rows=rows,
                               greedy=greedy, overflow=overflow)
    tokens = torch.where(result.status == Status.INVALID, -1, tokens.to(probs.device))
    result.tokens = tokens.to(torch.int32)
    return result

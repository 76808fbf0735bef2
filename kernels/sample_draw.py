"""Sample's device code: the draw that resolve makes for :func:`.sample.sample`
(the resolve kernel compiled with SAMPLE, kernels/capture_resolve.py), and
the window draw, the same race over a window row's support (its
candidates are only the ids around its cutoff), made by the window write
in its one read of the row (``_race_part``), and the tokens it drew.

An exponential race (equivalent to Gumbel-max): over the row's support,
token = argmax ``w_i / E_i`` with ``E_i = -log(u_i)`` and ``u_i`` component
``i mod 4`` of Philox4x32-10 at (seed, ``i div 4``) (:func:`_uniforms`):
one log an id, one Philox evaluation for four consecutive ids where a
whole row is raced (the window draw), and the token depends only on the
row's seed, probabilities and settings, never on the batch. It lives
apart from sample.py, which launches through capture's stages, so that
resolve can import it without an import cycle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .capture_workspace import CaptureWorkspace
from .float_bits import INF_KEY, log_any
from .launch import after_previous, launch, launch_options


@triton.jit
def _uniforms(seed, ids):
    """u_i for each id: component i mod 4 of Philox4x32-10 at (seed, i div 4).
    Philox computes four 32-bit words at once; an id takes its own, so four
    consecutive ids cost one evaluation (the window draw's tile) and every
    path draws the same u for an id."""
    u0, u1, u2, u3 = tl.rand4x(seed, ids // 4)
    lane = ids % 4
    return tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))


@triton.jit
def _draw(v, ids, live, hit, seed, rowmax, vocab, best_score, best_id, first_id):
    """One block of the sampler's draw (ids ascending, after the blocks
    before): the exponential race's best score and id so far, and the
    smallest id at the row's max (greedy)."""
    score = tl.where(hit, v / -tl.log(_uniforms(seed, ids)), float("-inf"))
    block_best = tl.max(score, axis=0)
    block_id = tl.min(tl.where(score == block_best, ids, vocab), axis=0)
    # ids ascend: a later block's tie never beats an earlier id
    best_id = tl.where(block_best > best_score, block_id, best_id)
    best_score = tl.maximum(best_score, block_best)
    # greedy: the smallest id among the maxima (all of them are candidates)
    first_id = tl.minimum(first_id, tl.min(tl.where(live & (v == rowmax), ids, vocab), axis=0))
    return best_score, best_id, first_id


def launch_drawn_tokens(probs: torch.Tensor, ws: CaptureWorkspace, tokens: torch.Tensor,
                        selected: torch.Tensor, pdl: bool) -> None:
    """_drawn_tokens_kernel over the rows, after the window write raced over
    the rows resolve marked in ws.draw (sample's window rows): each one's
    token and selected logprob from the race's best in ws.best."""
    batch, vocab = probs.shape
    launch(_drawn_tokens_kernel, (batch,),
        ws.draw, ws.best, probs, probs.stride(0), vocab, ws.logz, tokens, selected, PDL=pdl,
        num_warps=1, **launch_options(pdl),
    )


@triton.jit
def _race_part(probs_ptr, stride_row, vocab, row, start, cutoff, seed, SUB: tl.constexpr):
    """The exponential race of _draw over the support in columns [start,
    start + SUB) of row (window rows: every finite w at or above cutoff),
    the same score a column as _draw's, its best packed as ``score bits <<
    32 | 2^31 - 1 - id`` (0 where no column is in the support). Scores are
    >= 0, so their bits order as they do: an atomic max of packed bests
    keeps the largest score and the smallest id among equal ones, as the
    candidates' draw does."""
    # a tile row's four columns share one Philox evaluation only while
    # they are the four of one i div 4 (_uniforms): start and SUB whole quads
    tl.static_assert(SUB % 4 == 0)
    lane = tl.arange(0, 4)
    # a [SUB / 4, 4] tile: row j holds columns 4j .. 4j + 3, whose uniforms
    # are one Philox evaluation's four words (_uniforms)
    quad = start + 4 * tl.arange(0, SUB // 4)
    cols = quad[:, None] + lane[None, :]
    w = tl.load(probs_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=0.0).to(tl.float32)
    key = w.to(tl.int32, bitcast=True)
    # cutoff >= 1: no zero, no negative; +inf's bits and NaNs' excluded
    hit = (key >= cutoff) & (key < INF_KEY)
    u0, u1, u2, u3 = tl.rand4x(seed, quad // 4)
    u = tl.where(lane[None, :] == 0, u0[:, None],
                 tl.where(lane[None, :] == 1, u1[:, None],
                          tl.where(lane[None, :] == 2, u2[:, None], u3[:, None])))
    score = w / -tl.log(u)
    packed = ((score.to(tl.int32, bitcast=True).to(tl.int64) << 32)
              | (2147483647 - cols).to(tl.int64))
    return tl.max(tl.max(tl.where(hit, packed, 0), axis=1), axis=0)


@triton.jit
def _drawn_tokens_kernel(draw_ptr, best_ptr, probs_ptr, stride_row, vocab, logz_ptr, token_ptr,
                         selected_ptr, PDL: tl.constexpr):
    """Program b: a row the window write raced over gets its token (the
    best's id) and its selected logprob, log w_y - log Z as resolve takes
    it for every other row."""
    after_previous(PDL)
    row = tl.program_id(0)
    if tl.load(draw_ptr + row) != 0:
        token = (2147483647 - (tl.load(best_ptr + row) & 0xFFFFFFFF)).to(tl.int32)
        # (a drawn row has an id at or above its cutoff: the race's best is
        # one; the mask only keeps a load in the row whatever it holds)
        w_y = tl.load(probs_ptr + row.to(tl.int64) * stride_row + token,
                      mask=(token >= 0) & (token < vocab), other=0.0).to(tl.float32)
        tl.store(token_ptr + row, token)
        tl.store(selected_ptr + row, log_any(w_y) - tl.load(logz_ptr + row))

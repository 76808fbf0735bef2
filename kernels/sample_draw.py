"""Sample's device code: the draw that resolve makes for :func:`.sample.sample`
(the resolve kernel compiled with SAMPLE, kernels/capture_resolve.py), and
the window draw, the same race over a window row's support (its
candidates are only the ids around its cutoff) from one read of the row.

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

from . import tuning
from .capture_workspace import CaptureWorkspace
from .float_bits import INF_KEY
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


def launch_window_draw(probs: torch.Tensor, ws: CaptureWorkspace, seeds: torch.Tensor,
                       pdl: bool) -> None:
    """_window_draw_kernel over every (row, chunk), after resolve: ws.best
    of each row resolve marked in ws.draw (sample's window rows)."""
    batch, vocab = probs.shape
    launch(_window_draw_kernel, (batch, ws.n_chunks),
        probs, probs.stride(0), vocab, ws.draw, ws.cutoff, seeds, ws.best, CHUNK=tuning.CHUNK,
        SUB=tuning.WINDOW_WRITE_SUB, PDL=pdl, num_warps=tuning.WINDOW_WRITE_WARPS,
        **launch_options(pdl),
    )


@triton.jit
def _window_draw_kernel(
    probs_ptr, stride_row, vocab, draw_ptr, cutoff_ptr, seed_ptr, best_ptr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, c), sample's window rows only (their support reaches past
    their candidates): the exponential race of _draw over the support in
    columns [c*CHUNK, (c+1)*CHUNK) of row b, from one read, the same score
    a column as _draw's; the chunk's best (score, then the smallest id) is
    folded into the row's by one atomic max of ``score bits << 32 |
    2^31 - 1 - id`` (scores are >= 0, so their bits order as they do). The
    write kernel turns the row's best into its token."""
    # a tile row's four columns share one Philox evaluation only while
    # they are the four of one i div 4 (_uniforms): chunks and steps whole
    tl.static_assert(SUB % 4 == 0 and CHUNK % SUB == 0)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    after_previous(PDL)
    if tl.load(draw_ptr + row) != 0:
        cutoff = tl.load(cutoff_ptr + row)
        seed = tl.load(seed_ptr + row)
        best = tl.zeros([], dtype=tl.int64)
        lane = tl.arange(0, 4)
        for part in range(0, CHUNK // SUB):
            # a [SUB / 4, 4] tile: row j holds columns 4j .. 4j + 3, whose
            # uniforms are one Philox evaluation's four words (_uniforms)
            quad = chunk * CHUNK + part * SUB + 4 * tl.arange(0, SUB // 4)
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
            best = tl.maximum(best, tl.max(tl.max(tl.where(hit, packed, 0), axis=1), axis=0))
        if best != 0:
            tl.atomic_max(best_ptr + row, best)

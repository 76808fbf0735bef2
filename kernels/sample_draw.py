"""Sample's device code: the draw that resolve makes for :func:`.sample.sample`
(the resolve kernel compiled with SAMPLE, kernels/capture_resolve.py).

An exponential race (equivalent to Gumbel-max): over the row's support,
token = argmax ``w_i / E_i`` with ``E_i = -log(u_i)`` and ``u_i`` the Philox
uniform of (seed, i): one log a candidate, and the token depends only on
the row's seed, probabilities and settings, never on the batch. It lives
apart from sample.py, which launches through capture's stages, so that
resolve can import it without an import cycle.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _draw(v, ids, live, hit, seed, rowmax, vocab, best_score, best_id, first_id):
    """One block of the sampler's draw (ids ascending, after the blocks
    before): the exponential race's best score and id so far, and the
    smallest id at the row's max (greedy)."""
    score = tl.where(hit, v / -tl.log(tl.rand(seed, ids)), float("-inf"))
    block_best = tl.max(score, axis=0)
    block_id = tl.min(tl.where(score == block_best, ids, vocab), axis=0)
    # ids ascend: a later block's tie never beats an earlier id
    best_id = tl.where(block_best > best_score, block_id, best_id)
    best_score = tl.maximum(best_score, block_best)
    # greedy: the smallest id among the maxima (all of them are candidates)
    first_id = tl.minimum(first_id, tl.min(tl.where(live & (v == rowmax), ids, vocab), axis=0))
    return best_score, best_id, first_id

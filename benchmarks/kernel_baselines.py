"""Baselines for benchmarks/kernels.py.

``compact_one_program_per_row``: the one-program-per-row compaction design
that serving engines publish (one Triton program walks a whole row block by
block, keeping a running count, and writes ids into a padded [B, max_tokens]
buffer). Written here for comparison; it fills at most one program per row,
so at small B most of the chip idles and at any B each program streams a
608 KB row alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _one_program_per_row_kernel(
    x_ptr, stride_row, vocab, max_tokens, ids_ptr, lengths_ptr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    count = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=0.0)
        x = x.to(tl.float32)
        keep = inside & (x == x) & (tl.abs(x) < float("inf"))
        keep_i = keep.to(tl.int32)
        slot = count + tl.cumsum(keep_i, axis=0) - 1
        tl.store(ids_ptr + row.to(tl.int64) * max_tokens + slot, cols,
                 mask=keep & (slot < max_tokens))
        count += tl.sum(keep_i, axis=0)
    tl.store(lengths_ptr + row, count)


def compact_one_program_per_row(
    x: torch.Tensor, max_tokens: int, block: int = 4096, num_warps: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids [B, max_tokens] and lengths [B] (lengths may exceed max_tokens)."""
    batch, vocab = x.shape
    ids = torch.empty(batch, max_tokens, dtype=torch.int32, device=x.device)
    lengths = torch.empty(batch, dtype=torch.int32, device=x.device)
    _one_program_per_row_kernel[(batch,)](
        x, x.stride(0), vocab, max_tokens, ids, lengths, BLOCK=block, num_warps=num_warps
    )
    return ids, lengths

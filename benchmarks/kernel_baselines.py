"""Baselines for benchmarks/kernels.py and benchmarks/capture_bf16.py.

``read_once``: the floor of any pass over the logits, one read of them
(each program sums one chunk of a row), what mark's read alone costs.

``compact_one_program_per_row``: the one-program-per-row compaction design
that serving engines publish (one Triton program walks a whole row block by
block, keeping a running count, writes ids into a padded [B, max_tokens]
buffer and, so that a row wider than that stays exact, the row's
full-vocabulary bitmask). Written here for comparison; it fills at most one
program per row, so at small B most of the chip idles and at any B each
program streams a 608 KB row alone. It gathers no values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _one_program_per_row_kernel(
    x_ptr, stride_row, vocab, n_words, max_tokens, ids_ptr, words_ptr, lengths_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    count = tl.zeros([], dtype=tl.int32)
    bit = tl.arange(0, 32)
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
        words = tl.sum(tl.reshape(keep_i, [BLOCK // 32, 32]) << bit[None, :], axis=1)
        word_idx = start // 32 + tl.arange(0, BLOCK // 32)
        tl.store(words_ptr + row.to(tl.int64) * n_words + word_idx, words,
                 mask=word_idx < n_words)
        count += tl.sum(keep_i, axis=0)
    tl.store(lengths_ptr + row, count)


def compact_one_program_per_row(
    x: torch.Tensor, max_tokens: int, block: int = 4096, num_warps: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids [B, max_tokens], bitmask words [B, ceil(V / 32)] and
    lengths [B] (lengths may exceed max_tokens: then the words are the row)."""
    batch, vocab = x.shape
    n_words = triton.cdiv(vocab, 32)
    ids = torch.empty(batch, max_tokens, dtype=torch.int32, device=x.device)
    words = torch.empty(batch, n_words, dtype=torch.int32, device=x.device)
    lengths = torch.empty(batch, dtype=torch.int32, device=x.device)
    _one_program_per_row_kernel[(batch,)](
        x, x.stride(0), vocab, n_words, max_tokens, ids, words, lengths, BLOCK=block,
        num_warps=num_warps,
    )
    return ids, words, lengths


@triton.jit
def _read_kernel(x_ptr, stride_row, vocab, out_ptr, n_chunks, CHUNK: tl.constexpr):
    """Program (b, c) sums one chunk of row b: the read and nothing else."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab, other=0.0)
    tl.store(out_ptr + row * n_chunks + chunk, tl.sum(x, axis=0))


def read_once(x: torch.Tensor, out: torch.Tensor | None = None,
              chunk: int = 8192) -> torch.Tensor:
    """One read of x ([B, V]); `out` (B * ceil(V / chunk) floats) given, no
    allocation per call (as a CUDA graph of it needs)."""
    n_chunks = triton.cdiv(x.shape[1], chunk)
    if out is None:
        out = torch.empty(x.shape[0] * n_chunks, device=x.device)
    _read_kernel[(x.shape[0], n_chunks)](x, x.stride(0), x.shape[1], out, n_chunks,
                                         CHUNK=chunk, num_warps=4)
    return out


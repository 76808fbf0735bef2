"""Rows from an engine's fixed-capacity sampling masks: vLLM 0.33.0's
``SamplingMaskTensors`` (``token_ids[R, W]``: each row's first W kept ids,
ascending; ``packed_mask[R, ceil(V / 8)]``: every row's kept ids as bits,
LSB first; ``counts[R]``: each row's true support size) to shmask's
:class:`.rows.Rows`, on the device, so the engine's own compaction can be
published GPU-direct (kernels/direct.py) with no copy to the host and no
per-row slicing there (issue 36, shmask/adapters/vllm_worker.py).

Row r travels in shmask's form (:class:`.rows.Form`, with ``max_tokens``
= W): its ``counts[r]`` ascending ids from ``token_ids[r]`` while the row
fits there and ``32 L < V``, else its bitmask, whose words are the packed
bytes four at a time (little-endian: bit j of byte i is id ``8 i + j``,
bit ``8 i + j`` of word ``i // 4`` once four bytes make a word), bytes past
``ceil(V / 8)`` zero. Every row is OK (a row that sampled nothing this
step, vLLM's count 0, is an empty ids row, as vLLM's own ``tolists`` sends
it); the masks carry no values, so ``values`` is empty, every offset 0 and
``selected_logprob`` 0 (what the CPU path of the vLLM adapter sends).

One program per row: the exclusive scan of the rows' id words (each
program sums those of the rows before it: R is a batch, at most a few
thousand) gives its ``id_offsets``, then it copies its id data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_plan
from .launch import launch
from .rows import Form, Rows, Status, bitmask_words, empty_rows

__all__ = ["reference_rows_from_fixed", "rows_from_fixed"]

_BLOCK = 1024  # id words a program copies per loop iteration


def _checked(token_ids: torch.Tensor, packed_mask: torch.Tensor, counts: torch.Tensor,
             vocab: int) -> None:
    if type(vocab) is not int or vocab < 1:
        raise ValueError(f"vocab must be an int >= 1, got {vocab!r}")
    if token_ids.dim() != 2 or token_ids.dtype != torch.int32:
        raise ValueError(f"token_ids must be int32 [R, W], got {token_ids.dtype} "
                         f"{list(token_ids.shape)}")
    rows = token_ids.shape[0]
    packed_bytes = (vocab + 7) // 8
    if packed_mask.dim() != 2 or packed_mask.dtype != torch.uint8 or \
            list(packed_mask.shape) != [rows, packed_bytes]:
        raise ValueError(f"packed_mask must be uint8 [{rows}, {packed_bytes}] (ceil(vocab / 8) "
                         f"bytes a row), got {packed_mask.dtype} {list(packed_mask.shape)}")
    if counts.dim() != 1 or counts.dtype != torch.int32 or counts.numel() != rows:
        raise ValueError(f"counts must be int32 [{rows}], got {counts.dtype} "
                         f"{list(counts.shape)}")
    if rows > 1 and counts.stride(0) != 1:  # the kernel reads counts[r] at r
        raise ValueError(f"counts must be contiguous (stride 1), got stride {counts.stride(0)}")
    for name, tensor in (("token_ids", token_ids), ("packed_mask", packed_mask)):
        if tensor.shape[0] and tensor.shape[1] > 1 and tensor.stride(1) != 1:
            raise ValueError(f"{name}'s rows must be contiguous (stride 1), got "
                             f"strides {tensor.stride()}")
    if not (token_ids.device == packed_mask.device == counts.device):
        raise ValueError(f"token_ids, packed_mask and counts must share a device, got "
                         f"{token_ids.device}, {packed_mask.device}, {counts.device}")


def rows_from_fixed(token_ids: torch.Tensor, packed_mask: torch.Tensor, counts: torch.Tensor,
                    vocab: int) -> Rows:
    """``Rows`` (device, one launch, no sync) of an engine's fixed-capacity
    masks (module docstring). ``max_tokens`` of the result is W, the width
    of ``token_ids``: a row wider than W is a bitmask row. A count outside
    ``[0, V]`` makes its row INVALID (nothing written): the engine's counts
    are not trusted to index its matrices."""
    _checked(token_ids, packed_mask, counts, vocab)
    rows, width = token_ids.shape
    # An engine calls this every step: from the third call of a shape the
    # launch replays from a plan into result buffers kept per shape
    # (kernels/launch_plan.py, rows.empty_rows), one native launch of host
    # time instead of Triton's binding of 18 arguments.
    where = launch_plan.call_stream(token_ids) if rows else None
    result, buffers = empty_rows(rows, vocab, max(width, 1), "status", token_ids.device,
                                 selected=True, tokens=False, values=False, reuse=where)
    if not rows:
        result.offsets.zero_()
        result.id_offsets.zero_()
        return result

    def launches() -> None:
        launch(_rows_from_fixed_kernel, (rows,),
               token_ids, token_ids.stride(0), width, packed_mask, packed_mask.stride(0),
               counts, rows, vocab, result.offsets, result.id_offsets, result.lengths,
               result.status, result.sizes, result.forms, result.ids, result.selected_logprob,
               ROWS_BLOCK=triton.next_power_of_2(rows), BLOCK=_BLOCK, num_warps=4)

    if where is None:
        launches()
        return result
    slots = (token_ids, packed_mask, counts, *buffers[:2])
    addresses = launch_plan.pointers(slots)
    key = (*where, rows, width, vocab, token_ids.stride(0), packed_mask.stride(0),
           launch_plan.slots_key(addresses), launch_plan.tuning_state())
    _PLANS.launch(key, slots, addresses, where[1], launches)
    return result


_PLANS = launch_plan.Plans("rows_from_fixed")


@triton.jit
def _form_and_words(count, width, vocab):
    """(bitmask?, id words) of rows of ``count`` ids: shmask's form rule
    with max_tokens = width; a count outside [0, V] is INVALID (0 words)."""
    valid = (count >= 0) & (count <= vocab)
    bitmask = valid & ((count > width) | (count.to(tl.int64) * 32 >= vocab))
    n_words = tl.where(bitmask, (vocab + 31) // 32, tl.where(valid, count, 0))
    return valid, bitmask, n_words


@triton.jit
def _rows_from_fixed_kernel(
    token_ids_ptr, token_stride, width, packed_ptr, packed_stride, counts_ptr, n_rows, vocab,
    offsets_ptr, id_offsets_ptr, lengths_ptr, status_ptr, sizes_ptr, forms_ptr, ids_ptr,
    selected_ptr, ROWS_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    every = tl.arange(0, ROWS_BLOCK)
    all_counts = tl.load(counts_ptr + every, mask=every < n_rows, other=0)
    _, _, all_words = _form_and_words(all_counts, width, vocab)
    start = tl.sum(tl.where(every < r, all_words, 0), axis=0)
    count = tl.load(counts_ptr + r)
    valid, bitmask, n_words = _form_and_words(count, width, vocab)
    tl.store(id_offsets_ptr + r, start)
    tl.store(offsets_ptr + r, 0)
    if r == n_rows - 1:
        tl.store(id_offsets_ptr + n_rows, tl.sum(all_words, axis=0))
        tl.store(offsets_ptr + n_rows, 0)
    tl.store(lengths_ptr + r, tl.where(valid, count, 0))
    tl.store(sizes_ptr + r, tl.where(valid, count, 0))
    tl.store(status_ptr + r, tl.where(valid, 0, 2))  # Status.OK, Status.INVALID
    tl.store(forms_ptr + r, bitmask.to(tl.int32))  # Form.IDS 0, Form.BITMASK 1
    tl.store(selected_ptr + r, 0.0)
    offs = tl.arange(0, BLOCK)
    dest = ids_ptr + start.to(tl.int64)
    if bitmask:
        row = packed_ptr + r.to(tl.int64) * packed_stride
        n_bytes = (vocab + 7) // 8
        for w0 in range(0, n_words, BLOCK):
            w = w0 + offs
            word = tl.zeros([BLOCK], dtype=tl.int32)
            for i in tl.static_range(4):
                byte = 4 * w + i
                part = tl.load(row + byte, mask=(w < n_words) & (byte < n_bytes), other=0)
                word = word | (part.to(tl.int32) << (8 * i))
            tl.store(dest + w, word, mask=w < n_words)
    else:
        row_ids = token_ids_ptr + r.to(tl.int64) * token_stride
        for i0 in range(0, n_words, BLOCK):
            i = i0 + offs
            tl.store(dest + i, tl.load(row_ids + i, mask=i < n_words), mask=i < n_words)


def reference_rows_from_fixed(token_ids: torch.Tensor, packed_mask: torch.Tensor,
                              counts: torch.Tensor, vocab: int) -> Rows:
    """The same Rows in plain torch, row by row (tests)."""
    _checked(token_ids, packed_mask, counts, vocab)
    rows, width = token_ids.shape
    words = bitmask_words(vocab)
    id_data, lengths, status, forms = [], [], [], []
    for r in range(rows):
        count = int(counts[r])
        if not 0 <= count <= vocab:
            id_data.append(torch.zeros(0, dtype=torch.int32))
            lengths.append(0)
            status.append(int(Status.INVALID))
            forms.append(int(Form.IDS))
            continue
        lengths.append(count)
        status.append(int(Status.OK))
        if count > width or 32 * count >= vocab:
            padded = torch.zeros(4 * words, dtype=torch.uint8)
            padded[:packed_mask.shape[1]] = packed_mask[r].cpu()
            id_data.append(padded.view(torch.int32))  # little-endian bytes, as the GPU's
            forms.append(int(Form.BITMASK))
        else:
            id_data.append(token_ids[r, :count].cpu())
            forms.append(int(Form.IDS))
    sizes = torch.tensor(lengths, dtype=torch.int32)
    id_offsets = torch.zeros(rows + 1, dtype=torch.int32)
    id_offsets[1:] = torch.cumsum(sizes.new_tensor([d.numel() for d in id_data]), 0)
    ids = torch.cat(id_data) if id_data else torch.zeros(0, dtype=torch.int32)
    return Rows(torch.zeros(rows + 1, dtype=torch.int32), sizes.clone(),
                torch.tensor(status, dtype=torch.int32), sizes,
                torch.tensor(forms, dtype=torch.int32), id_offsets, ids,
                torch.empty(0, dtype=torch.float32), vocab,
                torch.zeros(rows, dtype=torch.float32), None, max_tokens=max(width, 1))

"""rows_from_fixed: an engine's fixed-capacity masks (vLLM 0.33.0's
SamplingMaskTensors layout: ids[R, W], packed bits [R, ceil(V/8)], counts)
to Rows on the device, against the torch reference and against the ids
the masks hold (a bitmask row decoded). Interpreter on the CPU; on CUDA
with SHMASK_TEST_GPU=1. vLLM's own kernel producing that layout is run in
tests/compat/test_vllm_gpu_publish.py."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from shmask.kernels import Form, Status, reference_rows_from_fixed, rows_from_fixed

DEVICE = "cuda" if os.environ.get("SHMASK_TEST_GPU") == "1" else "cpu"


def fixed_masks(supports: list[np.ndarray], width: int, vocab: int):
    """The layout vLLM's compaction kernel writes: the first `width` ids of
    each row (garbage past them), every row's bits LSB first, its count."""
    rows = len(supports)
    token_ids = torch.randint(-9, vocab + 9, (rows, width), dtype=torch.int32)
    bits = np.zeros((rows, vocab), np.uint8)
    for r, ids in enumerate(supports):
        token_ids[r, :min(width, ids.size)] = torch.from_numpy(ids[:width].astype(np.int32))
        bits[r, ids] = 1
    packed = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little"))
    counts = torch.tensor([ids.size for ids in supports], dtype=torch.int32)
    return token_ids.to(DEVICE), packed.to(DEVICE), counts.to(DEVICE)


def assert_rows_equal(got, want) -> None:
    for field in ("offsets", "lengths", "status", "sizes", "forms", "id_offsets"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field
    n = int(want.id_offsets[-1])
    assert torch.equal(got.ids[:n].cpu(), want.ids[:n].cpu())
    assert torch.equal(got.selected_logprob.cpu(), want.selected_logprob.cpu())
    assert got.vocab == want.vocab and got.max_tokens == want.max_tokens


@pytest.mark.parametrize("vocab,width", [(1000, 16), (3001, 64), (4099, 1), (777, 0)])
def test_rows_match_reference_and_masks(vocab: int, width: int) -> None:
    rng = np.random.default_rng(vocab + width)
    sizes = [0, 1, width, width + 1, 3, vocab // 32, vocab // 32 + 1, vocab // 3, vocab]
    supports = [np.sort(rng.choice(vocab, size=max(0, min(s, vocab)), replace=False))
                for s in sizes]
    token_ids, packed, counts = fixed_masks(supports, width, vocab)
    rows = rows_from_fixed(token_ids, packed, counts, vocab)
    assert_rows_equal(rows, reference_rows_from_fixed(token_ids, packed, counts, vocab))
    for r, ids in enumerate(supports):
        got, _ = rows.row(r)
        np.testing.assert_array_equal(got.cpu().numpy(), ids)
        bitmask = ids.size > width or 32 * ids.size >= vocab
        assert int(rows.forms[r]) == (Form.BITMASK if bitmask else Form.IDS)
        assert int(rows.status[r]) == Status.OK and int(rows.lengths[r]) == ids.size


def test_untrusted_counts_make_invalid_rows_only() -> None:
    vocab, width = 2000, 8
    supports = [np.array([3, 9]), np.arange(40), np.array([5])]
    token_ids, packed, counts = fixed_masks(supports, width, vocab)
    counts[0], counts[2] = -1, vocab + 1  # no index from them
    rows = rows_from_fixed(token_ids, packed, counts, vocab)
    assert rows.status.tolist() == [Status.INVALID, Status.OK, Status.INVALID]
    assert rows.lengths.tolist() == [0, 40, 0]
    assert rows.id_offsets.tolist() == [0, 0, 63, 63]  # ceil(2000 / 32) words for row 1
    np.testing.assert_array_equal(rows.row(1)[0].cpu().numpy(), np.arange(40))
    assert_rows_equal(rows, reference_rows_from_fixed(token_ids, packed, counts, vocab))


def test_bad_layouts_are_refused_with_the_field_named() -> None:
    token_ids, packed, counts = fixed_masks([np.array([1])], 4, 100)
    with pytest.raises(ValueError, match="packed_mask must be uint8 \\[1, 13\\]"):
        rows_from_fixed(token_ids, packed[:, :12], counts, 100)
    with pytest.raises(ValueError, match="token_ids must be int32"):
        rows_from_fixed(token_ids.long(), packed, counts, 100)
    with pytest.raises(ValueError, match="counts must be int32 \\[1\\]"):
        rows_from_fixed(token_ids, packed, counts.repeat(2), 100)
    with pytest.raises(ValueError, match="vocab must be an int >= 1"):
        rows_from_fixed(token_ids, packed, counts, 0)
    two_ids, two_packed, two_counts = fixed_masks([np.array([1]), np.array([2, 3])], 4, 100)
    with pytest.raises(ValueError, match="counts must be contiguous"):
        rows_from_fixed(two_ids, two_packed, two_counts.repeat_interleave(2)[::2], 100)


def test_no_rows() -> None:
    token_ids, packed, counts = fixed_masks([], 4, 100)
    rows = rows_from_fixed(token_ids, packed, counts, 100)
    assert rows.id_offsets.tolist() == [0] and rows.lengths.numel() == 0


def test_steps_of_one_shape_keep_each_result_while_it_is_held(monkeypatch) -> None:
    """An engine's steps: one shape, new masks each step, the last step's
    rows still held (the GPU-direct publisher keeps them until the next
    step) while the next are made. Results are kept per shape and reused
    once nothing holds them (on CUDA the launch also replays from a plan
    from the third call): no step's rows may change under their holder,
    and every step's rows are its own. On the CPU the call is made to look
    plannable, so the kept results are used there too (a plan needs
    compiled kernels: none is recorded, the launch takes Triton's path)."""
    from shmask.kernels import fixed_masks as module

    if DEVICE == "cpu":
        monkeypatch.setattr(module.launch_plan, "call_stream",
                            lambda tensor: ("cpu", 0, threading.get_ident()))
        monkeypatch.setattr(module._PLANS, "wants_recording", lambda key: False)
    vocab, width = 3001, 64
    replayed = module._PLANS.replayed
    previous = None
    addresses = []
    for step in range(6):
        rng = np.random.default_rng(step)
        sizes = rng.integers(0, vocab, 5).tolist() + [width, 2]
        supports = [np.sort(rng.choice(vocab, size=s, replace=False)) for s in sizes]
        masks = fixed_masks(supports, width, vocab)
        rows = rows_from_fixed(*masks, vocab)
        addresses.append(rows.ids.data_ptr())
        assert_rows_equal(rows, reference_rows_from_fixed(*masks, vocab))
        if previous is not None:  # made before this step, held through it: unchanged
            assert_rows_equal(*previous)
        previous = (rows, reference_rows_from_fixed(*masks, vocab))
        del rows
    # two results a shape, alternating: the one held is never handed out
    assert addresses[0::2] == [addresses[0]] * 3 and addresses[1::2] == [addresses[1]] * 3
    assert addresses[0] != addresses[1]
    if DEVICE == "cuda":
        assert module._PLANS.replayed - replayed >= 3

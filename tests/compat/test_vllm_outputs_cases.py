"""The transport cases of vLLM's sampling-mask tests (tests/v1/test_outputs.py:
to_nested_list, slicing several positions by request, supports of every size,
empty rows, request boundaries, the multi-row layout), re-stated here and run
through shmask: the scheduler's batch goes into the ring, each request's
slice crosses vLLM's real msgpack codec as a reference, and the frontend's
mask must equal what vLLM's own SamplingMaskLists gives for the same slice.
(Kernel-side cases, how the GPU computes a support, are not transport and
stay with vLLM.)"""

from __future__ import annotations

import numpy as np
import pytest
from _vllm_helpers import VOCAB, batch_masks, through_ipc
from vllm.v1.engine import EngineCoreOutput

import shmask
from shmask.adapters import vllm as shmask_vllm


@pytest.fixture
def wide(prefix):
    """Writer/reader accepting whole-vocabulary rows, as the adapter's
    defaults do (SHMASK_MAX_TOKENS unset)."""
    config = shmask.Config(ring_mb=8, name_prefix=prefix, max_tokens=shmask_vllm.VLLM_MAX_TOKENS)
    writer, reader = shmask.Writer(config), shmask.Reader(config)
    publisher = shmask_vllm.MaskPublisher(writer)
    yield publisher, shmask_vllm.MaskResolver(reader)
    publisher.close()
    reader.close()
    writer.close()


def transported(wide, masks, slices):
    """slices: (request index, positions). The frontend's masks."""
    publisher, resolver = wide
    step = publisher.publish_step(masks)
    outputs = [EngineCoreOutput(f"r{i}", [0] * n, new_sampling_mask=step.slice_request(i, n))
               for i, n in slices]
    received, _ = through_ipc(outputs)
    resolver.resolve_outputs(received)
    assert publisher.finish_step() == sum(
        1 for r in range(len(step)) if r not in dict(slices) and step.batch[r].kind == 1)
    return [o.new_sampling_mask for o in received]


def test_nested_list_of_two_positions_and_of_one(wide):
    masks = batch_masks([[10, 11, 12], [20, 21]], positions=[2])
    [got] = transported(wide, masks, [(0, 2)])
    assert got.to_nested_list() == [[10, 11, 12], [20, 21]]
    [single] = transported(wide, batch_masks([[7, 9]]), [(0, 1)])
    assert single.offsets is None and single.to_nested_list() == [[7, 9]]


def test_slices_multiple_positions_by_request(wide):
    masks = batch_masks([[10, 11], [20], [30, 31, 32], [40]], positions=[1, 2, 1])
    single, multi, last = transported(wide, masks, [(0, 1), (1, 2), (2, 1)])
    assert single.to_nested_list() == [[10, 11]] and single.offsets is None
    assert multi.to_nested_list() == [[20], [30, 31, 32]]
    assert multi.cu_num_generated_tokens is None
    assert last.to_nested_list() == [[40]]


def test_supports_of_every_size(wide):
    """Empty, one, around 512, and the whole vocabulary: each row arrives as
    the ascending set the sampler kept."""
    rng = np.random.default_rng(0)
    sizes = [0, 1, 7, 511, 512, 513, 2053, VOCAB, 40, 3]
    rows = [np.sort(rng.choice(VOCAB, n, replace=False)).tolist() for n in sizes]
    got = transported(wide, batch_masks(rows), [(i, 1) for i in range(len(rows))])
    assert [m.to_nested_list()[0] for m in got] == rows


def test_request_boundaries_with_an_empty_row(wide):
    """A request that sampled nothing has an empty row between two others."""
    masks = batch_masks([[1, 3], [], [0, 7]])
    got = transported(wide, masks, [(0, 1), (1, 1), (2, 1)])
    assert [m.to_nested_list() for m in got] == [[[1, 3]], [[]], [[0, 7]]]


def test_multirow_layout_with_a_request_without_positions(wide):
    """cu_num_generated_tokens [0, 1, 3, 7, 7]: the last request sampled no
    token, is not sliced, and holds no ring record."""
    rows = [[0, 3, 7], [4, 7, 11], [5, 8, 12], [8, 11, 15], [9, 12, 0], [10, 13, 1], [11, 14, 2]]
    rows = [sorted(r) for r in rows]
    masks = batch_masks(rows, positions=[1, 2, 4, 0])
    slices = [(0, 1), (1, 2), (2, 4)]
    got = transported(wide, masks, slices)
    assert [p for m in got for p in m.to_nested_list()] == rows
    for mask, (i, n) in zip(got, slices, strict=True):
        assert mask.to_nested_list() == masks.slice_request(i, n).to_nested_list()

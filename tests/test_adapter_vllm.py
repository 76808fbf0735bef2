"""shmask.adapters.vllm without vLLM installed (tests/compat runs it against
the real vLLM): one step of masks published, sliced per request, resolved
over real shared memory."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import shmask
from shmask.adapters import vllm as shmask_vllm

Masks = shmask_vllm._MaskLists  # vLLM's SamplingMaskLists, field for field


def batch(rows, positions=None):
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.concatenate([np.asarray(r, np.int32) for r in rows] + [np.zeros(0, np.int32)])
    return Masks(ids, offsets, None if positions is None else np.cumsum([0, *positions]).tolist())


@pytest.fixture
def pair(writer, reader):
    publisher = shmask_vllm.MaskPublisher(writer, mask_lists=Masks)
    yield publisher, shmask_vllm.MaskResolver(reader, mask_lists=Masks)
    publisher.close()


def test_rows_come_back_bit_identical(pair):
    publisher, resolver = pair
    rng = np.random.default_rng(3)
    rows = [np.sort(rng.choice(151_936, n, replace=False)) for n in rng.integers(1, 400, 20)]
    step = publisher.publish_step(batch(rows))
    refs = [step.slice_request(i, 1) for i in range(20)]
    assert all(shmask_vllm.is_ref(r) and r.token_ids.nbytes < 200 for r in refs)
    for row, ref in zip(rows, refs, strict=True):
        got = resolver.resolve(ref)
        assert got.token_ids.dtype == np.int32 and got.offsets is None
        np.testing.assert_array_equal(got.token_ids, row)


def test_positions_trimmed_and_errors(pair):
    publisher, resolver = pair
    step = publisher.publish_step(batch([[1], [2, 3], [4], [5, 6, 7]], positions=[1, 3, 0]))
    assert resolver.resolve(step.slice_request(0, 1)).to_nested_list() == [[1]]
    two = resolver.resolve(step.slice_request(1, 2))  # the scheduler kept 2 of 3
    assert two.to_nested_list() == [[2, 3], [4]]
    np.testing.assert_array_equal(two.offsets, [0, 2, 3])
    with pytest.raises(shmask.InvalidRowsError):
        step.slice_request(1, 1)  # sliced already: a second ref would release twice
    with pytest.raises(shmask.InvalidRowsError):
        step.slice_request(2, 1)  # no position this step
    with pytest.raises(IndexError):
        step.slice_request(-1, 1)


def test_unclaimed_chunks_are_released_by_the_next_step(pair):
    publisher, resolver = pair
    first = publisher.publish_step(batch([[1], [2], [3]]))
    kept = first.slice_request(2, 1)
    publisher.publish_step(batch([[9]]))  # gives back requests 0 and 1 of the first step
    assert publisher.finish_step() == 1  # the second step's only request, never sliced
    assert resolver.resolve(kept).to_nested_list() == [[3]]
    with pytest.raises(shmask.ShmaskError):
        resolver.resolve(kept)  # released by the first resolve


def test_plain_masks_pass_through(pair):
    _, resolver = pair
    mask = Masks(np.array([5, 6], np.int32))
    assert not shmask_vllm.is_ref(mask) and resolver.resolve(mask) is mask
    assert resolver.resolve(None) is None


def test_adapter_defaults():
    config = shmask_vllm.adapter_config({})
    assert config.max_tokens == shmask_vllm.VLLM_MAX_TOKENS >= 151_936
    assert shmask_vllm.adapter_config({"SHMASK_MAX_TOKENS": "100"}).max_tokens == 100


def test_no_vllm_needed():
    assert "vllm" not in sys.modules

"""vLLM EngineCoreOutputs carrying shmask references, through vLLM's real
MsgpackEncoder/MsgpackDecoder (default, secure settings), over real shared
memory: every row bit-identical to the producer's, output equal to vLLM's
own `slice_request(...).to_nested_list()`."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from _vllm_helpers import batch_masks, random_rows, secure_ipc, through_ipc
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.outputs import SamplingMaskLists

import shmask
from shmask.adapters import vllm as shmask_vllm


@pytest.fixture
def publisher(writer):
    p = shmask_vllm.MaskPublisher(writer)
    yield p
    p.close()


@pytest.fixture
def resolver(reader):
    return shmask_vllm.MaskResolver(reader)


def outputs_for(step, positions):
    return [EngineCoreOutput(f"req-{i}", list(range(n)), new_sampling_mask=step.slice_request(i, n))
            for i, n in enumerate(positions)]


def assert_same_mask(got, want):
    """Bit-identical arrays and the same layout as vLLM's own slice."""
    assert type(got) is SamplingMaskLists
    assert got.token_ids.dtype == np.int32
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    if want.offsets is None:
        assert got.offsets is None
    else:
        np.testing.assert_array_equal(got.offsets, want.offsets)
    assert got.cu_num_generated_tokens is None
    assert got.to_nested_list() == want.to_nested_list()


def test_refs_round_trip_bit_identical(publisher, resolver):
    rng = np.random.default_rng(8)
    masks = batch_masks(random_rows(rng, 48, 1000))
    step = publisher.publish_step(masks)
    received, frames = through_ipc(outputs_for(step, [1] * 48))
    # Only references crossed: one frame, no out-of-band arrays, a fraction
    # of the rows' bytes (vLLM's own path sends 48 array frames).
    assert len(frames) == 1
    assert frames[0] * 10 < masks.token_ids.nbytes
    assert all(shmask_vllm.is_ref(o.new_sampling_mask) for o in received)
    resolver.resolve_outputs(received)
    for i, output in enumerate(received):
        assert_same_mask(output.new_sampling_mask, masks.slice_request(i, 1))


def test_speculative_steps_and_trimmed_positions(publisher, resolver):
    """Several positions per request (cu_num_generated_tokens), a request the
    scheduler trimmed to fewer positions (stop token), and one with none."""
    rng = np.random.default_rng(9)
    positions = [1, 3, 2, 4, 0, 1]
    masks = batch_masks(random_rows(rng, sum(positions), 300), positions)
    step = publisher.publish_step(masks)
    kept = [1, 3, 1, 2, 0, 1]  # request 2 keeps 1 of 2, request 3 keeps 2 of 4
    outputs = [EngineCoreOutput(f"req-{i}", list(range(n)),
                                new_sampling_mask=step.slice_request(i, n))
               for i, n in enumerate(kept) if n]
    received, _ = through_ipc(outputs)
    resolver.resolve_outputs(received)
    wanted = [masks.slice_request(i, n) for i, n in enumerate(kept) if n]
    for output, want in zip(received, wanted, strict=True):
        assert_same_mask(output.new_sampling_mask, want)
    with pytest.raises(shmask.InvalidRowsError):
        step.slice_request(4, 1)  # request 4 had no position this step


def test_one_output_at_a_time_matches_batched(publisher, resolver):
    rng = np.random.default_rng(10)
    masks = batch_masks(random_rows(rng, 8, 200))
    received, _ = through_ipc(outputs_for(publisher.publish_step(masks), [1] * 8))
    for i, output in enumerate(received):
        resolver.resolve_output(output)
        assert_same_mask(output.new_sampling_mask, masks.slice_request(i, 1))


def test_default_settings_refuse_other_objects():
    """The codec under test is the secure one: an object vLLM does not know
    (here a shmask RefBatch itself) is refused, so the references above
    passed only as a type vLLM serialises natively."""
    encoder, _ = secure_ipc()
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        encoder.encode(shmask.RefBatch.from_refs([]))


def test_inline_fallback_travels_out_of_band(prefix, resolver):
    """A full ring sends rows inside the reference; past vLLM's 256-byte
    inline threshold the array rides as an out-of-band frame, and decodes."""
    writer = shmask.Writer(shmask.Config(transport="inline", name_prefix=prefix))
    publisher = shmask_vllm.MaskPublisher(writer)
    try:
        rng = np.random.default_rng(11)
        masks = batch_masks(random_rows(rng, 6, 500))
        received, frames = through_ipc(outputs_for(publisher.publish_step(masks), [1] * 6))
        assert len(frames) == 7
        resolver.resolve_outputs(received)
        for i, output in enumerate(received):
            assert_same_mask(output.new_sampling_mask, masks.slice_request(i, 1))
    finally:
        publisher.close()
        writer.close()


def test_resolve_releases_the_record(publisher, resolver):
    masks = batch_masks([[1, 2, 3], [4, 5]])
    received, _ = through_ipc(outputs_for(publisher.publish_step(masks), [1, 1]))
    again = [EngineCoreOutput(o.request_id, o.new_token_ids,
                              new_sampling_mask=o.new_sampling_mask) for o in received]
    resolver.resolve_outputs(received)
    assert [o.new_sampling_mask.token_ids.tolist() for o in received] == [[1, 2, 3], [4, 5]]
    # Released once already: each output loses its mask (logged), nothing raises
    # out of vLLM's output handler.
    resolver.resolve_outputs(again)
    assert [o.new_sampling_mask for o in again] == [None, None]


def test_unclaimed_rows_are_given_back(publisher, writer):
    """Rows of requests the scheduler did not emit (a partial prefill's
    discarded sample) are released by the next step, not left to the lease."""
    masks = batch_masks([[1], [2], [3], [4]])
    step = publisher.publish_step(masks)
    step.slice_request(1, 1)
    step.slice_request(3, 1)
    assert publisher.finish_step() == 2
    assert publisher.finish_step() == 0


def _tracked_per_request(build, count: int) -> int:
    """GC-tracked objects kept alive per request by `build(n)` (rounded: a
    stray object of the interpreter is 1/count here, a per-request one 1)."""
    build(2 * count)  # warm up: the queue pool grows to the batch size once

    def tracked(n):
        gc.collect()
        before = len(gc.get_objects())
        kept = build(n)
        gc.collect()
        after = len(gc.get_objects())
        del kept
        return after - before
    return round((tracked(2 * count) - tracked(count)) / count)


def test_gc_neutral_per_request(prefix, resolver):
    """Per request, the adapter keeps exactly as many GC-tracked objects alive
    as vLLM's own path at the engine core, and no more at the frontend.
    (The queue pool is per batch slot, like vLLM's persistent batch, and is
    warmed up first.)"""
    writer = shmask.Writer(shmask.Config(ring_mb=16, name_prefix=prefix))
    publisher = shmask_vllm.MaskPublisher(writer)
    rows = random_rows(np.random.default_rng(12), 128, 64)

    def engine_side(own):
        def build(n):
            masks = batch_masks(rows[:n])
            step = masks if own else publisher.publish_step(masks)
            return [EngineCoreOutput(f"r{i}", [0], new_sampling_mask=step.slice_request(i, 1))
                    for i in range(n)]
        return build

    def frontend_side(own):
        def build(n):
            received, _ = through_ipc(engine_side(own)(n))
            resolver.resolve_outputs(received)
            return received
        return build

    try:
        # engine core: the output's token list and the mask tuple, either way
        own = _tracked_per_request(engine_side(True), 64)
        assert _tracked_per_request(engine_side(False), 64) == own == 2
        # frontend: vLLM's decoded arrays also keep a memoryview of the frame
        # alive; the resolved masks are plain copies, so never more than own
        own = _tracked_per_request(frontend_side(True), 64)
        assert _tracked_per_request(frontend_side(False), 64) == 2 <= own
        assert writer.stats.inline_chunks == 0
    finally:
        publisher.close()
        writer.close()


def test_batched_resolve_validates_every_entry(publisher, resolver):
    """The batched parse is not a shortcut around validation: a forged entry
    among good ones fails its own request (vLLM's FinishReason.ERROR and a
    RequestError naming the error), and only that one."""
    from vllm.outputs import RequestError
    from vllm.v1.engine import FinishReason

    masks = batch_masks([[1, 2], [3], [4, 5, 6]])
    received, _ = through_ipc(outputs_for(publisher.publish_step(masks), [1, 1, 1]))
    forged = bytearray(received[1].new_sampling_mask.token_ids.tobytes())
    forged[-shmask.refs.ENTRY_DTYPE.itemsize] = 7  # entry kind 7 does not exist
    received[1].new_sampling_mask = SamplingMaskLists(np.frombuffer(bytes(forged), np.uint8))
    assert resolver.resolve_outputs(received) == ["req-1"]
    assert received[1].new_sampling_mask is None
    assert received[1].finish_reason == FinishReason.ERROR
    assert isinstance(received[1].error, RequestError)
    assert "InvalidRefError" in received[1].error.message
    assert received[0].new_sampling_mask.to_nested_list() == [[1, 2]]
    assert received[2].new_sampling_mask.to_nested_list() == [[4, 5, 6]]
    assert received[0].finish_reason is None and received[2].error is None

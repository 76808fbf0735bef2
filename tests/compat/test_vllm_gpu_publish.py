"""vLLM's model runner publishing from the GPU (issue 36, item 5;
shmask/adapters/vllm_gpu.py): vLLM 0.33.0's own compaction kernel
(`SamplingMaskTensors.from_logits`, run here in Triton's interpreter on
CPU logits), the patched sampler's `published(...)`, the calls vLLM's
`AsyncOutput` makes on the result (`to_cpu_nonblocking()`, then
`tolists(num_sampled)` in `get_output`), the scheduler's `publish_step` and
`slice_request`, vLLM's msgpack codec and the frontend's `resolve_outputs`:
every request's mask equals what vLLM's own path (`tolists` on the same
tensors, sliced) delivers. The store kernel is shmask's real one, in the
interpreter, writing the real ring.

Not run here: vLLM's `AsyncOutput` itself (it makes CUDA streams and
events) and its `Sampler` (its sampling states need the model runner); the
patched sampler module is loaded from a patched copy and the call it makes
is checked in test_vllm_patch.py."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from _vllm_helpers import through_ipc
from shmask.kernels import publisher_for
from vllm.v1.engine import EngineCoreOutput

from shmask.adapters import vllm as shmask_vllm
from shmask.adapters import vllm_gpu


def _vllm_output_module():
    """vLLM's vllm/v1/worker/gpu/sample/output.py with its kernel a real
    Triton kernel (here: the interpreter, TRITON_INTERPRET=1 from
    tests/conftest.py). On a host with no GPU, vLLM's Triton check finds
    no active driver and swaps Triton for a placeholder, unless
    CUDA_VISIBLE_DEVICES is set and empty (its branch for Ray workers): the
    check is run again that way, and the modules that took the placeholder
    are loaded again. Nothing of vLLM's is replaced."""
    import vllm.triton_utils

    if not vllm.triton_utils.HAS_TRITON:
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            importlib.reload(importlib.import_module("vllm.triton_utils.importing"))
            importlib.reload(vllm.triton_utils)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        assert vllm.triton_utils.HAS_TRITON
    module = importlib.import_module("vllm.v1.worker.gpu.sample.output")
    if not hasattr(module._compact_sampling_mask_kernel, "__getitem__"):
        module = importlib.reload(module)
    assert hasattr(module._compact_sampling_mask_kernel, "__getitem__"), "not a Triton kernel"
    return module


SamplingMaskTensors = _vllm_output_module().SamplingMaskTensors

VOCAB = 3000  # the interpreter's size; every form still occurs (bitmask from 94 ids)


@pytest.fixture
def engine_core(writer, monkeypatch):
    """The engine core's publisher in this process, as start_engine_core
    makes it (a UniProcExecutor's model runner shares the process)."""
    publisher = shmask_vllm.MaskPublisher(writer)
    monkeypatch.setattr(shmask_vllm, "_publisher", publisher)
    yield publisher
    publisher.close()


def step_logits(rng: np.random.Generator, supports: list[int]) -> torch.Tensor:
    """Processed logits as vLLM's sampler masks them: -inf outside each row's support."""
    logits = torch.full((len(supports), VOCAB), float("-inf"))
    for r, size in enumerate(supports):
        ids = torch.from_numpy(rng.choice(VOCAB, size, replace=False))
        logits[r, ids] = torch.randn(size)
    return logits


def vllm_tensors(logits: torch.Tensor, num_sampled: list[int], max_num_kept: int):
    """vLLM's compaction, as its Sampler calls it (one logits row a request)."""
    requests = logits.shape[0]
    return SamplingMaskTensors.from_logits(
        logits, torch.arange(requests + 1, dtype=torch.int32),
        torch.tensor(num_sampled, dtype=torch.int32), max_num_kept)


def frontend_masks(step, num_sampled: list[int]) -> dict[str, list[list[int]]]:
    """The scheduler's slices of the requests that sampled, through vLLM's
    codec and the frontend's resolve."""
    outputs = [EngineCoreOutput(f"req-{i}", [7], new_sampling_mask=step.slice_request(i, 1))
               for i, n in enumerate(num_sampled) if n]
    received, _ = through_ipc(outputs)
    assert shmask_vllm.MaskResolver().resolve_outputs(received) == []
    return {o.request_id: o.new_sampling_mask.to_nested_list() for o in received}


def vllm_own(tensors, num_sampled: list[int]) -> dict[str, list[list[int]]]:
    lists = tensors.to_cpu_nonblocking().tolists()
    return {f"req-{i}": lists.slice_request(i, 1).to_nested_list()
            for i, n in enumerate(num_sampled) if n}


def test_rows_from_the_gpu_equal_vllms_own(engine_core):
    rng = np.random.default_rng(36)
    supports = [5, 1, 40, 200, 3000, 17, 64, 65]  # ids rows, bitmask rows (past 64, 32 L >= V)
    num_sampled = [1, 1, 0, 1, 1, 1, 1, 1]  # request 2 is a partial prefill: no row sliced
    tensors = vllm_tensors(step_logits(rng, supports), num_sampled, max_num_kept=64)
    step = vllm_gpu.published(tensors)
    assert isinstance(step, vllm_gpu.DeviceStep)
    assert publisher_for(engine_core.writer).stats["direct_steps"] == 1  # the store kernel
    # AsyncOutput's calls, then the scheduler's
    masks = step.to_cpu_nonblocking().tolists(np.array(num_sampled))
    assert shmask_vllm.publish_step(masks) is masks
    got = frontend_masks(masks, num_sampled)
    assert got == vllm_own(tensors, num_sampled)
    assert [len(got["req-4"][0]), len(got["req-7"][0])] == [3000, 65]
    # request 2's row was never sliced: the next step gives it back
    assert engine_core.finish_step() == 1


def test_async_scheduling_steps_never_share_queues(engine_core):
    """Step N+1 is sampled (and stored) before step N's output is processed:
    N is taken first, each step's masks are its own."""
    rng = np.random.default_rng(7)
    sampled = [1, 1, 1]
    first = vllm_tensors(step_logits(rng, [3, 90, 12]), sampled, 16)
    second = vllm_tensors(step_logits(rng, [4, 8, 120]), sampled, 16)
    step_n = vllm_gpu.published(first)
    step_next = vllm_gpu.published(second)  # before step N's get_output
    masks_n = step_n.tolists()
    assert frontend_masks(shmask_vllm.publish_step(masks_n), sampled) == vllm_own(first, sampled)
    masks_next = step_next.tolists()
    assert frontend_masks(shmask_vllm.publish_step(masks_next), sampled) == vllm_own(second,
                                                                                     sampled)
    assert engine_core.finish_step() == 0


def test_steps_it_does_not_take_keep_vllms_path(writer, monkeypatch):
    rng = np.random.default_rng(3)
    tensors = vllm_tensors(step_logits(rng, [3, 4]), [1, 1], 8)
    monkeypatch.setattr(shmask_vllm, "_publisher", None)  # a worker process of its own
    assert vllm_gpu.published(tensors) is tensors
    publisher = shmask_vllm.MaskPublisher(writer)
    monkeypatch.setattr(shmask_vllm, "_publisher", publisher)
    try:
        spec = tensors._replace(rows_per_request=2)  # speculative decoding's layout
        assert vllm_gpu.published(spec) is spec
        # vLLM's own lists still go through the engine core's CPU path
        step = shmask_vllm.publish_step(tensors.tolists())
        assert frontend_masks(step, [1, 1]) == vllm_own(tensors, [1, 1])
    finally:
        publisher.close()


def test_a_writer_without_gpu_direct_keeps_vllms_path(config, monkeypatch):
    import dataclasses

    import shmask

    writer = shmask.Writer(dataclasses.replace(config, gpu_direct="off"))
    publisher = shmask_vllm.MaskPublisher(writer)
    monkeypatch.setattr(shmask_vllm, "_publisher", publisher)
    try:
        tensors = vllm_tensors(step_logits(np.random.default_rng(1), [3]), [1], 8)
        assert vllm_gpu.published(tensors) is tensors
    finally:
        publisher.close()
        writer.close()


def test_a_full_ring_still_delivers_every_mask(engine_core):
    """Steps whose references are held (nothing resolved or released) fill
    the 1 MiB ring: rows the GPU cannot store divert to the CPU path, and
    past that ride inline in their references. Every request still gets
    vLLM's mask."""
    from shmask.refs import KIND_INLINE

    rng = np.random.default_rng(11)
    sampled = [1] * 8
    held = []
    for _ in range(24):
        tensors = vllm_tensors(step_logits(rng, [int(n) for n in rng.integers(1, 300, 8)]),
                               sampled, 64)
        step = vllm_gpu.published(tensors)
        assert isinstance(step, vllm_gpu.DeviceStep)
        masks = shmask_vllm.publish_step(step.tolists())
        outputs = [EngineCoreOutput(f"req-{i}", [7], new_sampling_mask=masks.slice_request(i, 1))
                   for i in range(8)]
        held.append((outputs, masks, vllm_own(tensors, sampled)))
    stats = publisher_for(engine_core.writer).stats
    inline = sum(int(np.sum(m.batch.entries["kind"] == KIND_INLINE)) for _, m, _ in held)
    # both fallbacks ran (else the test proves nothing)
    assert stats["diverted_rows"] > 0 and inline > 0, (stats, inline)
    resolver = shmask_vllm.MaskResolver()
    for outputs, _, want in held:
        received, _ = through_ipc(outputs)
        assert resolver.resolve_outputs(received) == []
        assert {o.request_id: o.new_sampling_mask.to_nested_list() for o in received} == want
    resolver.close()

"""vLLM's model runner publishing sampling masks from the GPU (issue 36,
item 5): no copy of the masks to the host, no per-row slicing there.

vLLM 0.33.0's sampler compacts each step's masks on the GPU
(``SamplingMaskTensors.from_logits``: ``token_ids[R, W]``, a packed
bitmask per row, ``counts[R]``); its ``AsyncOutput`` then copies all three
to the host (``to_cpu_nonblocking``) and ``tolists`` slices every row into
a CSR ``SamplingMaskLists`` that the scheduler slices again per request,
and that the engine core's ``publish_step`` then copies into the ring.

The patched sampler passes vLLM's own result through :func:`published`.
Where this process holds the engine core's publisher (vLLM's
``UniProcExecutor``, or ``external_launcher``: the model runner runs in the
engine core's process) and the step has one row per request, it returns a
:class:`DeviceStep` instead, which ``AsyncOutput`` handles like the tensors
it stands for:

* ``published``: one launch turns the tensors into shmask ``Rows`` on the
  device (kernels/fixed_masks.py, ``rows_from_fixed``), and the store
  kernel writes each request's row into its RowQueue in the ring
  (kernels/direct.py: one native call and one launch);
* ``to_cpu_nonblocking()``: itself (nothing to copy);
* ``tolists(...)``: the step's ``StepMasks`` (one ``take_batch``), which
  the scheduler's ``publish_step`` passes through and slices per request
  exactly as it slices a step it published itself.

The step is taken at the latest when the next step is published (the next
sampler call: its kernel ran before that sampler on the GPU, so the take
waits for nothing the GPU has not done) or when ``tolists`` asks, whichever
comes first, so two steps never share the queues even with vLLM's async
scheduling (the next step sampled before this one's output is processed).

Left on vLLM's own path, unchanged: speculative decoding (several rows a
request, from the rejection sampler), model runners in processes of their
own (``MultiprocExecutor``: tensor or pipeline parallel; each rank's
sampler runs, and the engine core's publisher is in another process), and
a writer without GPU-direct (no CUDA, ``SHMASK_GPU_DIRECT=off``, an inline
transport): there the rows come to the host as vLLM copies them and the
engine core publishes them (``publish_step``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..errors import ShmaskError
from ..writer import Writer

log = logging.getLogger("shmask")

# The widest compact row vLLM 0.33.0 makes (its MAX_COMPACT_SUPPORT); wider
# rows are bitmasks. The GPU-direct publisher gives each queue room for one
# row of this many ids, or a bitmask, before a step.
VLLM_COMPACT_WIDTH = 2048


def published(tensors: Any) -> Any:
    """vLLM's ``SamplingMaskTensors`` of one step, or a :class:`DeviceStep`
    standing for them once the GPU stores them into the ring (module
    docstring says when). A shmask error, or tensors it refuses (a
    ValueError naming the field), leave the step on vLLM's path, logged."""
    from . import vllm

    publisher = vllm._publisher  # the engine core's, where it shares this process
    if tensors is None or publisher is None or getattr(tensors, "rows_per_request", 1) != 1:
        return tensors
    try:
        direct = device_publisher(publisher.writer)
        if direct is None:
            return tensors  # no launch for a step that keeps vLLM's path
        from shmask.kernels import rows_from_fixed

        rows = rows_from_fixed(tensors.token_ids, tensors.packed_mask, tensors.counts,
                               int(tensors.vocab_size))
        return publisher.publish_device(direct, rows, tensors)
    except (ShmaskError, ValueError) as exc:
        log.error("sampling masks of this step left on vLLM's path: %s", exc)
        return tensors


def device_publisher(writer: Writer) -> Any:
    """The Writer's GPU-direct publisher (``kernels.publisher_for``, made
    with room for one compact row of vLLM's width a queue), or None where
    the GPU cannot store rows (no CUDA, SHMASK_GPU_DIRECT=off, an inline
    transport)."""
    from shmask.kernels import publisher_for

    publisher = publisher_for(writer, max_tokens=VLLM_COMPACT_WIDTH)
    return publisher if publisher.active else None


class DeviceStep:
    """One step's masks stored by the GPU; what ``AsyncOutput`` holds in
    place of vLLM's ``SamplingMaskTensors``."""

    __slots__ = ("_publisher", "_handles", "_tensors", "_masks")

    def __init__(self, publisher: Any, handles: np.ndarray, tensors: Any) -> None:
        self._publisher = publisher  # the engine core's MaskPublisher
        self._handles = handles.copy()
        self._tensors = tensors  # vLLM's, for its own path if the take fails
        self._masks: Any = None

    @property
    def rows_per_request(self) -> int:
        return 1

    def to_cpu_nonblocking(self) -> DeviceStep:
        """Nothing to copy: the rows are in the ring."""
        return self

    def take(self) -> Any:
        """The step's chunks as a StepMasks (once); vLLM's own lists if the
        take fails (copied from the device now: an error path)."""
        if self._masks is None:
            try:
                self._masks = self._publisher._step_of(self._handles)
            except ShmaskError as exc:
                log.error("sampling masks of this step sent without shmask: %s", exc)
                self._publisher._reset_queues()
                self._masks = self._tensors.to_cpu_nonblocking().tolists()
            self._tensors = None
        return self._masks

    def tolists(self, num_sampled_tokens: Any = None) -> Any:
        """What the scheduler receives as ``sampling_masks``: the StepMasks
        (``publish_step`` passes it through)."""
        if self._publisher._device_step is self:
            self._publisher._device_step = None
        return self.take()

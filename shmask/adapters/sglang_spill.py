"""SGLang's ``SamplingMaskOutput`` with the rows too long for its fixed
capacity (issue 36, item 2: top-p-only masks).

Released SGLang packs every captured row into ``[R, cap]`` matrices
(``cap`` = ``--sampling-mask-max-tokens``) and aborts a request whose row is
longer (OVERFLOW). A top-p-only row has no such bound: on a flat
distribution its nucleus holds tens of thousands of ids. With
``SHMASK_PAST_CAP=exact`` the patched sampler hands such rows on in a form
whose size the host knows before the GPU has run (so the copy to the host
needs no sync): a ``ceil(V / 32)``-word bitmask per candidate row (an
opted-in row whose ``top_k`` exceeds ``cap``) and, for support-mode
candidates, a row of V values. Their statuses in the released fields stay
OVERFLOW, so any code path that rebuilds a plain ``SamplingMaskOutput`` from
the released fields (pipeline parallelism sends them as a tensor dict)
aborts those requests as released rather than returning a partial row;
``shmask.adapters.sglang_sampler.materialize_spilled`` turns them into whole
rows.

This module imports SGLang; only the patched sampler (through
``sglang_sampler``) imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from sglang.srt.layers.logits_processor import SamplingMaskOutput

__all__ = ["SpilledSamplingMaskOutput"]


@dataclasses.dataclass
class SpilledSamplingMaskOutput(SamplingMaskOutput):
    """The released fields, plus the candidate rows past the capacity."""

    # positions among the opted-in rows (the released fields' row numbers)
    spill_rows: tuple[int, ...] = ()
    # per candidate: the row of spill_values holding its values, or -1
    spill_value_rows: tuple[int, ...] = ()
    spill_lengths: torch.Tensor | None = None  # int32 [C]; 0: not past the capacity
    spill_bits: torch.Tensor | None = None  # int32 [C, ceil(V / 32)]
    spill_values: torch.Tensor | None = None  # float32 [S, V]: support-mode candidates

    def map_device_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """SGLang's one hook for moving the output to the host (the
        overlap scheduler's copy); the spilled rows travel with the rest."""
        super().map_device_tensors(fn)
        if self.spill_lengths is not None:
            self.spill_lengths = fn(self.spill_lengths)
        if self.spill_bits is not None:
            self.spill_bits = fn(self.spill_bits)
        if self.spill_values is not None:
            self.spill_values = fn(self.spill_values)

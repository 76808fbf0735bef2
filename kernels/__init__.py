"""GPU kernels of shmask: exact compaction, sampler-native support capture,
sample with capture, admission, the host hand-off to the transport, and the
trainer's replay of a sampled support (replay_logprobs).

Each kernel module holds its Triton kernel(s) beside their launcher; each
public function sits beside a plain-torch reference of the same function
(docs/kernels.md lists the modules). Without CUDA the kernels run in Triton's
interpreter (unless ``TRITON_INTERPRET`` says otherwise); choosing it leaves
``os.environ`` as it was.

Needs the ``kernels`` extra (torch, triton); does not need the compiled
transport (``shmask._native``): ``publish`` takes any object with
``append_step``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import torch
except ImportError as exc:  # exercised in a subprocess by tests/test_packaging.py
    raise ImportError(
        f"shmask.kernels needs torch and triton ({exc}): pip install 'shmask[kernels]' "
        "(or install the torch build your serving engine pins first, then the extra)"
    ) from exc


def use_interpreter() -> bool:
    """Whether shmask's kernels run in Triton's interpreter: as
    TRITON_INTERPRET says when it is set, else when there is no CUDA device
    (CPU users, the tests)."""
    if "TRITON_INTERPRET" in os.environ:
        return os.environ["TRITON_INTERPRET"] == "1"
    return not torch.cuda.is_available()


@contextmanager
def _interpreter_scope() -> Iterator[None]:
    """Imports triton and the kernel modules in interpreter mode when
    use_interpreter() says so and the host has not chosen a mode already
    (TRITON_INTERPRET set, or triton imported).

    Triton's interpreter is a mode of the whole process: triton.language's
    own helpers (tl.sum...) are decorated at `import triton` and must be
    interpreted too, and Triton reads its `knobs.runtime.interpret` again
    at launch. The mode is kept in that knob (in the knob object itself:
    setattr would copy it into os.environ); TRITON_INTERPRET exists only
    while triton itself is imported, the one step that reads nothing else,
    and os.environ is then given back exactly as it was, so the host's
    child processes (a GPU worker spawned by a CPU-only front end) never
    inherit it."""
    if (not use_interpreter() or "TRITON_INTERPRET" in os.environ
            or "triton" in sys.modules):
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # triton < 3.4: its interpreter has no other switch
        raise ImportError("shmask.kernels without CUDA needs triton >= 3.4 (pip install "
                          "'shmask[kernels]'), or TRITON_INTERPRET=1 set before it is imported")
    runtime.__dict__["interpret"] = True
    yield


with _interpreter_scope():
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"shmask.kernels needs torch and triton ({exc}): "
                          "pip install 'shmask[kernels]'") from exc
    from .admission import check_admission
    from .capture import capture, reference_capture, top_p_within_rounding
    from .compact import compact, reference_compact
    from .direct import DirectPublisher, publish, publisher_for, reference_direct
    from .fixed_masks import reference_rows_from_fixed, rows_from_fixed
    from .host import HostRows, HostStaging
    from .replay import (
        ReplayOutput,
        reference_replay_logprobs,
        replay_forward,
        replay_logprobs,
        replay_logprobs_vocab_parallel,
    )
    from .rows import Form, Rows, Status
    from .sample import reference_sample, sample

__all__ = [
    "DirectPublisher",
    "Form",
    "HostRows",
    "HostStaging",
    "ReplayOutput",
    "Rows",
    "Status",
    "capture",
    "check_admission",
    "compact",
    "publish",
    "publisher_for",
    "reference_capture",
    "reference_compact",
    "reference_direct",
    "reference_replay_logprobs",
    "reference_rows_from_fixed",
    "reference_sample",
    "replay_forward",
    "replay_logprobs",
    "replay_logprobs_vocab_parallel",
    "rows_from_fixed",
    "sample",
    "top_p_within_rounding",
    "use_interpreter",
]

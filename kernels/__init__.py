"""GPU kernels of shmask: exact compaction, sampler-native support capture,
sample with capture, admission, and the host hand-off to the transport.

Each kernel module holds its Triton kernel(s), the launcher and a plain-torch
reference of the same function. Without CUDA the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1`` is set before triton is imported).
"""

from ._common import Rows, Status
from .admission import check_admission
from .capture import capture, reference_capture
from .compact import compact, reference_compact
from .host import HostRows, HostStaging, publish
from .sample import reference_sample, sample

__all__ = [
    "HostRows",
    "HostStaging",
    "Rows",
    "Status",
    "capture",
    "check_admission",
    "compact",
    "publish",
    "reference_capture",
    "reference_compact",
    "reference_sample",
    "sample",
]

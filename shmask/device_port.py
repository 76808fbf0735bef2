"""The seam between the Writer and GPU-direct publishing (shmask.kernels'
DirectPublisher): what each side may ask of the other, and nothing more.

The Writer implements :class:`DevicePort`; a publisher implements
:class:`DeviceAttachment` and attaches to a port. While one is attached the
GPU owns the queues' counts between steps, so the Writer runs every CPU
change of a queue inside the attachment's ``quiesced()`` (one mechanism in
writer.py). Both sides import this module and nothing private of the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .config import Config
    from .segment import Segment

__all__ = ["DeviceAttachment", "DevicePort"]


class DeviceAttachment(Protocol):
    """What the Writer calls on the publisher attached to it."""

    @property
    def quiet(self) -> bool:
        """True while the CPU owns the queues (inside ``quiesced()``)."""
        ...

    def quiesced(self) -> AbstractContextManager[None]:
        """Wait for the last kernel and append its diverted rows; the GPU
        stores nothing until the block ends."""
        ...

    def wait(self) -> None:
        """Block until the last step's rows are in the ring."""
        ...

    def close(self) -> None:
        """Wait for the last kernel, unregister memory, detach (idempotent)."""
        ...


class DevicePort(Protocol):
    """What a publisher may use of a Writer (``shmask.Writer`` is one)."""

    config: Config
    segment: Segment | None
    closed: bool

    @property
    def ring_handle(self) -> Any:
        """The native ``shm_ring *`` every ``shm_direct_*`` call takes. Only
        the C core writes through it."""
        ...

    @property
    def attached(self) -> DeviceAttachment | None:
        """The publisher storing rows into this ring now, if any."""
        ...

    def attach_direct(self, publisher: DeviceAttachment) -> None:
        """From now on every CPU change of a queue runs inside
        ``publisher.quiesced()``. Raises ValueError if one is attached."""
        ...

    def detach_direct(self, publisher: DeviceAttachment) -> None:
        """Undo :meth:`attach_direct` (and forget it as the default
        publisher); nothing if ``publisher`` is not the one attached."""
        ...

    @property
    def default_publisher(self) -> Any:
        """The publisher ``kernels.publisher_for`` gives for this Writer
        (None until the first); kept by the Writer so both are collected
        together."""
        ...

    @default_publisher.setter
    def default_publisher(self, publisher: Any) -> None: ...

    def append_step(self, queues: Sequence[Any] | np.ndarray, lengths: np.ndarray,
                    ids: np.ndarray, logprobs: np.ndarray,
                    selected_logprobs: np.ndarray | None = None, *,
                    status: np.ndarray | None = None, forms: np.ndarray | None = None,
                    vocab: int = 0) -> None: ...

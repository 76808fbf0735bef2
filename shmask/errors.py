"""Every error shmask raises derives from ShmaskError."""


class ShmaskError(Exception):
    """Base class of shmask errors."""


class ConfigError(ShmaskError, ValueError):
    """A SHMASK_* setting (or a Config field) is out of its accepted range."""


class SegmentError(ShmaskError, OSError):
    """A shared-memory segment could not be created, attached or validated."""


class InvalidRefError(ShmaskError, ValueError):
    """A reference (or the record it points at) is malformed or forged."""


class StaleChunkError(ShmaskError):
    """The chunk was reclaimed (lease ran out, producer gone) before it was read."""


class DoubleReleaseError(ShmaskError):
    """A chunk was released twice."""


class InvalidRowsError(ShmaskError, ValueError):
    """Rows handed to a Writer or RowQueue have the wrong shape, dtype or values."""


class RemoteChunkError(ShmaskError):
    """The chunk lives in the shared memory of another host (or of a
    container with its own /dev/shm): it must be forwarded inline."""


class RowDroppedError(ShmaskError):
    """A row's ids were not sent: the producer marked it OVERFLOW (support
    larger than its cap) or INVALID. `row` is its index in the chunk and
    `status` its status value (shmask.chunk.ROW_OVERFLOW, ROW_INVALID)."""

    def __init__(self, message: str, row: int, status: int) -> None:
        # Every argument goes to Exception.args, so the error pickles.
        super().__init__(message, row, status)
        self.row = row
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0])

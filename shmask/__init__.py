"""shmask: move LLM sampling masks between processes through POSIX shared
memory, with only small references crossing the sockets.

Producer (scheduler)::

    writer = shmask.Writer()                      # one ring per producer
    queue = writer.open_queue("support")          # one per request
    writer.append_step(handles, lengths, ids, logprobs) # every decode step (int64 handles)
    batch = writer.take_batch(queues)             # every emission: a RefBatch
    socket.send(batch.to_bytes())

Consumer (tokenizer)::

    reader = shmask.Reader()
    for ref in shmask.RefBatch.from_bytes(socket.recv()):
        with reader.open(ref) as chunk:
            ids, logprobs = chunk.to_lists()
"""

import importlib
import logging
from typing import TYPE_CHECKING, Any

from .config import Config
from .errors import (
    ConfigError,
    DoubleReleaseError,
    InvalidRefError,
    InvalidRowsError,
    RemoteChunkError,
    RowDroppedError,
    SegmentError,
    ShmaskError,
    StaleChunkError,
)
from .refs import ChunkRef, RefBatch, msgpack_ext_hook
from .refs import msgpack_enc_hook as _refs_msgpack_enc_hook


def msgpack_enc_hook(obj: Any) -> Any:
    """msgspec.msgpack enc_hook: RefBatch/ChunkRef travel as one ext object.
    Needs msgspec (the ``msgpack`` extra); without it the error says so."""
    try:
        return _refs_msgpack_enc_hook(obj)
    except ModuleNotFoundError as exc:
        if exc.name != "msgspec":
            raise
        raise ImportError(f"shmask.msgpack_enc_hook needs msgspec ({exc}): "
                          "pip install 'shmask[msgpack]'") from exc


# The transport's classes load the compiled core (shmask._native), so they are
# imported on first use: shmask.kernels, shmask.config and shmask.refs work
# where the core is not built (a GPU box that only runs the kernels).
_LAZY = {
    "Chunk": ".chunk",
    "Offload": ".offload",
    "Reader": ".reader",
    "ReaderStats": ".reader",
    "host_id": ".segment",
    "RowQueue": ".writer",
    "Writer": ".writer",
    "WriterStats": ".writer",
    "decode_rows": ".binary_rows",  # numpy only: a client decodes without the core
}

if TYPE_CHECKING:
    from .chunk import Chunk
    from .reader import Reader, ReaderStats
    from .segment import host_id
    from .writer import RowQueue, Writer, WriterStats


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

# The library convention: a NullHandler, and the host decides levels and handlers.
logging.getLogger("shmask").addHandler(logging.NullHandler())

__all__ = [
    "Chunk",
    "ChunkRef",
    "Config",
    "ConfigError",
    "DoubleReleaseError",
    "InvalidRefError",
    "InvalidRowsError",
    "Reader",
    "ReaderStats",
    "RefBatch",
    "RemoteChunkError",
    "RowDroppedError",
    "RowQueue",
    "SegmentError",
    "ShmaskError",
    "StaleChunkError",
    "Writer",
    "WriterStats",
    "decode_rows",
    "host_id",
    "msgpack_enc_hook",
    "msgpack_ext_hook",
]

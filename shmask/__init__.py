"""shmask: move LLM sampling masks between processes through POSIX shared
memory, with only small references crossing the sockets.

Producer (scheduler)::

    writer = shmask.Writer()                      # one ring per producer
    queue = writer.open_queue("support")          # one per request
    writer.append_step(slots, lengths, ids, logprobs)   # every decode step
    batch = writer.take_batch(queues)             # every emission: a RefBatch
    socket.send(batch.to_bytes())

Consumer (tokenizer)::

    reader = shmask.Reader()
    for ref in shmask.RefBatch.from_bytes(socket.recv()):
        with reader.open(ref) as chunk:
            ids, logprobs = chunk.to_lists()
"""

import logging

from .chunk import Chunk
from .config import Config
from .errors import (
    ConfigError,
    DoubleReleaseError,
    InvalidRefError,
    InvalidRowsError,
    RemoteChunkError,
    SegmentError,
    ShmaskError,
    StaleChunkError,
)
from .reader import Reader, ReaderStats
from .refs import ChunkRef, RefBatch, msgpack_enc_hook, msgpack_ext_hook
from .segment import host_id
from .writer import RowQueue, Writer, WriterStats

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
    "RowQueue",
    "SegmentError",
    "ShmaskError",
    "StaleChunkError",
    "Writer",
    "WriterStats",
    "host_id",
    "msgpack_enc_hook",
    "msgpack_ext_hook",
]

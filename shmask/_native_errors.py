"""Turns the native core's return codes into shmask exceptions."""

from __future__ import annotations

from ._native import lib
from .errors import (
    DoubleReleaseError,
    InvalidRefError,
    InvalidRowsError,
    ShmaskError,
    StaleChunkError,
)

_MESSAGES: dict[int, tuple[type[ShmaskError], str]] = {
    lib.SHM_E_TOO_BIG: (InvalidRowsError, "chunk is larger than the whole ring"),
    lib.SHM_E_BAD_HEADER: (InvalidRefError, "segment header is invalid"),
    lib.SHM_E_BAD_POSITION: (InvalidRefError, "position is outside the ring's live range"),
    lib.SHM_E_BAD_RECORD: (InvalidRefError, "record does not match the reference"),
    lib.SHM_E_STALE: (StaleChunkError, "chunk was reclaimed (lease expired) before it was read"),
    lib.SHM_E_DOUBLE_RELEASE: (DoubleReleaseError, "chunk was released already"),
    lib.SHM_E_NOT_WRITTEN: (InvalidRefError, "position does not hold a published chunk"),
    lib.SHM_E_BAD_LENGTHS: (InvalidRefError, "rows are malformed: a length negative or too "
                            "long, invalid flags, a bitmask that disagrees with its length, or "
                            "totals that do not match nnz and words"),
    lib.SHM_E_BAD_STATE: (ShmaskError, "record is not in the state this call needs"),
    lib.SHM_E_OVERFLOW: (InvalidRefError, "sizes overflow"),
    lib.SHM_E_WRONG_RECORD: (InvalidRefError, "the record at this position is not the one this "
                             "reference was issued for (its seal differs): a garbled or "
                             "misrouted reference"),
    lib.SHM_E_BAD_SLOT: (InvalidRowsError, "not the handle of an open RowQueue of this Writer "
                         "(closed, never opened, or another Writer's)"),
    lib.SHM_E_BAD_LENGTH: (InvalidRowsError, "row length is negative or longer than allowed"),
    lib.SHM_E_SOURCE_OVERRUN: (InvalidRowsError, "lengths run past the end of ids/logprobs"),
    lib.SHM_E_MODE: (InvalidRowsError, "selected-mode rows take one logprob per row: pass "
                     "logprobs of shape [B], or selected_logprobs= when the step mixes modes"),
    lib.SHM_E_MIXED_NEEDS_SELECTED: (InvalidRowsError, "the step mixes selected- and support-mode "
                                     "queues: pass selected_logprobs= ([B]) beside logprobs"),
    lib.SHM_E_NO_MEMORY: (InvalidRowsError, "no memory for the queue's buffer"),
    lib.SHM_E_TRUNCATED: (StaleChunkError, "the segment was truncated by another process"),
    lib.SHM_E_BAD_FLAGS: (InvalidRowsError, "row flags must be OK (optionally bitmask form), "
                          "OVERFLOW or INVALID"),
    lib.SHM_E_VOCAB: (InvalidRowsError, "a bitmask row needs vocab > 0, the same for every "
                      "bitmask row of a queue between takes"),
    lib.SHM_E_BAD_BITMASK: (InvalidRowsError, "a bitmask row's set bits must number its length "
                            "and name ids below vocab"),
    lib.SHM_E_NO_SLOT: (ShmaskError, "every RowQueue slot of this Writer (2^16) is open or "
                        "retired (a slot retires after 2^32 reopenings): close finished "
                        "RowQueues, or start another Writer"),
    lib.SHM_E_DIRECT_SLOT: (ShmaskError, "the queue's slot lies past the GPU-direct table"),
    lib.SHM_E_DIRECT_REPEAT: (ShmaskError, "a queue has more than one row in this step"),
    lib.SHM_E_DIRECT_COUNTS: (ShmaskError, "the GPU-direct table's counts went backwards or "
                              "past a capacity"),
    lib.SHM_E_DIRECT_LAUNCH: (ShmaskError, "the GPU-direct store kernel could not be launched "
                              "(no CUDA driver loaded, or an unexpected kernel signature)"),
    lib.SHM_E_LAUNCH_PLAN: (ShmaskError, "a kernel plan's launches were not made (no CUDA "
                            "driver loaded, or a plan whose parameters lie outside its bytes)"),
    lib.SHM_E_COPY_SKIPPED: (ShmaskError, "the chunk was not copied in its batch (open it on "
                             "its own)"),
    lib.SHM_E_ROW_DROPPED: (InvalidRowsError, "a kept row's status is not OK, so its ids were "
                            "not sent"),
}


def raise_for(rc: int, context: str) -> None:
    """Raise the exception for a negative return code; `context` says where."""
    kind, message = _MESSAGES.get(rc, (ShmaskError, f"native error {rc}"))
    raise kind(f"{context}: {message}")

"""A deterministic stand-in for a sampler: the support of token t of request
r is a pure function of (seed, r, t), so the consumer can check every row it
receives without any data travelling beside the transport.

Rows look like real top-k/top-p supports: ascending distinct token ids in a
151,936-entry vocabulary, a length between top_k/2 and top_k that varies per
row, and negative float32 logprobs (or one logprob per row, selected mode).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import logging
import os
import signal

import numpy as np

import shmask
import shmask.metrics

VOCAB = 151_936
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _hash(seed: int, requests: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = (np.uint64(seed) * _MIX) ^ (requests.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9))
        h ^= tokens.astype(np.uint64) * np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xD6E8FEB86837B1AB)
        h ^= h >> np.uint64(29)
    return h


def request_lengths(requests: np.ndarray, tokens: int) -> np.ndarray:
    """Output length of each request: they end at different steps, as real ones do."""
    return tokens - (requests % 7) * (tokens // 20)


def row_params(seed: int, top_k, requests: np.ndarray, tokens: np.ndarray):
    """Per row: length, first id, id step, logprob offset. top_k: one for
    every row, or one per row (a serving engine's requests each ask)."""
    h = _hash(seed, requests, tokens)
    k = np.asarray(top_k, dtype=np.uint64)
    lengths = (k - h % (k // np.uint64(2) + np.uint64(1))).astype(np.int32)
    steps = (1 + (h >> np.uint64(20)) % np.uint64(3)).astype(np.int64)
    span = np.maximum(VOCAB - lengths.astype(np.int64) * steps, 1)
    first = ((h >> np.uint64(24)).astype(np.int64) % span).astype(np.int64)
    offset = ((h >> np.uint64(40)) % np.uint64(1000)).astype(np.float32) / np.float32(100)
    return lengths, first, steps, offset


def step_rows(seed: int, top_k: int, requests: np.ndarray, token: int, mode: str):
    """One decode step's host buffers, as an engine has them: lengths [B],
    ids [B, top_k] padded, logprobs [B, top_k] (support) or [B] (selected)."""
    return rows_at(seed, top_k, requests, np.full(requests.shape, token, np.int64), mode, top_k)


def rows_at(seed: int, top_k, requests: np.ndarray, tokens: np.ndarray, mode: str, width: int):
    """Rows of requests each at its own token, top_k per row or one for
    all, padded to `width` columns (at least every row's top_k): a serving
    engine's step, whose requests arrived at different times."""
    lengths, first, steps, offset = row_params(seed, top_k, requests, tokens)
    column = np.arange(width, dtype=np.int64)
    ids = (first[:, None] + column[None, :] * steps[:, None]).astype(np.int32)
    ids[column[None, :] >= lengths[:, None]] = 0  # padding, never read
    if mode == "support":
        logprobs = -(offset[:, None] + column[None, :].astype(np.float32) * np.float32(0.001))
    else:
        logprobs = -offset
    return lengths, ids, logprobs.astype(np.float32)


def expected_chunk(seed: int, top_k: int, request: int, start: int, rows: int, mode: str):
    """CSR (lengths, ids, logprobs) of tokens [start, start + rows) of one request."""
    tokens = np.arange(start, start + rows, dtype=np.int64)
    lengths, first, steps, offset = row_params(seed, top_k, np.full(rows, request), tokens)
    row_of = np.repeat(np.arange(rows), lengths)
    starts = np.zeros(rows, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    within = np.arange(row_of.size, dtype=np.int64) - starts[row_of]
    ids = (first[row_of] + within * steps[row_of]).astype(np.int32)
    if mode == "support":
        logprobs = -(offset[row_of] + within.astype(np.float32) * np.float32(0.001))
    else:
        logprobs = -offset
    return lengths, ids, logprobs.astype(np.float32)


def configure() -> shmask.Config:
    """What a program embedding shmask does once at start: read SHMASK_*,
    route the library's log records somewhere, and apply SHMASK_LOG_LEVEL
    (the library itself never touches logging)."""
    config = shmask.Config.from_env()
    logging.basicConfig(format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s")
    config.apply_log_level()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") \
            and importlib.util.find_spec("prometheus_client") is not None:
        # prometheus_client's multiprocess mode (examples/server.py sets it
        # when prometheus_client is installed): every process of the
        # pipeline writes its shmask metrics there, the server exports them.
        shmask.metrics.enable()
    return config


def sampled_tokens(seed: int, top_k: int, request: int, start: int, rows: int) -> np.ndarray:
    """The token the engine sampled at tokens [start, start + rows) of one
    request: each row's first id, the most likely one (its support-mode
    logprob, -offset, is the row's largest and is the selected-mode value)."""
    tokens = np.arange(start, start + rows, dtype=np.int64)
    _, first, _, _ = row_params(seed, top_k, np.full(rows, request), tokens)
    return first.astype(np.int32)


def sampled_logprobs(seed: int, top_k: int, request: int, start: int, rows: int) -> np.ndarray:
    """The logprob of each sampled token (sampled_tokens'): its row's first
    and largest value, -offset, which a selected-mode row records."""
    tokens = np.arange(start, start + rows, dtype=np.int64)
    _, _, _, offset = row_params(seed, top_k, np.full(rows, request), tokens)
    return (-offset).astype(np.float32)


def request_for_prompt(prompt: str | list[int], requests: int, sampling_seed: int = 0) -> int:
    """Which of the engine's `requests` workloads (its distinct
    completions) answers a prompt (text or token ids): a stable hash of the
    prompt and the sampling seed, so the same prompt and seed get the same
    completion, and another seed likely another one."""
    data = b"text:" + prompt.encode() if isinstance(prompt, str) \
        else b"ids:" + ",".join(map(str, prompt)).encode()
    digest = hashlib.blake2b(data, digest_size=8, salt=sampling_seed.to_bytes(16, "little",
                                                                             signed=True))
    return int.from_bytes(digest.digest(), "little") % requests


def exit_with(parent_pid: int | None) -> None:
    """Have the kernel send this process SIGTERM when `parent_pid`, the
    process that started it, dies (Linux's PR_SET_PDEATHSIG): a child of
    the pipeline or the server never outlives it, even one killed outright
    (SIGKILL, the OOM killer), and SIGTERM's default action takes a
    producer's ring with it. None: run on its own, nothing to watch."""
    if parent_pid is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it died before the call above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def describe_exit(status: int) -> str:
    """A Popen returncode in words: "exited with status 1", "was killed by
    signal 9 (SIGKILL)"."""
    if status >= 0:
        return f"exited with status {status}"
    with contextlib.suppress(ValueError):  # a real-time signal has no name
        return f"was killed by signal {-status} ({signal.Signals(-status).name})"
    return f"was killed by signal {-status}"

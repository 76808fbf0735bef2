"""Shared fixtures. Every test gets its own segment-name prefix, and the
session fails if a test leaves a segment of that prefix in /dev/shm."""

from __future__ import annotations

import os
import secrets

# Kernels run under Triton's interpreter on machines without a GPU; set it
# before anything imports triton. SHMASK_TEST_GPU=1 runs them on CUDA.
if os.environ.get("SHMASK_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

import shmask

SESSION_PREFIX = "shmtest" + secrets.token_hex(3)


def leftover_segments(prefix: str = SESSION_PREFIX) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]


@pytest.fixture
def prefix() -> str:
    return SESSION_PREFIX


@pytest.fixture
def config(prefix: str) -> shmask.Config:
    """A small ring, so tests exercise wrap-around and the full policy."""
    return shmask.Config(ring_mb=1, name_prefix=prefix, full_wait_ms=20, lease_s=60)


@pytest.fixture
def writer(config: shmask.Config):
    w = shmask.Writer(config)
    yield w
    w.close()


@pytest.fixture
def reader(config: shmask.Config):
    r = shmask.Reader(config)
    yield r
    r.close()


@pytest.fixture(autouse=True, scope="session")
def no_segments_left():
    yield
    left = leftover_segments()
    for entry in left:  # clean up anyway, then fail loudly
        try:
            os.unlink(os.path.join("/dev/shm", entry))
        except OSError:
            pass
    assert not left, f"tests left shared-memory segments behind: {left}"


def random_chunk(rng: np.random.Generator, rows: int, max_len: int, mode: str = "support",
                 vocab: int = 151_936):
    """CSR rows with ascending distinct ids, like a sampler's support."""
    lengths = rng.integers(0, max_len + 1, rows).astype(np.int32)
    ids = np.concatenate(
        [np.sort(rng.choice(vocab, n, replace=False)) for n in lengths]
        or [np.zeros(0)]
    ).astype(np.int32)
    n_logprobs = ids.size if mode == "support" else rows
    logprobs = (np.log(rng.random(n_logprobs) + 1e-9)).astype(np.float32)
    return lengths, ids, logprobs


def assert_chunk_equal(chunk: shmask.Chunk, lengths, ids, logprobs) -> None:
    np.testing.assert_array_equal(chunk.lengths, lengths)
    np.testing.assert_array_equal(chunk.ids, ids)
    assert chunk.logprobs.dtype == np.float32
    np.testing.assert_array_equal(chunk.logprobs.view(np.uint32), np.asarray(logprobs).view(np.uint32))

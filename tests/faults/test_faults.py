"""The fault matrix of issue 7 (real processes, real /dev/shm, zmq where a
pipeline is needed). `make test` runs the short sizes; `make faults`
(SHMASK_FAULTS_FULL=1) the full ones: 1,000,000 soak chunks, 100,000
forged refs. The case logic lives in fault_cases.py, shared with
benchmarks/reliability.py; each test fails with every problem its case
recorded, so one run shows all that departs from the specification."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fault_cases import CASES, Result

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
# Each case bounds its own waits; this is the backstop for a hang in shmask.
TIMEOUT = 1800 if FULL else 180


def run(name: str, prefix: str) -> Result:
    result = CASES[name](prefix, FULL)
    print(result.report())  # the figure, shown with -s or on failure
    return result


def assert_clean(result: Result) -> None:
    assert not result.problems, result.report()


@pytest.mark.timeout(TIMEOUT)
def test_sigkill_producer_mid_stream(prefix):
    """Held views stay valid, new opens get a shmask error, the ring goes."""
    result = run("SIGKILL producer mid-stream", prefix)
    assert result.metrics.get("held", 0) > 0, "nothing was held when the producer died"
    assert_clean(result)


@pytest.mark.timeout(TIMEOUT)
def test_sigkill_consumer_holding_chunks(prefix):
    """The producer goes on; lease reclaim frees the space; stalls stay near FULL_WAIT."""
    result = run("SIGKILL consumer holding chunks", prefix)
    assert result.metrics.get("expired", 0) > 0
    assert_clean(result)


@pytest.mark.timeout(TIMEOUT)
def test_sigstop_consumer_past_lease(prefix):
    """After SIGCONT every held or late chunk raises StaleChunkError, never other rows."""
    result = run("SIGSTOP consumer past its lease", prefix)
    assert result.metrics.get("held", 0) > 0
    assert_clean(result)


@pytest.mark.timeout(TIMEOUT)
def test_soak(prefix):
    """Random sizes and release order, several consumers: 0 mismatches, RSS flat."""
    assert_clean(run("soak", prefix))


@pytest.mark.timeout(TIMEOUT)
def test_forged_refs(prefix):
    """Seeded forgeries in a child: 0 crashes, hangs, non-shmask errors, other rows."""
    result = run("forged refs", prefix)
    assert sum(result.metrics.get("counts", {}).values()) >= (100_000 if FULL else 5_000) - 10
    assert_clean(result)


@pytest.mark.timeout(TIMEOUT)
def test_truncated_segment(prefix):
    """Truncation under a reader and a writing producer: no SIGBUS, shmask errors only."""
    assert_clean(run("truncated segment", prefix))


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")
def test_another_uid(prefix):
    """nobody cannot open, list, collect, attach or lock root's ring; planted
    files neither break nor get deleted by someone who does not own them."""
    assert_clean(run("another uid", prefix))


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(os.geteuid() != 0, reason="a private tmpfs on /dev/shm needs root")
def test_dev_shm_too_small(prefix):
    """SegmentError naming SHMASK_RING_MB at creation, no SIGBUS, nothing left."""
    assert_clean(run("/dev/shm too small", prefix))


@pytest.mark.timeout(TIMEOUT)
def test_bad_config_values(prefix):
    """Every SHMASK_* variable, a few bad values each: ConfigError naming it at start."""
    assert_clean(run("bad SHMASK_* values", prefix))


@pytest.mark.timeout(TIMEOUT)
def test_fork_on_both_sides(prefix):
    """A forking producer keeps (and alone owns) its ring; a forking reader works on both sides."""
    assert_clean(run("fork on both sides", prefix))


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(os.geteuid() != 0, reason="unshare -p needs root")
def test_producer_in_another_pid_namespace(prefix):
    """gc, Writer() and Reader() keep a live namespaced producer's ring; gc removes it once dead."""
    assert_clean(run("producer in another PID namespace", prefix))


@pytest.mark.timeout(TIMEOUT)
def test_ring_being_created_is_not_collected(prefix):
    """A segment whose lifetime lock is held survives gc, whatever its header says."""
    assert_clean(run("ring being created (lifetime lock)", prefix))


def test_every_case_has_a_test():
    """A case added to fault_cases.py (or a cases_*.py module) without a test
    here or in a test_faults_*.py would never run in `make test`."""
    tests = "".join(path.read_text() for path in Path(__file__).parent.glob("test_faults*.py"))
    untested = [name for name, run_case in CASES.items() if f'"{name}"' not in tests
                and f"'{name}'" not in tests and f"{run_case.__name__}(" not in tests]
    assert not untested

"""Issue 33, the input-validation class: every public call that takes
indices, ids, sizes or settings refuses a value of the wrong type or range
with a clear error, and nothing is silently coerced. The table of (call,
bad value) lives in tests/api_walk.py, shared with the fault case "wrong-type
walk of the public API" (tests/faults/cases_api.py)."""

from __future__ import annotations

import api_walk
import pytest
from conftest import SESSION_PREFIX

PROBES = api_walk.probes()


@pytest.fixture(scope="module")
def walk_context():
    """One Writer, Reader and open chunk for the whole table (each probe that
    could change them gets fresh queues and batches)."""
    with api_walk.context(SESSION_PREFIX) as ctx:
        yield ctx


@pytest.mark.parametrize("probe", PROBES, ids=[f"{p.call} <- {p.value}" for p in PROBES])
def test_a_bad_value_is_refused_with_a_clear_error(walk_context, probe):
    outcome = api_walk.run_probe(walk_context, probe)
    assert outcome.verdict == "refused", f"{probe.call} <- {probe.value}: {outcome.detail}"


def test_the_table_walks_the_public_api():
    """Every name of shmask.__all__ that takes an argument a caller could
    get wrong is in the table (the exceptions, stats records and host_id
    take none)."""
    import shmask

    takes_nothing = {"ConfigError", "DoubleReleaseError", "InvalidRefError", "InvalidRowsError",
                     "RemoteChunkError", "RowDroppedError", "SegmentError", "ShmaskError",
                     "StaleChunkError", "ReaderStats", "WriterStats", "host_id"}
    calls = " ".join(p.call for p in PROBES)
    missing = [name for name in shmask.__all__ if name not in takes_nothing and name not in calls]
    assert not missing

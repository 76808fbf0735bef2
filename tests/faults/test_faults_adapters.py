"""The adapters' fault cases (tests/faults/cases_adapters.py): one reference
that cannot be read costs its own request, never another request's rows,
the message, or the process. Short sizes here; SHMASK_FAULTS_FULL=1 runs
the full ones."""

from __future__ import annotations

import os

import pytest
from cases_adapters import garbled_refs_through_adapters, tokenizer_behind_lease
from fault_cases import Result

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
TIMEOUT = 1800 if FULL else 180


def report(result: Result) -> Result:
    print(result.report())  # the figure, shown with -s or on failure
    return result


@pytest.mark.timeout(TIMEOUT)
def test_garbled_refs_through_both_adapters(prefix):
    """Every single-byte garble of real encoded references of live requests,
    and references swapped onto another live record of the same shape,
    through each adapter's consumer path in a child process: 0 other-request
    rows, 0 whole-message failures, 0 process deaths, the rest of the
    message unaffected."""
    result = report(garbled_refs_through_adapters(prefix, FULL))
    assert all(m["trials"] > 0 for m in result.metrics.values()), result.report()
    assert not result.problems, result.report()


@pytest.mark.timeout(TIMEOUT)
def test_tokenizer_falls_behind_its_lease_sglang_adapter(prefix):
    """A tokenizer process reading some messages after SHMASK_LEASE_S (their
    space reclaimed and reused) lives; only the late requests fail, with
    StaleChunkError; the on-time ones get their exact rows."""
    result = report(tokenizer_behind_lease(prefix, FULL))
    assert result.metrics.get("late", 0) > 0 and result.metrics.get("on_time", 0) > 0, \
        result.report()
    assert not result.problems, result.report()

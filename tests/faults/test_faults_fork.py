"""The fork-safety fault case (cases_fork.py, issue 33): `make test` runs
the short size, `make faults` (SHMASK_FAULTS_FULL=1) the full one."""

from __future__ import annotations

import os

import cases_fork  # noqa: F401 - registers its case in CASES
import pytest
from fault_cases import CASES

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
TIMEOUT = 1800 if FULL else 180


@pytest.mark.timeout(TIMEOUT)
def test_fork_at_random_points(prefix):
    """Children forked while threads make, close and attach rings: none
    hangs, each reads back its own rows, none holds a parent's ring lock."""
    result = CASES["fork at random points of the ring life cycle"](prefix, FULL)
    print(result.report())
    assert result.metrics.get("hangs") == 0, result.report()
    assert not result.problems, result.report()

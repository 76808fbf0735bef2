"""The lifecycle fault cases of issue 17 (cases_lifecycle.py): `make test`
runs the short sizes, `make faults` (SHMASK_FAULTS_FULL=1) the full ones."""

from __future__ import annotations

import os

import cases_lifecycle  # noqa: F401 - registers its cases in CASES
import pytest
from fault_cases import CASES

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
TIMEOUT = 1800 if FULL else 180


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_drain(prefix):
    """A producer that drains on SIGTERM (handler installed before or after
    its Writer) keeps its ring until it exits: a consumer started after the
    signal reads every row exactly. One that dies of SIGTERM's default action
    (Writer on the main thread or a worker thread) unlinks its ring."""
    result = CASES["SIGTERM drain"](prefix, FULL)
    print(result.report())
    assert result.metrics.get("rows_after_sigterm", 0) > 0, "nothing was published while draining"
    assert result.metrics.get("rows_lost", 1) == 0
    assert not result.problems, result.report()

"""Fault cases of the SIGBUS guard (cases_guard.py, issue 17): short sizes
in `make test`, full ones under SHMASK_FAULTS_FULL=1."""

from __future__ import annotations

import os

import cases_guard  # noqa: F401 - registers its cases
import pytest
from fault_cases import CASES

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
TIMEOUT = 1800 if FULL else 180  # the backstop; each case bounds its own waits


@pytest.mark.timeout(TIMEOUT)
def test_truncation_with_faulthandler_on(prefix):
    """Cut under processes with faulthandler on (before, after, behind the
    guard), also grown back: no process dies, only shmask errors, and no
    read of a whole-file cut returns rows."""
    result = CASES["truncation with faulthandler on"](prefix, FULL)
    print(result.report())
    assert result.metrics["deaths"] == 0, result.report()
    assert not result.problems, result.report()

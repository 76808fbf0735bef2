"""Fault case of issue 33 (cases_api.py): the wrong-type walk of the public
API, the same in `make test` and `make faults`."""

from __future__ import annotations

import os

import cases_api  # noqa: F401 - registers its case
import pytest
from fault_cases import CASES

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
TIMEOUT = 1800 if FULL else 180  # the backstop; the case bounds its own wait


@pytest.mark.timeout(TIMEOUT)
def test_wrong_type_walk_of_the_public_api(prefix):
    """Every (call, bad value) of tests/api_walk.py refused with a clear
    error in a child process: 0 silent coercions, 0 unclear errors, no crash."""
    result = CASES["wrong-type walk of the public API"](prefix, FULL)
    print(result.report())
    assert result.metrics.get("probes", 0) > 200, result.report()
    assert result.metrics["silent"] == 0 and result.metrics["unclear"] == 0, result.report()
    assert not result.problems, result.report()

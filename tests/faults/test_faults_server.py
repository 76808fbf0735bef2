"""The example server's fault case (cases_server.py, issue 33): `make test`
runs the short size, `make faults` (SHMASK_FAULTS_FULL=1) the full one."""

from __future__ import annotations

import os

import cases_server  # noqa: F401 - registers its case in CASES
import pytest
from fault_cases import CASES

FULL = os.environ.get("SHMASK_FAULTS_FULL") == "1"
TIMEOUT = 1800 if FULL else 180


@pytest.mark.timeout(TIMEOUT)
def test_engine_death_under_load(prefix):
    """An engine process SIGKILLed with requests pending: every one is
    answered with a 503 naming it within 1 s, /health turns 503, and the
    server exits 0 on SIGTERM leaving no ring behind."""
    result = CASES["engine death under load with the example server"](prefix, FULL)
    print(result.report())
    assert result.metrics.get("pending", 0) > 0
    assert result.metrics.get("errors") == result.metrics["pending"], result.report()
    assert not result.problems, result.report()

"""Fault cases of issue 17 (cases_trust.py): threads sharing a Reader."""

from __future__ import annotations

import pytest
from test_faults import TIMEOUT, assert_clean, run


@pytest.mark.timeout(TIMEOUT)
def test_threads_sharing_a_reader(prefix):
    """Threads of one tokenizer share a Reader: every ref opens its own rows."""
    result = run("threads sharing a Reader", prefix)
    assert result.metrics.get("opened", 0) > 0
    assert_clean(result)

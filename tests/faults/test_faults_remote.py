"""Fault cases of rows read from another host through NIXL (cases_remote.py):
two network namespaces, SGLang's adapter on each side."""

from __future__ import annotations

import cases_remote
import pytest
from test_faults import TIMEOUT, assert_clean, run

needs_nixl_hosts = pytest.mark.skipif(cases_remote.netns.nixl_unavailable() is not None,
                                      reason=cases_remote.netns.nixl_unavailable() or "")


@needs_nixl_hosts
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", ["remote: producer killed before the pull",
                                  "remote: link dropped mid-stream",
                                  "remote: agent unreachable",
                                  "remote: forged descriptors",
                                  "remote: records reused before the pull"])
def test_remote_fault_fails_only_the_requests_it_touches(name, prefix):
    result = run(name, prefix)
    assert result.metrics["failed"] > 0, result.report()
    assert_clean(result)

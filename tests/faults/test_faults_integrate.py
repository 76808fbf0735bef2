"""Fault case of issue 33 (cases_integrate.py): integrate on mixed trees of
both released engines; a sample in `make test`, every tree under
SHMASK_FAULTS_FULL=1."""

from __future__ import annotations

import importlib.util

import cases_integrate  # noqa: F401 - registers its case
import pytest
from test_faults import TIMEOUT, assert_clean, run

MISSING = [name for name in cases_integrate.ENGINES if importlib.util.find_spec(name) is None]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: `make test-compat` "
                                          "installs the released engines this case copies")
def test_integrate_on_mixed_trees(prefix):
    """Each mixed tree: --check names it (exit 1), --apply patches the rest,
    --revert unpatches the patched files; 0 false reports."""
    result = run("integrate on mixed trees", prefix)
    assert result.metrics["false_reports"] == 0, result.report()
    assert sum(result.metrics["trees"].values()) > 0, result.report()
    assert_clean(result)

"""The documents quote RESULTS.md's first table (benchmarks/figures.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import figures  # noqa: E402


def test_every_quoted_figure_is_in_results_first_table(capsys):
    assert figures.main() == 0, capsys.readouterr().out


def test_a_figure_that_differs_or_quotes_nothing_is_reported(tmp_path):
    rows = figures.table_rows(
        "## Where shmask stands now\n\n| area | measure | now |\n|---|---|---|\n"
        "| kernels | capture <!-- key: cap --> | 97.6 us; host 1,318 us |\n\n## History\n")
    assert rows["cap"].split() == ["capture", "97.6", "us;", "host", "1,318", "us"]
    readme = tmp_path / "README.md"
    readme.write_text("capture <!-- fig: cap -->97.6 us, host 1318 us<!-- /fig -->\n"
                      "rounded <!-- fig: cap -->97 us<!-- /fig -->\n"
                      "unknown <!-- fig: nope -->1 us<!-- /fig -->\n"
                      "bare 5.2 ms and `3.4x` in code\n")
    problems = figures.check([readme], rows, readme=readme)
    assert len(problems) == 3, problems
    assert ":2: 97 not in" in problems[0]
    assert ":3: no row" in problems[1] and "'nope'" in problems[1]
    assert ":4: '5.2 ms' is a figure" in problems[2]
    other = tmp_path / "other.md"  # not the README: only its spans are checked
    other.write_text("bare 5.2 ms\n")
    assert figures.check([other], rows, readme=readme) == []

"""The documents quote RESULTS.md (benchmarks/figures.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import figures  # noqa: E402

RESULTS = """# Benchmark results

## Where shmask stands now

| area | measure | now | goal: verdict |
|---|---|---|---|
| kernels | capture <!-- key: cap --> | 97.6 us; host 1,318 us | <= 120 us: met |

## History, newest first

- Transport (issue 4): 2026-11-29

## Transport (issue 4)

scheduler 0.60 ms per emission, pickled arrays 158 ms (265x); 338.0 us on H200.

### Part 1: per emission

detokenizer 0.24 ms.

## Kernels (issue 3)

mark 40.8 us.

## Kernels (issue 9)

expand 13.5 us.
"""


def _check(tmp_path: Path, name: str, text: str) -> list[str]:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return figures.check([path], figures.table_rows(RESULTS), figures.sections(RESULTS))


def test_the_repository_passes(capsys):
    assert figures.main() == 0, capsys.readouterr().out


def test_every_document_is_checked():
    paths = figures.documents()
    assert figures.ROOT / "README.md" in paths
    assert figures.ROOT / "docs" / "integrations" / "sglang.md" in paths
    assert figures.ROOT / "docs" / "kernels.md" in paths


def test_a_span_that_differs_or_quotes_nothing_is_reported(tmp_path):
    rows = figures.table_rows(RESULTS)
    assert rows["cap"].split() == ["capture", "97.6", "us;", "host", "1,318", "us", "<=", "120",
                                   "us:", "met"]
    problems = _check(tmp_path, "README.md",
                      "capture <!-- fig: cap -->97.6 us, host 1318 us, goal 120 us<!-- /fig -->\n"
                      "rounded <!-- fig: cap -->97 us<!-- /fig -->\n"
                      "unknown <!-- fig: nope -->1 us<!-- /fig -->\n"
                      "bare 5.2 ms and `3.4x` in code\n")
    assert len(problems) == 3, problems
    assert ":2: 97 not in RESULTS.md's row 'cap'" in problems[0]
    assert ":3: no row" in problems[1] and "'nope'" in problems[1]
    assert ":4: '5.2 ms' is a measured figure outside every span and record" in problems[2]


def test_a_figure_in_docs_outside_spans_and_records_fails(tmp_path):
    problems = _check(tmp_path, "docs/integrations/engine.md",
                      "# Engine\n\nthe step takes 14 ms and the copy 2.5x less;\n"
                      "a default of `5 s`, a ring of 1 GiB, 256 requests: not figures\n")
    assert len(problems) == 2, problems
    assert "engine.md:3: '14 ms' is a measured figure" in problems[0]
    assert "engine.md:3: '2.5x' is a measured figure" in problems[1]
    assert "<!-- record: SECTION -->" in problems[0]


def test_a_record_whose_numbers_are_in_its_section_passes(tmp_path):
    problems = _check(tmp_path, "docs/a.md",
                      "<!-- record: Transport (issue 4) -->scheduler 0.60 ms, 158 ms for arrays,\n"
                      "265x; 338 us on the H200 (`12.5 ms` in code)<!-- /record -->\n"
                      "<!-- record: transport-issue-4 -->0.24 ms<!-- /record -->\n"
                      "<!-- record: Part 1 -->0.24 ms<!-- /record -->\n"
                      "<!-- record: Kernels (issue 3) -->40.8 us, quoting <!-- fig: cap -->97.6 us"
                      "<!-- /fig --><!-- /record -->\n")
    assert problems == []


def test_a_record_figure_absent_from_its_section_fails(tmp_path):
    problems = _check(tmp_path, "docs/a.md",
                      "intro\n<!-- record: Kernels (issue 3) -->mark 40.8 us,\n"
                      "scan 2.8 us<!-- /record -->\n"
                      "<!-- record: Part 1 -->0.60 ms<!-- /record -->\n"
                      "<!-- record: Kernels (issue 3) --><!-- fig: cap -->97 us<!-- /fig -->"
                      "<!-- /record -->\n")
    assert len(problems) == 3, problems
    assert "docs/a.md:3: 2.8 not in RESULTS.md's section 'Kernels (issue 3)' (the record of " \
           "line 2)" in problems[0]
    # a ### section's text ends at the next heading: 0.60 is its parent's
    assert "docs/a.md:4: 0.60 not in RESULTS.md's section 'Part 1: per emission'" in problems[1]
    assert "docs/a.md:5: 97 not in RESULTS.md's row 'cap'" in problems[2]


def test_a_record_naming_a_missing_or_ambiguous_section_fails(tmp_path):
    problems = _check(tmp_path, "docs/a.md",
                      "<!-- record: Transport (issue 5) -->0.60 ms<!-- /record -->\n"
                      "<!-- record: Kernels -->40.8 us<!-- /record -->\n"
                      "<!-- record: -->40.8 us<!-- /record -->\n")
    assert len(problems) == 3, problems
    assert "docs/a.md:1: record names 'Transport (issue 5)', but no section's heading is or " \
           "starts with it" in problems[0]
    assert "docs/a.md:2: record names 'Kernels', but 2 sections' headings start with it " \
           "('Kernels (issue 3)'; 'Kernels (issue 9)')" in problems[1]
    assert "docs/a.md:3: record names ''" in problems[2]


def test_markers_without_partners_and_nested_records_fail(tmp_path):
    problems = _check(tmp_path, "docs/a.md",
                      "<!-- fig: cap -->97.6 us\n\n"
                      "`<!-- record: nowhere -->` in code is an example\n"
                      "<!-- record: Transport (issue 4) -->0.60 ms\n")
    assert len(problems) == 4, problems
    assert "docs/a.md:1: '<!-- fig: cap -->' has no partner" in problems[0]
    assert "docs/a.md:1: '97.6 us' is a measured figure" in problems[1]
    assert "docs/a.md:4: '<!-- record: Transport (issue 4) -->' has no partner" in problems[2]
    assert "docs/a.md:4: '0.60 ms' is a measured figure" in problems[3]
    nested = _check(tmp_path, "docs/b.md",
                    "<!-- record: Transport (issue 4) -->a <!-- record: Part 1 -->0.24 ms"
                    "<!-- /record --> <!-- /record -->\n")
    assert len(nested) == 2, nested
    assert "docs/b.md:1: record 'Transport (issue 4)' holds another marker" in nested[0]
    assert "docs/b.md:1: '<!-- /record -->' has no partner" in nested[1]


def test_numbers_are_compared_by_value_and_names_hold_none():
    assert figures.numbers("1,318 ms, 338.0 us, 1.50x, H200, fp32, sm_90, p99, 2026-12-01") == {
        "1318", "338", "1.5", "2026", "12", "01"}
    assert figures.number("97.6") != figures.number("97")
    assert [m.group(0) for m in figures.MEASURED.finditer(
        "0.60 ms, 1,318-1,382 ms, 44-46x, -1.70%, 2.3 s; H200s, 5 slots, 1 GiB, 256 x 50")] == [
        "0.60 ms", "1,318-1,382 ms", "44-46x", "1.70%", "2.3 s"]


def test_sections_nest_by_level():
    found = dict(figures.sections(RESULTS))
    assert "0.24 ms" in found["Transport (issue 4)"]
    assert "0.60 ms" not in found["Part 1: per emission"]
    assert "Where shmask stands now" not in found
    assert [title for title, _ in figures.named(figures.sections(RESULTS), "kernels issue 9")] == [
        "Kernels (issue 9)"]

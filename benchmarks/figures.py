"""Every figure the documents quote is one of RESULTS.md's.

benchmarks/RESULTS.md opens with "Where shmask stands now": one row per
measure, the current figure in its "now" cell. A row that other documents
quote carries a key in its measure cell, `<!-- key: transport-scheduler -->`
(invisible when rendered), and a document quotes it by wrapping what it
says in a span:

    the scheduler takes <!-- fig: transport-scheduler -->0.60 ms<!-- /fig -->

Every number inside a span must appear in the keyed row's measure, now or
goal cell.

A dated passage (a decision that cites the figures of its day, a
"Numbers" section, a measurement of its time) is a record block instead,
naming the section of RESULTS.md below the first table that its figures
come from:

    <!-- record: Transport (issue 4) -->
    ... 0.60 ms per emission, 265x below pickled arrays ...
    <!-- /record -->

SECTION names one `## ` or `### ` heading: its whole text, or enough of
its start to name it alone (`Capture on real logits, ninth round` names
"Capture on real logits, ninth round (issue 20, 2026-12-02): launches
chained, the sums' predicate"). Names are compared as slugs (case,
backticks and punctuation ignored: `transport-issue-4` is "Transport
(issue 4)"); a heading that is the whole name wins over longer ones that
start with it. A `## ` section's text runs to the next `## ` heading (its
`### ` subsections included), a `### ` section's to the next heading of
either level. Every number inside the block must appear in that text. A
name that matches no heading, or starts more than one, is an error, as is
a record inside a record. A span may sit inside a record (it is checked
against its row).

Numbers: 1,318 is 1318 and 338.0 is 338, but 97 is not 97.6; digits glued
to a name (H200, fp32, sm_90, p99) are not numbers; code (`...` and fenced
blocks) in a span or a record is not checked, and markers written in code
are examples, not spans or records.

In README.md and in every document under docs/ a measured figure (a number
with a unit of time, a ratio or a percentage: 0.60 ms, 44-46x, -1.70%,
2.3 s) outside every span, record and code is an error: the documents
quote RESULTS.md, they do not measure. A value that only looks like a
figure is written so that it does not: a setting or constant in code
(`SPIN_NS`, `200000` ns), a design ratio in words ("plus a quarter").

    python benchmarks/figures.py     # exit 1, one line per problem

Each problem reads `FILE:LINE: what is wrong (what was expected)`, in the
order of the lines. tests/test_figures.py runs it in `make test`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
TABLE_HEADING = "## Where shmask stands now"

KEY = re.compile(r"<!--\s*key:\s*([\w.-]+)\s*-->")
SPAN = re.compile(r"<!--\s*fig:\s*([\w.-]+)\s*-->(.*?)<!--\s*/fig\s*-->", re.S)
RECORD = re.compile(r"<!--\s*record:\s*(.*?)\s*-->(.*?)<!--\s*/record\s*-->", re.S)
# An opening or closing marker that no span or record consumed.
MARKER = re.compile(r"<!--\s*(?:fig|record|/fig|/record)\b[^>]*-->")
# A number not glued to a name (H200, fp32, sm_90 and p99 hold none).
NUMBER = re.compile(r"(?<![\w.])\d(?:\d|,(?=\d))*(?:\.\d+)?")
# A measured figure in prose: 0.60 ms, 1,318-1,382 ms, 44-46x, -1.70%, 2.3 s.
MEASURED = re.compile(
    r"(?<![\w.])\d(?:\d|,(?=\d))*(?:\.\d+)?(?:-\d(?:\d|,(?=\d))*(?:\.\d+)?)?"
    r"(?: ?(?:us|ms|s)|x|%)(?![\w])")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
HEADING = re.compile(r"^(##|###) (.+)$", re.M)


def number(text: str) -> str:
    """1,318 -> 1318, 1.50 -> 1.5, 338.0 -> 338: one spelling per number."""
    text = text.replace(",", "")
    return text.rstrip("0").rstrip(".") if "." in text else text


def numbers(text: str) -> set[str]:
    return {number(match) for match in NUMBER.findall(text)}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("`", "")).strip("-")


def table_rows(results: str) -> dict[str, str]:
    """key -> the text of its row's measure, now and goal cells."""
    start = results.index(TABLE_HEADING)
    end = results.find("\n## ", start + len(TABLE_HEADING))
    rows: dict[str, str] = {}
    for line in results[start:end].splitlines():
        if not line.startswith("|"):
            continue
        cells = line.split("|")
        if len(cells) < 4:
            continue
        for key in KEY.findall(line):
            if key in rows:
                raise SystemExit(f"{RESULTS.name}: key {key!r} names two rows")
            rows[key] = KEY.sub("", " ".join(cells[2:5]))
    return rows


def sections(results: str) -> list[tuple[str, str]]:
    """(heading, text) of every `## ` and `### ` section below the first
    table, in order."""
    start = results.index(TABLE_HEADING)
    start = results.find("\n## ", start + len(TABLE_HEADING))
    if start < 0:
        return []
    found = []
    heads = list(HEADING.finditer(results, start + 1))
    for i, head in enumerate(heads):
        level = len(head.group(1))
        end = next((h.start() for h in heads[i + 1:] if len(h.group(1)) <= level), len(results))
        found.append((head.group(2).strip(), results[head.start():end]))
    return found


def named(records: list[tuple[str, str]], name: str) -> list[tuple[str, str]]:
    """The sections a record's SECTION names: the one whose heading's slug
    is SECTION's, else every one whose heading's slug starts with it (one
    is a match; more, an ambiguous name)."""
    want = slug(name)
    exact = [(title, text) for title, text in records if slug(title) == want]
    if exact or not want:
        return exact
    return [(title, text) for title, text in records if slug(title).startswith(want + "-")]


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def _blank(match: re.Match) -> str:
    """Text as spaces and its newlines, so offsets and line numbers stay."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _excerpt(text: str) -> str:
    return " ".join(text.split())[:120]


def check(paths: list[Path], rows: dict[str, str],
          records: list[tuple[str, str]] | None = None) -> list[str]:
    """One line per problem in `paths`, in the order of the lines: a span
    whose numbers its row lacks or of an unknown key; a record whose
    numbers its section lacks, or that names no one section; a marker
    without its partner; a measured figure outside every span, record and
    code. `records` is sections(RESULTS.md's text)."""
    problems = []
    for path in paths:
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found = _problems(path.read_text(), rows, [] if records is None else records)
        problems += [f"{name}:{line}: {what}" for line, what in sorted(found, key=lambda p: p[0])]
    return problems


def _problems(raw: str, rows: dict[str, str],
              records: list[tuple[str, str]]) -> list[tuple[int, str]]:
    problems: list[tuple[int, str]] = []
    text = CODE.sub(_blank, raw)  # code is exempt, markers written in it included
    for match in SPAN.finditer(text):
        key, quoted = match.group(1), match.group(2)
        line = _line(text, match.start())
        if key not in rows:
            problems.append((line, f"no row of RESULTS.md's first table has key {key!r}"))
            continue
        missing = sorted(numbers(quoted) - numbers(rows[key]))
        if missing:
            problems.append((line, f"{', '.join(missing)} not in RESULTS.md's row {key!r}: "
                                   f"{_excerpt(quoted)}"))
    unspanned = SPAN.sub(_blank, text)  # a span inside a record is checked as a span
    for match in RECORD.finditer(unspanned):
        section, body = match.group(1), match.group(2)
        line = _line(unspanned, match.start())
        found = named(records, section)
        if len(found) != 1:
            which = (f"{len(found)} sections' headings start with it "
                     f"({'; '.join(repr(t) for t, _ in found)})" if found else
                     "no section's heading is or starts with it")
            problems.append((line, f"record names {section!r}, but {which} (expected the start of "
                                   f"one `## ` or `### ` heading of RESULTS.md below the first "
                                   f"table, enough of it to name that one alone)"))
            continue
        if MARKER.search(body):
            problems.append((line, f"record {section!r} holds another marker (expected records "
                                   f"that do not nest: close one before the next opens)"))
            continue
        title, source = found[0]
        have = numbers(source)
        for figure in NUMBER.finditer(body):
            if number(figure.group(0)) not in have:
                around = body[max(0, figure.start() - 50):figure.end() + 50]
                problems.append((_line(unspanned, match.start(2) + figure.start()),
                                 f"{figure.group(0)} not in RESULTS.md's section {title!r} "
                                 f"(the record of line {line}): ...{_excerpt(around)}..."))
    outside = RECORD.sub(_blank, unspanned)
    for match in MARKER.finditer(outside):
        problems.append((_line(outside, match.start()),
                         f"{match.group(0)!r} has no partner (expected <!-- fig: KEY -->...<!-- /fig "
                         f"--> or <!-- record: SECTION -->...<!-- /record -->)"))
    for match in MEASURED.finditer(outside):
        problems.append((_line(outside, match.start()),
                         f"{match.group(0)!r} is a measured figure outside every span and record "
                         f"(expected a quote of RESULTS.md's first table, <!-- fig: KEY -->, or "
                         f"of a dated section, <!-- record: SECTION -->)"))
    return problems


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main() -> int:
    results = RESULTS.read_text()
    rows, records = table_rows(results), sections(results)
    paths = documents()
    problems = check(paths, rows, records)
    for problem in problems:
        print(problem)
    texts = [CODE.sub(_blank, path.read_text()) for path in paths]
    quoted = sum(len(SPAN.findall(text)) for text in texts)
    recorded = sum(len(RECORD.findall(SPAN.sub(_blank, text))) for text in texts)
    print(f"{quoted} quoted figures and {recorded} records in {len(paths)} documents, "
          f"{len(rows)} keyed rows: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

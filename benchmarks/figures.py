"""Every figure the documents quote is the one in RESULTS.md's first table.

benchmarks/RESULTS.md opens with "Where shmask stands now": one row per
measure, the current figure in its "now" cell. A row that other documents
quote carries a key in its measure cell, `<!-- key: transport-scheduler -->`
(invisible when rendered), and a document quotes it by wrapping what it
says in a span:

    the scheduler takes <!-- fig: transport-scheduler -->0.60 ms<!-- /fig -->

Every number inside a span must appear in the keyed row's measure or now
cell (1,318 and 1318 are the same number; 97 is not 97.6). In README.md a
measured figure (a number with a unit of time, a ratio or a percentage)
outside every span and outside code is an error too: README quotes
RESULTS.md, it does not measure. docs/ holds dated records besides
reference text (docs/README.md says which), so there only the spans are
checked.

    python benchmarks/figures.py     # exit 1, one line per mismatch

tests/test_figures.py runs it in `make test`.
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
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# A measured figure in prose: 0.60 ms, 1,318-1,382 ms, 44-46x, -1.70%, 2.3 s.
MEASURED = re.compile(r"\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?: ?(?:us|ms|s)|x|%)(?![\w])")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def numbers(text: str) -> set[str]:
    return {match.replace(",", "") for match in NUMBER.findall(text)}


def table_rows(results: str) -> dict[str, str]:
    """key -> the text of its row's measure and now cells."""
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
            rows[key] = KEY.sub("", cells[2] + " " + cells[3])
    return rows


def check(paths: list[Path], rows: dict[str, str], readme: Path = ROOT / "README.md") -> list[str]:
    """One line per problem: a span whose numbers its row lacks, a span of
    an unknown key, a figure in `readme` outside every span."""
    problems = []
    for path in paths:
        text = path.read_text()
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for match in SPAN.finditer(text):
            key, quoted = match.group(1), match.group(2)
            line = text.count("\n", 0, match.start()) + 1
            if key not in rows:
                problems.append(f"{name}:{line}: no row of RESULTS.md's first table has key {key!r}")
                continue
            missing = sorted(numbers(CODE.sub("", quoted)) - numbers(rows[key]))
            if missing:
                problems.append(f"{name}:{line}: {', '.join(missing)} not in RESULTS.md's row "
                                f"{key!r}: {' '.join(quoted.split())[:120]}")
        if path == readme:
            outside = SPAN.sub(lambda m: " " * len(m.group(0)), CODE.sub(_blank, text))
            for match in MEASURED.finditer(outside):
                line = outside.count("\n", 0, match.start()) + 1
                problems.append(f"{name}:{line}: {match.group(0)!r} is a figure that quotes no "
                                f"row of RESULTS.md's first table (wrap it in <!-- fig: KEY -->)")
    return problems


def _blank(match: re.Match) -> str:
    """Code as spaces and its newlines, so line numbers stay right."""
    return re.sub(r"[^\n]", " ", match.group(0))


def main() -> int:
    rows = table_rows(RESULTS.read_text())
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    problems = check(paths, rows)
    for problem in problems:
        print(problem)
    quoted = sum(len(SPAN.findall(path.read_text())) for path in paths)
    print(f"{quoted} quoted figures in {len(paths)} documents, {len(rows)} keyed rows: "
          f"{len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

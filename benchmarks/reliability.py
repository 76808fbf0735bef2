"""The Reliability table: run the fault matrix of issue 7 (tests/faults) and
print one Markdown row per case: what happened and its figure.

    .venv/bin/python benchmarks/reliability.py            # full sizes (as `make faults`)
    .venv/bin/python benchmarks/reliability.py --short    # the `make test` sizes
    .venv/bin/python benchmarks/reliability.py --case soak --json out.json

The case functions are the ones tests/faults/test_faults.py runs, so the
table and the tests cannot disagree. Exit status 1 when a case found a problem.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "faults"))

from fault_cases import CASES, markdown_table  # noqa: E402
from fault_lib import SHM_DIR  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the sizes `make test` runs")
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="run only this case (repeatable)")
    parser.add_argument("--json", help="also write every case's metrics here")
    args = parser.parse_args()
    prefix = "shmrel" + secrets.token_hex(3)
    full = not args.short
    started = time.monotonic()
    results = []
    for name in args.case or list(CASES):
        result = CASES[name](prefix, full)
        print(result.report(), file=sys.stderr, flush=True)
        results.append(result)
    left = [e for e in os.listdir(SHM_DIR) if e.startswith(prefix)]
    for entry in left:
        os.unlink(os.path.join(SHM_DIR, entry))
    print(f"## Reliability ({'full' if full else 'short'} fault matrix, "
          f"{datetime.date.today()}, {platform.node() or 'this machine'}: {os.cpu_count()} cores, "
          f"{time.monotonic() - started:.0f} s)\n")
    print(markdown_table(results))
    if left:
        print(f"\nsegments left behind and removed: {left}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"case": r.case, "happened": r.happened, "figure": r.figure, "problems": r.problems,
              "seconds": r.seconds, "metrics": r.metrics} for r in results], indent=1, default=str))
    return 1 if any(r.problems for r in results) or left else 0


if __name__ == "__main__":
    sys.exit(main())

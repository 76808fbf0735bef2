"""Run the four benchmark parts and print one summary with the issue's
targets as ratios from this same run (PASS/MISS).

    .venv/bin/python benchmarks/run.py            # full run (~10 min on 2 cores); writes
                                                  # benchmarks/results/transport.txt
    .venv/bin/python benchmarks/run.py --quick    # small sizes, few repeats (< 60 s); writes nothing

Exits non-zero when a tokenizer received wrong rows or a ring segment was
left in /dev/shm; a missed target is reported, not an error.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from typing import Any

import bookkeeping
import decode_loop
import numpy as np
import responses
import transport
import zmq
from _common import RESULTS_DIR, TRANSPORTS, console, leftover_segments, print_table, ratio


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({model}), {memory_gib:.0f} GiB, "
            f"{platform.machine()}, {platform.system()}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pick(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def summary(part1: list[dict[str, Any]], part2: list[dict[str, Any]], part3: list[dict[str, Any]],
            part4: list[dict[str, Any]], headline_width: int) -> list[tuple[Any, ...]]:
    """(target, shmask, baseline, ratio, goal, verdict) rows."""
    row = {name: pick(part1, transport=name, mode="support", width=headline_width) for name in TRANSPORTS}
    shm = row["shmask"]
    where = f"{headline_width} support"
    rows: list[tuple[Any, ...]] = []

    def add(target: str, ours: float, theirs: float, unit: str, goal: float) -> None:
        value = ratio(theirs, ours)
        rows.append((target, f"{ours:.3f} {unit}", f"{theirs:.3f} {unit}", f"{value:.1f}x",
                     f">= {goal:g}x", verdict(value >= goal)))

    add(f"scheduler per emission vs arrays ({where})", shm["scheduler_ms"],
        row["arrays"]["scheduler_ms"], "ms", 50)
    add(f"detokenizer vs arrays ({where})", shm["detokenizer_ms"], row["arrays"]["detokenizer_ms"], "ms", 100)
    add(f"detokenizer vs oob ({where})", shm["detokenizer_ms"], row["oob"]["detokenizer_ms"], "ms", 10)
    add(f"CPU of 3 processes, no build, vs oob ({where})", shm["cpu_no_build_ms"],
        row["oob"]["cpu_no_build_ms"], "ms", 5)
    for r in part2:
        rows.append((f"append_step vs numpy copy (support {r['width']})", f"{r['append_mean_ms']:.3f} ms",
                     f"{r['copy_mean_ms']:.3f} ms", f"{r['ratio']:.2f}x", "<= 2x", verdict(r["ratio"] <= 2)))
    for r in part3:
        rows.append((f"to_json vs json.dumps of lists (support {r['width']})", f"{r['to_json']:.3f} ms",
                     f"{r['json_dumps']:.3f} ms", f"{r['json_speedup']:.1f}x", ">= 10x",
                     verdict(r["json_speedup"] >= 10)))
    off, shm4 = pick(part4, transport="off"), pick(part4, transport="shmask")
    rows.append(("decode loop tokens/s vs masks off", f"{shm4['tokens_per_s']:,.0f}/s",
                 f"{off['tokens_per_s']:,.0f}/s", f"{-100 * shm4['slowdown']:+.1f}%", "within 3%",
                 verdict(shm4["slowdown"] <= 0.03)))
    floor = pick(part4, transport="floor")
    rows.append(("decode loop, floor: numpy copy of the rows only", f"{floor['tokens_per_s']:,.0f}/s",
                 f"{off['tokens_per_s']:,.0f}/s", f"{-100 * floor['slowdown']:+.1f}%", "(context)", ""))
    rows.append(("decode loop: last response built (s after start)", f"{shm4['last_response_s']:.2f} s",
                 f"{off['last_response_s']:.2f} s", "", "reported", ""))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke test)")
    args = parser.parse_args()
    out = console()
    started = time.monotonic()
    command = ".venv/bin/python benchmarks/run.py" + (" --quick" if args.quick else "")
    out.print(f"command: {command}\ndate: {datetime.datetime.now().isoformat(timespec='seconds')}\n"
              f"machine: {machine()}\npython {platform.python_version()}, numpy {np.__version__}, "
              f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), commit {commit()}")

    part1 = transport.run(quick=args.quick)
    part2 = bookkeeping.run(quick=args.quick)
    part3 = responses.run(quick=args.quick)
    part4 = decode_loop.run(quick=args.quick)

    headline_width = 200 if args.quick else 1000
    mismatches = sum(r["mismatches"] for part in (part1, part3, part4) for r in part)
    inline = sum(r["inline_chunks"] for part in (part1, part4) for r in part)
    inline += sum(r["inline"] for r in part2)
    rows = summary(part1, part2, part3, part4, headline_width)
    rows.append(("rows verified (tokenizer CRC = scheduler CRC; JSON values)", "", "", "", "0 mismatches",
                 verdict(mismatches == 0)))
    rows.append(("shmask chunks sent inline (ring full)", str(inline), "", "", "0", verdict(inline == 0)))
    print_table("Summary - shmask against the baselines, ratios from this run", (
        "target", "shmask", "baseline", "ratio", "goal", "verdict"), rows)
    leftovers = leftover_segments()
    out.print(f"transports: {', '.join(TRANSPORTS)}")
    out.print(f"mismatches: {mismatches}")
    out.print(f"inline chunks: {inline}")
    out.print(f"segments left in /dev/shm: {len(leftovers)} {' '.join(leftovers)}")
    out.print(f"wall time: {time.monotonic() - started:.0f} s")
    if not args.quick:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "transport.txt").write_text(out.export_text())
    return 1 if mismatches or leftovers else 0


if __name__ == "__main__":
    sys.exit(main())

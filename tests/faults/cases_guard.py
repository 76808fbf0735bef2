"""Fault cases of the SIGBUS guard (issue 17): a segment truncated under
processes that have faulthandler enabled, before shmask set its guard,
after it (faulthandler.enable()), or behind its back (a handler installed
without going through faulthandler's Python functions, as native code
would); and a ring cut then grown back to its size, which faults nowhere.

The children are fault_child.py's truncation roles, started through a
small bootstrap that enables faulthandler at the chosen moment.
"""

from __future__ import annotations

import json
import os
import sys
import time

from fault_cases import Result, case
from fault_lib import Child, child_env, describe_rc, shm_path

RING_FILE = 4096 + (1 << 20)  # the truncation roles' ring_mb=1 segment

# argv: <when> <python> <fault_child.py> <role> args... ; "after" and "behind
# its back" enable faulthandler right after each shmask mapping, so its
# handler is in front of the guard when the cut comes.
BOOTSTRAP = """
import faulthandler, os, runpy, sys
when, child = sys.argv[1], sys.argv[3]
sys.path.insert(0, os.path.dirname(child))
import shmask.segment as segment
if when == "before":
    faulthandler.enable()
else:
    mapped = segment._map
    def map_then_enable(*args):
        base = mapped(*args)
        if when == "after":
            faulthandler.disable()
            faulthandler.enable()
        else:  # the functions as they are without shmask's wrappers
            getattr(faulthandler.disable, "__wrapped__", faulthandler.disable)()
            getattr(faulthandler.enable, "__wrapped__", faulthandler.enable)()
        return base
    segment._map = map_then_enable
sys.argv = [child, *sys.argv[4:]]
runpy.run_path(child, run_name="__main__")
"""

# What the reader does after the cut; with the whole file cut, none may return rows.
READS = ("to_lists", "to_json", "open(held batch)", "open(unopened batch)", "new Reader().open")


def _cut(name: str, size: int, grow_back: bool) -> str:
    path = shm_path(name)
    try:
        os.truncate(path, size)
        if grow_back:
            os.truncate(path, RING_FILE)
    except OSError as exc:
        return f"refused: {exc.strerror}"
    return "truncated" + (" and grown back" if grow_back else "")


def _runs(full: bool) -> list[tuple[str, int, bool]]:
    if not full:
        return [("behind its back", 0, False), ("after", 0, True), ("before", RING_FILE // 2, False)]
    cuts = [(0, False), (100, False), (4096, False), (RING_FILE // 2, False),
            (RING_FILE - 4096, False), (0, True), (4096, True)]
    return [(when, size, grow) for when in ("before", "after", "behind its back")
            for size, grow in cuts]


@case("truncation with faulthandler on")
def truncation_with_faulthandler_on(result: Result, prefix: str, full: bool) -> None:
    runs = _runs(full)
    deaths, errors, rows_from_cut, reports = 0, 0, 0, 0
    non_shmask: list[str] = []
    for when, size, grow_back in runs:
        label = f"faulthandler {when}, cut to {size}{' and grown back' if grow_back else ''}"
        env = child_env(prefix)
        boot = [sys.executable, "-c", BOOTSTRAP, when]
        writer = Child("trunc_writer", 1.5, env=env, argv_prefix=boot)
        reader = Child("trunc_reader", 7, env=env, argv_prefix=boot)
        try:
            name = writer.expect("segment", 30)
            reader.send("refs " + writer.expect("refs", 30))
            reader.send("refs " + writer.expect("refs", 30))
            result.check(reader.expect("held", 30) == "ok", f"{label}: rows read before the cut differ")
            writer.send("go")  # the producer is now writing in a loop
            time.sleep(0.3)
            done = _cut(name, size, grow_back)
            reader.send("go")
            outcomes = {}
            for who, child in (("reader", reader), ("producer", writer)):
                try:
                    outcomes[who] = json.loads(child.expect("result", 30))
                except RuntimeError:
                    outcomes[who] = None
            writer.send("exit")
            for who, child in (("reader", reader), ("producer", writer)):
                rc = child.wait(20)
                if rc is None or rc < 0:
                    deaths += 1
                    result.problems.append(f"{label}: {who} {describe_rc(rc)}")
                reports += child.stderr_tail(1 << 20).count("Fatal Python error: Bus error")
            for who, calls in outcomes.items():
                for call, got in (calls or {}).items():
                    counts = got if isinstance(got, dict) else {got: 1}
                    for outcome, n in counts.items():
                        if outcome.startswith("shmask:"):
                            errors += n
                        elif outcome.startswith("other"):
                            non_shmask.append(f"{label} {who} {call}: {outcome}")
                        elif who == "reader" and size == 0 and call in READS:
                            rows_from_cut += 1
                            result.problems.append(f"{label}: reader {call} returned rows")
            result.metrics[label] = {"cut": done, **outcomes}
        finally:
            writer.kill()
            reader.kill()
    result.check(not non_shmask, f"{len(non_shmask)} non-shmask errors: {non_shmask[:4]}")
    result.check(errors > 0, "no shmask error seen: the cut went unnoticed")
    result.metrics.update(deaths=deaths, shmask_errors=errors, rows_from_cut=rows_from_cut,
                          faulthandler_reports=reports)
    result.happened = (f"{len(runs)} cuts of a ring under a reader holding a chunk and a writing "
                       "producer, faulthandler enabled before shmask's guard, after it, or "
                       "behind its back; whole-file cuts also grown back to size")
    result.figure = (f"{len(runs)} runs x 2 processes: {deaths} died, {errors} shmask errors, "
                     f"{len(non_shmask)} other errors, {rows_from_cut} reads of a cut ring "
                     f"returned rows ({reports} faulthandler reports)")

"""Fault case of issue 33: a wrong-type walk of the public API. The table
of (public call, bad value) is tests/api_walk.py, the one tests/test_api_types.py
runs; here it runs in a child process, so a call that crashes the process
(a bad value reaching native code) is counted, not the end of the run."""

from __future__ import annotations

import json

from fault_cases import Result, case
from fault_lib import HERE, child_env, describe_rc, run_script

WALK = HERE.parent / "api_walk.py"


@case("wrong-type walk of the public API")
def wrong_type_walk(result: Result, prefix: str, full: bool) -> None:
    done = run_script(f"import runpy, sys; sys.argv = ['api_walk', {prefix!r}]; "
                      f"sys.path.insert(0, {str(WALK.parent)!r}); "
                      f"runpy.run_path({str(WALK)!r}, run_name='__main__')",
                      child_env(prefix), timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        result.problems.append(f"the walk's process {describe_rc(done.returncode)}: "
                               f"{done.stderr[-2000:]}")
        return
    summary = json.loads(lines[-1])
    silent, unclear = summary["silent"], summary["unclear"]
    for what, found in (("taken silently", silent), ("refused with an unclear error", unclear)):
        result.problems += [f"{what}: {line}" for line in found]
    result.metrics.update(probes=summary["probes"], calls=summary["calls"],
                          refused=summary["refused"], silent=len(silent), unclear=len(unclear))
    result.happened = (f"every public call that takes indices, ids, sizes or settings given "
                       f"values of the wrong type or range ({summary['calls']} calls), in a "
                       "child process")
    result.figure = (f"{summary['probes']} calls x bad values ({summary['calls']} public calls), "
                     f"{len(silent)} silent coercions, {len(unclear)} unclear errors, 0 crashes")

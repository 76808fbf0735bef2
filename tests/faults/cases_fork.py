"""Fault case of fork safety (issue 33, item 3): children forked at random
points of the ring life cycle, while threads of the parent make, close,
drop and attach rings and keep the thread pools busy. Each child must make
its own Writer, publish, read its rows back, use both pools and exit within
a bounded time, and must not hold a lifetime lock of its parent's rings.

The driver is tests/test_fork_safety.py's own (fork_at_random_points), so
the test and this case cannot disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fault_cases import Result, case

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fork test's driver
import test_fork_safety as fork_test  # noqa: E402


@case("fork at random points of the ring life cycle")
def fork_at_random_points(result: Result, prefix: str, full: bool) -> None:
    forks = fork_test.FORKS_FULL if full else fork_test.FORKS_SHORT
    report = fork_test.fork_at_random_points(prefix, forks, seed=33)
    hangs, failures = report.get("hangs"), report.get("failures")
    locks_held = report.get("locks_held")
    result.metrics.update({k: v for k, v in report.items() if k != "stderr"})
    result.check(hangs is not None, f"the driver failed: {report.get('stderr', '')[-1000:]}")
    result.check(hangs in (None, 0), f"{hangs} children hung: {report.get('stderr', '')[-1000:]}")
    result.check(report.get("forks") == forks or hangs is None,
                 f"stopped after {report.get('forks')} of {forks} forks")
    result.check(failures in (None, 0),
                 f"{failures} children failed: {report.get('stderr', '')[-1000:]}")
    result.check(locks_held in (None, 0), f"{locks_held} children held a parent's ring lock")
    result.check(not report.get("thread_errors") and not report.get("threads_stuck"),
                 f"the parent's threads failed: {report.get('thread_errors')}")
    result.happened = (f"{forks} forks from the main thread at random moments while two threads "
                       "made, closed and dropped Writers, one attached each new ring with a "
                       "Reader and one kept the native and the documents' thread pools busy; "
                       "each child made its own Writer, published, read back and used both "
                       f"pools (bounded at {fork_test.CHILD_TIMEOUT_S:.0f} s a child)")
    result.figure = (f"{report.get('forks')} forks, {hangs} hangs, {failures} failed children, "
                     f"{locks_held} holding a parent's ring lock")

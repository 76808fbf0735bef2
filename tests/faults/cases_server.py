"""Fault case of the example server (issue 33): an engine process
(examples/producer.py or examples/detokenizer.py) SIGKILLed while the
server has requests pending, some streamed, some waiting for a whole
response. The server watches its engine processes (a pidfd each on its
event loop): every pending request must be answered at once with a 503
naming the dead process and its signal, /health must turn 503, and the
server must still exit 0 on SIGTERM leaving no ring behind.

The server, its start-up and the load are tests/test_server.py's own
(start_server, kill_engine_under_load), so the test and this case cannot
disagree.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
from fault_cases import Result, case
from fault_lib import segments_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the server test's helpers
import test_server as server_test  # noqa: E402

GOAL_S = 1.0  # issue 33: every pending request answered with an error within 1 s
TOKENS = 20_000  # per planned request: minutes of work, so nothing finishes before the kill


@case("engine death under load with the example server")
def engine_death_under_load(result: Result, prefix: str, full: bool) -> None:
    victims = ["producer.py", "detokenizer.py"] * 2 if full else ["producer.py"]
    pending = 64 if full else 16  # every other one streamed
    latencies: list[float] = []
    errors = unanswered = healthy_after = rings_left = 0
    for round_number, victim in enumerate(victims):
        label = f"round {round_number} ({victim})"
        with tempfile.TemporaryFile() as log:
            process, url = server_test.start_server(TOKENS, log, name_prefix=prefix)
            try:
                answers = asyncio.run(server_test.kill_engine_under_load(process, url, victim,
                                                                         pending))
                health = httpx.get(url + "/health", timeout=10)
                process.send_signal(signal.SIGTERM)
                rc = process.wait(timeout=30)
            finally:
                server_test.kill_group(process)
            log.seek(0)
            output = log.read().decode(errors="replace")
        for kind, took, last in answers:
            if took is None:
                unanswered += 1
                continue
            latencies.append(took)
            error = server_test.error_answer(kind, last)
            if (error is not None and error.get("code") == 503
                    and f"{victim} (pid " in error.get("message", "")
                    and "SIGKILL" in error.get("message", "")):
                errors += 1
            else:
                result.problems.append(f"{label}: a {kind} answer is not a 503 naming the dead "
                                       f"process: {last[:200]!r}")
        if health.status_code != 503 or victim not in health.text:
            healthy_after += 1
            result.problems.append(f"{label}: /health answered {health.status_code} "
                                   f"{health.text[:200]!r} after the death")
        result.check(rc == 0, f"{label}: the server exited {rc} on SIGTERM: {output[-600:]}")
        result.check("Traceback" not in output, f"{label}: the server logged {output[-600:]}")
        left = segments_of(prefix)
        rings_left += len(left)
        result.check(not left, f"{label}: rings left after the server exited: {left}")
    total = len(victims) * pending
    worst = max(latencies, default=float("nan"))
    result.check(unanswered == 0, f"{unanswered}/{total} pending requests got no answer "
                 f"within {server_test.DEATH_WAIT_S:.0f} s")
    result.check(worst <= GOAL_S, f"the slowest error answer took {worst * 1000:.0f} ms "
                 f"(goal {GOAL_S * 1000:.0f} ms)")
    median = float(np.median(latencies)) if latencies else float("nan")
    result.metrics.update(rounds=len(victims), victims=victims, pending=total, errors=errors,
                          unanswered=unanswered, max_ms=round(worst * 1000, 1),
                          p50_ms=round(median * 1000, 1), health_not_503=healthy_after,
                          rings_left=rings_left)
    result.happened = (f"{len(victims)} engine processes SIGKILLed ({', '.join(victims)}) with "
                       f"{pending} requests pending each (half streamed): each answered with a "
                       "503 naming the dead process, /health 503 after")
    result.figure = (f"{total} pending, {errors} answered with an error, {unanswered} unanswered; "
                     f"max {worst * 1000:.0f} ms (p50 {median * 1000:.0f} ms; goal <= "
                     f"{GOAL_S * 1000:.0f} ms); /health 503 {len(victims) - healthy_after}/"
                     f"{len(victims)}; {rings_left} rings left")

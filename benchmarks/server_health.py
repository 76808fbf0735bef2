"""The example server at load (issue 18, item 2): /health latency and one SSE
event per emission while 64 incremental streams run; and (issue 33) the
time from SIGTERM to the server's exit under that load.

    .venv/bin/python benchmarks/server_health.py [--tokens 20000] [--runs 3]
    .venv/bin/python benchmarks/server_health.py --runs 0 --exit-runs 7 [--stalled 2]

Uses tests/test_server.py's own server start, /health poller (its own
process, one GET every 20 ms, open loop), httpx stream reader and signal
helper (64 streams at 20,000 tokens under way, `--stalled` clients that
never read their streams, the exit timed by another process waiting on the
server's pidfd), so the figures are those the tests assert on, at any size.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_server as server_test  # noqa: E402


def one_run(tokens: int) -> str:
    with tempfile.TemporaryFile() as log:
        process, url = server_test.start_server(tokens, log)
        try:
            poller = subprocess.Popen([sys.executable, "-c", server_test.POLLER, url],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
            count = server_test.LOAD_REQUESTS
            events: list[list] = [[] for _ in range(count)]

            async def load() -> None:
                limits = httpx.Limits(max_connections=count)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                    await asyncio.gather(*(server_test.read_stream(client, url, rid, events[rid])
                                           for rid in range(count)))

            started = time.monotonic()
            asyncio.run(load())
            took = time.monotonic() - started
            latencies = np.array(orjson.loads(poller.communicate(timeout=60)[0])[0]) * 1000
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    lengths = server_test.request_lengths(np.arange(count), tokens)
    exact = sum(len(events[r]) - 1 == -(-int(lengths[r]) // server_test.EMIT_EVERY)
                for r in range(count))
    gaps = [np.diff([arrival for arrival, _ in stream]).max() for stream in events if len(stream) > 1]
    return (f"/health p50 {np.percentile(latencies, 50):.1f} ms, p99 "
            f"{np.percentile(latencies, 99):.1f} ms, max {latencies.max():.0f} ms "
            f"({latencies.size} polls); one event per emission: {exact}/{count} streams; "
            f"largest gap per stream, median {np.median(gaps) * 1000:.0f} ms; streams {took:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--exit-runs", type=int, default=0,
                        help="also time SIGTERM to exit under load this many times")
    parser.add_argument("--stalled", type=int, default=2,
                        help="clients that never read their streams, in the exit runs")
    args = parser.parse_args()
    print(f"{server_test.LOAD_REQUESTS} streams x {args.tokens} tokens, an emission every "
          f"{server_test.EMIT_EVERY} tokens", flush=True)
    for run in range(args.runs):
        print(f"run {run}: {one_run(args.tokens)}", flush=True)
    exits = []
    for run in range(args.exit_runs):
        exit_s, events, output, returncode, outlived = server_test.signal_under_load(
            signal.SIGTERM, args.stalled, args.tokens)
        ended = sum(b"shutting down" in stream[-1][1] for stream in events)
        exits.append(exit_s)
        print(f"exit run {run}: {exit_s * 1000:.0f} ms from SIGTERM to exit (status {returncode}; "
              f"{ended}/{len(events)} streams ended saying so; {args.stalled} stalled clients; "
              f"traceback: {'yes' if 'Traceback' in output else 'no'}; engine outlived it: "
              f"{'yes' if outlived else 'no'})", flush=True)
    if exits:
        print(f"SIGTERM to exit: median {np.median(exits) * 1000:.0f} ms, "
              f"{min(exits) * 1000:.0f}-{max(exits) * 1000:.0f} ms over {len(exits)} runs")


if __name__ == "__main__":
    main()

"""The example server at load: /health latency and one SSE event per
emission while 64 incremental streams run; and the time from SIGTERM to
the server's exit under that load.

    .venv/bin/python benchmarks/server_health.py [--tokens 20000] [--runs 3] [--busy 1]
    .venv/bin/python benchmarks/server_health.py --runs 0 --exit-runs 7 [--stalled 2]

Uses tests/test_server.py's own server start, /health prober (its own
process: a new connection per probe, one every 20 ms, open loop, as a
kubelet's liveness probe), httpx stream reader and signal helper (64
streams at 20,000 tokens under way, `--stalled` clients that never read
their streams, the exit timed by another process waiting on the server's
pidfd), so the figures are those the tests assert on, at any size.

/health latency is given twice: as the prober saw it, and to the answer's
arrival in the prober's socket (the kernel's receive timestamp), which
the prober's own wait for a CPU on a busy machine does not lengthen. The
loop thread's share of the streams' time on a CPU and waiting for one
(/proc/PID/task/PID/schedstat) says how busy the machine kept it.
`--busy N` runs N busy processes beside it (each in its own session, as
unrelated services are), and the 1-minute load average is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_server as server_test  # noqa: E402


def schedstat(pid: int) -> tuple[int, int]:
    """Nanoseconds the thread `pid` has run on a CPU and waited for one."""
    on_cpu, waiting, _ = map(int, Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split())
    return on_cpu, waiting


def one_run(tokens: int) -> tuple[str, float, float]:
    """One run's line, and its kernel-stamped and prober-seen p99 (ms)."""
    with tempfile.TemporaryFile() as log:
        process, url = server_test.start_server(tokens, log)
        try:
            poller = subprocess.Popen([sys.executable, "-c", server_test.PROBER, url],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
            count = server_test.LOAD_REQUESTS
            events: list[list] = [[] for _ in range(count)]

            async def load() -> None:
                limits = httpx.Limits(max_connections=count)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                    await asyncio.gather(*(server_test.read_stream(client, url, rid, events[rid])
                                           for rid in range(count)))

            started, loop_before = time.monotonic(), schedstat(process.pid)
            asyncio.run(load())
            took = time.monotonic() - started
            on_cpu, waiting = (after - before for after, before in
                               zip(schedstat(process.pid), loop_before, strict=True))
            probes = orjson.loads(poller.communicate(timeout=60)[0])
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    lengths = server_test.request_lengths(np.arange(count), tokens)
    exact = sum(len(events[r]) - 1 == -(-int(lengths[r]) // server_test.EMIT_EVERY)
                for r in range(count))
    gaps = [np.diff([arrival for arrival, _ in stream]).max() for stream in events if len(stream) > 1]
    seen = np.array([latency for _, latency, _, _ in probes]) * 1000
    stamped = np.array([stamp for _, _, stamp, _ in probes if stamp is not None]) * 1000
    failed = sum(not ok for *_, ok in probes)
    line = (f"/health to the prober's socket p50 {np.percentile(stamped, 50):.1f} ms, p99 "
            f"{np.percentile(stamped, 99):.1f} ms, max {stamped.max():.0f} ms; as the prober "
            f"saw it p50 {np.percentile(seen, 50):.1f}, p99 {np.percentile(seen, 99):.1f}, max "
            f"{seen.max():.0f} ms ({seen.size} probes, {failed} not 200); the loop thread on a "
            f"CPU {on_cpu / 1e9 / took:.0%} of the time, waiting for one {waiting / 1e9 / took:.0%}; "
            f"one event per emission: {exact}/{count} streams; largest gap per stream, median "
            f"{np.median(gaps) * 1000:.0f} ms; streams {took:.1f} s")
    return line, float(np.percentile(stamped, 99)), float(np.percentile(seen, 99))


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[float]]:
    """`count` busy processes (each in its own session) while the block
    runs, and the 1-minute load averages sampled meanwhile (every 2 s, from
    60 s after they start, when the average has risen to them)."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(count)]
    loads: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(2.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        if count:
            print(f"{count} busy processes; waiting 60 s for the load average", flush=True)
            time.sleep(60)
        sampler.start()
        yield loads
    finally:
        stop.set()
        for process in spin:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--exit-runs", type=int, default=0,
                        help="also time SIGTERM to exit under load this many times")
    parser.add_argument("--busy", type=int, default=0,
                        help="busy processes beside the server (other work on the machine)")
    parser.add_argument("--stalled", type=int, default=2,
                        help="clients that never read their streams, in the exit runs")
    args = parser.parse_args()
    print(f"{server_test.LOAD_REQUESTS} streams x {args.tokens} tokens, an emission every "
          f"{server_test.EMIT_EVERY} tokens", flush=True)
    with busy_processes(args.busy) as loads:
        p99s = []
        for run in range(args.runs):
            line, stamped_p99, seen_p99 = one_run(args.tokens)
            p99s.append((stamped_p99, seen_p99))
            print(f"run {run}: {line}", flush=True)
        if p99s:
            stamped, seen = np.array(p99s).T
            print(f"/health p99 over {len(p99s)} runs: to the prober's socket median "
                  f"{np.median(stamped):.1f} ms ({stamped.min():.1f}-{stamped.max():.1f}); as the "
                  f"prober saw it median {np.median(seen):.1f} ms ({seen.min():.1f}-{seen.max():.1f})"
                  + (f"; 1-minute load average median {np.median(loads):.2f} "
                     f"({min(loads):.2f}-{max(loads):.2f})" if loads else ""), flush=True)
    exits = []
    for run in range(args.exit_runs):
        exit_s, events, output, returncode, outlived = server_test.signal_under_load(
            signal.SIGTERM, args.stalled, args.tokens)
        ended = sum(b"shutting down" in stream["last"] for stream in events)
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

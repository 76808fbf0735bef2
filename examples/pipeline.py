"""Runs scheduler -> detokenizer -> tokenizer(s) as separate OS processes
joined by zmq, moves every sampling mask through shmask, checks every row,
and prints what moved and what it cost.

    python examples/pipeline.py [--requests 256 --tokens 512 --top-k 1000]

shmask settings come from SHMASK_* environment variables (docs/configuration.md),
which the child processes inherit.

Every child is watched (a pidfd each, polled with the results socket): if
one dies, the pipeline does not wait for it, nor for the others, which can
no longer finish. It stops them, removes the ring of a producer killed
outright, and exits 1 with one line naming the dead process and how it
died ("pipeline failed: producer.py (pid 4242) was killed by signal 9
(SIGKILL)"). The other way round, every child is started with --exit-with
(workload.exit_with): the kernel sends it SIGTERM if the pipeline itself
dies, even by SIGKILL, so none is left waiting for a peer, and the
producer's ring goes with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table
from workload import describe_exit, request_lengths

import shmask
from shmask.segment import collect_garbage

HERE = Path(__file__).resolve().parent


class PipelineFailed(Exception):
    """A child died or the pipeline ran out of time: the message says which."""


def main() -> int:
    try:
        return run()
    except PipelineFailed as exc:
        print(f"pipeline failed: {exc}", file=sys.stderr)
        return 1


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--mode", choices=["support", "selected"], default="support")
    parser.add_argument("--emit-every", type=int, default=50)
    parser.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-seed", type=int, default=None,
                        help="seed the tokenizers check against (default: --seed; another value "
                             "shows that the check catches wrong rows)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--summary-json", default=None, help="also write the totals here")
    args = parser.parse_args()
    check_seed = args.seed if args.check_seed is None else args.check_seed
    total_rows = int(request_lengths(np.arange(args.requests), args.tokens).sum())
    env = dict(os.environ)
    env.setdefault("SHMASK_RING_MB", "1024")
    console = Console()

    with tempfile.TemporaryDirectory(prefix="shmask-demo-") as tmp:
        def endpoint(name: str) -> str:
            return f"ipc://{tmp}/{name}"

        context = zmq.Context()
        results = context.socket(zmq.PULL)
        results.bind(endpoint("results"))
        control = context.socket(zmq.PUSH)
        control.bind(endpoint("control"))
        # --exit-with: each goes with this process, even one killed outright.
        common = ["--results", endpoint("results"), "--exit-with", str(os.getpid())]
        workload = ["--top-k", str(args.top_k), "--mode", args.mode]
        tokenizer_inputs = [endpoint(f"tokenizer{i}") for i in range(args.tokenizers)]
        commands = [
            [str(HERE / "consumer.py"), "--inp", inp, *common, *workload, "--seed", str(check_seed)]
            for inp in tokenizer_inputs
        ] + [
            [str(HERE / "detokenizer.py"), "--inp", endpoint("detok"), "--out", *tokenizer_inputs,
             *common],
            [str(HERE / "producer.py"), "--out", endpoint("detok"), "--control", endpoint("control"),
             *common, *workload, "--requests", str(args.requests), "--tokens", str(args.tokens),
             "--emit-every", str(args.emit_every), "--seed", str(args.seed)],
        ]
        started = time.perf_counter()
        processes = [subprocess.Popen([sys.executable, *command], env=env) for command in commands]
        # A pidfd per child turns readable when it exits: polled with the
        # results socket, a death is heard at once, whatever else arrives.
        watch = zmq.Poller()
        watch.register(results, zmq.POLLIN)
        exits = {os.pidfd_open(process.pid): process for process in processes}
        for fd in exits:
            watch.register(fd, zmq.POLLIN)
        stats: dict[str, list[dict]] = {}
        decoder = msgspec.msgpack.Decoder()
        deadline = time.monotonic() + args.timeout
        expected_reports = args.tokenizers + 2
        told_exit = False
        try:
            with Progress("[progress.description]{task.description}", BarColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                          disable=not console.is_terminal) as progress:
                task = progress.add_task("rows checked", total=total_rows)
                while sum(len(v) for v in stats.values()) < expected_reports:
                    ready = dict(watch.poll(1000))
                    for fd in [fd for fd in exits if fd in ready]:
                        watch.unregister(fd)
                        os.close(fd)
                        process = exits.pop(fd)
                        status = process.wait()  # at once: it has exited
                        if status != 0:  # 0: its work is done (a report is on its way)
                            raise PipelineFailed(f"{Path(process.args[1]).name} (pid "
                                                 f"{process.pid}) {describe_exit(status)}")
                    if results not in ready:
                        if not exits and results.poll(0) == 0:
                            raise PipelineFailed("every process exited before reporting")
                        if time.monotonic() > deadline:
                            raise PipelineFailed(f"no result within --timeout {args.timeout:g} s")
                        continue
                    report = decoder.decode(results.recv())
                    if report["stage"] == "progress":
                        progress.advance(task, report["rows"])
                    else:
                        stats.setdefault(report["stage"], []).append(report)
                        if not told_exit and len(stats.get("tokenizer", ())) == args.tokenizers:
                            # Once: the producer exits on it, and a second send
                            # to a PUSH socket with no peer left blocks forever
                            # (reports can arrive in any order).
                            told_exit = True
                            control.send(b"exit")  # the producer may unlink its ring now
            wall = time.perf_counter() - started
            for process in processes:
                try:
                    status = process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    raise PipelineFailed(f"{Path(process.args[1]).name} (pid {process.pid}) "
                                         "did not exit within 60 s of the end") from None
                if status != 0:
                    raise PipelineFailed(f"{Path(process.args[1]).name} (pid {process.pid}) "
                                         f"{describe_exit(status)} after reporting")
        finally:
            for fd in exits:
                os.close(fd)
            stop(processes)
            # A producer killed outright (SIGKILL) left its ring behind.
            collect_garbage(shmask.Config.from_env(env).name_prefix)
            results.close(linger=0)
            control.close(linger=0)
            context.term()
    return _report(console, args, stats, wall, total_rows)


def stop(processes: list[subprocess.Popen]) -> None:
    """Children still running (the pipeline failed): SIGTERM, so that the
    producer unlinks its ring; SIGKILL for one that does not go in 2 s."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _report(console: Console, args, stats, wall: float, total_rows: int) -> int:  # type: ignore[no-untyped-def]
    scheduler = stats["scheduler"][0]
    detokenizer = stats["detokenizer"][0]
    tokenizers = stats["tokenizer"]
    rows = sum(t["rows"] for t in tokenizers)
    mismatches = sum(t["mismatches"] for t in tokenizers)
    table = Table(title=f"shmask pipeline: {args.requests} requests x {args.tokens} tokens, "
                        f"top_k {args.top_k}, {args.mode} mode, emission every {args.emit_every}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("chunks", f"{sum(t['chunks'] for t in tokenizers):,}")
    table.add_row("rows (expected)", f"{rows:,} ({total_rows:,})")
    table.add_row("MB moved through shared memory", f"{scheduler['payload_bytes'] / 1e6:,.1f}")
    table.add_row("MB over sockets (scheduler -> detokenizer)", f"{scheduler['socket_bytes'] / 1e6:,.3f}")
    table.add_row("mismatched rows", f"[{'green' if mismatches == 0 else 'red'}]{mismatches}")
    table.add_row("inline fallbacks", f"{scheduler['inline_chunks']}")
    table.add_row("scheduler: append_step total", f"{scheduler['append_s'] * 1000:,.1f} ms")
    table.add_row("scheduler: per emission (median)", f"{scheduler['emission_ms_median']:.2f} ms")
    table.add_row("detokenizer: per emission (median)", f"{detokenizer['emission_ms_median']:.3f} ms")
    table.add_row("tokenizer: open total", f"{sum(t['open_s'] for t in tokenizers) * 1000:,.1f} ms")
    table.add_row("tokenizer: to_lists total", f"{sum(t['build_s'] for t in tokenizers) * 1000:,.1f} ms")
    table.add_row("tokenizer: per emission (median, incl. checking)",
                  f"{max(t['emission_ms_median'] for t in tokenizers):.1f} ms")
    table.add_row("wall time", f"{wall:.1f} s")
    console.print(table)
    ok = mismatches == 0 and rows == total_rows
    if args.summary_json:
        Path(args.summary_json).write_bytes(msgspec.json.encode({
            "rows": rows, "expected_rows": total_rows, "mismatches": mismatches,
            "chunks": sum(t["chunks"] for t in tokenizers),
            "inline_chunks": scheduler["inline_chunks"], "wall_s": wall,
            "scheduler": scheduler, "detokenizer": detokenizer, "tokenizers": tokenizers,
        }))
    console.print("[green]OK: every row arrived intact[/]" if ok else "[red]FAILED[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

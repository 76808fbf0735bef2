"""Runs scheduler -> detokenizer -> tokenizer(s) as separate OS processes
joined by zmq, moves every sampling mask through shmask, checks every row,
and prints what moved and what it cost.

    python examples/pipeline.py [--requests 256 --tokens 512 --top-k 1000]

shmask settings come from SHMASK_* environment variables (docs/configuration.md),
which the child processes inherit.
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
from workload import request_lengths

HERE = Path(__file__).resolve().parent


def main() -> int:
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
        common = ["--results", endpoint("results")]
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
                    if results.poll(1000) == 0:
                        failed = [p.args[1] for p in processes if p.poll() not in (None, 0)]
                        if all(p.poll() is not None for p in processes):
                            failed = failed or ["every process exited before reporting"]
                        if failed or time.monotonic() > deadline:
                            raise RuntimeError(f"pipeline stalled or failed: {failed or 'timeout'}")
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
                process.wait(timeout=60)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            results.close(linger=0)
            control.close(linger=0)
            context.term()
    return _report(console, args, stats, wall, total_rows)


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

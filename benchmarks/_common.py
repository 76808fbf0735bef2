"""Helpers shared by the benchmarks: workloads, clocks, child processes,
checksums and tables.

Child processes never import rich; only the parent prints.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
VOCAB = 151_936  # a Qwen-sized vocabulary, so ids use the int32 range a real tokenizer does
BATCH = 256  # requests decoding together
EMIT_TOKENS = 50  # tokens per request between two emissions
SEGMENT_PREFIX = "shmaskbench"  # our own ring names, so cleanup never touches anyone else's
POOL_STEPS = 7  # coprime with the emission interval: consecutive emissions carry different rows
MODES = ("support", "selected")
TRANSPORTS = ("lists", "arrays", "oob", "shmask")


# ------------------------------------------------------------------ clocks

def now() -> float:
    """CLOCK_MONOTONIC: one clock for every process of this host, so a
    timestamp taken by the scheduler can be compared with the tokenizer's."""
    return time.monotonic()


def cpu_seconds() -> float:
    """CPU of the whole process, every thread included (zmq's I/O threads):
    CLOCK_PROCESS_CPUTIME_ID, exact where getrusage is tick-sampled (its
    error would swamp the few milliseconds shmask spends per emission)."""
    return time.process_time()


def thread_cpu() -> float:
    """CPU of the calling thread only: used to take the harness's own work
    (checksums) and response building out of a process's total."""
    return time.thread_time()


def median_ms(values: Iterable[float]) -> float:
    values = list(values)
    return 1000.0 * statistics.median(values) if values else float("nan")


def ratio(slow: float, fast: float) -> float:
    return slow / fast if fast > 0 else float("inf")


# ---------------------------------------------------------------- workload

@dataclass
class StepPool:
    """Pre-generated decode steps, so no benchmark measures the RNG.

    Step i uses slot i % POOL_STEPS: `lengths[p]` int32[B], `ids[p]` the
    padded host buffer int32[B, W] an engine copies from the GPU, and
    `logprobs[p]` float32[B, W] (support mode) or float32[B] (selected)."""

    lengths: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray

    def step(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slot = index % len(self.lengths)
        return self.lengths[slot], self.ids[slot], self.logprobs[slot]

    def emission_crc(self, first_step: int, steps: int) -> int:
        """The checksum the tokenizer must compute for the rows of steps
        [first_step, first_step + steps): see rows_crc."""
        crc = 0
        slots = [(first_step + s) % len(self.lengths) for s in range(steps)]
        support = self.logprobs.ndim == 3
        for r in range(self.ids.shape[1]):
            lengths = np.array([self.lengths[p, r] for p in slots], np.int32)
            ids = np.concatenate([self.ids[p, r, :n] for p, n in zip(slots, lengths, strict=True)])
            if support:
                logprobs = np.concatenate(
                    [self.logprobs[p, r, :n] for p, n in zip(slots, lengths, strict=True)])
            else:
                logprobs = np.array([self.logprobs[p, r] for p in slots], np.float32)
            crc = rows_crc(lengths, ids, logprobs, crc)
        return crc


def make_pool(batch: int, width: int, mode: str, seed: int = 0) -> StepPool:
    """Rows of `width - 3 .. width` entries (a top_k support, a few rows
    short so the CSR lengths are exercised), random ids and logprobs."""
    rng = np.random.default_rng(seed)
    shortest = max(1, width - 3)
    lengths = rng.integers(shortest, width + 1, size=(POOL_STEPS, batch), dtype=np.int32)
    ids = rng.integers(0, VOCAB, size=(POOL_STEPS, batch, width), dtype=np.int32)
    shape = (POOL_STEPS, batch, width) if mode == "support" else (POOL_STEPS, batch)
    logprobs = rng.standard_normal(shape, dtype=np.float32) - np.float32(5.0)
    return StepPool(lengths, ids, logprobs)


def ring_mb_for(batch: int, tokens: int, width: int, copies: float) -> int:
    """A ring holding `copies` emissions of full-width support rows plus the
    Writer's 25% staging slack, in MiB (shmask rounds up to a power of two)."""
    emission = batch * tokens * width * 8 * 1.25
    return max(8, int(copies * emission / 2**20) + 1)


# --------------------------------------------------------------- checksums

def rows_crc(lengths: Any, ids: Any, logprobs: Any, crc: int = 0) -> int:
    """CRC-32 of one request's chunk (lengths, then ids, then logprobs, as
    int32/int32/float32 bytes), chained onto `crc` across requests."""
    for part in (lengths, ids, logprobs):
        crc = zlib.crc32(np.ascontiguousarray(part), crc)
    return crc


def lists_crc(ids_rows: Sequence[list[int]], logprobs_rows: Sequence[Any], crc: int = 0) -> int:
    """rows_crc of a request whose rows arrived as Python lists."""
    lengths = np.array([len(row) for row in ids_rows], np.int32)
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(ids_rows), np.int32, count=total)
    if logprobs_rows and isinstance(logprobs_rows[0], list):
        logprobs = np.fromiter(itertools.chain.from_iterable(logprobs_rows), np.float32, count=total)
    else:
        logprobs = np.array(logprobs_rows, np.float32)
    return rows_crc(lengths, ids, logprobs, crc)


def csr_to_lists(lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                 support: bool) -> tuple[list[list[int]], list[Any]]:
    """The response lists a peer tokenizer builds from its numpy chunk: one
    tolist per array, then one slice per row (the cheapest pure-Python way)."""
    bounds = [0, *itertools.accumulate(lengths.tolist())]
    flat_ids = ids.tolist()
    ids_rows = [flat_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    flat_logprobs = logprobs.tolist()
    if not support:
        return ids_rows, flat_logprobs
    return ids_rows, [flat_logprobs[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --------------------------------------------------------- child processes

def launch(script: Path, role: str, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start `python script child <role> <spec>`: a real OS process."""
    return subprocess.Popen([sys.executable, str(script), "child", role, json.dumps(spec)],
                            cwd=str(BENCH_DIR.parent))


def launch_own_group(script: Path, role: str, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """launch(), the child in a process group of its own (kill_groups ends
    it); the child should call die_with_parent() first thing."""
    return subprocess.Popen([sys.executable, str(script), "child", role, json.dumps(spec)],
                            cwd=str(BENCH_DIR.parent), start_new_session=True)


def kill_groups(children: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of every child still running, then reap it."""
    for child in children:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()


def die_with_parent(parent_pid: int) -> None:
    """In a child of launch_own_group: have Linux send this process SIGTERM
    when its parent dies, and exit on SIGTERM through the usual cleanup
    (`finally` blocks: a Writer unlinks its ring), so a parent killed
    outright (its process group killed by a test's timeout) leaves nothing
    running in the children's own groups."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's timeout still kills the group
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)


def segments_of(pid: int) -> list[str]:
    """Our ring segments in /dev/shm created by process `pid` (other
    benchmarks sharing the machine use the same prefix)."""
    return [name for name in leftover_segments()
            if name.split("-")[2:3] == [str(pid)]]  # <prefix>-<uid>-<pid>-<random>


def remove_segments_of(pid: int) -> list[str]:
    """Unlink the ring segments of process `pid` (one that was killed
    before it could close its Writer); returns their names."""
    removed = []
    for name in segments_of(pid):
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def wait_children(children: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every child; on a timeout or a failure kill the others (by
    their own pid) so nothing outlives the benchmark, then raise."""
    deadline = time.monotonic() + timeout_s
    try:
        for child in children:
            remaining = max(0.1, deadline - time.monotonic())
            rc = child.wait(remaining)
            if rc != 0:
                raise RuntimeError(f"benchmark child {child.args[3]!r} exited with {rc}")
    except BaseException:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        raise


def write_result(out_dir: str, role: str, result: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, f"{role}.json"), "w") as f:
        json.dump(result, f)


def read_result(out_dir: str, role: str) -> dict[str, Any]:
    with open(os.path.join(out_dir, f"{role}.json")) as f:
        result: dict[str, Any] = json.load(f)
    return result


def leftover_segments() -> list[str]:
    """Our ring segments still in /dev/shm (there must be none at the end)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX + "-"))
    except FileNotFoundError:
        return []


# ------------------------------------------------------------------ output

_console = None


def console() -> Any:
    """One recording rich console for every part, so run.py can save the
    whole output as text."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(record=True, width=200)
    return _console


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                note: str = "") -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=note or None, caption_justify="left")
    for i, column in enumerate(columns):
        # the first column names the row: never cut (other columns wrap first)
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(fmt(value) for value in row))
    console().print(table)


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table (for RESULTS.md), values formatted as fmt()."""
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if i == 0 else "--:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(fmt(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN: not measured
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 0.1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def kernel_us(call, runs: int) -> dict[str, float]:
    """Each GPU activity's mean device us over ``runs`` calls of ``call``
    (torch.profiler), by its name, largest first (capture_bf16.py and
    capture_stages.py)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize()
    parts: dict[str, float] = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:  # torch before device_time_total
            total = event.cuda_time_total
        if total > 0:
            parts[event.key] = parts.get(event.key, 0.0) + total / runs
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def gpu_and_host_us(calls, reps: int, per_rep: int,
                    cpu: list[float] | None = None) -> tuple[float, float]:
    """(GPU us, host us) per call of ``calls`` (run in turn), medians of
    ``reps``: the GPU is kept busy by a sleep kernel long enough to cover
    the enqueue of ``per_rep`` calls, so the events between the first and
    the last call see device time only, and the host timer sees the Python
    call only (capture_bf16.py and sweep.py). ``cpu``: appended with the
    median CPU time of the calling thread a call (time.thread_time), which
    a host busy with other processes does not inflate as it does the wall
    time (the sweep prints both)."""
    import torch  # the GPU benchmarks' alone: _common stays importable without it

    n = len(calls)
    for i in range(3 * n):  # warm up (compiles, allocator pools)
        calls[i % n]()
    torch.cuda.synchronize()
    host_samples, gpu_samples, cpu_samples = [], [], []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    cycles = 2_000_000  # grown until the sleep outlasts the enqueue
    attempts = 0
    while len(gpu_samples) < reps and attempts < reps + 6:
        attempts += 1
        torch.cuda._sleep(cycles)
        start.record()
        began, began_cpu = time.perf_counter(), time.thread_time()
        for i in range(per_rep):
            calls[i % n]()
        host = (time.perf_counter() - began) / per_rep
        host_cpu = (time.thread_time() - began_cpu) / per_rep
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end) * 1e3 / per_rep
        # If the GPU finished the sleep before the host had queued the
        # calls (1.98e3 cycles per us: the H200's clock), the events
        # measured the host too: grow the sleep, retry.
        if host * per_rep * 1e6 > cycles / 1.98e3 * 0.8:
            cycles = int(host * per_rep * 1e6 * 1.98e3 * 2)
            continue
        host_samples.append(host * 1e6)
        cpu_samples.append(host_cpu * 1e6)
        gpu_samples.append(gpu)
    if cpu is not None:
        cpu.append(statistics.median(cpu_samples) if cpu_samples else float("nan"))
    if not gpu_samples:
        return float("nan"), float("nan")
    return statistics.median(gpu_samples), statistics.median(host_samples)

"""The response leg at scale (issue 18, item 5): does the tokenizer build
every request's response as fast as decode produces the rows?

    scheduler --PUSH/PULL--> detokenizer --PUSH/PULL--> tokenizer 0 .. N-1

Separate OS processes, zmq ipc:// between them, rows in a shmask ring
(support mode, Config.from_env: SHMASK_* variables apply, the ring size and
segment prefix are set here).

  scheduler    R requests decoding together, paced at --step-ms per decode
               step (a 14 ms GPU step, during which the scheduler appends the
               previous step's [R, W] rows with one Writer.append_step; a
               scheduler later than the step delays the next one); every
               --emission steps one Writer.take_batch and one RefBatch sent.
               It never waits for the tokenizers: a tokenizer that falls
               behind fills the ring (full waits, inline chunks, leases).
  detokenizer  routes each emission the way SGLang's multi-tokenizer mode
               does, by request: request r goes to tokenizer r % N, with
               RefBatch.select (it never touches the rows).
  tokenizer    per emission: opens every chunk it was sent, builds each
               request's response (an SGLang meta_info dict whose three
               sampling-mask fields are shmask.adapters.sglang.meta_info_rows
               of the chunk, all of the emission's written by
               shmask.response_json.dumps_many: each response whole on one of
               SHMASK_JSON_THREADS threads, by the native response writer,
               straight from the ring into the response's bytes), and
               releases the chunks. Incremental streaming: each response carries the
               emission's rows.

Per emission (warmup left out: by default as many emissions as lap the ring
once, so every process has its ring pages mapped, as in a long-running server):
  decode ms      steps x step ms (nominal); "measured" is the median time
                 between two emissions at the scheduler
  response ms    a tokenizer's busy time for one emission: recv'd batch ->
                 chunks opened -> every response built -> chunks released
                 (the byte-identity check is taken out); p50 and p90 over
                 emissions, the slowest tokenizer's
  ratio          response p50 / nominal decode per emission (issue 18: <= 25%
                 at 256 requests, < 100% at 1,024, one tokenizer)
  lag            the scheduler's emission -> that tokenizer holding every
                 response of it (one CLOCK_MONOTONIC for all processes)
  keeps up       every emission's lag below one decode interval, and no ring
                 full wait, expired lease or inline chunk at the scheduler, no
                 chunk reclaimed before its tokenizer opened it
  mismatches     for each emission's first and last request of every
                 tokenizer: the response bytes against SGLang's way (to_lists,
                 SGLang's SamplingMaskChunk where installed, else the same
                 per-row tolist loop, then orjson.dumps of the same meta_info
                 dict) must be identical, and the rows must equal the
                 scheduler's; plus any emission a tokenizer never got and any
                 response that failed to build

    python benchmarks/response_leg.py --emissions 20 --out results.json   # full sweep
    python benchmarks/response_leg.py --requests 32 64 --support 200 --emissions 3

The full sweep (256 and 1,024 requests x 1, 2, 4 tokenizers) is decode-paced:
each configuration runs (warmup + emissions) x 50 x 14 ms plus a few seconds
to start, ~25 s at --emissions 20. The ring holds 3 emissions x 1.25 (2 GiB
at 1,024 requests x 1000 support) in /dev/shm. It prints a markdown table
(for RESULTS.md) with the command, machine and date; --out keeps every
per-emission number. Exits non-zero on a mismatch or a segment left behind;
a missed goal is reported, not an error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zmq
from _common import (
    POOL_STEPS,
    SEGMENT_PREFIX,
    cpu_seconds,
    die_with_parent,
    kill_groups,
    launch_own_group,
    make_pool,
    markdown_table,
    now,
    read_result,
    remove_segments_of,
    ring_mb_for,
    segments_of,
    wait_children,
    write_result,
)
from responses import sglang_chunk_class, sglang_lists
from transport import HEADER, LINGER_MS, MARK, STOP, socket, wait_readable

import shmask
from shmask import response_json
from shmask.adapters.sglang import LENGTH_FIELD, LOGPROBS_FIELD, MASK_FIELD, meta_info_rows

SCRIPT = Path(__file__).resolve()
RING_COPIES = 3  # emissions the ring holds (x1.25 staging slack): room to fall a little behind
GOALS = {256: 0.25, 1024: 1.0}  # issue 18: response/decode per emission, one tokenizer
COLUMNS = ("requests", "tokenizers", "decode ms/emission (measured)", "response ms p50",
           "response ms p90", "ratio p50 (p90)", "scaling vs 1 tokenizer", "keeps up?",
           "lag ms p90 (max)", "full waits / expired / inline", "mismatches (checked)")


# ------------------------------------------------------------------ helpers

def ring_config(spec: dict[str, Any]) -> shmask.Config:
    return shmask.Config.from_env(ring_mb=spec["ring_mb"], name_prefix=SEGMENT_PREFIX)


def endpoint(spec: dict[str, Any], name: str) -> str:
    return f"ipc://{spec['dir']}/{name}"


def control(out: zmq.Socket[Any], acks: zmq.Socket[Any], index: int, tokenizers: int) -> None:
    """Send MARK (every process up and connected) or STOP through the
    pipeline; wait until every tokenizer has acked it."""
    out.send(HEADER.pack(index, now()))
    for _ in range(tokenizers):
        wait_readable(acks)
        acks.recv()


def meta_info(request: int, completion_tokens: int, mask_fields: dict[str, Any]) -> dict[str, Any]:
    """The response's meta_info: a few of SGLang's own fields, then the three
    sampling-mask fields (holes the native writer fills, or SGLang's lists)."""
    return {"id": f"req-{request}", "finish_reason": None, "prompt_tokens": 128,
            "completion_tokens": completion_tokens, **mask_fields}


def expected_rows(pool: Any, request: int, first_step: int,
                  steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's rows of steps [first_step, first_step + steps), as the scheduler appended them."""
    slots = [(first_step + s) % POOL_STEPS for s in range(steps)]
    lengths = pool.lengths[slots, request]
    ids = np.concatenate([pool.ids[p, request, :n] for p, n in zip(slots, lengths, strict=True)])
    logprobs = np.concatenate([pool.logprobs[p, request, :n]
                               for p, n in zip(slots, lengths, strict=True)])
    return lengths, ids, logprobs


def percentile_ms(values: list[float], q: float) -> float:
    return 1000.0 * float(np.percentile(values, q)) if values else float("nan")


# -------------------------------------------------------------------- roles

def run_scheduler(spec: dict[str, Any]) -> None:
    requests, emission, tokenizers = spec["requests"], spec["emission"], spec["tokenizers"]
    step_s = spec["step_ms"] / 1000.0
    total = (spec["warmup"] + spec["emissions"]) * emission
    pool = make_pool(requests, spec["support"], "support", seed=spec["seed"])
    writer = shmask.Writer(ring_config(spec))
    context: zmq.Context[Any] = zmq.Context()
    result: dict[str, Any] = {}
    try:
        handles = np.array([writer.open_queue("support").handle for _ in range(requests)], np.int64)
        out = socket(context, zmq.PUSH, endpoint(spec, "rows"), bind=True)
        acks = socket(context, zmq.PULL, endpoint(spec, "acks"), bind=True)
        control(out, acks, MARK, tokenizers)
        append_s: list[float] = []
        take_s: list[float] = []
        emitted_at: list[float] = []
        overshoot_s: list[float] = []
        late_steps = 0  # steps whose deadline had passed before the step's sleep
        started = deadline = now()
        for step in range(total):
            deadline += step_s  # the GPU's step ends here
            delay = deadline - now()
            if delay > 0:
                time.sleep(delay)
                overshoot_s.append(now() - deadline)
            else:  # the GPU waited for the scheduler: the next step starts now, no catching up
                late_steps += 1
                deadline = now()
            t0 = now()
            writer.append_step(handles, *pool.step(step))
            append_s.append(now() - t0)
            if (step + 1) % emission == 0:
                emitted = now()
                batch = writer.take_batch(handles, final=step + 1 == total)
                out.send_multipart([HEADER.pack(len(emitted_at), emitted), batch.to_bytes()])
                take_s.append(now() - emitted)
                emitted_at.append(emitted)
        finished = now()
        control(out, acks, STOP, tokenizers)  # every tokenizer is done with every chunk
        writer.reclaim()  # counts any lease that expired under a slow tokenizer
        result = {"started": started, "finished": finished, "emitted_at": emitted_at,
                  "append_s": append_s, "take_s": take_s, "overshoot_s": overshoot_s,
                  "late_steps": late_steps, "stats": asdict(writer.stats),
                  "ring_bytes": writer.config.ring_capacity_bytes}
    finally:
        writer.close()
        context.destroy(linger=LINGER_MS)
    write_result(spec["dir"], "scheduler", result)


def run_detokenizer(spec: dict[str, Any]) -> None:
    tokenizers = spec["tokenizers"]
    context: zmq.Context[Any] = zmq.Context()
    forward_s: list[float] = []
    try:
        inp = socket(context, zmq.PULL, endpoint(spec, "rows"), bind=False)
        outs = [socket(context, zmq.PUSH, endpoint(spec, f"tokenizer{i}"), bind=False)
                for i in range(tokenizers)]
        while True:
            wait_readable(inp)
            frames = inp.recv_multipart()
            t0 = now()
            index, _ = HEADER.unpack(frames[0])
            if index in (MARK, STOP):
                for out in outs:
                    out.send(frames[0])
                if index == STOP:
                    break
                continue
            batch = shmask.RefBatch.from_bytes(frames[1])
            owner = np.arange(len(batch)) % tokenizers  # entry r is request r
            for n, out in enumerate(outs):
                routed = np.flatnonzero(owner == n)
                part = batch.select(routed) if tokenizers > 1 else batch
                out.send_multipart([frames[0], routed.astype(np.int32).tobytes(), part.to_bytes()])
            forward_s.append(now() - t0)
    finally:
        context.destroy(linger=LINGER_MS)
    write_result(spec["dir"], "detokenizer", {"forward_s": forward_s})


def run_tokenizer(spec: dict[str, Any], index: int) -> None:
    emission = spec["emission"]
    pool = make_pool(spec["requests"], spec["support"], "support", seed=spec["seed"])
    chunk_class = sglang_chunk_class()  # imported now: importing SGLang takes seconds
    reader = shmask.Reader(ring_config(spec))
    context: zmq.Context[Any] = zmq.Context()
    log: dict[str, list[Any]] = {key: [] for key in (
        "index", "emitted_at", "received_at", "built_at", "done_at", "busy_s", "cpu_s",
        "requests", "response_bytes")}
    checked = json_mismatches = row_mismatches = stale = failed = 0
    try:
        inp = socket(context, zmq.PULL, endpoint(spec, f"tokenizer{index}"), bind=True)
        acks = socket(context, zmq.PUSH, endpoint(spec, "acks"), bind=False)
        while True:
            wait_readable(inp)
            frames = inp.recv_multipart()
            received = now()
            emission_index, emitted = HEADER.unpack(frames[0])
            if emission_index in (MARK, STOP):
                acks.send(frames[0])
                if emission_index == STOP:
                    break
                continue
            cpu0, t0 = cpu_seconds(), now()
            requests = np.frombuffer(frames[1], np.int32).tolist()
            chunks, opened = [], []
            for request, ref in zip(requests, shmask.RefBatch.from_bytes(frames[2]), strict=True):
                try:
                    chunks.append(reader.open(ref))
                    opened.append(request)
                except shmask.StaleChunkError:  # reclaimed: this tokenizer fell a lease behind
                    stale += 1
            requests = opened
            completion_tokens = (emission_index + 1) * emission
            sampled = {0, len(chunks) - 1}  # kept for the check; the others are dropped as sent
            kept, response_bytes = {}, 0
            # The emission's responses at once, each whole on one JSON thread;
            # a request whose response fails costs only that request.
            responses = response_json.dumps_many(
                [meta_info(request, completion_tokens, meta_info_rows(chunk))
                 for request, chunk in zip(requests, chunks, strict=True)],
                return_exceptions=True)
            for k, response in enumerate(responses):
                if isinstance(response, Exception):
                    failed += 1
                    continue
                response_bytes += len(response)
                if k in sampled:
                    kept[k] = response
            del responses  # sent: dropped once built, as a server does
            built, cpu1 = now(), cpu_seconds()

            # Not timed: the first and last request against SGLang's way and the scheduler's rows.
            for k, response in kept.items():
                chunk, request = chunks[k], requests[k]
                masks, logprobs = sglang_lists(chunk_class, chunk.lengths, chunk.ids, chunk.logprobs)
                theirs = orjson.dumps(meta_info(request, completion_tokens, {
                    MASK_FIELD: masks, LOGPROBS_FIELD: logprobs, LENGTH_FIELD: len(masks)}))
                json_mismatches += response != theirs
                lengths, ids, values = expected_rows(pool, request, emission_index * emission,
                                                     emission)
                row_mismatches += not (np.array_equal(chunk.lengths, lengths)
                                       and np.array_equal(chunk.ids, ids)
                                       and np.array_equal(chunk.logprobs.view(np.int32),
                                                          values.view(np.int32)))
                checked += 1

            released, cpu2 = now(), cpu_seconds()
            for chunk in chunks:
                chunk.release()
            done, cpu3 = now(), cpu_seconds()
            for key, value in (("index", emission_index), ("emitted_at", emitted),
                               ("received_at", received), ("built_at", built), ("done_at", done),
                               ("busy_s", (built - t0) + (done - released)),
                               ("cpu_s", (cpu1 - cpu0) + (cpu3 - cpu2)),
                               ("requests", len(chunks)),
                               ("response_bytes", response_bytes)):
                log[key].append(value)
    finally:
        reader.close()
        context.destroy(linger=LINGER_MS)
    from shmask.response_json import json_threads

    write_result(spec["dir"], f"tokenizer{index}", {
        **log, "checked": checked, "json_mismatches": json_mismatches,
        "row_mismatches": row_mismatches, "stale": stale, "failed": failed,
        "json_threads": json_threads(),
        "sglang": "SGLang's SamplingMaskChunk" if chunk_class else "the same per-row loop"})


def child(role: str, spec: dict[str, Any]) -> None:
    die_with_parent(spec["parent"])
    if role == "scheduler":
        run_scheduler(spec)
    elif role == "detokenizer":
        run_detokenizer(spec)
    elif role.startswith("tokenizer"):
        run_tokenizer(spec, int(role.removeprefix("tokenizer")))
    else:
        raise SystemExit(f"unknown role {role!r}")


# ------------------------------------------------------------------- parent

def run_config(args: argparse.Namespace, requests: int, tokenizers: int) -> dict[str, Any]:
    """One configuration: every process started in its own group, waited
    for, and killed (group and all) on a timeout, a failure or an exit."""
    ring_mb = args.ring_mb or ring_mb_for(requests, args.emission, args.support, RING_COPIES)
    warmup = args.warmup
    if warmup is None:
        # Lap the ring once before measuring: a long-running server's ring pages
        # are mapped in every process already; first touches are a one-off cost.
        emission_bytes = requests * args.emission * args.support * 8
        warmup = math.ceil(shmask.Config(ring_mb=ring_mb).ring_capacity_bytes / emission_bytes)
    directory = tempfile.mkdtemp(prefix="shmaskbench-")
    spec = {"requests": requests, "tokenizers": tokenizers, "support": args.support,
            "emission": args.emission, "emissions": args.emissions, "warmup": warmup,
            "step_ms": args.step_ms, "seed": args.seed, "ring_mb": ring_mb, "dir": directory,
            "parent": os.getpid()}
    decode_s = (warmup + args.emissions) * args.emission * args.step_ms / 1000.0
    timeout_s = args.timeout or 120.0 + 5.0 * decode_s
    children: list[Any] = []
    started = time.monotonic()
    try:
        children = [launch_own_group(SCRIPT, f"tokenizer{i}", spec) for i in range(tokenizers)]
        children += [launch_own_group(SCRIPT, "detokenizer", spec),
                     launch_own_group(SCRIPT, "scheduler", spec)]
        try:
            wait_children(children, timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{requests} requests, {tokenizers} tokenizer(s): not done within "
                             f"{timeout_s:.0f} s (--timeout); every process killed") from None
        roles = ["scheduler", "detokenizer", *(f"tokenizer{i}" for i in range(tokenizers))]
        results = {role: read_result(directory, role) for role in roles}
    finally:
        kill_groups(children)
        if children and children[-1].returncode != 0:  # killed before closing its Writer
            remove_segments_of(children[-1].pid)
        shutil.rmtree(directory, ignore_errors=True)
    row = summarize(spec, results, time.monotonic() - started)
    # Only this run's scheduler's segments: other runs may share the machine and the prefix.
    row["segments_left"] = segments_of(children[-1].pid)
    return row


def summarize(spec: dict[str, Any], results: dict[str, Any], wall_s: float) -> dict[str, Any]:
    scheduler, warmup = results["scheduler"], spec["warmup"]
    total = spec["warmup"] + spec["emissions"]
    decode_ms = spec["emission"] * spec["step_ms"]
    emitted = scheduler["emitted_at"]
    intervals = [b - a for a, b in zip(emitted, emitted[1:], strict=False)][max(0, warmup - 1):]
    per_tokenizer = []
    for n in range(spec["tokenizers"]):
        tok = results[f"tokenizer{n}"]
        measured = [i for i, index in enumerate(tok["index"]) if index >= warmup]
        busy = [tok["busy_s"][i] for i in measured]
        lag = [tok["built_at"][i] - tok["emitted_at"][i] for i in measured]
        missing = len(set(range(total)) - set(tok["index"]))
        per_tokenizer.append({
            "requests_per_emission": tok["requests"][0] if tok["requests"] else 0,
            "response_ms_p50": percentile_ms(busy, 50), "response_ms_p90": percentile_ms(busy, 90),
            "cpu_ms_p50": percentile_ms([tok["cpu_s"][i] for i in measured], 50),
            "lag_ms_p50": percentile_ms(lag, 50), "lag_ms_p90": percentile_ms(lag, 90),
            "lag_ms_max": percentile_ms(lag, 100),
            "response_mb_per_emission": float(np.median([tok["response_bytes"][i]
                                                         for i in measured])) / 1e6,
            "checked": tok["checked"], "json_mismatches": tok["json_mismatches"],
            "row_mismatches": tok["row_mismatches"], "missing_emissions": missing,
            "failed_responses": tok["failed"], "stale_chunks": tok["stale"],
            "json_threads": tok["json_threads"], "sglang": tok["sglang"],
            "busy_ms": [1000 * v for v in busy], "lag_ms": [1000 * v for v in lag]})
    stats = scheduler["stats"]
    slowest = max(per_tokenizer, key=lambda t: t["response_ms_p50"])
    row = {
        "requests": spec["requests"], "tokenizers": spec["tokenizers"], "support": spec["support"],
        "emission": spec["emission"], "emissions": spec["emissions"], "warmup": warmup,
        "step_ms": spec["step_ms"], "ring_mb": scheduler["ring_bytes"] // 2**20,
        "decode_ms": decode_ms,
        "decode_ms_measured": 1000 * float(np.median(intervals)) if intervals else float("nan"),
        "response_ms_p50": slowest["response_ms_p50"],
        "response_ms_p90": max(t["response_ms_p90"] for t in per_tokenizer),
        "lag_ms_p90": max(t["lag_ms_p90"] for t in per_tokenizer),
        "lag_ms_max": max(t["lag_ms_max"] for t in per_tokenizer),
        "full_waits": stats["full_waits"], "expired": stats["expired"],
        "inline_chunks": stats["inline_chunks"],
        "stale_chunks": sum(t["stale_chunks"] for t in per_tokenizer),
        "checked": sum(t["checked"] for t in per_tokenizer),
        "mismatches": sum(t["json_mismatches"] + t["row_mismatches"] + t["missing_emissions"]
                          + t["failed_responses"] for t in per_tokenizer),
        "append_ms_p50": percentile_ms(scheduler["append_s"], 50),
        "take_ms_p50": percentile_ms(scheduler["take_s"], 50),
        "late_steps": scheduler["late_steps"],
        "detokenizer_ms_p50": percentile_ms(results["detokenizer"]["forward_s"][warmup:], 50),
        "json_threads": slowest["json_threads"], "sglang": slowest["sglang"],
        "wall_s": wall_s, "per_tokenizer": per_tokenizer,
    }
    row["ratio_p50"] = row["response_ms_p50"] / decode_ms
    row["ratio_p90"] = row["response_ms_p90"] / decode_ms
    row["keeps_up"] = bool(row["lag_ms_max"] < decode_ms and not row["full_waits"]
                           and not row["expired"] and not row["inline_chunks"]
                           and not row["stale_chunks"])
    return row


def table_rows(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    one = {r["requests"]: r["response_ms_p50"] for r in rows if r["tokenizers"] == 1}
    out = []
    for r in rows:
        scaling = (f"{one[r['requests']] / r['response_ms_p50']:.2f}x"
                   if r["requests"] in one and r["response_ms_p50"] > 0 else "-")
        out.append((r["requests"], r["tokenizers"], f"{r['decode_ms']:g} ({r['decode_ms_measured']:.0f})",
                    r["response_ms_p50"], r["response_ms_p90"],
                    f"{100 * r['ratio_p50']:.0f}% ({100 * r['ratio_p90']:.0f}%)", scaling,
                    "yes" if r["keeps_up"] else "no",
                    f"{r['lag_ms_p90']:.0f} ({r['lag_ms_max']:.0f})",
                    f"{r['full_waits']} / {r['expired']} / {r['inline_chunks']}",
                    f"{r['mismatches']} ({r['checked']})"))
    return out


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        goal = GOALS.get(r["requests"])
        if r["tokenizers"] != 1 or goal is None or r["support"] != 1000 or r["emission"] != 50:
            continue
        passed = r["ratio_p50"] <= goal if goal < 1 else r["ratio_p50"] < goal
        lines.append(f"goal: {r['requests']} requests, 1 tokenizer: response/decode "
                     f"{100 * r['ratio_p50']:.0f}% ({'<=' if goal < 1 else '<'} {100 * goal:.0f}%): "
                     f"{'PASS' if passed else 'MISS'}")
    return lines


def no_nan(value: Any) -> Any:
    """NaN (not measured) as null: strict JSON has no NaN."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def machine() -> str:
    from run import machine as describe  # run.py's line, so every result names the host alike

    return describe()


def commit() -> str:
    from run import commit as short_hash

    return short_hash()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--tokenizers", type=int, nargs="+", default=[1, 2, 4],
                        help="tokenizer processes (the detokenizer routes request r to r %% N)")
    parser.add_argument("--support", type=int, default=1000, help="entries per row (top_k)")
    parser.add_argument("--emission", type=int, default=50, help="decode steps per emission")
    parser.add_argument("--emissions", type=int, default=10, help="measured emissions per run")
    parser.add_argument("--warmup", type=int, default=None,
                        help="emissions not measured (default: as many as lap the ring once)")
    parser.add_argument("--step-ms", type=float, default=14.0, help="decode step (the GPU's time)")
    parser.add_argument("--ring-mb", type=int, default=0,
                        help=f"ring size (default: {RING_COPIES} emissions x 1.25, per size)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds per configuration (default: 120 + 5 x its decode time)")
    parser.add_argument("--out", default=None, help="write the raw numbers here (JSON)")
    args = parser.parse_args()
    for name in ("requests", "tokenizers"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be >= 1")
    if min(args.requests) < max(args.tokenizers):
        parser.error("every --requests value must be >= the largest --tokenizers value")
    if min(args.support, args.emission, args.emissions) < 1 or (args.warmup or 0) < 0 or args.step_ms < 0:
        parser.error("--support, --emission, --emissions must be >= 1; --warmup, --step-ms >= 0")
    # SIGTERM unwinds like Ctrl-C, so every child's process group is killed on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    started = time.monotonic()
    threads = shmask.Config.from_env().json_threads
    header = {
        "command": "python benchmarks/response_leg.py " + shlex.join(sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(), "commit": commit(),
        "SHMASK_JSON_THREADS": os.environ.get("SHMASK_JSON_THREADS", f"unset (default {threads})"),
    }
    for key, value in header.items():
        print(f"{key}: {value}", flush=True)
    rows = []
    for requests in args.requests:
        for tokenizers in args.tokenizers:
            row = run_config(args, requests, tokenizers)
            rows.append(row)
            print(f"{requests} requests, {tokenizers} tokenizer(s): response p50 "
                  f"{row['response_ms_p50']:.1f} ms vs decode {row['decode_ms']:g} ms "
                  f"({100 * row['ratio_p50']:.0f}%), lag max {row['lag_ms_max']:.0f} ms, "
                  f"mismatches {row['mismatches']}, {row['wall_s']:.1f} s", flush=True)
    first = rows[0]
    sizes = [r for r in rows if r["tokenizers"] == rows[0]["tokenizers"]]  # one per --requests
    rings = "/".join(str(r["ring_mb"]) for r in sizes)
    warmups = "/".join(str(r["warmup"]) for r in sizes)
    print(f"\nResponse leg: {first['support']} support, emission every {first['emission']} steps of "
          f"{first['step_ms']:g} ms, {warmups} warmup + {first['emissions']} measured "
          f"emissions, ring {rings} MiB (per requests value), "
          f"{first['json_threads']} JSON threads per tokenizer, reference: {first['sglang']}\n")
    print(markdown_table(COLUMNS, table_rows(rows)))
    print()
    for line in verdicts(rows):
        print(line)
    mismatches = sum(r["mismatches"] for r in rows)
    leftovers = [name for r in rows for name in r["segments_left"]]
    print(f"mismatches: {mismatches}")
    print(f"segments left in /dev/shm: {len(leftovers)} {' '.join(leftovers)}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(no_nan({**header, "configs": rows}), indent=1))
    return 1 if mismatches or leftovers else 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "child":
        child(sys.argv[2], json.loads(sys.argv[3]))
    else:
        sys.exit(main())

"""Part 4: a decode loop. The scheduler runs 256 requests x 512 tokens; each
step is a 14 ms sleep standing in for the GPU, then the step's bookkeeping
(the [256, W] host buffer appended to the transport's staging); every 50
tokens and at the finish it emits, without waiting for anyone. The same
detokenizer and tokenizer processes as part 1 forward the emissions and
build the response lists. Conservative: nothing the scheduler does overlaps
the sleep, so every millisecond of transport work shows in tokens/s.

  off             masks off: emissions carry no rows (the tokenizer still gets one message each)
  floor           masks on, but the scheduler only copies each step's ids and logprobs into a
                  staging array with numpy and sends nothing: the floor of any design that copies
                  rows out of the host buffer on the scheduler's thread
  tokens/s        256 x 512 / the scheduler's wall time from the first step to the last emission
  last response   time from the first step until the tokenizer built the last response
  append, emit    the scheduler's bookkeeping and emissions, per step
  sleep overshoot how much longer than 14 ms the sleep took (the OS waking the scheduler late
                  while the tokenizer keeps the other core busy)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import transport as part1
from _common import BATCH, EMIT_TOKENS, console, make_pool, now, print_table, ring_mb_for

SCRIPT = Path(__file__).resolve()
STEP_S = 0.014
TOTAL_TOKENS = 512
WIDTH = 1000  # top_k 1000, support mode
TARGET_SLOWDOWN = 0.03
ROWLESS = ("off", "floor")  # transports whose emissions carry no rows


def emission_steps(total: int, interval: int) -> list[tuple[int, int]]:
    """(first step, steps) of each emission: every `interval` tokens and at the finish."""
    return [(start, min(interval, total - start)) for start in range(0, total, interval)]


def run_scheduler(spec: dict[str, Any]) -> None:
    transport = part1.make_transport(spec, "scheduler")
    pool = make_pool(spec["batch"], spec["width"], spec["mode"], seed=spec["seed"])
    context, out, acks = part1.scheduler_sockets(spec)
    total, interval = spec["total_tokens"], spec["tokens"]
    result: dict[str, Any] = {}
    try:
        # Every process up and connected before the clock starts.
        part1.round_trip(out, acks, part1.MARK)
        started = now()
        emission = 0
        sleep_s = append_s = emit_s = 0.0  # where the scheduler's wall time went
        for step in range(total):
            slept = now()
            time.sleep(STEP_S)
            appended = now()
            transport.append(*pool.step(step))
            emitted = now()
            if (step + 1) % interval == 0 or step + 1 == total:
                frames = transport.emit(final=step + 1 == total)
                out.send_multipart([part1.HEADER.pack(emission, emitted), *frames], copy=transport.copy)
                emission += 1
            sleep_s += appended - slept
            append_s += emitted - appended
            emit_s += now() - emitted
        finished = now()
        part1.round_trip(out, acks, part1.STOP)  # the tokenizer is done with every chunk
        expected = [pool.emission_crc(first, steps) if spec["transport"] not in ROWLESS else 0
                    for first, steps in emission_steps(total, interval)]
        result = {"started": started, "finished": finished, "expected_crc": expected,
                  "sleep_s": sleep_s, "append_s": append_s, "emit_s": emit_s,
                  "stats": transport.stats()}
    finally:
        transport.close()
        context.destroy(linger=part1.LINGER_MS)
    part1.write_result(spec["dir"], "scheduler", result)


def run_once(name: str, batch: int, total: int, interval: int, width: int) -> dict[str, Any]:
    spec = {"transport": name, "mode": "support", "batch": batch, "tokens": interval,
            "total_tokens": total, "width": width, "warmup": 0, "seed": 1, "ack": False,
            # The tokenizer may lag a few emissions behind while building lists.
            "ring_mb": ring_mb_for(batch, interval, width, copies=6)}
    results = part1.run_pipeline(spec, scheduler_script=SCRIPT)
    scheduler, tok = results["scheduler"], results["tokenizer"]
    mismatches = sum(a != b for a, b in zip(scheduler["expected_crc"], tok["crc"], strict=False))
    mismatches += abs(len(scheduler["expected_crc"]) - len(tok["crc"]))
    wall = scheduler["finished"] - scheduler["started"]
    return {"transport": name, "tokens_per_s": batch * total / wall, "wall_s": wall,
            "last_response_s": max(tok["built_at"]) - scheduler["started"],
            "mismatches": int(mismatches),
            "inline_chunks": scheduler["stats"].get("inline_chunks", 0),
            "full_waits": scheduler["stats"].get("full_waits", 0),
            "sleep_over_ms": 1000 * (scheduler["sleep_s"] / total - STEP_S),
            "append_ms": 1000 * scheduler["append_s"] / total,
            "emit_ms": 1000 * scheduler["emit_s"] / total}


def run(quick: bool = False) -> list[dict[str, Any]]:
    if quick:
        batch, total, interval, width, repeats = 32, 60, 20, 100, 1
    else:
        batch, total, interval, width, repeats = BATCH, TOTAL_TOKENS, EMIT_TOKENS, WIDTH, 3
    # Masks off, the copy floor and shmask alternate, three times each, to spread the
    # machine's noise; the peers are far enough off that one run each says enough.
    order = ["off", "floor", "shmask"] * repeats + ["lists", "arrays", "oob"]
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in order:
        result = run_once(name, batch, total, interval, width)
        runs.setdefault(name, []).append(result)
        console().log(f"part 4: {name:>6}: {result['tokens_per_s']:,.0f} tokens/s, last response at "
                      f"{result['last_response_s']:.2f} s, mismatches {result['mismatches']}")
    console().print(__doc__)
    rows = []
    for name in ("off", "floor", "lists", "arrays", "oob", "shmask"):
        medians = {key: float(np.median([r[key] for r in runs[name]]))
                   for key in ("tokens_per_s", "last_response_s", "append_ms", "emit_ms", "sleep_over_ms")}
        rows.append({"transport": name, **medians,
                     "mismatches": sum(r["mismatches"] for r in runs[name]),
                     "inline_chunks": sum(r["inline_chunks"] for r in runs[name]),
                     "runs": len(runs[name])})
    off = rows[0]["tokens_per_s"]
    for row in rows:
        row["slowdown"] = 1.0 - row["tokens_per_s"] / off
    print_table(
        f"Part 4 - decode loop: {batch} requests x {total} tokens, {STEP_S * 1000:g} ms step, "
        f"emission every {interval} tokens, top_k {width} support (median of runs)",
        ("transport", "runs", "tokens/s", "vs masks off", "last response s", "append ms/step",
         "emit ms/step", "sleep overshoot ms", "mismatches", "inline"),
        [(r["transport"], r["runs"], r["tokens_per_s"], f"{-100 * r['slowdown']:+.1f}%",
          r["last_response_s"], r["append_ms"], r["emit_ms"], r["sleep_over_ms"], r["mismatches"],
          r["inline_chunks"]) for r in rows]
    )
    return rows


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "child":
        if sys.argv[2] == "scheduler":
            run_scheduler(json.loads(sys.argv[3]))
        else:
            part1.ROLES[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        run(quick="--quick" in sys.argv)

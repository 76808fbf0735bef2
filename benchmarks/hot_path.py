"""The hot path before and after a change, side by side in one run: per
decode step (append_step of 256 rows), per emission (take_batch) and per
ref (Reader.open + release), for this tree and a baseline git revision.

The baseline is checked out into a temporary worktree and built there; each
round runs one child per tree, alternating, so a noisy spell of the machine
lands on both. Medians over rounds; ratios are this tree / baseline.

`--instructions` counts instead of timing: each tree runs the same workload
under valgrind's callgrind four times (setup only; + one emission's 50
append_steps; + its take_batch; + opening and releasing its 256 refs), and
the differences give instructions per step, per emission and per ref. The
counts are the same whatever else the machine is doing, so a few percent
can be told from noise on a busy 2-core VM.

    python benchmarks/hot_path.py --baseline 3e55ee9 [--rounds 7] [--instructions]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import print_table

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import numpy as np
import shmask

width, emissions, tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
batch, warm = 256, 2
rng = np.random.default_rng(width)
pool = [(np.full(batch, width, np.int32),
         rng.integers(0, 151936, (batch, width)).astype(np.int32),
         rng.standard_normal((batch, width)).astype(np.float32)) for _ in range(7)]
ring_mb = max(64, int(batch * tokens * width * 8 * 2.5 / 2**20) + 1)
config = shmask.Config(ring_mb=ring_mb, name_prefix="shmaskhot", full_wait_ms=50, lease_s=600)
append_s, take_s, open_s = [], [], []
with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
    queues = [writer.open_queue("support") for _ in range(batch)]
    if hasattr(queues[0], "handle"):
        handles = np.array([q.handle for q in queues], np.int64)
    else:  # the API before queue handles
        handles = np.array([q.slot for q in queues], np.int32)
    step = 0
    for emission in range(warm + emissions):
        measured = emission >= warm
        for _ in range(tokens):
            lengths, ids, logprobs = pool[step % len(pool)]
            step += 1
            started = time.perf_counter()
            writer.append_step(handles, lengths, ids, logprobs)
            if measured:
                append_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        refs = writer.take_batch(queues)
        if measured:
            take_s.append(time.perf_counter() - started)
        refs = list(refs)
        started = time.perf_counter()
        for ref in refs:
            reader.open(ref).release()
        if measured:
            open_s.append((time.perf_counter() - started) / len(refs))
median = lambda v: 1e6 * sorted(v)[len(v) // 2]
print(json.dumps({"append_us": median(append_s), "take_us": median(take_s),
                  "open_us": median(open_s)}))
"""

# The same workload for callgrind: warm up, then do the phases up to `upto`
# (0 none, 1 append_step x tokens, 2 + take_batch, 3 + open/release of every ref).
COUNT_CHILD = r"""
import sys
import numpy as np
import shmask

width, tokens, upto = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
batch = 256
rng = np.random.default_rng(width)
lengths = np.full(batch, width, np.int32)
ids = rng.integers(0, 151936, (batch, width)).astype(np.int32)
logprobs = rng.standard_normal((batch, width)).astype(np.float32)
ring_mb = max(64, int(batch * tokens * width * 8 * 2.5 / 2**20) + 1)
config = shmask.Config(ring_mb=ring_mb, name_prefix="shmaskhot", full_wait_ms=50, lease_s=600)
with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
    queues = [writer.open_queue("support") for _ in range(batch)]
    handles = np.array([q.handle for q in queues], np.int64)
    for phase_upto in (3, 3, upto):  # two warm emissions, then the measured phases
        if phase_upto >= 1:
            for _ in range(tokens):
                writer.append_step(handles, lengths, ids, logprobs)
        if phase_upto >= 2:
            refs = list(writer.take_batch(queues))
        if phase_upto >= 3:
            for ref in refs:
                reader.open(ref).release()
"""


def build_baseline(revision: str, where: Path) -> Path:
    tree = where / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree),
                    revision], check=True, capture_output=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                   check=True, capture_output=True)
    return tree


def run_child(tree: Path, width: int, emissions: int, tokens: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, str(width), str(emissions), str(tokens)],
                         env=env,
                         check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def count_instructions(tree: Path, width: int, tokens: int, upto: int) -> int:
    """Instructions callgrind counts for COUNT_CHILD (the whole process).
    Fixed hashing and single-threaded BLAS, so two runs of the same work
    count the same (numpy's BLAS threads spin a varying number of times)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["valgrind", "--tool=callgrind",
                              f"--callgrind-out-file={tmp}/callgrind.out", sys.executable, "-c",
                              COUNT_CHILD, str(width), str(tokens), str(upto)],
                             env=env, check=True, capture_output=True, text=True, cwd=tree)
    collected = [line for line in out.stderr.splitlines() if "Collected" in line]
    return int(collected[-1].split()[-1])


def instruction_rows(baseline: Path, widths: list[int], tokens: int) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for width in widths:
        per_tree = {}
        for name, tree in (("baseline", baseline), ("this tree", REPO)):
            counts = [count_instructions(tree, width, tokens, upto) for upto in range(4)]
            per_tree[name] = ((counts[1] - counts[0]) / tokens, counts[2] - counts[1],
                              (counts[3] - counts[2]) / 256)
        for i, label in enumerate(("append_step per step", "take_batch per emission",
                                   "open + release per ref")):
            old, new = per_tree["baseline"][i], per_tree["this tree"][i]
            rows.append((f"{label}, support {width}", f"{old:,.0f}", f"{new:,.0f}",
                         f"{new / old:.3f}"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--emissions", type=int, default=6)
    parser.add_argument("--widths", default="20,1000")
    parser.add_argument("--tokens", type=int, default=50,
                        help="decode steps per emission (1: takes on warm caches)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions with callgrind instead of timing")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.instructions:
        with tempfile.TemporaryDirectory() as tmp:
            baseline = build_baseline(args.baseline, Path(tmp))
            try:
                rows = instruction_rows(baseline, widths, args.tokens)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(baseline)], capture_output=True)
        print_table(f"Hot path: this tree against {args.baseline} (instructions, callgrind; "
                    f"256 requests x {args.tokens}-token emissions)",
                    ("measure", "baseline", "this tree", "ratio"), rows)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_baseline(args.baseline, Path(tmp))
        try:
            rows = []
            for width in widths:
                results: dict[str, list[dict[str, float]]] = {"baseline": [], "this tree": []}
                for _ in range(args.rounds):
                    results["baseline"].append(run_child(baseline, width, args.emissions,
                                                         args.tokens))
                    results["this tree"].append(run_child(REPO, width, args.emissions,
                                                          args.tokens))
                for metric, label in (("append_us", "append_step per step"),
                                      ("take_us", "take_batch per emission"),
                                      ("open_us", "open + release per ref")):
                    old = statistics.median(r[metric] for r in results["baseline"])
                    new = statistics.median(r[metric] for r in results["this tree"])
                    rows.append((f"{label}, support {width}", f"{old:,.1f}", f"{new:,.1f}",
                                 f"{new / old:.3f}"))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(baseline)], capture_output=True)
    print_table(f"Hot path: this tree against {args.baseline} (us, medians of "
                f"{args.rounds} alternating rounds; 256 requests x {args.tokens}-token "
                f"emissions)",
                ("measure", "baseline", "this tree", "ratio"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

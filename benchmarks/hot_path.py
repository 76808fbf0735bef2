"""The hot path before and after a change, side by side in one run: per
decode step (append_step of 256 rows), per emission (take_batch) and per
ref (Reader.open + release), for this tree and a baseline git revision.

The baseline is checked out into a temporary worktree and built there; each
round runs one child per tree, alternating, so a noisy spell of the machine
lands on both. Medians over rounds; ratios are this tree / baseline.

    python benchmarks/hot_path.py --baseline 3e55ee9 [--rounds 7]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--emissions", type=int, default=6)
    parser.add_argument("--widths", default="20,1000")
    parser.add_argument("--tokens", type=int, default=50,
                        help="decode steps per emission (1: takes on warm caches)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_baseline(args.baseline, Path(tmp))
        try:
            rows = []
            for width in (int(w) for w in args.widths.split(",")):
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

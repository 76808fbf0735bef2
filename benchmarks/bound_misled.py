"""Issue 35: how often capture's bound misleads a top-p-only row, and what
its floor costs the rows it does not, per tuning value, without timing.

For each distribution of the sweep (benchmarks/sweep.py's generators), input
seed and top_p, the bound kernel alone (kernels/capture_bound.py) sets each
row's floor and window flag; the exact cutoff comes from the torch
reference (reference_support). A row is

  window   a window row (bracketed by pivot masses; its cutoff never falls back)
  misled   not a window row, and its exact cutoff key lies under the floor:
           resolve's check fails and the row takes the whole-row passes
           (~130-180 us of one program on the H100, the call's time)
  kept     the ids at or above a non-window row's floor: its candidates,
           what the expand and resolve pay for (median and max printed)

Runs in Triton's interpreter on the CPU (B = 256, V = 151936: ~12 s a bound
call on this VM's core; the bf16 distributions' head matmul ~10 s an input
set) or on a GPU in seconds. --tuning NAME=VALUE as sweep.py's, one table a
value set:

  .venv/bin/python benchmarks/bound_misled.py --dists 'bf16 s5$|fp32 s5$' \\
      --top-p 0.9,0.99 --seeds 0,1 --tuning P_KEEP=2048 --tuning P_KEEP=3072
"""

from __future__ import annotations

import argparse
import re
import time

import sweep  # noqa: F401  (imports the kernels first: the interpreter on a CPU)
import torch
from shmask.kernels import tuning
from shmask.kernels.capture import reference_support
from shmask.kernels.capture_bound import launch_bound
from shmask.kernels.capture_workspace import CaptureSettings, CaptureWorkspace


def bound_rows(probs: torch.Tensor, top_p: float) -> dict[str, torch.Tensor]:
    """The bound's floor and window flag of each row, and the exact cutoff key
    and floor-kept ids beside them."""
    batch, vocab = probs.shape
    settings = CaptureSettings.of(batch, vocab, probs.device, top_k=None, top_p=top_p,
                                  min_p=None, greedy=None, rows=None, sequential=False)
    ws = CaptureWorkspace.allocate(batch, vocab, probs.device, settings.window)
    launch_bound(probs, settings, ws, False)
    keys = probs.float().view(torch.int32)
    support = reference_support(probs, None, top_p, None, "joint")[0]
    cutoff = torch.where(support, keys, torch.iinfo(torch.int32).max).min(1).values
    lo = ws.lo.clone()
    return {"window": ws.window.clone() != 0, "misled": (ws.window == 0) & (cutoff < lo),
            "kept": (keys >= lo[:, None]).sum(1), "support": support.sum(1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dists", default=".", help="regex over the sweep's distributions")
    parser.add_argument("--top-p", default="0.9,0.99")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tuning", action="append", default=[],
                        help="NAME=VALUE, one variant each (default: the committed values)")
    args = parser.parse_args()
    batch, vocab = args.batch, 151936
    dists = {name: make for name, make in sweep.distributions(batch, vocab, sweep.SCALES).items()
             if re.search(args.dists, name)}
    variants = [[]] + [[v] for v in args.tuning] if args.tuning else [[]]
    print(f"bound_misled: {sweep.DEVICE}, B={batch} V={vocab}; variants: "
          + ", ".join(" ".join(v) or "committed" for v in variants))
    print(f"{'distribution':12s} {'seed':>4s} {'top_p':>5s} {'variant':16s} | {'window':>6s} "
          f"{'misled':>6s} | kept median    max | support median    max")
    for name, make in dists.items():
        for seed in [int(s) for s in args.seeds.split(",")]:
            probs = torch.softmax(make(seed), -1)
            for top_p in [float(p) for p in args.top_p.split(",")]:
                for variant in variants:
                    saved = {n.partition("=")[0]: getattr(tuning, n.partition("=")[0], None)
                             for n in variant}
                    sweep.set_tuning(variant)
                    try:
                        start = time.time()
                        rows = bound_rows(probs, top_p)
                    finally:
                        for key, value in saved.items():
                            setattr(tuning, key, value)
                    plain = ~rows["window"]
                    kept = rows["kept"][plain].float()
                    size = rows["support"].float()
                    print(f"{name:12s} {seed:4d} {top_p:5.2f} {' '.join(variant) or 'committed':16s} | "
                          f"{int(rows['window'].sum()):6d} {int(rows['misled'].sum()):6d} | "
                          f"{(kept.median().item() if len(kept) else 0):11.0f} "
                          f"{(kept.max().item() if len(kept) else 0):6.0f} | "
                          f"{size.median().item():14.0f} {size.max().item():6.0f}"
                          f"  ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

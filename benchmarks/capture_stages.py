"""Issue 35: where a top-p-only call's GPU time goes, per distribution of the
sweep (benchmarks/sweep.py): per kernel, and per row the paths the rows
took.

    python3 benchmarks/capture_stages.py [--json PATH] [--dists REGEX]   # GPU
        [--paths 'capture k1000,sample p0.9,...'] [--tuning NAME=VALUE] [--no-pdl]
        [--seeds 0,1,2,3]

B = 256, V = 151,936, the sweep's distributions at scales 0.5-8 (fp32 and
bf16-derived), capture top_p 0.6 / 0.9 / 0.99 and sample top_p 0.9 (or
--paths: any of the sweep's settings, top-k ones included; --tuning as
sweep.py's: an integer of kernels/tuning.py set for the run; --seeds: the
input sets, of which the sweep times four, 0-3, and averages them). Per
call: GPU us (host ahead, as the sweep times it), then from the call's
workspace: window rows (a support the sample put past WINDOW_MIN), wide
brackets (a window row whose sample missed its cutoff by more than the
inner pivots: refined), the largest bracket (a window row's candidates,
which resolve's one program a row searches), rows resolved from their
whole row (not window, a cutoff under the bound's floor: resolve's serial
passes), the largest candidate count of the other rows, the support's
median and largest size; then each kernel's mean GPU us a call
(torch.profiler, 10 calls).

Under programmatic dependent launch (sm90+, the default) a kernel starts
while the one before ends and waits for it inside: its profiled time holds
that wait, so the kernels add up to more than the call and a kernel after
a slow one looks slow. ``--no-pdl`` launches them one after another: each
kernel's own time, adding up to the call's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402  (first: it picks the kernels, installed or this checkout's)
from _common import gpu_and_host_us, kernel_us  # noqa: E402
from shmask.kernels import capture_workspace  # noqa: E402

BATCH, VOCAB, MAX_TOKENS = 256, 151_936, 8192
SCALES = (0.5, 1.0, 2.0, 3.0, 5.0, 8.0)
PATHS = [("capture", "p0.6"), ("capture", "p0.9"), ("sample", "p0.9"), ("capture", "p0.99")]


@contextlib.contextmanager
def workspaces_seen() -> Iterator[list]:
    """The workspace of capture's last call (allocated, or taken from the
    kept ones: every call asks), as the list's one item: the rows' paths
    are read from it."""
    seen: list = [None]
    cls = capture_workspace.CaptureWorkspace
    allocate = cls.__dict__["allocate"]

    def watched(owner, *args, **kwargs):
        seen[-1] = allocate.__func__(owner, *args, **kwargs)
        return seen[-1]

    cls.allocate = classmethod(watched)
    try:
        yield seen
    finally:
        cls.allocate = allocate


def stage_us(call, runs: int = 10) -> dict[str, float]:
    """Mean GPU us a call of each kernel the call launches, by its stage's
    name (copies left out)."""
    return {key.removeprefix("_").removesuffix("_kernel"): us
            for key, us in kernel_us(call, runs).items() if "Memcpy" not in key}


def row_paths(ws, rows, may_window: bool) -> dict[str, int]:
    """The rows' paths from the call's workspace; ``may_window`` False: a
    call that cannot have window rows (top-k on every row), whose kernels
    neither flag window rows nor count wide brackets (its wide count is
    another call's)."""
    lo, cutoff, n_cand = ws.lo.cpu(), ws.cutoff.cpu(), ws.n_cand.cpu()
    window = ws.window.cpu() != 0 if may_window else torch.zeros_like(lo, dtype=torch.bool)
    sizes = rows.sizes.cpu().float()
    others = ~window
    # "whole_row": a row whose cutoff lies under its floor took resolve's
    # whole-row passes (a row of bad values would count too: the sweep has none)
    return {"window": int(window.sum()), "wide": int(ws.wide_count.cpu()[0]) if may_window else 0,
            "whole_row": int((others & (cutoff < lo) & (lo > 1)).sum()),
            "cand_max_others": int(n_cand[others].max()) if bool(others.any()) else 0,
            # a window row's candidates are its bracket's ids: resolve's one
            # program a row searches them, so the largest sets the call's time
            "bracket_max": int(n_cand[window].max()) if bool(window.any()) else 0,
            "size_median": int(sizes.median()), "size_max": int(sizes.max())}


def run_paths(name: str, seed: int, inputs, paths: list[tuple[str, str]], seen: list) -> list:
    """Each path on one input set: GPU us, the rows' paths, each kernel's us
    (printed as a line, returned as dicts)."""
    results = []
    for kind, settings in paths:
        call = sweep.make_call(sweep.SweepPath(f"{kind} {settings}", kind, settings),
                               inputs, None, MAX_TOKENS, seed)
        gpu, host = gpu_and_host_us([call], 5, 20)
        rows = call()
        torch.cuda.synchronize()
        kw = sweep.settings_kwargs(settings, BATCH)
        may_window = capture_workspace.may_be_window(kw.get("top_k"), kw.get("top_p"),
                                                     kw.get("min_p"), VOCAB)
        result = {"dist": name, "seed": seed, "path": f"{kind} {settings}", "gpu_us": gpu,
                  "host_us": host, **row_paths(seen[-1], rows, may_window),
                  "kernels_us": stage_us(call)}
        results.append(result)
        top = " ".join(f"{k}:{v:.1f}" for k, v in list(result["kernels_us"].items())[:8])
        print(f"{name:9s} {seed} {kind:7s} {settings:5s} GPU {gpu:6.1f} us | window "
              f"{result['window']:3d} wide {result['wide']:3d} bracket max "
              f"{result['bracket_max']:6d} whole-row {result['whole_row']:2d} cand max "
              f"{result['cand_max_others']:5d} | size median {result['size_median']:6d} max "
              f"{result['size_max']:6d} | {top}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dists", default="", help="regex: the distributions to run")
    parser.add_argument("--json", help="write every row here too")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated input sets (sweep.py times sets 0-3; default 0)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the kernels one after another: each kernel's own time")
    parser.add_argument("--paths", default=",".join(f"{k} {s}" for k, s in PATHS),
                        help="comma-separated 'capture SETTINGS' or 'sample SETTINGS' "
                             "(sweep.py's settings names: p0.9, k1000, k1000 p0.9, ..., mixed)")
    parser.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE",
                        help="set an integer constant of kernels/tuning.py (as sweep.py's)")
    args = parser.parse_args()
    tuned = sweep.set_tuning(args.tuning)
    paths = [tuple(name.strip().split(" ", 1)) for name in args.paths.split(",")]
    for kind, settings in paths:
        if kind not in ("capture", "sample") or settings not in (*sweep.SETTINGS, "mixed"):
            raise SystemExit(f"--paths: {kind} {settings!r} is not capture or sample with one "
                             f"of sweep.py's settings ({', '.join((*sweep.SETTINGS, 'mixed'))})")
    if args.no_pdl:
        # the stages' launcher (the package's name "capture" is the function)
        importlib.import_module("shmask.kernels.capture").pdl_default = lambda device: False
    if not torch.cuda.is_available():
        raise SystemExit("capture_stages.py measures the GPU: run it on the device")
    print(f"capture_stages: {torch.cuda.get_device_name()}, B={BATCH} V={VOCAB}, "
          f"{'kernels one after another' if args.no_pdl else 'programmatic dependent launch'}"
          + "".join(f"; tuning.{name} = {value}" for name, value in tuned.items()))
    dists = sweep.distributions(BATCH, VOCAB, SCALES)
    results = []
    with workspaces_seen() as seen:
        for name, logits in dists.items():
            if name == "mix" or (args.dists and not re.search(args.dists, name)):
                continue
            for seed in (int(seed) for seed in args.seeds.split(",")):
                inputs = sweep.InputSet(logits(seed), seed, sorted({s for _, s in paths}))
                results += run_paths(name, seed, inputs, paths, seen)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                               "pdl": not args.no_pdl, "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The replay backward's shape (warps, gradient columns a block) on the GPU:
each variant's kernel time for 1,000-id rows and 40% bitmask rows (every
variant's gradients checked equal to the first's), then the replay
benchmark (benchmarks/replay.py) with the variant of the lowest worst
case, in one process. CUDA only.

    python3 benchmarks/replay_variants.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import replay as bench  # noqa: E402
import shmask.kernels.replay as R  # noqa: E402

VARIANTS = [(warps, block) for warps in (4, 8) for block in (2048, 4096, 8192)]


def gpu_us(call: Callable[[], object]) -> float:
    """Median GPU us per call, each enqueued while the GPU sleeps (replay.py's timing)."""
    return bench.timed(call, 5)[0] * 1000


def backward_call(args: tuple, grad_out: torch.Tensor, vocab: int) -> Callable[[], torch.Tensor]:
    """The backward alone, with what a forward kept."""
    logits, targets, offsets, ids, temp, _, form = args
    _, logz, _, _, zs = R._forward(*args, full=False, save=True)
    return lambda: R._backward(logits, 0, vocab, targets, temp, offsets, ids, form, logz, zs,
                               grad_out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the variants and the benchmark here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("replay_variants: needs CUDA", file=sys.stderr)
        return 2
    n, vocab = 16384, 151936
    logits, gen = bench.bench_logits(n, vocab)
    sets = {"ids": bench.rows_ids(n, vocab, 1000, gen),
            "bitmask": bench.rows_bitmask(n, vocab, 0.4, gen)}
    print(f"zeros_like {gpu_us(lambda: torch.zeros_like(logits)):.1f} us")
    checked = {}
    for name, (offsets, ids, forms, targets) in sets.items():
        checked[name] = R._checked(logits, targets, offsets, ids, 1.0, None, forms)
        c = checked[name]
        print(f"{name}: forward {gpu_us(lambda c=c: R._forward(*c, full=False)):.1f} us, "
              f"keeping what the backward reads "
              f"{gpu_us(lambda c=c: R._forward(*c, full=False, save=True)):.1f} us")
    first: dict[str, torch.Tensor] = {}
    results: dict[tuple[int, int], dict[str, float]] = {}
    for warps, block in VARIANTS:
        R.BACKWARD_WARPS, R.ZERO_BLOCK = warps, block
        row = {}
        for name, given in checked.items():
            call = backward_call(given, torch.ones(n, device="cuda"), vocab)
            grad = call()
            if name in first and not torch.equal(grad, first[name]):
                raise SystemExit(f"{name}: warps {warps}, block {block} gave another gradient")
            first.setdefault(name, grad)
            row[name] = gpu_us(call)
        results[(warps, block)] = row
        print(f"backward warps {warps} ZERO_BLOCK {block}: "
              + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
    best = min(results, key=lambda k: max(results[k].values()))
    R.BACKWARD_WARPS, R.ZERO_BLOCK = best
    print("chosen (lowest worst case):", best)
    measured = bench.run(n, vocab, 1000, 0.4, 5)
    for r in measured:
        print(f"\n{r['rows']} (max |replay - dense| {r['max_abs_error']:.2e})")
        for group in ("forward_ms", "forward_backward_ms", "peak_extra_mb", "ratios"):
            print(f"  {group:20s} " + "  ".join(f"{k} {v:.3f}" for k, v in r[group].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"variants": {f"{w}x{b}": v for (w, b), v in results.items()}, "chosen": best,
             "results": measured}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

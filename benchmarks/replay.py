"""The trainer's replay (issue 38, kernels/replay.py) against what a trainer
runs by hand, side by side in one run.

    python3 benchmarks/replay.py [--tokens N] [--json PATH]   # the H200
    python3 benchmarks/replay.py --smoke                      # CPU, Triton's interpreter

N tokens x V = 151,936 logits (bf16, or fp32 with --dtype; default N = 16,384), two row sets:
supports of 1,000 ids (the ids form) and top-p-only supports as bitmask
rows (~40% of the vocabulary each). Paths, each checked against the
dense-mask result first:

  dense mask        scatter the ids into a bool [N, V] mask, masked_fill,
                    log_softmax in fp32, gather the target (forward), and
                    its backward through autograd
  plain logsoftmax  log_softmax + gather over the whole vocabulary: what a
                    trainer computes anyway (no support)
  replay            replay_logprobs (forward) and its backward
  read / write      one read of the logits (amax over rows), one write of
                    a dense gradient (zeros_like): the floors
  support gather    (ids rows) torch's gather of the support's logits
                    alone: the reads a forward of them cannot avoid

GPU ms per call (CUDA events, median of repeats, each call enqueued while
the GPU sleeps, so host gaps do not count) and peak memory above the
inputs (torch.cuda.max_memory_allocated); goals from the issue: forward
>= 20x below the dense mask and <= 0.1x one read for 1,000-id rows;
forward + backward <= 1.1x writing the dense gradient once; peak extra
memory >= 10x below the dense mask's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shmask.kernels.replay import replay_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# GPU cycles the stream sleeps before each timed call (~25 ms), so the GPU
# time measured is the kernels', not the host's Python between them
HOST_AHEAD_CYCLES = 50_000_000


def rows_ids(n: int, vocab: int, length: int, gen: torch.Generator):
    """n rows of `length` ascending random ids: (offsets, ids, forms, targets),
    made where `gen` lives (the GPU: a CPU argsort of N x V takes minutes)."""
    dev = gen.device
    ids = torch.rand(n, vocab, generator=gen, device=dev).topk(length, 1).indices.sort(1).values
    pick = torch.randint(length, (n,), generator=gen, device=dev)
    targets = ids[torch.arange(n, device=dev), pick]
    offsets = torch.arange(n + 1, device=dev) * length
    return offsets, ids.reshape(-1).int(), torch.zeros(n, dtype=torch.int32, device=dev), targets


def rows_bitmask(n: int, vocab: int, share: float, gen: torch.Generator, step: int = 1024):
    """n bitmask rows keeping about `share` of the vocabulary each (made
    `step` rows at a time: the packing's int64 tiles are 32x the words)."""
    dev = gen.device
    words = (vocab + 31) // 32
    packed, targets = [], []
    for first in range(0, n, step):
        rows = min(step, n - first)
        keep = torch.rand(rows, vocab, generator=gen, device=dev) < share
        padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=dev)
        padded[:, :vocab] = keep.long()
        part = (padded.view(rows, words, 32) << torch.arange(32, device=dev)).sum(2)
        packed.append(torch.where(part >= 2**31, part - 2**32, part).int())
        targets.append(torch.multinomial(keep.float(), 1, generator=gen)[:, 0])
    return (torch.arange(n + 1, device=dev) * words, torch.cat(packed).reshape(-1),
            torch.ones(n, dtype=torch.int32, device=dev), torch.cat(targets))


def dense_mask(logits, targets, offsets, ids, forms, vocab):
    """The hand-written path: a bool mask from the rows, masked log-softmax."""
    n = logits.shape[0]
    if int(forms[0]) == 1:
        words = ids.view(n, -1)  # int32: an arithmetic shift, then bit 0
        lanes = torch.arange(32, dtype=torch.int32, device=ids.device)
        mask = ((words[:, :, None] >> lanes) & 1).bool()
        mask = mask.view(n, -1)[:, :vocab]
    else:
        mask = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, ids.view(n, -1).long(), True)
    masked = logits.float().masked_fill(~mask, float("-inf"))
    return torch.log_softmax(masked, 1).gather(1, targets[:, None])[:, 0]


def timed(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median ms, peak MB above what was allocated before) of `call`."""
    call()  # warm up: compiles, allocator pools
    times = []
    peak = 0.0
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOST_AHEAD_CYCLES)  # the host enqueues the call while the GPU waits
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**20)
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times), peak


def host_us(call: Callable[[], object], calls: int = 10) -> float:
    """Host us per eager call with the GPU busy (the calls enqueued behind a
    sleep, so the host never waits for the GPU): median of 5 batches. On
    the CPU (the interpreter) the wall time of one call."""
    call()
    if DEVICE != "cuda":
        calls = 1
    batches = []
    for _ in range(5 if DEVICE == "cuda" else 1):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(HOST_AHEAD_CYCLES * 4)
        began = time.perf_counter()
        for _ in range(calls):
            call()
        batches.append((time.perf_counter() - began) / calls * 1e6)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return statistics.median(batches)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def bench_logits(n: int, vocab: int, dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[torch.Tensor, torch.Generator]:
    """The replay benchmarks' logits [n, vocab] (randn x 2, seed 38; bf16 by
    default, fp32 as trainers that upcast the head's output for the loss
    hold them) and the generator after them, which the rows are drawn from."""
    gen = torch.Generator(device=DEVICE).manual_seed(38)
    return (torch.randn(n, vocab, generator=gen, device=DEVICE) * 2).to(dtype), gen


def run(n: int, vocab: int, length: int, share: float, repeats: int,
        dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    logits, gen = bench_logits(n, vocab, dtype)
    results: list[dict] = []
    read_ms, _ = timed(lambda: logits.amax(1), repeats)
    write_ms, write_mb = timed(lambda: torch.zeros_like(logits), repeats)
    plain_ms, plain_mb = timed(lambda: torch.log_softmax(logits.float(), 1)
                               .gather(1, torch.zeros(n, 1, dtype=torch.int64, device=DEVICE)),
                               repeats)
    floors = {"one_read": read_ms, "plain_logsoftmax": plain_ms, "plain_mb": plain_mb,
              "gradient_write": write_ms, "gradient_mb": write_mb}
    for label, rows in ((f"{length}-id rows", rows_ids(n, vocab, length, gen)),
                        (f"bitmask rows ({share:.0%})", rows_bitmask(n, vocab, share, gen))):
        results.append(measure(label, logits, list(rows), floors, repeats))
    return results


def measure(label: str, logits: torch.Tensor, rows: list[torch.Tensor], floors: dict,
            repeats: int) -> dict:
    """One row set: the check against the dense mask, then every path."""
    offsets, ids, forms, targets = rows
    vocab = logits.shape[1]
    want = dense_mask(logits, targets, offsets, ids, forms, vocab)
    got = replay_logprobs(logits, targets, offsets, ids, forms=forms)
    error = float((got.double() - want.double()).abs().max())
    if not error < 1e-3:
        raise SystemExit(f"{label}: replay differs from the dense mask by {error}")

    def dense_both() -> None:
        leaf = logits.detach().requires_grad_(True)
        dense_mask(leaf, targets, offsets, ids, forms, vocab).sum().backward()

    def replay_both() -> None:
        leaf = logits.detach().requires_grad_(True)
        replay_logprobs(leaf, targets, offsets, ids, forms=forms).sum().backward()

    dense_ms, dense_mb = timed(lambda: dense_mask(logits, targets, offsets, ids, forms, vocab),
                               repeats)
    # ids rows: the gather of their logits alone (torch's), the reads no
    # forward of them can do without (a 2-byte logit costs a 32-byte sector)
    gather: dict[str, float] = {}
    if int(forms[0]) == 0:
        index = ids.view(logits.shape[0], -1).long()
        gather["support_gather"] = timed(lambda: logits.gather(1, index), repeats)[0]
    fwd_ms, fwd_mb = timed(lambda: replay_logprobs(logits, targets, offsets, ids, forms=forms),
                           repeats)
    dense_both_ms, dense_both_mb = timed(dense_both, repeats)
    both_ms, both_mb = timed(replay_both, repeats)
    forward_host = host_us(lambda: replay_logprobs(logits, targets, offsets, ids, forms=forms))
    both_host = host_us(replay_both, calls=3)
    return {
        "rows": label, "max_abs_error": error, "mean_logp": float(want.mean()),
        "forward_ms": {"dense_mask": dense_ms, "plain_logsoftmax": floors["plain_logsoftmax"],
                       "replay": fwd_ms, "one_read": floors["one_read"], **gather},
        "forward_backward_ms": {"dense_mask": dense_both_ms, "replay": both_ms,
                                "dense_gradient_write": floors["gradient_write"]},
        "peak_extra_mb": {"dense_mask": dense_mb, "replay": fwd_mb, "dense_mask_both": dense_both_mb,
                          "replay_both": both_mb, "plain_logsoftmax": floors["plain_mb"],
                          "gradient": floors["gradient_mb"]},
        "host_us": {"forward": forward_host, "forward_backward": both_host},
        "ratios": {"forward_vs_dense": dense_ms / fwd_ms, "forward_vs_read": fwd_ms / floors["one_read"],
                   **({"gather_vs_read": gather["support_gather"] / floors["one_read"]}
                      if gather else {}),
                   "both_vs_gradient_write": both_ms / floors["gradient_write"],
                   "memory_dense_vs_replay": dense_mb / max(fwd_mb, 1e-9)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--length", type=int, default=1000, help="ids per ids-form row")
    parser.add_argument("--share", type=float, default=0.4, help="bitmask rows' kept share")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="the logits' dtype (a 1,000-id row's gather reads one 32-byte "
                             "sector an id in either: fp32 halves its share of one read)")
    parser.add_argument("--smoke", action="store_true", help="N=4, V=2000 (CPU: the interpreter)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    n, vocab, length, repeats = ((4, 2000, 50, 1) if args.smoke else
                                 (args.tokens, 151_936, args.length, args.repeats))
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton's interpreter)"
    print(f"replay: {name}; torch {torch.__version__}; N={n} V={vocab} {args.dtype}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    results = run(n, vocab, length, args.share, repeats, DTYPES[args.dtype])
    for r in results:
        print(f"\n{r['rows']} (max |replay - dense| {r['max_abs_error']:.2e}, "
              f"mean logp_S {r['mean_logp']:.3f})")
        for group in ("forward_ms", "forward_backward_ms", "peak_extra_mb", "host_us"):
            print(f"  {group:20s} " + "  ".join(f"{k} {v:.3f}" for k, v in r[group].items()))
        print("  ratios               " + "  ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "tokens": n, "vocab": vocab,
                                               "dtype": args.dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

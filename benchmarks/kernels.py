"""H200 benchmark of shmask.kernels with exact rows in two forms (issue 9).

V = 151936, fp32, max_tokens = 8192, B in {256, 512}. Every row is a
sampler's support: top_k 1000 + top_p 0.95 (about 1000 ids, the ids form),
except a share of rows (0%, 10%, 100%) that are top-p-only (top_p 0.95:
about 29k ids, past max_tokens, so the bitmask form). Per configuration:

* floor: one read of the [B, V] fp32 logits at the device-to-device copy
  bandwidth measured in this run (bytes read + written over time);
* compaction of the masked logits (-inf outside the support): ours with
  overflow="exact" (every row, both forms) and "status" (rows past the cap
  dropped as OVERFLOW: what the exact rows cost beyond it), and the
  one-program-per-row baseline (benchmarks/kernel_baselines.py: padded ids
  plus a full bitmask per row, no values);
* capture from the fp32 probabilities, exact and status;
* the bytes each form moves device to host: ids rows (4 L ids + 4 L
  values), bitmask rows (4 ceil(V / 32) words + 4 L values).

Times are medians in microseconds of CUDA-graph replays that run the op on 4
input sets in turn (so inputs are not served from L2). Every configuration
is checked against the torch reference before it is timed. --sweep adds a
per-kernel breakdown and the launch-parameter variants of compaction.

Run: PYTHONPATH=<dir holding shmask/kernels> python3 benchmarks/kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graphs import captured_graph  # noqa: E402
from kernel_baselines import compact_one_program_per_row, read_once  # noqa: E402
from shmask.kernels import capture, compact, reference_capture, reference_compact  # noqa: E402
from shmask.kernels.capture import reference_support  # noqa: E402

VOCAB = 151936
MAX_TOKENS = 8192
TOP_K = 1000  # rows within the cap
TOP_P = 0.95
ROTATE = 4
DEVICE = "cuda"


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.randn(1 << 28, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * (1 << 28) * 4 / (ms * 1e-3)


def d2h_bandwidth() -> float:
    """Bytes per second of a 256 MiB device-to-host copy into pinned memory."""
    src = torch.empty(1 << 26, device=DEVICE)
    dst = torch.empty(1 << 26, pin_memory=True)
    ms = triton.testing.do_bench(lambda: dst.copy_(src, non_blocking=True),
                                 return_mode="median")
    return (1 << 26) * 4 / (ms * 1e-3)


def time_graph(calls, replays: int = 30) -> float:
    """Median microseconds per call of a CUDA graph that runs every call once."""
    graph = captured_graph(calls)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(samples)


def settings(batch: int, past: float) -> dict:
    """Per-row top_k: off (top-p only, past the cap) for every round(1/past)-th
    row, else TOP_K."""
    top_k = torch.full((batch,), TOP_K, dtype=torch.int32, device=DEVICE)
    n_past = round(past * batch)
    if n_past:
        top_k[torch.linspace(0, batch - 1, n_past, device=DEVICE).round().long()] = 0
    return {"top_k": top_k, "top_p": TOP_P}


def make_inputs(batch: int, kw: dict, seed: int):
    """fp32 probabilities, logits masked to the sampler's support, argmax tokens."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(batch, VOCAB, device=DEVICE, generator=gen) * 2.5
    probs = torch.softmax(logits, -1)
    support, _, _ = reference_support(probs, kw["top_k"], kw["top_p"], 0.0, "joint",
                                      torch.float32)
    masked = torch.where(support, logits, float("-inf"))
    return probs, masked, probs.argmax(1)


def check_compact(ours, want) -> None:
    for field in ("offsets", "lengths", "status", "sizes", "forms", "id_offsets"):
        assert torch.equal(getattr(ours, field), getattr(want, field)), f"compaction {field}"
    assert torch.equal(ours.ids[:int(want.id_offsets[-1])], want.ids), "compaction ids"
    assert torch.equal(ours.values[:int(want.offsets[-1])], want.values), "compaction values"


def check_capture(ours, want) -> None:
    assert torch.equal(ours.status, want.status), "capture statuses differ"
    # fp32 mass sums may differ in order at the top-p boundary: allow a tiny drift
    drift = (ours.sizes - want.sizes).abs().max().item()
    assert drift <= 2, f"capture supports differ by {drift} ids"


def d2h_bytes(rows) -> tuple[int, int, int]:
    """Bytes a host copy of the valid prefixes moves: (ids of ids rows,
    words of bitmask rows, values)."""
    id_lengths = (rows.id_offsets[1:] - rows.id_offsets[:-1]).long()
    bitmask = rows.forms == 1
    return (4 * int(id_lengths[~bitmask].sum()), 4 * int(id_lengths[bitmask].sum()),
            4 * int(rows.offsets[-1]))


def measure(batch: int, past: float, bandwidth: float) -> dict:
    """One configuration: check against torch, then time every variant."""
    kw = settings(batch, past)
    sets = [make_inputs(batch, kw, seed) for seed in range(ROTATE)]
    probs, masked, tokens = sets[0]
    result: dict = {"B": batch, "past": past, "floor": batch * VOCAB * 4 / bandwidth * 1e6}
    for overflow in ("exact", "status"):
        ours = compact(masked, MAX_TOKENS, overflow=overflow)
        check_compact(ours, reference_compact(masked, MAX_TOKENS, overflow=overflow))
        result[f"compact_{overflow}"] = time_graph(
            [lambda s=s, o=overflow: compact(s[1], MAX_TOKENS, overflow=o) for s in sets])
        result[f"bytes_{overflow}"] = d2h_bytes(ours)
        cap_kw = dict(max_tokens=MAX_TOKENS, overflow=overflow, **kw)
        cap = capture(probs, tokens, **cap_kw)
        check_capture(cap, reference_capture(probs, tokens, compute_dtype=torch.float32,
                                             **cap_kw))
        result[f"capture_{overflow}"] = time_graph(
            [lambda s=s, k=cap_kw: capture(s[0], s[2], **k) for s in sets])
        if overflow == "exact":
            result["support"] = float(ours.sizes.float().mean())
            result["bitmask_rows"] = int(ours.forms.sum())
    _, _, base_len = compact_one_program_per_row(masked, MAX_TOKENS)
    assert torch.equal(base_len, ours.sizes), "baseline lengths differ"
    result["baseline"] = time_graph(
        [lambda s=s: compact_one_program_per_row(s[1], MAX_TOKENS) for s in sets])
    return result


def breakdown(batch: int, past: float) -> None:
    """Per-kernel device times of one eager call of compact and capture."""
    kw = settings(batch, past)
    probs, masked, tokens = make_inputs(batch, kw, 99)
    for name, call in (
        ("compact", lambda: compact(masked, MAX_TOKENS)),
        ("capture", lambda: capture(probs, tokens, max_tokens=MAX_TOKENS, **kw)),
    ):
        for _ in range(100):  # warm up, and let the clocks rise
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        parts = []
        for event in prof.key_averages():
            total = getattr(event, "device_time_total", 0)
            if total > 0:
                parts.append(f"{event.key[:28]}={total / 5:.1f}")
        print(f"breakdown {name} B={batch} past={past:.0%} (us per call): " + ", ".join(parts),
              flush=True)


def sweep(batch: int, bandwidth: float) -> None:
    """Compaction (exact, no rows past the cap) under other launch parameters."""
    kw = settings(batch, 0.0)
    sets = [make_inputs(batch, kw, seed) for seed in range(ROTATE)]
    floor = batch * VOCAB * 4 / bandwidth * 1e6
    variants = [
        {},
        {"pdl": False},
        {"num_warps": 8},
        {"expand_words": 256, "expand_warps": 4},
        {"expand_words": 512, "expand_warps": 8},
        {},  # the default again: the spread between two timings of one version
    ]
    read = time_graph([lambda s=s: read_once(s[1]) for s in sets])
    print(f"sweep B={batch} plain Triton read of the logits: {read:.1f} us "
          f"({read / floor:.2f}x floor)", flush=True)
    for variant in variants:
        us = time_graph([lambda s=s, v=variant: compact(s[1], MAX_TOKENS, **v) for s in sets])
        print(f"sweep B={batch} {variant or 'default'}: {us:.1f} us ({us / floor:.2f}x floor)",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="256,512")
    parser.add_argument("--past", default="0,0.1,1.0", help="shares of rows past max_tokens")
    parser.add_argument("--sweep", action="store_true",
                        help="per-kernel breakdown and launch-parameter variants first")
    parser.add_argument("--profile-only", action="store_true",
                        help="a few eager compactions (B=256, 0%% and 100%% past) for ncu")
    args = parser.parse_args()
    if args.profile_only:
        for past in (0.0, 1.0):
            _, masked, _ = make_inputs(256, settings(256, past), 0)
            for _ in range(3):
                compact(masked, MAX_TOKENS)
        torch.cuda.synchronize()
        return
    batches = [int(b) for b in args.batches.split(",")]
    shares = [float(p) for p in args.past.split(",")]

    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; date {time.strftime('%Y-%m-%d')}")
    print(f"device copy bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s")
    to_host = d2h_bandwidth()
    print(f"device-to-host copy bandwidth (pinned): {to_host / 1e9:.1f} GB/s")
    if args.sweep:
        for past in (0.0, 1.0):
            breakdown(256, past)
        for batch in batches:
            sweep(batch, bandwidth)
    results = []
    for batch in batches:
        for past in shares:
            results.append(measure(batch, past, bandwidth))
            print("  ", {k: v for k, v in results[-1].items()}, flush=True)
            torch.cuda.empty_cache()

    print()
    print(f"V={VOCAB} fp32, max_tokens={MAX_TOKENS}; rows: top_k {TOP_K} + top_p {TOP_P} "
          f"(ids form), 'past' share top-p only (past the cap: bitmask form)")
    print("times in us (median, CUDA-graph replay); x = / floor")
    head = (f"{'B':>4} {'past':>5} {'|S|':>6} {'bm rows':>7} {'floor':>6} | {'compact':>7} "
            f"{'x':>5} {'status':>7} {'1prog/row':>9} | {'capture':>7} {'status':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['B']:>4} {r['past']:>5.0%} {r['support']:>6.0f} {r['bitmask_rows']:>7} "
              f"{r['floor']:>6.1f} | {r['compact_exact']:>7.1f} "
              f"{r['compact_exact'] / r['floor']:>5.2f} {r['compact_status']:>7.1f} "
              f"{r['baseline']:>9.1f} | {r['capture_exact']:>7.1f} {r['capture_status']:>7.1f}")
    print()
    print("compaction bytes device -> host (MB): ids of ids rows, words of bitmask rows, values;")
    print("extra = exact - status compaction time, beside the extra bytes' time at the device "
          "copy bandwidth (hbm us) and the time the exact bytes take to the host (d2h us)")
    head = (f"{'B':>4} {'past':>5} | {'exact ids':>9} {'words':>7} {'values':>7} | "
            f"{'status ids':>10} {'values':>7} | {'extra us':>8} {'hbm us':>6} {'d2h us':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        e_ids, e_words, e_vals = r["bytes_exact"]
        s_ids, s_words, s_vals = r["bytes_status"]
        extra_bytes = (e_ids + e_words + e_vals) - (s_ids + s_words + s_vals)
        print(f"{r['B']:>4} {r['past']:>5.0%} | {e_ids / 1e6:>9.2f} {e_words / 1e6:>7.2f} "
              f"{e_vals / 1e6:>7.2f} | {(s_ids + s_words) / 1e6:>10.2f} {s_vals / 1e6:>7.2f} | "
              f"{r['compact_exact'] - r['compact_status']:>8.1f} "
              f"{extra_bytes / bandwidth * 1e6:>6.1f} "
              f"{(e_ids + e_words + e_vals) / to_host * 1e6:>7.1f}")


if __name__ == "__main__":
    main()

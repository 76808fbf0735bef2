"""Host time of an eager capture / sample / compact call, plans on and off
(issue 35; kernels/launch_plan.py), launched one by one from the core or
as CUDA graphs (launch_plan.GRAPHS), results reused or not (kernels/rows.py
REUSE_RESULTS), with the GPU busy, on a CUDA device.

    python3 benchmarks/host_time.py            # from the repository root, shmask installed
    python3 benchmarks/host_time.py --profile  # then each call's own time by function

Per call: 20 calls enqueued behind a ``torch.cuda._sleep`` (so the GPU is
busy and the host is ahead), host time by ``time.perf_counter`` around
them and GPU time by CUDA events; the median of 7 such batches, the
better of 2 rounds; plans off = ``SHMASK_KERNEL_PLANS=0`` in the same
process, interleaved with plans on. B = 256, V = 151936, softmax of
randn x 2 (fp32). Needs CUDA: without it the kernels run in Triton's
interpreter, whose time says nothing of an engine's host.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch


def measure(fn, n: int = 20) -> tuple[float, float]:
    """(GPU us, host us) per call: medians over 7 batches of n calls."""
    for _ in range(4):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(7):
        torch.cuda._sleep(80_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - began) / n * 1e6
        end.record()
        end.synchronize()
        out.append((start.elapsed_time(end) * 1e3 / n, host))
    return statistics.median(o[0] for o in out), statistics.median(o[1] for o in out)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_time.py needs a CUDA device (plans replay compiled launches only)")
    from shmask.kernels import launch_plan, rows

    from shmask import kernels

    batch, vocab = 256, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    probs = torch.softmax(torch.randn(batch, vocab, device="cuda", generator=gen) * 2, -1)
    tokens = torch.multinomial(probs, 1, generator=gen)[:, 0]
    logp = torch.log(probs)
    top_k = torch.full((batch,), 1000, dtype=torch.int32, device="cuda")
    top_p = torch.full((batch,), 0.9, device="cuda")
    # an engine's tensors as it has them (SGLang: int32 drawn tokens, a bool
    # opt-in mask; int64 top_k), read by the kernels without a cast
    engine = dict(top_k=top_k.long(), top_p=top_p, rows=torch.ones(batch, dtype=torch.bool,
                                                                    device="cuda"),
                  greedy=torch.zeros(batch, dtype=torch.bool, device="cuda"))
    tokens32 = tokens.int()
    calls = {
        "capture top_p 0.9": lambda: kernels.capture(probs, tokens, top_p=0.9, max_tokens=8192),
        "capture top_k 1000": lambda: kernels.capture(probs, tokens, top_k=1000, max_tokens=8192),
        "capture [B] top_k+top_p": lambda: kernels.capture(probs, tokens, top_k=top_k,
                                                           top_p=top_p, max_tokens=8192),
        "capture [B] engine dtypes": lambda: kernels.capture(probs, tokens32, max_tokens=8192,
                                                             **engine),
        "sample top_p 0.9": lambda: kernels.sample(probs, 7, top_p=0.9, max_tokens=8192),
        "sample top_k 1000": lambda: kernels.sample(probs, 7, top_k=1000, max_tokens=8192),
        "compact": lambda: kernels.compact(logp, 8192),
    }
    print(f"host_time: {torch.cuda.get_device_name()}, B={batch} V={vocab}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'call':28} | plans off: GPU us, host us | plans, launches from Python | "
          f"plans, launches from the core | the same, results not reused | "
          f"plans as CUDA graphs")
    for name, fn in calls.items():
        runs: dict[str, list[tuple[float, float]]] = {"off": [], "python": [], "native": [],
                                                      "native, fresh results": [], "graphs": []}
        for _ in range(2):
            for mode in runs:
                os.environ["SHMASK_KERNEL_PLANS"] = "0" if mode == "off" else "1"
                launch_plan.NATIVE_LAUNCHES = mode.startswith("native") or mode == "graphs"
                launch_plan.GRAPHS = mode == "graphs"
                rows.REUSE_RESULTS = mode != "native, fresh results"
                runs[mode].append(measure(fn))
        rows.REUSE_RESULTS = True
        launch_plan.GRAPHS = True
        best = {mode: min(found, key=lambda r: r[1]) for mode, found in runs.items()}
        print(f"{name:28} | " + " | ".join(f"{gpu:8.1f} {host:8.1f}" for gpu, host in best.values()),
              flush=True)
    os.environ.pop("SHMASK_KERNEL_PLANS", None)
    launch_plan.NATIVE_LAUNCHES = True
    import importlib

    entry_points = [importlib.import_module(f"shmask.kernels.{name}") for name in ("capture", "compact")]
    planned = [state for module in entry_points for state in module._PLANS._states.values()
               if isinstance(state, launch_plan.Plan)]
    print(f"plans: {len(planned)}, of which launched from the core: "
          f"{sum(plan.native is not None for plan in planned)}; graphs made "
          f"{sum(plan.graphs.captured for plan in planned if plan.graphs)}, calls served by "
          f"one {sum(plan.graphs.launched for plan in planned if plan.graphs)}")
    if "--profile" in sys.argv:
        for name, fn in calls.items():
            profile(name, fn)


def profile(name: str, fn, n: int = 2000, top: int = 22) -> None:
    """Where a call's host time goes (plans, launches from the core,
    results reused): own time per call by function under cProfile, which
    inflates every Python call, so read it as shares, not as the call's
    time. The GPU is kept busy so that no launch waits for room."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    for _ in range(n // 100):
        torch.cuda._sleep(50_000_000)
        profiler.enable()
        for _ in range(100):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    total = sum(entry[2] for entry in stats.values()) / n * 1e6
    print(f"\n== {name}: profiled own time {total:.1f} us a call; top functions "
          f"(own us, cumulative us, calls a call):")
    for (path, line, func), (_, calls_made, own, cumulative, _) in rows:
        print(f"  {own / n * 1e6:7.2f} {cumulative / n * 1e6:8.2f} {calls_made / n:5.1f}x  "
              f"{os.path.basename(path)}:{line}:{func}")


if __name__ == "__main__":
    main()

"""Issue 10: the decode loop on a GPU with the real capture kernel, five ways
(and compaction, three).

256 requests x 512 tokens; each step is a real GPU step (a chain of bf16
matmuls calibrated to ~14 ms, then logits, softmax and argmax), the tokens
come back to the host (the engine's one sync per step), and then the masks:

  off      masks off: no capture, emissions carry no rows
  capture  the capture kernel runs, its rows are dropped: the GPU time of
           computing the masks, which no transport can remove
  cpu      the CPU path: capture, HostStaging.fetch (D2H + sync), kernels.publish
           of HostRows (Writer.append_step copies the rows into the ring)
  direct   the default with CUDA: capture, kernels.publish of the device Rows
           (the GPU stores them straight into the registered ring; the CPU makes
           one native call and one launch)
  fused    capture(..., into=(writer, handles)) before the sync: capture's own write
           kernel stores each row into the ring as it computes it (masks us/step:
           the step's claim inside that call, its only extra CPU work)
  *-spin   (--spin) the same, but the scheduler waits for the step's end spinning on
           an event query (its CPU kept busy) before the usual sync
  compact, compact-direct, compact-fused  (--paths) the masks by compact() of the
           step's top-k-masked logprobs instead of capture: rows dropped; kernels.publish
           of the device rows (the store kernel); compact(..., into=) (its expand kernel
           stores each row into the ring). "vs capture" is against compact there

Every 50 tokens (and at the finish) the scheduler takes the queues and sends
one RefBatch; the detokenizer and tokenizer processes of benchmarks/transport.py
forward it, open every chunk, build the response (to_json, or to_lists with
--lists), check-sum the rows and release them. Columns:

  masks us/step     the scheduler's wall time in the mask calls per step (fetch + publish,
                    or publish of device rows), the issue's "scheduler CPU time for masks"
  masks cpu us      the same calls' thread CPU time per step
  emit us/step      take_batch + send per emission, divided by the steps it covers
  launch p50        the store kernel's launch inside publish (median per step)
  probe             a fixed few-microsecond piece of Python work, timed back to back
                    (warm) and right after the step's sync: how much slower this CPU
                    runs code just after the wait
  tokens/s          256 x 512 / the scheduler's wall time, first step to last emission
  vs off, vs capture  throughput against masks off, and against capture-only (the
                    transport's own cost; compact-* paths: against compact)
  step->readable    per emission: from the tokens' sync of its last step until the
                    tokenizer holds its chunks (median, ms)
  rows equal        the tokenizer's checksums of every emission equal the first masks-on
                    path's with the same rows (the cpu path's when it runs; compact-direct's)

Run: python benchmarks/direct.py [--quick] [--repeats N] [--paths off,capture,...] [--lists]
[--spin] [--breakdown] [--top-p P] [--logit-scale S] [--out FILE]
(--quick: a small CPU-interpreter smoke run of the same code). The masks are top_k
1000 rows by default; --top-p P captures top-p-only rows instead (top_k off, the RL
rollout setting; capture's paths only, the compact paths mask top_k), and
--logit-scale S multiplies the step's logits (std ~3 as they are: S 8/3 gives the
sweep's peaked "s8" rows, supports of a few to tens of ids at top_p 0.9;
benchmarks/sweep.py). The ring is sized for 1,000-id rows either way: wider rows
travel inline, and the table's "inline" column counts them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import transport as part1
from _common import console, now, print_table, ring_mb_for

SCRIPT = Path(__file__).resolve()
STEP_S = 0.014
EMIT_TOKENS = 50
PATHS = ("off", "capture", "cpu", "direct", "fused")
SPIN_PATHS = ("capture-spin", "direct-spin")  # with --spin
# The compact paths (chosen with --paths) run the capture paths' code with
# compact() making the rows.
AS_CAPTURE = {"compact": "capture", "compact-direct": "direct", "compact-fused": "fused"}


def masks_only(path: str) -> bool:
    """Paths whose scheduler sends no rows (no transport)."""
    return path.startswith(("off", "capture")) or path == "compact"


def baseline(path: str) -> str:
    """The masks-only path whose rows this path's transport sends."""
    if path.startswith("compact"):
        return "compact"
    return "capture-spin" if path.endswith("-spin") else "capture"


def gpu_step_fn(spec: dict[str, Any]):
    """A closure running one decode step on the device; returns probs, sampled."""
    import torch

    device = spec["device"]
    batch, vocab, hidden = spec["batch"], spec["vocab"], spec["hidden"]
    gen = torch.Generator(device=device).manual_seed(spec["seed"])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weights = torch.randn(hidden, vocab, generator=gen, device=device, dtype=dtype) / hidden**0.5
    square = torch.randn(spec["square"], spec["square"], generator=gen, device=device,
                         dtype=dtype) / spec["square"] ** 0.5
    work = torch.randn(spec["square"], spec["square"], generator=gen, device=device, dtype=dtype)
    states = torch.randn(64, batch, hidden, generator=gen, device=device, dtype=dtype) * 3

    def step(index: int):
        x = work
        for _ in range(spec["matmuls"]):  # the model's ~14 ms of work
            x = x @ square
        logits = states[index % states.shape[0]] @ weights
        logits = logits + x[0, 0].to(logits.dtype) * 0  # the step depends on the work
        probs = torch.softmax(logits.float() * spec.get("logit_scale", 1.0), -1)
        return probs, probs.argmax(1)

    return step


def mask_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """capture()'s settings for the run: top_k (the default), or top-p only."""
    if spec.get("top_p") is not None:
        return {"top_p": spec["top_p"]}
    return {"top_k": spec["top_k"]}


def settings_label(spec: dict[str, Any]) -> str:
    scale = spec.get("logit_scale", 1.0)
    kind = (f"top_p {spec['top_p']} only" if spec.get("top_p") is not None
            else f"top_k {spec['top_k']}")
    return kind + (f", logits x {scale:g}" if scale != 1.0 else "")


def probe() -> float:
    """Seconds of a fixed piece of Python and numpy work (a few microseconds)."""
    began = now()
    total = 0
    for value in range(200):
        total += value
    np.add(np.arange(64), total)
    return now() - began


def calibrate(spec: dict[str, Any]) -> int:
    """Matmuls of the square matrix that take ~STEP_S on this device."""
    import torch

    if spec["device"] != "cuda":
        return 1
    n = spec["square"]
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return max(1, round(STEP_S / ((time.perf_counter() - started) / 20)))


def run_scheduler(spec: dict[str, Any]) -> None:
    import torch
    from shmask.kernels import HostStaging, capture, compact, publish, publisher_for

    import shmask

    compacting = spec["path"] in AS_CAPTURE
    path = AS_CAPTURE.get(spec["path"], spec["path"].removesuffix("-spin"))
    spin = spec["path"].endswith("-spin")  # wait for the step spinning, the CPU kept busy
    spec["matmuls"] = spec.get("matmuls") or calibrate(spec)
    step_fn = gpu_step_fn(spec)
    sync = torch.cuda.synchronize if spec["device"] == "cuda" else (lambda: None)
    config = shmask.Config(ring_mb=spec["ring_mb"], name_prefix=part1.SEGMENT_PREFIX,
                           full_wait_ms=50, lease_s=600)

    def capture_rows(probs, sampled, into=None):
        if compacting:  # the engine's own top-k masking, then compaction of the logprobs
            kth = probs.topk(spec["top_k"], dim=1).values[:, -1:]
            logprobs = torch.where(probs >= kth, probs.log(), -float("inf"))
            return compact(logprobs, spec["max_tokens"], into=into)
        return capture(probs, sampled, **mask_settings(spec), max_tokens=spec["max_tokens"],
                       into=into)

    # Warm-up on a throwaway ring: compiles the step, capture and the direct kernel.
    if path in ("cpu", "direct", "fused"):
        with shmask.Writer(config) as writer:
            queues = np.array([writer.open_queue().handle for _ in range(spec["batch"])])
            staging = HostStaging()
            for index in range(3):
                probs, sampled = step_fn(index)
                if path == "fused":
                    capture_rows(probs, sampled, into=(writer, queues))
                elif path == "direct":
                    publish(writer, queues, capture_rows(probs, sampled))
                else:
                    publish(writer, queues, staging.fetch(capture_rows(probs, sampled)))
                writer.take_batch(queues)
            sync()
    else:
        probs, sampled = step_fn(0)
        if path == "capture":
            capture_rows(probs, sampled)
        sync()

    writer = shmask.Writer(config) if path in ("cpu", "direct", "fused") else None
    publisher = None
    if writer is not None:
        queues = [writer.open_queue() for _ in range(spec["batch"])]
        handles = np.array([q.handle for q in queues], np.int64)
        if path in ("direct", "fused"):
            publisher = publisher_for(writer)  # what kernels.publish uses for device rows
            if not publisher.active:
                raise RuntimeError(f"direct path inactive: {publisher.reason}")
    staging = HostStaging()
    context, out, acks = part1.scheduler_sockets(spec)
    total, interval = spec["total_tokens"], spec["tokens"]
    result: dict[str, Any] = {}
    try:
        part1.round_trip(out, acks, part1.MARK)
        started = now()
        mask_s = mask_cpu_s = emit_s = 0.0
        per_step: list[float] = []
        launches: list[float] = []
        if publisher is not None:  # time the launch inside publish, step by step
            launch = publisher._launch

            def timed_launch(batch: int, support: bool) -> None:
                began = now()
                launch(batch, support)
                launches.append(now() - began)

            publisher._launch = timed_launch
        claims: list[float] = []
        if path == "fused":  # the masks' only CPU work: the step's claim inside capture
            claim = publisher.claim

            def timed_claim(*args: Any, **kwargs: Any) -> bool:
                began, cpu_began = now(), time.thread_time()
                taken = claim(*args, **kwargs)
                claims.append(now() - began)
                claims_cpu.append(time.thread_time() - cpu_began)
                return taken

            claims_cpu: list[float] = []
            publisher.claim = timed_claim
        # The same fixed piece of CPU work, timed warm (back to back) and right
        # after each step's sync: how much slower the CPU runs there.
        warm_probe = float(np.median([probe() for _ in range(200)]))
        probes: list[float] = []
        emission = 0
        for step in range(total):
            probs, sampled = step_fn(step)
            if path == "fused":  # the rows are stored by capture's own kernel
                rows = capture_rows(probs, sampled, into=(writer, handles))
            else:
                rows = capture_rows(probs, sampled) if path != "off" else None
            if spin:
                ready = torch.cuda.Event() if spec["device"] == "cuda" else None
                if ready is not None:
                    ready.record()
                    while not ready.query():
                        pass
            sampled.cpu()  # the engine's one sync per step: it needs the tokens
            synced = now()
            if step % 8 == 7:  # a sample of steps (the probe's time counts in the loop)
                probes.append(probe())
                synced = now()
            if path == "fused":
                mask_s += claims[-1]
                mask_cpu_s += claims_cpu[-1]
                per_step.append(claims[-1])
            elif writer is not None:
                clock = time.thread_time()
                if publisher is not None:
                    publish(writer, handles, rows)  # device rows: GPU-direct
                else:
                    publish(writer, handles, staging.fetch(rows))
                mask_cpu_s += time.thread_time() - clock
                took = now() - synced
                mask_s += took
                per_step.append(took)
            if (step + 1) % interval == 0 or step + 1 == total:
                emitted = now()
                if writer is not None:
                    frames = [writer.take_batch(queues, final=step + 1 == total).to_bytes()]
                else:
                    frames = []
                # The header carries the step's sync: the tokenizer's latency is step -> readable.
                out.send_multipart([part1.HEADER.pack(emission, synced), *frames])
                emit_s += now() - emitted
                emission += 1
        finished = now()
        part1.round_trip(out, acks, part1.STOP)
        result = {"started": started, "finished": finished, "mask_s": mask_s,
                  "mask_cpu_s": mask_cpu_s, "emit_s": emit_s, "matmuls": spec["matmuls"],
                  "mask_p50_s": float(np.median(per_step)) if per_step else 0.0,
                  "launch_p50_s": float(np.median(launches)) if launches else 0.0,
                  "probe_warm_s": warm_probe, "probe_loop_s": float(np.median(probes)),
                  "launcher": publisher.launcher if publisher is not None else "-",
                  "mask_p99_s": float(np.percentile(per_step, 99)) if per_step else 0.0,
                  "stats": dict(publisher.stats) if publisher is not None else {},
                  "writer": ({k: v for k, v in vars(writer.stats).items()
                              if k in ("inline_ring_full", "full_waits", "staging_moves")}
                             if writer is not None else {}),
                  "inline_chunks": writer.stats.inline_chunks if writer is not None else 0}
    finally:
        if writer is not None:
            writer.close()
        context.destroy(linger=part1.LINGER_MS)
    part1.write_result(spec["dir"], "scheduler", result)


def breakdown(base: dict[str, Any]) -> None:
    """Where publish's time goes, call by call, on idle hardware (medians
    of 300), and the GPU time of the store kernel and of capture."""
    import torch
    from shmask.kernels import capture, publish, publisher_for

    import shmask
    from shmask._native import ffi, lib

    spec = {**base, "matmuls": 1}
    probs, sampled = gpu_step_fn(spec)(0)

    def captured():
        return capture(probs, sampled, **mask_settings(spec), max_tokens=spec["max_tokens"])

    rows = captured()
    config = shmask.Config(ring_mb=base["ring_mb"], name_prefix=part1.SEGMENT_PREFIX,
                           lease_s=600)
    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn, n: int = 300, between=sync) -> float:
        samples = []
        for _ in range(n):
            between()
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return 1e6 * float(np.median(samples))

    busy_input = torch.randn(4096, 4096, device=spec["device"])

    def gpu_timed(fn, n: int = 100, between=sync) -> float:
        """GPU time between events around fn's kernels, queued behind ~1 ms of
        other work so that the CPU's launch time is not in it."""
        samples = []
        for _ in range(n):
            between()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(8):
                busy_input @ busy_input
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(1e3 * start.elapsed_time(end))
        return float(np.median(samples))

    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue() for _ in range(spec["batch"])]
        handles = np.array([q.handle for q in queues], np.int64)
        publisher = publisher_for(writer)
        results = {}
        steps = [0]

        def one_step() -> None:
            publish(writer, handles, rows)
            steps[0] += 1

        def take_every_40() -> None:
            sync()
            if steps[0] % 40 == 39:  # a consumer gives every chunk back
                reader.discard_batch(writer.take_batch(queues))
                writer.reclaim()

        for _ in range(5):
            one_step()
        results["kernels.publish(device rows), whole"] = timed(one_step, between=take_every_40)
        results["DirectPublisher.publish, whole"] = timed(
            lambda: publisher.publish(handles, rows), between=take_every_40)
        reader.discard_batch(writer.take_batch(queues))
        writer.reclaim()
        sync()
        results["8 x Tensor.data_ptr()"] = timed(lambda: [
            t.data_ptr() for t in (rows.status, rows.forms, rows.lengths, rows.id_offsets,
                                   rows.offsets, rows.ids, rows.values, rows.values)])
        c_handles = ffi.from_buffer("int64_t[]", handles)
        step_args = (writer.ring_handle, publisher._direct, c_handles, handles.size,
                     lib.SHM_MODE_SUPPORT, 4748, spec["max_tokens"], publisher._addresses,
                     rows.vocab, publisher._bad_row)

        def prepare_only() -> None:
            rc = lib.shm_direct_step(*step_args)
            if rc:
                raise RuntimeError(f"shm_direct_step returned {rc}")
            lib.shm_direct_cancel(publisher._direct)

        results[f"shm_direct_step ({handles.size} rows) + cancel"] = timed(prepare_only)
        results["shm_direct_idle (one load)"] = timed(lambda: lib.shm_direct_idle(publisher._direct))

        def gpu_pieces(results: dict[str, Any]) -> None:
            def prepared() -> None:
                take_every_40()
                steps[0] += 1
                rc = lib.shm_direct_step(*step_args)
                while rc > 0:  # the last kernel still running, or diverted rows
                    publisher.wait()
                    rc = lib.shm_direct_step(*step_args)
                if rc:
                    raise RuntimeError(f"shm_direct_step returned {rc}")

            results[f"launch ({publisher.launcher})"] = timed(
                lambda: publisher._launch(handles.size, True), between=prepared)
            results["GPU: store kernel, 256 x 1000 rows (us)"] = gpu_timed(
                lambda: publisher._launch(handles.size, True), between=prepared)
            results[f"GPU: capture, {settings_label(spec)} (us)"] = gpu_timed(captured)
            results["probe (warm)"] = timed(probe, between=lambda: None)
            results["probe (after a sync)"] = timed(probe)

        if cuda:
            try:
                gpu_pieces(results)
            except Exception as exc:  # noqa: BLE001 - print what was measured, and why not the rest
                results["stopped"] = repr(exc)
        results["stats after the breakdown"] = str(publisher.stats)
        try:
            publisher.close()
        except RuntimeError as exc:
            results["close"] = repr(exc)
    print_table("publish of device rows, piece by piece (median us of 300 calls; GPU: 100)",
                ("call", "us"), list(results.items()))


def run_once(path: str, base: dict[str, Any]) -> dict[str, Any]:
    spec = {**base, "path": path, "transport": "off" if masks_only(path) else "shmask"}
    # A scheduler that fails must not hold the others (and the GPU) for 10 minutes.
    results = part1.run_pipeline(spec, scheduler_script=SCRIPT, timeout_s=150)
    scheduler, tok = results["scheduler"], results["tokenizer"]
    total, batch = spec["total_tokens"], spec["batch"]
    wall = scheduler["finished"] - scheduler["started"]
    latency = [h - e for h, e in zip(tok["held_at"], tok["emitted_at"], strict=True)]
    return {"path": path, "tokens_per_s": batch * total / wall, "wall_s": wall,
            "mask_us": 1e6 * scheduler["mask_s"] / total,
            "mask_cpu_us": 1e6 * scheduler["mask_cpu_s"] / total,
            "mask_p50_us": 1e6 * scheduler["mask_p50_s"], "mask_p99_us": 1e6 * scheduler["mask_p99_s"],
            "emit_us": 1e6 * scheduler["emit_s"] / total,
            "launch_p50_us": 1e6 * scheduler["launch_p50_s"],
            "probe_warm_us": 1e6 * scheduler["probe_warm_s"],
            "probe_loop_us": 1e6 * scheduler["probe_loop_s"], "launcher": scheduler["launcher"],
            "readable_ms": 1e3 * float(np.median(latency)), "crc": tok["crc"],
            "stats": {**scheduler["stats"], **scheduler["writer"]},
            "inline": scheduler["inline_chunks"],
            "matmuls": scheduler["matmuls"]}


def run(quick: bool, repeats: int, build: str, spin: bool = False,
        paths: tuple[str, ...] = PATHS, top_p: float | None = None,
        logit_scale: float = 1.0) -> list[dict[str, Any]]:
    paths = paths + (SPIN_PATHS if spin else ())
    if top_p is not None and any(path in AS_CAPTURE for path in paths):
        raise SystemExit("--top-p sets capture's masks; the compact paths mask top_k: "
                         f"leave out {', '.join(p for p in paths if p in AS_CAPTURE)}")
    if quick:
        base = {"device": "cpu", "batch": 8, "total_tokens": 12, "tokens": 5, "vocab": 4096,
                "hidden": 64, "square": 64, "top_k": 100, "max_tokens": 256, "matmuls": 1}
    else:
        base = {"device": "cuda", "batch": 256, "total_tokens": 512, "tokens": EMIT_TOKENS,
                "vocab": 151_936, "hidden": 4096, "square": 8192, "top_k": 1000,
                "max_tokens": 2048, "matmuls": 0}
    # A ring of 8 emissions: the tokenizer holds one while the next ones arrive.
    base.update({"mode": "support", "width": base["top_k"], "warmup": 0, "seed": 1, "ack": False,
                 "build": build, "top_p": top_p, "logit_scale": logit_scale,
                 "ring_mb": ring_mb_for(base["batch"], base["tokens"], base["top_k"], copies=8)})
    if not quick:  # calibrate once, so every run does the same work
        base["matmuls"] = calibrate(base)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for _ in range(repeats):
        for path in paths:
            result = run_once(path, base)
            runs[path].append(result)
            console().log(f"{path:>6}: {result['tokens_per_s']:,.0f} tokens/s, masks "
                          f"{result['mask_us']:.1f} us/step (launch p50 "
                          f"{result['launch_p50_us']:.1f} us by {result['launcher']}), probe "
                          f"warm {result['probe_warm_us']:.1f} us, after the sync "
                          f"{result['probe_loop_us']:.1f} us, stats {result['stats']}")
    # Every masks-on run's checksums against the first masks-on path's of the
    # same rows (capture's: cpu when run; compaction's).
    reference: dict[str, Any] = {}
    for path in paths:
        if not masks_only(path):
            reference.setdefault(baseline(path), runs[path][0]["crc"])
    off = float(np.median([r["tokens_per_s"] for r in runs["off"]]))
    masks = {p: float(np.median([r["tokens_per_s"] for r in runs[p]])) if p in runs
             else float("nan") for p in ("capture", "capture-spin", "compact")}
    rows = []
    for path in paths:
        results = runs[path]

        def med(key: str, results: list[dict[str, Any]] = results) -> float:
            return float(np.median([r[key] for r in results]))

        equal = "-" if masks_only(path) else str(
            all(r["crc"] == reference[baseline(path)] for r in results))
        rows.append((path, len(results), med("tokens_per_s"),
                     f"{100 * (med('tokens_per_s') / off - 1):+.2f}%",
                     f"{100 * (med('tokens_per_s') / masks[baseline(path)] - 1):+.2f}%",
                     med("mask_us"),
                     med("mask_p50_us"), med("mask_p99_us"), med("mask_cpu_us"), med("emit_us"),
                     med("launch_p50_us"), med("probe_warm_us"), med("probe_loop_us"),
                     med("readable_ms"), equal, sum(r["inline"] for r in results)))
    console().print(__doc__)
    print_table(
        f"Issue 10 - decode loop on {base['device']}: {base['batch']} requests x "
        f"{base['total_tokens']} tokens, step = {base.get('matmuls')} bf16 matmuls "
        f"{base['square']}^3 + logits (V = {base['vocab']}), {settings_label(base)} rows, "
        f"emission every {base['tokens']} tokens, responses by {build} (median of runs)",
        ("path", "runs", "tokens/s", "vs off", "vs capture", "masks us/step", "p50 us", "p99 us",
         "masks cpu us", "emit us/step", "launch p50 us", "probe warm us", "probe after sync us",
         "step->readable ms", "rows equal", "inline"),
        rows)
    return [{"path": p, **{k: v for k, v in r.items() if k != "crc"}} for p in paths
            for r in runs[p]]


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "child":
        if sys.argv[2] == "scheduler":
            if json.loads(sys.argv[3])["device"] == "cpu":
                os.environ.setdefault("TRITON_INTERPRET", "1")
            run_scheduler(json.loads(sys.argv[3]))
        else:
            part1.ROLES[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 2
        quick = "--quick" in sys.argv
        if quick:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        chosen = (tuple(sys.argv[sys.argv.index("--paths") + 1].split(","))
                  if "--paths" in sys.argv else PATHS)
        top_p = float(sys.argv[sys.argv.index("--top-p") + 1]) if "--top-p" in sys.argv else None
        scale = (float(sys.argv[sys.argv.index("--logit-scale") + 1])
                 if "--logit-scale" in sys.argv else 1.0)
        results = run(quick, 1 if quick else repeats, "lists" if "--lists" in sys.argv else "json",
                      spin="--spin" in sys.argv, paths=chosen, top_p=top_p, logit_scale=scale)
        if "--out" in sys.argv:
            Path(sys.argv[sys.argv.index("--out") + 1]).write_text(json.dumps(results, indent=1))
        if "--breakdown" in sys.argv:
            base = {"device": "cpu" if quick else "cuda", "batch": 8 if quick else 256,
                    "vocab": 4096 if quick else 151_936, "hidden": 64 if quick else 4096,
                    "square": 64, "top_k": 100 if quick else 1000, "seed": 1,
                    "max_tokens": 256 if quick else 2048, "ring_mb": 64 if quick else 512,
                    "top_p": top_p, "logit_scale": scale}
            breakdown(base)

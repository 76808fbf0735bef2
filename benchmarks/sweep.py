"""Issue 35: shmask's kernels against FlashInfer's over a sweep of distributions.

B = 256, V = 151936, max_tokens 8192 on the device (--smoke: B = 2,
V = 4000, scale 8 and the mix, in Triton's interpreter when there is no
GPU). One table per distribution, then THE table: each path's worst case
over the distributions beside its goal and the matching FlashInfer
kernel's worst case.

Distributions (probs = softmax(logits) in fp32, fixed seeds); a top_p 0.9
support from ~1 id to ~120k ids across the scales s in SCALES (printed):

  fp32 s<s>   logits randn(B, V) * s
  bf16 s<s>   logits (hidden @ head) in bf16, hidden ~ N(0, 1) [B, 4096],
              head ~ N(0, 1 / 4096) [4096, V], cast to float, times s: bf16
              precision, so the k-th largest value is tied with many others
  mix         rows alternating fp32 and bf16, at the scales of SCALES in a
              fixed shuffled order: one batch of very different rows

Paths, each measured on every distribution:

  capture <settings>    capture(probs, sampled, ...) with sampled drawn from
                        the reference support of those settings; settings in
                        SETTINGS (top-p only, top-k only, top-k + top-p,
                        min-p) and "mixed" ([B] tensors, row b takes the
                        b-th of SETTINGS in turn)
  sample <settings>     sample(probs, seeds, ...)
  compact k1000         compact() of the top-k-1000-masked log-probs
  read (floor)          one Triton read of probs: compaction's floor
  fi <kernel> <set.>    FlashInfer's kernels through benchmarks/flashinfer_ref.py
                        (top_p/top_k_renorm_probs: the exact cutoff alone; the
                        samplers: cutoff and draw, no rows written)

Columns: GPU us per call with the host ahead of the GPU (CUDA events around
N calls enqueued behind a torch.cuda._sleep, median of repeats) and host us
per call with the GPU busy, as capture_bf16.py measures them; calls rotate
over 4 input sets (2 in --smoke) so the inputs are not served from L2. Without CUDA
both columns are the interpreter's wall time of one call (a smoke run: they
say nothing of the GPU, and no verdict is given).

Check (shmask paths, first input set, each path's first call): the rows'
supports and statuses against the torch reference (reference_capture,
reference_compact); a top-p row that differs only within fp32 rounding of
its target (kernels.top_p_within_rounding, and inside the row's other
cutoffs) is counted apart as "round". Mismatches are counted in the tables,
not raised: a fast kernel that is wrong shows there.

Run (device, repository root, FlashInfer's headers fetched by
benchmarks/flashinfer_fetch.sh and carried: carry=[".device/flashinfer"]):
  python3 benchmarks/sweep.py --json $OUT/sweep.json 2>&1 | tee $OUT/sweep.txt
(~5 min on a warm H200, plus ~1.5 min of Triton and nvcc builds on a fresh
one; --quick, --only REGEX (paths), --dists REGEX split it if need be;
--tuning NAME=VALUE sets an integer of kernels/tuning.py for the run, so
that one device call can hold an A/B of it; --baseline JSON, an earlier
run's --json, prints each path against it per distribution and marks a
path that got slower anywhere, not only in its worst case.)
Smoke (CPU): TRITON_INTERPRET=1 python benchmarks/sweep.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def import_kernels():
    """shmask.kernels: the installed package, else a shim of this checkout's
    kernels/ and the few shmask modules they import (the device has no
    compiled transport, so shmask itself does not import there)."""
    try:
        from shmask import kernels
        return kernels
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="shmask_shim_"))
    (shim / "shmask").mkdir()
    (shim / "shmask" / "__init__.py").write_text("")
    (shim / "shmask" / "kernels").symlink_to(REPO / "kernels")
    for module in ("errors", "layout", "device_port"):  # what kernels/ imports of shmask
        (shim / "shmask" / f"{module}.py").symlink_to(REPO / "shmask" / f"{module}.py")
    for name in [m for m in sys.modules if m == "shmask" or m.startswith("shmask.")]:
        del sys.modules[name]
    sys.path.insert(0, str(shim))
    from shmask import kernels
    return kernels


kernels = import_kernels()  # first: it picks Triton's interpreter when there is no GPU
import triton  # noqa: E402
from _common import gpu_and_host_us  # noqa: E402
from kernel_baselines import read_once  # noqa: E402
from shmask.kernels.capture import reference_support  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HIDDEN = 4096
SCALES = (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 14.0)
SMOKE_SCALES = (8.0,)  # with the mix, 3 distributions: ~1 min on a busy 2-core CPU
COMPACT_K = 1000  # compact's input: the top-k-1000-masked log-probs
SUPPORT_P = 0.9  # the top_p whose support sizes are printed per distribution
HOST_GOAL = 50.0  # host us of one shmask call
COMPACT_GOAL = 1.5  # compact <= 1.5x one read of probs

# Sampler settings (joint order), each a path of capture and of FlashInfer.
SETTINGS: dict[str, dict[str, float]] = {
    "p0.6": {"top_p": 0.6}, "p0.9": {"top_p": 0.9}, "p0.99": {"top_p": 0.99},
    "k1": {"top_k": 1}, "k20": {"top_k": 20}, "k1000": {"top_k": 1000},
    "k4096": {"top_k": 4096}, "k1000 p0.9": {"top_k": 1000, "top_p": 0.9},
    "min_p0.1": {"min_p": 0.1},
}


@dataclass
class SweepPath:
    name: str
    kind: str  # capture, sample, compact, read, fi
    settings: str = ""  # a SETTINGS key, or "mixed"
    goal_us: float | None = None  # the GPU goal at B = 256
    match: str = ""  # the FlashInfer path (or the read) it is compared with
    method: str = ""  # FlashInfer's function (kind fi)


def fi_path(method: str, settings: str) -> SweepPath:
    short = method.replace("_from_probs", "").replace("_probs", "")
    return SweepPath(f"fi {short} {settings}", "fi", settings, method=method)


FI_PATHS = [fi_path("top_p_renorm_probs", s) for s in ("p0.6", "p0.9", "p0.99")]
FI_PATHS += [fi_path("top_k_renorm_probs", s) for s in ("k1", "k20", "k1000", "k4096")]
FI_PATHS += [fi_path("top_k_top_p_sampling_from_probs", s) for s in ("k1000 p0.9", "mixed")]
FI_PATHS += [fi_path("top_p_sampling_from_probs", "p0.9"),
             fi_path("top_k_sampling_from_probs", "k1000"),
             fi_path("min_p_sampling_from_probs", "min_p0.1")]
FI = {p.settings + "/" + p.method: p.name for p in FI_PATHS}
CAPTURE_GOALS = {"p0.6": 250.0, "p0.9": 250.0, "p0.99": 250.0, "k1000": 120.0,
                 "k1000 p0.9": 150.0}
SAMPLE_GOALS = {"p0.9": 300.0, "k1000": 130.0}


def capture_match(settings: str) -> str:
    """The FlashInfer kernel doing the same cutoff: renorm for top-p or top-k
    alone (the cutoff and nothing else), the joint sampler for top-k + top-p
    and for the mixed rows (min-p dropped: FlashInfer has no kernel with all
    three), the min-p sampler for min-p."""
    if settings in ("k1000 p0.9", "mixed"):
        return FI[settings + "/top_k_top_p_sampling_from_probs"]
    if settings == "min_p0.1":
        return FI[settings + "/min_p_sampling_from_probs"]
    method = "top_p_renorm_probs" if settings.startswith("p") else "top_k_renorm_probs"
    return FI[settings + "/" + method]


SAMPLE_MATCH = {"p0.9": "top_p_sampling_from_probs", "k1000": "top_k_sampling_from_probs",
                "k1000 p0.9": "top_k_top_p_sampling_from_probs",
                "min_p0.1": "min_p_sampling_from_probs"}
PATHS = [SweepPath(f"capture {s}", "capture", s, CAPTURE_GOALS.get(s), capture_match(s))
         for s in [*SETTINGS, "mixed"]]
PATHS += [SweepPath(f"sample {s}", "sample", s, SAMPLE_GOALS.get(s), FI[f"{s}/{m}"])
          for s, m in SAMPLE_MATCH.items()]
PATHS += [SweepPath("compact k1000", "compact", match="read (floor)"),
          SweepPath("read (floor)", "read"), *FI_PATHS]


# ------------------------------------------------------------------ inputs


def fp32_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(batch, vocab, device=DEVICE, generator=gen)


def bf16_logits(batch: int, head: torch.Tensor, seed: int) -> torch.Tensor:
    """Unit-std logits with a bf16 lm_head's precision (ties included)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
    hidden = torch.randn(batch, HIDDEN, device=DEVICE, generator=gen).to(torch.bfloat16)
    return (hidden @ head).float()


def make_head(vocab: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(20)
    head = torch.randn(HIDDEN, vocab, device=DEVICE, generator=gen) / HIDDEN ** 0.5
    return head.to(torch.bfloat16)


def distributions(batch: int, vocab: int, scales) -> dict[str, Callable[[int], torch.Tensor]]:
    """name -> logits of input set `seed` ([B, V] float32)."""
    head = make_head(vocab)
    dists: dict[str, Callable[[int], torch.Tensor]] = {}
    for s in scales:
        dists[f"fp32 s{s:g}"] = lambda seed, s=s: fp32_logits(batch, vocab, seed) * s
    for s in scales:
        dists[f"bf16 s{s:g}"] = lambda seed, s=s: bf16_logits(batch, head, seed) * s
    # the mix: rows alternate fp32 and bf16, at every scale of SCALES in a
    # fixed shuffled order (also in a smoke run, whose own scales are few)
    order = torch.randperm(len(SCALES), generator=torch.Generator().manual_seed(35))
    row_scale = torch.tensor(SCALES)[order[torch.arange(batch) % len(SCALES)]]
    row_bf16 = torch.arange(batch) % 2 == 1

    def mix(seed: int) -> torch.Tensor:
        both = torch.where(row_bf16.to(DEVICE)[:, None], bf16_logits(batch, head, seed),
                           fp32_logits(batch, vocab, seed))
        return both * row_scale.to(DEVICE)[:, None]

    dists["mix"] = mix
    return dists


def settings_kwargs(settings: str, batch: int) -> dict[str, Any]:
    """capture()/sample() keyword arguments of a SETTINGS key; "mixed": [B]
    tensors, row b with the settings of SETTINGS' (b mod n)-th entry."""
    if settings != "mixed":
        return dict(SETTINGS[settings])
    rows = [list(SETTINGS.values())[b % len(SETTINGS)] for b in range(batch)]
    return {"top_k": torch.tensor([r.get("top_k", 0) for r in rows], device=DEVICE),
            "top_p": torch.tensor([r.get("top_p", 1.0) for r in rows], device=DEVICE),
            "min_p": torch.tensor([r.get("min_p", 0.0) for r in rows], device=DEVICE)}


class InputSet:
    """One [B, V] input: probs, compaction's masked log-probs, sample()'s
    seeds, and per capture setting the tokens a sampler drew from its support."""

    def __init__(self, logits: torch.Tensor, seed: int, capture_settings: list[str]) -> None:
        self.probs = torch.softmax(logits, -1)
        batch, vocab = self.probs.shape
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        kept = reference_support(self.probs, COMPACT_K, 1.0, 0.0, "joint")[0]
        self.masked = torch.where(kept, torch.log(self.probs), float("-inf"))
        self.seeds = torch.randint(0, 2**40, (batch,), device=DEVICE, generator=gen)
        self.tokens = {}
        for settings in capture_settings:
            kw = settings_kwargs(settings, batch)
            support = reference_support(self.probs, kw.get("top_k"), kw.get("top_p"),
                                        kw.get("min_p"), "joint")[0]
            race = torch.empty_like(self.probs).exponential_(generator=gen)
            self.tokens[settings] = torch.where(support, self.probs / race, -1.0).argmax(1)
        self.read_out = torch.empty(batch * triton.cdiv(vocab, 8192), device=DEVICE)


# ------------------------------------------------------------------ calls and checks


def make_call(path: SweepPath, s: InputSet, fi, max_tokens: int, seed: int) -> Callable[[], Any]:
    batch, vocab = s.probs.shape
    kw = settings_kwargs(path.settings, batch) if path.settings else {}
    if path.kind == "capture":
        return lambda: kernels.capture(s.probs, s.tokens[path.settings], max_tokens=max_tokens,
                                       **kw)
    if path.kind == "sample":
        return lambda: kernels.sample(s.probs, s.seeds, max_tokens=max_tokens, **kw)
    if path.kind == "compact":
        return lambda: kernels.compact(s.masked, max_tokens)
    if path.kind == "read":
        return lambda: read_once(s.probs, s.read_out)
    # FlashInfer's top-k has no "off" (it takes k in [1, V]): shmask's off
    # (k <= 0 or k >= V) is k = V there, which keeps every id; its per-row
    # settings are int32 / float32 tensors; the mixed rows' min-p is dropped
    # (FlashInfer has no kernel with all three cutoffs)
    if path.settings == "mixed":
        k = kw["top_k"]
        kw = {"top_k": torch.where((k > 0) & (k < vocab), k, vocab).to(torch.int32),
              "top_p": kw["top_p"].float()}
    elif "top_k" in kw:
        kw["top_k"] = min(int(kw["top_k"]), vocab)
    args = [kw[k] for k in ("top_k", "top_p", "min_p") if k in kw]
    if path.method.endswith("sampling_from_probs"):
        args.append(seed)
    method = getattr(fi, path.method)
    return lambda: method(s.probs, *args)


def support_mask(rows, batch: int, vocab: int) -> torch.Tensor:
    """bool [B, V]: the ids of device Rows, both forms decoded, no host loop."""
    dev = rows.ids.device
    n_ids = int(rows.id_offsets[-1])
    id_len = (rows.id_offsets[1:] - rows.id_offsets[:-1]).long()
    row_of = torch.repeat_interleave(torch.arange(batch, device=dev), id_len)
    data = rows.ids[:n_ids].long()
    bitmask = rows.forms.long()[row_of] == kernels.Form.BITMASK
    mask = torch.zeros(batch, vocab, dtype=torch.bool, device=dev)
    mask[row_of[~bitmask], data[~bitmask]] = True
    # word j of a bitmask row holds ids 32 j .. 32 j + 31, bit i = id 32 j + i
    words = data[bitmask] & 0xFFFFFFFF
    word_idx = torch.arange(n_ids, device=dev)[bitmask] - rows.id_offsets[:-1].long()[row_of][bitmask]
    bit = torch.arange(32, device=dev)
    cols = word_idx[:, None] * 32 + bit
    hit = ((words[:, None] >> bit) & 1).bool() & (cols < vocab)
    mask[row_of[bitmask][:, None].expand_as(hit)[hit], cols[hit]] = True
    return mask


def check(path: SweepPath, got, s: InputSet, max_tokens: int) -> tuple[int, int]:
    """(rows that differ from the torch reference, rows that differ only
    within fp32 rounding of their top-p target) of a shmask path's result."""
    probs = s.probs
    batch, vocab = probs.shape
    kw = settings_kwargs(path.settings, batch) if path.settings else {}
    if path.kind == "compact":
        want = kernels.reference_compact(s.masked, max_tokens)
    else:
        tokens = s.tokens[path.settings] if path.kind == "capture" else got.tokens.long()
        want = kernels.reference_capture(probs, tokens, max_tokens=max_tokens, **kw)
    got_mask = support_mask(got, batch, vocab)
    differ = ((got_mask != support_mask(want, batch, vocab)).any(1)
              | (got.status != want.status) | (got.sizes != want.sizes))
    rounding = torch.zeros_like(differ)
    top_p = kw.get("top_p")
    if top_p is not None and bool(differ.any()):
        p = top_p if isinstance(top_p, torch.Tensor) else torch.full((batch,), top_p,
                                                                        device=probs.device)
        # a top-p support for a target within rounding that the row's other
        # cutoffs (top-k, min-p) keep whole is the same support, found in fp32
        others = reference_support(probs, kw.get("top_k"), 1.0, kw.get("min_p"), "joint")[0]
        rounding = (differ & (p < 1) & (got.status == kernels.Status.OK)
                    & kernels.top_p_within_rounding(probs, got_mask, p)
                    & ~(got_mask & ~others).any(1))
    return int((differ & ~rounding).sum()), int(rounding.sum())


# ------------------------------------------------------------------ timing


def measure(path: SweepPath, dist: str, sets: list[InputSet], fi, args) -> dict:
    """One (path, distribution): the check on the first call, then the timing."""
    calls = [make_call(path, s, fi, args.max_tokens, seed) for seed, s in enumerate(sets)]
    began = time.perf_counter()
    first = calls[0]()
    wall_us = (time.perf_counter() - began) * 1e6
    mismatches = rounding = None
    if path.kind in ("capture", "sample", "compact"):
        mismatches, rounding = check(path, first, sets[0], args.max_tokens)
    cpu: list[float] = []
    if CUDA:
        gpu, host = gpu_and_host_us(calls, args.reps, args.per_rep, cpu)
    else:  # the interpreter: one call's wall time stands for both (no verdicts)
        gpu = host = wall_us
        cpu.append(float("nan"))
    return {"path": path.name, "dist": dist, "gpu_us": gpu, "host_us": host,
            "host_cpu_us": cpu[0], "mismatches": mismatches, "rounding": rounding}


# ------------------------------------------------------------------ tables


def fmt(x: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if x is None or math.isnan(x) else f"{x:{width}.1f}"


def worst(results: list[dict], name: str) -> dict | None:
    """The row of `name` with the largest GPU us, and the largest host us over
    the distributions (with that cell's thread CPU us: a host busy with
    other work inflates the wall time, not this); None when the path was
    not measured."""
    rows = [r for r in results if r["path"] == name and not math.isnan(r["gpu_us"])]
    if not rows:
        return None
    top = max(rows, key=lambda r: r["gpu_us"])
    slowest_host = max(rows, key=lambda r: r["host_us"])
    return {"gpu_us": top["gpu_us"], "dist": top["dist"],
            "host_us": slowest_host["host_us"],
            "host_cpu_us": slowest_host.get("host_cpu_us", float("nan")),
            "host_dist": slowest_host["dist"],
            "mismatches": sum(r["mismatches"] or 0 for r in rows),
            "rounding": sum(r["rounding"] or 0 for r in rows)}


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None or not CUDA else ("PASS" if ok else "MISS")


def worst_table(results: list[dict], paths: list[SweepPath], fi_missing: bool,
                n_dists: int) -> list[dict]:
    """THE table: per shmask path its worst case, its goals and verdicts,
    and its FlashInfer kernel's worst case judged by the same GPU goal."""
    print(f"\nworst case over {n_dists} distributions (GPU us, the distribution, worst host us"
          " and that cell's thread CPU us)"
          + ("" if CUDA else "; no CUDA: interpreter wall time, no verdicts"))
    header = (f"{'path':34} | {'GPU us':>8} | {'on':9} | {'host us':>8} | {'cpu us':>8} | "
              f"{'mism':>4} | "
              f"{'round':>5} | {'goal':40} | {'GPU':4} | {'host':4} | {'FlashInfer/floor':34} | "
              f"{'its GPU us':>10} | {'on':9} | {'its':4}")
    print(header)
    print("-" * len(header))
    table = []
    for path in paths:
        w = worst(results, path.name)
        if w is None:
            continue
        if path.kind in ("fi", "read"):  # baselines: their worst case, no goal of their own
            table.append({"path": path.name, **w})
            print(f"{path.name:34} | {fmt(w['gpu_us'])} | {w['dist']:9} | {fmt(w['host_us'])} | "
                  f"{fmt(w['host_cpu_us'])} |")
            continue
        goal, gpu_ok = "-", None
        if path.goal_us is not None:
            goal, gpu_ok = f"<= {path.goal_us:g} us", w["gpu_us"] <= path.goal_us
        if path.kind == "compact":  # the worst ratio to the read of the same inputs
            ratio = max(r["gpu_us"] / read["gpu_us"] for r in results if r["path"] == path.name
                        for read in results if read["path"] == "read (floor)"
                        and read["dist"] == r["dist"])
            goal, gpu_ok = f"<= {COMPACT_GOAL}x read (worst {ratio:.2f}x)", ratio <= COMPACT_GOAL
        goal += f"; host <= {HOST_GOAL:g}"
        m = worst(results, path.match)
        if m is not None:
            judged = path.goal_us is not None  # the read has no goal of its own
            its = (fmt(m["gpu_us"], 10), f"{m['dist']:9}",
                   verdict(m["gpu_us"] <= path.goal_us) if judged else "")
        else:
            its = (f"{'not built' if fi_missing else 'not run':>10}", f"{'':9}", "")
        row = {"path": path.name, **w, "goal": goal, "gpu_verdict": verdict(gpu_ok),
               "host_verdict": verdict(w["host_us"] <= HOST_GOAL), "match": path.match,
               "match_gpu_us": None if m is None else m["gpu_us"],
               "match_dist": None if m is None else m["dist"], "match_verdict": its[2]}
        table.append(row)
        print(f"{path.name:34} | {fmt(w['gpu_us'])} | {w['dist']:9} | {fmt(w['host_us'])} | "
              f"{fmt(w['host_cpu_us'])} | {w['mismatches']:4d} | {w['rounding']:5d} | {goal:40} | "
              f"{row['gpu_verdict']:4} | "
              f"{row['host_verdict']:4} | {path.match:34} | {its[0]} | {its[1]} | {its[2]:4}")
    return table


SLOWER = 1.03  # a path this much slower than the baseline on some distribution is named


def against_baseline(results: list[dict], baseline: dict, device: str) -> list[dict]:
    """--baseline: each path's GPU us against an earlier run's (its --json)
    on the distributions both ran: the worst case then and now, and the
    distribution where it moved most; a path slower by SLOWER on some
    distribution is marked, so that a change that slows a path the change
    did not aim at shows in the run that would otherwise hide it under
    the worst case."""
    then = {(r["path"], r["dist"]): r["gpu_us"] for r in baseline["rows"]}
    same_card = baseline.get("device") == device
    print(f"\nagainst the baseline ({baseline.get('device')}"
          + ("" if same_card else f"; this run: {device}, another card: the ratios say little")
          + "; GPU us, the distributions both ran)")
    header = (f"{'path':34} | {'then':>8} | {'now':>8} | {'now/then':>8} | "
              f"{'moved most on':13} | {'ratio':>6} |")
    print(header)
    print("-" * len(header))
    table = []
    for name in dict.fromkeys(r["path"] for r in results):
        pairs = [(r["dist"], r["gpu_us"], then[(name, r["dist"])]) for r in results
                 if r["path"] == name and (name, r["dist"]) in then
                 and not math.isnan(r["gpu_us"]) and not math.isnan(then[(name, r["dist"])])]
        if not pairs:
            continue
        worst_then = max(t for _, _, t in pairs)
        worst_now = max(n for _, n, _ in pairs)
        slower = any(n > SLOWER * t for _, n, t in pairs)
        # a slower path names where it slowed most, another where it moved most
        dist, now, was = max(pairs, key=(lambda p: p[1] / p[2]) if slower
                             else (lambda p: abs(p[1] / p[2] - 1.0)))
        row = {"path": name, "then_us": worst_then, "now_us": worst_now,
               "ratio": worst_now / worst_then, "moved_most_on": dist,
               "moved_ratio": now / was, "slower": slower}
        table.append(row)
        print(f"{name:34} | {fmt(worst_then)} | {fmt(worst_now)} | {row['ratio']:8.3f} | "
              f"{dist:13} | {row['moved_ratio']:6.3f} |"
              + (f" SLOWER (past {SLOWER:g}x)" if slower else ""))
    return table


def load_flashinfer() -> tuple[Any, str]:
    """(FlashInfer's kernels, its version) or (None, why not):
    benchmarks/flashinfer_ref.py builds them from FlashInfer's headers (nvcc,
    once per header version), or says in one line why it cannot."""
    if not CUDA:  # and no nvcc build on a CPU host for nothing
        return None, "no CUDA device"
    try:
        import flashinfer_ref
    except ImportError as exc:
        return None, f"benchmarks/flashinfer_ref.py does not import: {exc}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):  # load() prints its reason
            fi = flashinfer_ref.load()
    except Exception as exc:  # noqa: BLE001 - any failure: the table says why
        return None, f"load() raised {type(exc).__name__}: {exc}"
    print(said.getvalue(), end="")
    if fi is None:
        lines = said.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "load() returned None"
    return fi, (flashinfer_ref.find_include() / "VERSION").read_text().split()[0]


# ------------------------------------------------------------------ main


def set_tuning(assignments: list[str]) -> dict[str, int]:
    """--tuning NAME=VALUE: kernels/tuning.py's integer NAME set to VALUE
    (the launchers read it at each call); a name it does not have, or a
    value that is not an integer, is refused."""
    tuning = importlib.import_module(kernels.__name__ + ".tuning")
    tuned = {}
    for assignment in assignments:
        name, _, value = assignment.partition("=")
        if not name.isupper() or not isinstance(getattr(tuning, name, None), int):
            raise SystemExit(f"--tuning {assignment}: kernels/tuning.py has no integer {name}")
        try:
            tuned[name] = int(value)
        except ValueError:
            raise SystemExit(f"--tuning {assignment}: {value!r} is not an integer") from None
        setattr(tuning, name, tuned[name])
    return tuned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="B=2, V=4000, scale 8 and the mix (CPU: Triton's interpreter)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only", default="", help="regex: run the paths it finds")
    parser.add_argument("--dists", default="", help="regex: run the distributions it finds")
    parser.add_argument("--json", help="write every row and the worst-case table here")
    parser.add_argument("--baseline", metavar="JSON",
                        help="an earlier run's --json: each path against it, per distribution")
    parser.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE",
                        help="set an integer constant of kernels/tuning.py for this run "
                             "(repeatable; an A/B of a tuning in one device call)")
    args = parser.parse_args()
    tuned = set_tuning(args.tuning)
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    # smoke: the interpreter costs ~0.2-1.5 s per call and row, so few rows;
    # V = 4000 is one block of the kernels (k4096 is then off: the whole row)
    batch, vocab, scales, rotate = (2, 4000, SMOKE_SCALES, 2) if args.smoke else \
        (256, 151936, SCALES, 4)
    args.max_tokens = 8192
    args.reps, args.per_rep = (2, 4) if args.smoke else (5, 20) if args.quick else (15, 40)
    paths = [p for p in PATHS if re.search(args.only, p.name)]
    if any(p.kind == "compact" for p in paths) and not any(p.kind == "read" for p in paths):
        paths.append(next(p for p in PATHS if p.kind == "read"))  # compact's goal needs it
    started = time.perf_counter()
    where = (f"{torch.cuda.get_device_name()}" if CUDA else "CPU, Triton interpreter")
    print(f"sweep: {where}; torch {torch.__version__}, triton {triton.__version__}; "
          f"B={batch} V={vocab} max_tokens={args.max_tokens}; {time.strftime('%Y-%m-%d %H:%M')}"
          + "".join(f"; tuning.{name} = {value}" for name, value in tuned.items()))
    fi, fi_said = None, ""
    fi_wanted = any(p.kind == "fi" for p in paths)
    if fi_wanted:
        fi, fi_said = load_flashinfer()
    if not fi_wanted:
        print("flashinfer: not run (--only selects no fi path)")
    else:
        print(f"flashinfer: not built ({fi_said})" if fi is None else
              f"flashinfer: {fi_said} (benchmarks/flashinfer_ref.py, from its headers)")
    if fi is None:
        paths = [p for p in paths if p.kind != "fi"]
    capture_settings = sorted({p.settings for p in paths if p.kind == "capture"})
    results: list[dict] = []
    dists = {name: make for name, make in distributions(batch, vocab, scales).items()
             if re.search(args.dists, name)}
    supports = {}
    for dist, make in dists.items():
        sets = [InputSet(make(seed), seed, capture_settings) for seed in range(rotate)]
        size = reference_support(sets[0].probs, None, SUPPORT_P, None, "joint")[0].sum(1).float()
        supports[dist] = {"mean": size.mean().item(), "min": size.min().item(),
                          "max": size.max().item()}
        print(f"\n{dist}: top_p {SUPPORT_P} support mean {supports[dist]['mean']:.0f}, "
              f"min {supports[dist]['min']:.0f}, max {supports[dist]['max']:.0f} ids")
        print(f"  {'path':34} | {'GPU us':>8} | {'host us':>8} | {'cpu us':>8} | check")
        for path in paths:
            r = measure(path, dist, sets, fi, args)
            results.append(r)
            checked = ("-" if r["mismatches"] is None
                       else f"{r['mismatches']} mismatched, {r['rounding']} within rounding")
            print(f"  {path.name:34} | {fmt(r['gpu_us'])} | {fmt(r['host_us'])} | "
                  f"{fmt(r['host_cpu_us'])} | {checked}",
                  flush=True)
        del sets
        if CUDA:
            torch.cuda.empty_cache()
    table = worst_table(results, paths, fi_wanted and fi is None, len(dists))
    compared = [] if baseline is None else against_baseline(results, baseline, where)
    bad = sum(r["mismatches"] or 0 for r in results)
    print(f"\nchecks: {bad} mismatched rows; {sum(r['rounding'] or 0 for r in results)} rows "
          f"within fp32 rounding of the top-p target; {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": where, "batch": batch, "vocab": vocab, "max_tokens": args.max_tokens,
             "flashinfer": fi_said if fi is not None else f"not built ({fi_said})",
             "supports": supports, "rows": results, "worst": table,
             "baseline": compared}, indent=1))


if __name__ == "__main__":
    main()

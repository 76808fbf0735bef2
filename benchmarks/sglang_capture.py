"""Issue 36 item 1: SGLang 0.5.23's sampling-mask capture against the patched
capture (shmask.adapters.sglang_sampler), per decode step, on the GPU.

B = 256 requests, every one opted in, V = 151936, --sampling-mask-max-tokens
4096 (SGLang's default), over distributions from flat to peaked (sweep.py's
fp32 and bf16 logits at scales 0.5-14; the worst case per path is the
verdict). Settings: top_k 1000 (the joint sampler's branch) and top_p 0.9
only (the RL rollout setting released SGLang refuses).

Paths (GPU us per step with the host ahead, host us per step with the GPU
busy: _common.gpu_and_host_us; each also "+ copy": its output copied to
pinned host memory as SGLang's `_async_d2h` does):

  released    what SGLang 0.5.23's sampler runs for the mask, op for op
              (its `_sample_from_probs` FlashInfer branch after the draw,
              then `_build_sampling_mask_output`): FlashInfer's
              top_k_renorm_probs / top_p_renorm_probs (sgl_kernel's
              top_k_renorm_prob / top_p_renorm_prob are these kernels; here
              built from FlashInfer's headers by flashinfer_ref.py), the
              gather of the selected weight, the support mass, statuses,
              torch.topk(k=4096, sorted) and the support logprobs. The ops
              are re-run from this description, not imported: SGLang's
              module needs its whole package and its CUDA extensions,
              which the device cannot install (the CPU comparison of the
              real modules is tests/compat/test_sglang_sampler_patched.py).
  patched     shmask.adapters.sglang_sampler.fixed_capture: capture +
              fixed_rows (engine order) + the same support logprobs; for
              top-p-only rows (top_k above the cap) also the rows past the
              cap whole (SHMASK_PAST_CAP=exact: spill_rows' bitmasks, and
              values in support mode); "past cap status": those rows
              OVERFLOW instead (what released SGLang would abort).

Goal (issue 36): patched <= 1/5 of released for top_k rows (GPU), host time
no more than released's; top-p-only rows no more than released's top_k 4096.
Without CUDA (--smoke): B = 2, V = 512, cap 32, one distribution, the
interpreter; no timing (the columns say nothing of the GPU there).

--sglang-module TREE (a zip or folder from sglang_device_tree.py; "installed":
the SGLang this Python imports): SGLang's own `Sampler.forward` instead of the
ops above, released and patched (sampler.py with the patch's sampler section),
loaded by tests/compat/_sglang_sampler.py from the tree, on a real
SamplingBatchInfo of B requests all opted in (SamplingBatchInfo.from_schedule_batch
on the GPU), --backend flashinfer (SGLang's CUDA default: its joint sampler
and, for the mask, sgl_kernel's renorms; both FlashInfer's kernels from
flashinfer_ref.py, sglang_device_tree.py says what is stubbed) or pytorch.
Each path is one whole forward (the logits copied first, as the sampler
softmaxes in place); "draw alone" is the same forward with no row opted in,
so a path's mask work is its time less that one; "patched, shmask draw" is
the patched forward with SHMASK_DRAW=shmask (shmask's sample() draws and
captures in one pass: its "mask us" is what the draw and masks together
add to SGLang's draw alone; its tokens are its own, so its rows are not
compared). "+ copy": the output's
tensors to pinned host memory by SGLang's own `map_device_tensors(async_d2h)`
(the overlap scheduler's copy). Released SGLang's scheduler refuses top-p-only
mask requests (top_k above the cap): its column there is what its sampler
would do with such a batch (rows past the cap OVERFLOW), and the issue's
comparison for the patched top-p-only rows is released top_k 4096. The rows
of both are compared per setting on each distribution until one has OK
rows to compare (a top-p row on a flat distribution is past the cap: its
fixed fields hold OVERFLOW on both sides; every distribution with
--check-all): tokens, statuses, ids (sets; order, which may differ only
among equal weights), logprobs to float32 rounding; mismatches are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import gpu_and_host_us, print_table  # noqa: E402
from sweep import distributions  # noqa: E402

from shmask.adapters.sglang_sampler import fixed_capture  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAP = 4096  # SGLang's --sampling-mask-max-tokens default
# name: (top_k, top_p, support mode); every row opted in
SETTINGS = {"top_k 1000": (1000, 1.0, True), "top_p 0.9": (1 << 30, 0.9, True),
            "top_p 0.9 selected": (1 << 30, 0.9, False), "top_k 4096": (4096, 1.0, True)}
# --smoke (the interpreter): a small cap and small supports
SMOKE_CAP = 32
SMOKE_SETTINGS = {"top_k 16": (16, 1.0, True), "top_p 0.9": (1 << 30, 0.9, True),
                  "top_p 0.9 selected": (1 << 30, 0.9, False)}


def info_for(batch: int, top_k: int, top_p: float, support: bool) -> Any:
    """The fields of SGLang's SamplingBatchInfo the capture reads."""
    return SimpleNamespace(
        return_sampling_masks=[True] * batch, sampling_mask_top_ks=[top_k] * batch,
        return_sampling_support_logprobs=[support] * batch,
        sampling_mask_batch_indices=torch.arange(batch, device=DEVICE),
        top_ks=torch.full((batch,), top_k, dtype=torch.int32, device=DEVICE),
        top_ps=torch.full((batch,), top_p, dtype=torch.float32, device=DEVICE),
        min_ps=torch.zeros(batch, dtype=torch.float32, device=DEVICE),
        need_top_k_sampling=top_k < (1 << 30), need_top_p_sampling=top_p < 1.0,
        need_min_p_sampling=False)


def released_capture(fi: Any, probs: torch.Tensor, tokens: torch.Tensor, info: Any,
                     cap: int = CAP) -> tuple:
    """SGLang 0.5.23's mask work for a step, op for op (module docstring)."""
    filtered = probs
    if info.need_top_k_sampling:
        filtered = fi.top_k_renorm_probs(probs, info.top_ks)
    if info.need_top_p_sampling:
        top_p_probs = fi.top_p_renorm_probs(probs, info.top_ps)
        if filtered is probs:
            filtered = top_p_probs
        else:
            filtered.masked_fill_(top_p_probs <= 0, 0)
    sampled = tokens.view(-1, 1).long()
    selected_weight = torch.gather(filtered, 1, sampled).squeeze(1)
    # _build_sampling_mask_output
    sampled_in_capture = selected_weight > 0
    support = filtered > 0
    support_mass = torch.where(support, filtered, torch.zeros_like(filtered)).sum(
        dim=-1, dtype=torch.float32)
    selected_logprobs = torch.log(selected_weight.float() / support_mass)
    invalid = ~(sampled_in_capture & (selected_weight > 0) & (support_mass > 0)
                & torch.isfinite(selected_logprobs))
    lengths = support.sum(dim=-1, dtype=torch.int32)
    statuses = torch.where(invalid, 2, torch.where(lengths > cap, 1, 0)).to(torch.int32)
    packed_weights, positions = torch.topk(filtered, k=min(cap, probs.shape[1]), dim=-1,
                                           largest=True, sorted=True)
    outputs = (positions.to(torch.int32), lengths.clamp(max=cap), selected_logprobs, statuses)
    if info.return_sampling_support_logprobs[0]:
        outputs += (torch.log(packed_weights.float() / support_mass.unsqueeze(-1)),)
    return outputs


def patched_capture(probs: torch.Tensor, tokens: torch.Tensor, info: Any,
                    cap: int = CAP, past_cap: str = "exact") -> tuple:
    """What the patched sampler hands SGLang: the fixed fields (support
    logprobs for support-mode rows only) and, past_cap "exact", the spilled
    rows of a batch whose top_k exceeds the cap (SHMASK_PAST_CAP)."""
    fixed = fixed_capture(probs, tokens, info, order="joint", max_tokens=cap, row_order="engine",
                          past_cap=past_cap)
    support = fixed.support_logprobs if info.return_sampling_support_logprobs[0] else None
    outputs = (fixed.token_ids, fixed.lengths, fixed.selected_logprobs, support, fixed.statuses)
    if fixed.spill is not None:
        outputs += (fixed.spill.lengths, fixed.spill.bits, fixed.spill.values)
    return tuple(t for t in outputs if t is not None)


def with_copy(outputs: tuple) -> tuple:
    """SGLang's `_async_d2h`: each tensor into pinned host memory, async."""
    copies = []
    for tensor in outputs:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=DEVICE == "cuda")
        host.copy_(tensor, non_blocking=True)
        copies.append(host)
    return tuple(copies)


def load_flashinfer() -> Any:
    import flashinfer_ref

    return flashinfer_ref.load()


# ------------------------------------------------ SGLang's own sampler (--sglang-module)

def module_info(harness: Any, logits: torch.Tensor, top_k: int, top_p: float, support: bool,
                masks: bool = True) -> Any:
    """A real SamplingBatchInfo: every row opted in (masks) or none."""
    batch = logits.shape[0]
    rows = list(range(batch)) if masks else []
    return harness.sampling_info(
        logits, temperatures=[1.0] * batch, top_ks=[-1 if top_k >= 1 << 30 else top_k] * batch,
        top_ps=[top_p] * batch, min_ps=[0.0] * batch, mask_rows=rows,
        support_rows=rows if support else [])


@contextlib.contextmanager
def shmask_env(values: dict[str, str] | None) -> Iterator[None]:
    """SHMASK_* variables for the block (None: as set; e.g. SHMASK_PAST_CAP,
    SHMASK_DRAW), read afresh by the patched sampler."""
    from shmask.adapters import sglang_sampler

    saved = {name: os.environ.get(name) for name in values or {}}
    os.environ.update(values or {})
    sglang_sampler._settings.cache_clear()
    try:
        yield
    finally:
        for name, was in saved.items():
            if was is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = was
        sglang_sampler._settings.cache_clear()


def compare_rows(harness: Any, info: Any, patched: tuple, released: tuple) -> tuple[list[str], dict]:
    """Patched against released (each (next_token_ids, SamplingMaskOutput)):
    the problems, and a summary. Ids may be ordered differently only among
    equal weights (released torch.topk leaves ties in any order; patched:
    ascending id); logprobs agree to float32 rounding (atol 1e-5, rtol 1e-6:
    the support mass is summed in another order)."""
    problems = []
    if not torch.equal(patched[0].cpu(), released[0].cpu()):
        problems.append(f"tokens differ in {int((patched[0] != released[0]).sum())} rows")
    mine, theirs = harness.ok_rows(patched[1], info), harness.ok_rows(released[1], info)
    ok = tie_orders = 0
    worst = 0.0
    for row, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a.status != b.status:
            problems.append(f"row {row}: status {a.status}, released {b.status}")
            continue
        if a.status != 0:
            continue
        ok += 1
        if set(a.ids.tolist()) != set(b.ids.tolist()):
            only = set(a.ids.tolist()) ^ set(b.ids.tolist())
            problems.append(f"row {row}: {len(a.ids)} ids, released {len(b.ids)} "
                            f"({len(only)} in one only)")
            continue
        pairs = [(a.selected_logprob, b.selected_logprob)]
        if b.support_logprobs is not None:
            by_id = dict(zip(b.ids.tolist(), b.support_logprobs.tolist(), strict=True))
            pairs += zip(a.support_logprobs.tolist(), [by_id[i] for i in a.ids.tolist()], strict=True)
            if not numpy.array_equal(a.ids, b.ids):
                # a tie: at each differing place released has the same weight for both ids
                differ = numpy.flatnonzero(a.ids != b.ids)
                if all(by_id[a.ids[i]] == b.support_logprobs[i] for i in differ):
                    tie_orders += 1
                else:
                    problems.append(f"row {row}: ids ordered differently beyond ties "
                                    f"(first at {differ[0]})")
        elif not numpy.array_equal(a.ids, b.ids):
            tie_orders += 1  # selected mode: no weights to tell; the sets are equal
        for got, want in pairs:
            worst = max(worst, abs(got - want))
            if abs(got - want) > 1e-5 + 1e-6 * abs(want):
                problems.append(f"row {row}: logprob {got!r}, released {want!r}")
                break
    return problems, {"ok_rows": ok, "rows": len(mine), "tie_orders": tie_orders,
                      "max_logprob_diff": worst}


def with_sglang_copy(result: tuple) -> Any:
    """SGLang's copy of the output to the host (the overlap scheduler's
    map_device_tensors(async_d2h))."""
    from sglang.srt.utils.common import async_d2h

    result[1].map_device_tensors(async_d2h)
    return result


def module_paths(forward: Any, released: Any, patched: Any, logits: torch.Tensor, info: Any,
                 plain: Any, past_cap_paths: bool) -> dict[str, tuple[Any, dict[str, str] | None]]:
    """path -> (call, SHMASK_* variables for it): one forward each. "shmask
    draw": SHMASK_DRAW=shmask, the draw and the rows from shmask's sample()
    (its tokens are its own: timed, not compared)."""
    paths: dict[str, tuple[Any, dict[str, str] | None]] = {
        "draw alone (no masks)": (lambda: forward(released, logits, plain), None),
        "released": (lambda: forward(released, logits, info), None),
        "patched": (lambda: forward(patched, logits, info), None),
        "patched, shmask draw": (lambda: forward(patched, logits, info), {"SHMASK_DRAW": "shmask"})}
    if past_cap_paths:  # rows past the cap OVERFLOW instead of whole
        paths["patched, past cap status"] = (paths["patched"][0], {"SHMASK_PAST_CAP": "status"})
    for name, (call, env) in list(paths.items())[1:]:
        paths[name + " + copy"] = (lambda c=call: with_sglang_copy(c()), env)
    return paths


def sglang_module_main(args: argparse.Namespace) -> int:
    import sglang_device_tree

    released, patched, harness = sglang_device_tree.load(
        None if args.sglang_module == "installed" else args.sglang_module)
    smoke = args.smoke or DEVICE != "cuda"
    batch, vocab = (4, 512) if smoke else (256, 151936)
    scales = (8.0,) if smoke else (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 14.0)
    cap, settings = (SMOKE_CAP, SMOKE_SETTINGS) if smoke else (CAP, SETTINGS)
    dists = distributions(batch, vocab, scales)
    if smoke:
        dists = dict(list(dists.items())[:1])
    if args.dists:  # a part of the list (a device call has 300 s)
        dists = {name: make for name, make in dists.items() if re.search(args.dists, name)}
    print(f"SGLang's Sampler.forward from {released.__file__} (released) and "
          f"{patched.__file__} (patched), backend {args.backend}, B {batch}, V {vocab}, cap {cap}")
    rows: list[dict] = []
    problems_total = 0

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # `timeout`: keep what is measured
    signal.signal(signal.SIGTERM, stop)
    try:
        with harness.sampler_context(cap, backend=args.backend):
            from sglang.srt.runtime_context import get_exec

            # SGLang's resolution has the last word (a CPU device resolves to pytorch)
            print(f"SGLang's sampling backend: {get_exec().kernel.sampling_backend}")
            samplers = {released: released.Sampler(), patched: patched.Sampler()}

            def forward(module: Any, logits: torch.Tensor, info: Any) -> tuple:
                return harness.run_forward(module, samplers[module], logits, info, torch_seed=None)
            compared: set[str] = set()  # settings whose rows were compared on OK rows
            for dist_name, make in dists.items():
                logits = make(0)
                for set_name, (top_k, top_p, support) in settings.items():
                    info = module_info(harness, logits, top_k, top_p, support)
                    plain = module_info(harness, logits, top_k, top_p, support, masks=False)
                    if smoke or set_name not in compared or args.check_all:
                        problems, summary = compare_rows(
                            harness, info, forward(patched, logits, info), forward(released, logits, info))
                        problems_total += len(problems)
                        if summary["ok_rows"]:
                            compared.add(set_name)
                        print(f"rows {dist_name}, {set_name}: {summary}; {len(problems)} mismatches")
                        for line in problems[:10]:
                            print("   ", line)
                    alone = float("nan")
                    for path, (call, env) in module_paths(forward, released, patched, logits, info,
                                                          plain, top_k > cap).items():
                        with shmask_env(env):
                            if smoke:
                                call()
                                gpu, host = float("nan"), float("nan")
                            else:
                                gpu, host = gpu_and_host_us([call], reps=5, per_rep=10)
                        alone = gpu if path.startswith("draw alone") else alone
                        rows.append({"distribution": dist_name, "settings": set_name, "path": path,
                                     "gpu_us": gpu, "host_us": host, "mask_gpu_us": gpu - alone})
                if args.json:  # each distribution as it ends: a timeout keeps them
                    write_rows(args.json, rows, batch, vocab, cap, args.backend)
    except KeyboardInterrupt:
        print(f"stopped: {len({r['distribution'] for r in rows})} distributions measured")
    worst: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["settings"], row["path"])
        was = worst.get(key, row)
        worst[key] = {**(row if row["gpu_us"] >= was["gpu_us"] else was),
                      "host_us": max(row["host_us"], was["host_us"]),
                      "mask_gpu_us": max(row["mask_gpu_us"], was["mask_gpu_us"])}
    print_table(f"SGLang's Sampler.forward per decode step, worst over {len(dists)} "
                "distributions (mask us: the path less the draw alone)",
                ["settings", "path", "GPU us", "on", "mask us", "host us"],
                [[s, p, "-" if smoke else f"{w['gpu_us']:.1f}", w["distribution"],
                  "-" if smoke else f"{w['mask_gpu_us']:.1f}",
                  "-" if smoke else f"{w['host_us']:.1f}"] for (s, p), w in worst.items()])
    print(f"row mismatches, patched vs released: {problems_total}")
    if args.json:
        write_rows(args.json, rows, batch, vocab, cap, args.backend)
    return 0


def write_rows(path: str, rows: list[dict], batch: int, vocab: int, cap: int, backend: str) -> None:
    Path(path).write_text(json.dumps({"rows": rows, "batch": batch, "vocab": vocab, "cap": cap,
                                      "backend": backend, "sglang_module": True}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: interpreter)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sglang-module", metavar="TREE",
                        help="time SGLang's own Sampler.forward from this zip or folder "
                             "(sglang_device_tree.py), or 'installed'")
    parser.add_argument("--backend", default="flashinfer", choices=("flashinfer", "pytorch"),
                        help="--sglang-module: SGLang's sampling backend")
    parser.add_argument("--check-all", action="store_true",
                        help="--sglang-module: compare the rows on every distribution")
    parser.add_argument("--dists", default="", help="--sglang-module: the distributions "
                        "whose names this regex finds (default: all)")
    args = parser.parse_args()
    if args.sglang_module:
        return sglang_module_main(args)
    smoke = args.smoke or DEVICE != "cuda"
    batch, vocab = (2, 512) if smoke else (256, 151936)
    scales = (8.0,) if smoke else (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 14.0)
    cap, settings = (SMOKE_CAP, SMOKE_SETTINGS) if smoke else (CAP, SETTINGS)
    fi = None if smoke else load_flashinfer()
    if fi is None and not smoke:
        print("FlashInfer's kernels are not built: the released path cannot run")
        return 1
    dists = distributions(batch, vocab, scales)
    rows, worst = [], {}
    if smoke:
        dists = dict(list(dists.items())[:1])
    for dist_name, make in dists.items():
        probs = torch.softmax(make(0), -1)
        tokens = torch.multinomial(probs, 1)[:, 0].to(torch.int32)
        for set_name, (top_k, top_p, support) in settings.items():
            info = info_for(batch, top_k, top_p, support)
            paths = {"patched": lambda i=info, p=probs, t=tokens: patched_capture(p, t, i, cap)}
            if top_k > cap:  # rows past the cap: OVERFLOW instead of whole
                paths["patched, past cap status"] = (
                    lambda i=info, p=probs, t=tokens: patched_capture(p, t, i, cap, "status"))
            if fi is not None:
                paths["released"] = lambda i=info, p=probs, t=tokens: released_capture(
                    fi, p, t, i, cap)
            for path, call in list(paths.items()):
                paths[path + " + copy"] = lambda c=call: with_copy(c())
            for path, call in paths.items():
                if smoke:
                    gpu, host = float("nan"), float("nan")
                    call()
                else:
                    gpu, host = gpu_and_host_us([call], reps=5, per_rep=10)
                rows.append({"distribution": dist_name, "settings": set_name, "path": path,
                             "gpu_us": gpu, "host_us": host})
                key = (set_name, path)
                best = worst.get(key, (0.0, 0.0, ""))
                worst[key] = (max(best[0], gpu), max(best[1], host),
                              dist_name if gpu >= best[0] else best[2])
    print_table("worst case over the distributions (per decode step)",
                ["settings", "path", "GPU us", "on", "host us"],
                [[s, p, "-" if smoke else f"{g:.1f}", d, "-" if smoke else f"{h:.1f}"]
                 for (s, p), (g, h, d) in worst.items()])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "batch": batch, "vocab": vocab,
                                               "cap": cap}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: interpreter)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
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

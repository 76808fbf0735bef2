"""vLLM 0.33.0's engine-core CPU per step for sampling masks made on the GPU
(issue 36, item 5): vLLM's own path, the patched path before the masks were
published from the GPU, and the patched path now, in one run.

One decode step of a model runner in the engine core's process (vLLM's
UniProcExecutor): `requests` (256) requests, one logits row each, masked to
`support` (1000) random ids in a 151,936 vocabulary (``--support`` may be a
list: each step cycles through it; rows wider than vLLM's 2,048-id compact
width travel as bitmasks). Each path starts from the same processed logits
on the GPU and ends with every request's slice as the scheduler puts it in
its ``EngineCoreOutput``:

- released: ``SamplingMaskTensors.from_logits`` (vLLM's compaction kernel),
  ``to_cpu_nonblocking()`` (AsyncOutput's copies), then after the step's
  event ``tolists()`` (get_output) and ``slice_request`` per request;
- patched, CPU: the same, then ``publish_step`` of the lists (the engine
  core copies the rows into the ring) and its slices;
- patched, GPU: ``from_logits``, ``vllm_gpu.published`` (shmask's
  ``rows_from_fixed`` and the GPU-direct store kernel: the rows go into the
  ring from the GPU), ``to_cpu_nonblocking()``, then ``tolists()`` (the
  step's take) and ``publish_step`` (passes it through) and its slices.

CPU time is what the engine core's thread spends in those calls
(``time.perf_counter`` around them; the wait for the step's event is not
counted, and the device is synchronised there, so no call waits inside).
Every request's ids are checked against vLLM's own lists each step, outside
the timing (the references resolved by ``MaskResolver`` and released).
Medians over ``--steps`` steps, the paths interleaved step by step after
warm-up.

vLLM on a machine without it (the GPU machine has no package index and
vLLM's wheel is larger than what can be carried): ``--vllm-src DIR`` names a
copy of vLLM's two files that define these classes
(``vllm/v1/worker/gpu/sample/output.py``, ``vllm/v1/outputs.py``;
``--copy-vllm-src DIR`` writes one from the installed vLLM). They are
loaded as they are, under their own module names; the five modules they
import that these classes do not use are replaced by inert stand-ins, and
``vllm.triton_utils`` by Triton itself (the module re-exports
``triton`` and ``triton.language``). Without ``--vllm-src`` the installed
vLLM's files are loaded the same way (on a machine without CUDA, in
Triton's interpreter: ``--smoke``).

    python benchmarks/vllm_gpu_step.py [--requests 256] [--support 1000] [--steps 100]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

FILES = ("vllm/v1/worker/gpu/sample/output.py", "vllm/v1/outputs.py")
VOCAB = 151936
WARMUP = 5


def installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: pass --vllm-src (a copy made by "
                         "--copy-vllm-src where it is)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def load_vllm_classes(root: Path) -> tuple[Any, Any]:
    """vLLM's SamplingMaskTensors and SamplingMaskLists from the files under
    ``root``, as modules of their real names (module docstring)."""
    import triton
    import triton.language as tl

    def package(name: str) -> types.ModuleType:
        module = sys.modules.get(name) or types.ModuleType(name)
        module.__path__ = getattr(module, "__path__", [])
        sys.modules[name] = module
        return module

    for name in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu",
                 "vllm.v1.worker.gpu.sample", "vllm.v1.core", "vllm.v1.core.sched",
                 "vllm.compilation", "vllm.utils"):
        package(name)
    # Stand-ins: names vllm/v1/outputs.py imports for other classes than these.
    stand_ins = {"vllm.compilation.cuda_graph": {"CUDAGraphStat": type("CUDAGraphStat", (), {})},
                 "vllm.utils.torch_utils": {"PIN_MEMORY": True},
                 "vllm.v1.core.sched.output": {
                     "SchedulerOutput": type("SchedulerOutput", (), {})},
                 "vllm.triton_utils": {"triton": triton, "tl": tl}}
    for name, names in stand_ins.items():
        module = types.ModuleType(name)
        module.__dict__.update(names)
        sys.modules[name] = module
    loaded = {}
    for relative in reversed(FILES):  # outputs.py first: output.py imports it
        name = relative[:-3].replace("/", ".")
        spec = importlib.util.spec_from_file_location(name, root / relative)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loaded[name] = module
    return (loaded["vllm.v1.worker.gpu.sample.output"].SamplingMaskTensors,
            loaded["vllm.v1.outputs"].SamplingMaskLists)


def step_logits(torch: Any, device: Any, requests: int, support: int, vocab: int,
                seed: int) -> Any:
    """Processed logits as vLLM's sampler leaves them: -inf outside each
    row's `support` random ids."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keys = torch.rand(requests, vocab, generator=gen)
    kept = keys.topk(support, dim=1).indices
    logits = torch.full((requests, vocab), float("-inf"))
    logits.scatter_(1, kept, torch.randn(requests, support, generator=gen))
    return logits.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--support", default="1000", help="ids a row (a comma list cycles)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--vllm-src", type=Path, default=None)
    parser.add_argument("--copy-vllm-src", type=Path, default=None, metavar="DIR")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (CPU: Triton's interpreter)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.copy_vllm_src is not None:
        root = installed_vllm_root()
        for relative in FILES:
            (args.copy_vllm_src / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / relative, args.copy_vllm_src / relative)
        print(f"copied {', '.join(FILES)} to {args.copy_vllm_src}")
        return
    if args.smoke:
        args.requests, args.steps, args.vocab = 6, 2, 3000
    supports = [int(s) for s in args.support.split(",")]
    if args.smoke:
        supports = [40, 130]

    import torch
    from _common import SEGMENT_PREFIX

    import shmask
    from shmask.adapters import vllm as vllm_adapter
    from shmask.adapters import vllm_gpu

    masks_type, lists_type = load_vllm_classes(args.vllm_src or installed_vllm_root())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    requests = args.requests
    steps = [step_logits(torch, device, requests, s, args.vocab, i)
             for i, s in enumerate(supports)]
    cu = torch.arange(requests + 1, dtype=torch.int32, device=device)
    num_sampled = torch.ones(requests, dtype=torch.int32, device=device)
    max_kept = max(min(s, 2048) for s in supports)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    writer = shmask.Writer(shmask.Config(ring_mb=256, name_prefix=SEGMENT_PREFIX,
                                         max_tokens=vllm_adapter.VLLM_MAX_TOKENS,
                                         queue_rows=vllm_adapter.VLLM_QUEUE_ROWS))
    publisher = vllm_adapter.MaskPublisher(writer, mask_lists=lists_type)
    vllm_adapter._publisher = publisher  # the engine core's, in this process
    resolver = vllm_adapter.MaskResolver(shmask.Reader(writer.config), mask_lists=lists_type)

    def released(logits: Any) -> tuple[float, float, list[Any], Any]:
        began = time.perf_counter()
        on_host = masks_type.from_logits(logits, cu, num_sampled, max_kept).to_cpu_nonblocking()
        enqueue = time.perf_counter() - began
        sync()
        began = time.perf_counter()
        lists = on_host.tolists()
        slices = [lists.slice_request(i, 1) for i in range(requests)]
        return enqueue, time.perf_counter() - began, slices, lists

    def patched_cpu(logits: Any) -> tuple[float, float, list[Any], Any]:
        began = time.perf_counter()
        tensors = masks_type.from_logits(logits, cu, num_sampled, max_kept)
        on_host = tensors.to_cpu_nonblocking()
        enqueue = time.perf_counter() - began
        sync()
        began = time.perf_counter()
        step = publisher.publish_step(on_host.tolists())
        slices = [step.slice_request(i, 1) for i in range(requests)]
        return enqueue, time.perf_counter() - began, slices, None

    def patched_gpu(logits: Any) -> tuple[float, float, list[Any], Any]:
        began = time.perf_counter()
        tensors = vllm_gpu.published(masks_type.from_logits(logits, cu, num_sampled, max_kept))
        on_host = tensors.to_cpu_nonblocking()
        enqueue = time.perf_counter() - began
        assert isinstance(tensors, vllm_gpu.DeviceStep), "the GPU path was not taken"
        sync()
        began = time.perf_counter()
        step = publisher.publish_step(on_host.tolists())
        slices = [step.slice_request(i, 1) for i in range(requests)]
        return enqueue, time.perf_counter() - began, slices, None

    paths = {"released": released, "patched, CPU": patched_cpu, "patched, GPU": patched_gpu}
    parts = ("enqueue", "after the event", "total")
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in parts} for n in paths}
    checked = 0
    for step in range(WARMUP + args.steps):
        logits = steps[step % len(steps)]
        want = None
        for name, run in paths.items():
            enqueue, after, slices, lists = run(logits)
            if lists is not None:
                want = [lists.slice_request(i, 1).to_nested_list() for i in range(requests)]
            else:
                got = [resolver.resolve(s).to_nested_list() for s in slices]  # and released
                assert got == want, f"{name}: a request's ids differ from vLLM's own"
                checked += requests
            if step >= WARMUP:
                for part, seconds in zip(parts, (enqueue, after, enqueue + after), strict=True):
                    times[name][part].append(seconds * 1e6)
    direct = publisher.writer.default_publisher
    stats = direct.stats if direct is not None else {}
    publisher.close()
    resolver.close()
    writer.close()

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter)"
    print(f"vLLM 0.33.0 masks, {requests} requests x {supports} ids, V={args.vocab}, "
          f"{args.steps} steps, {name}; every request's ids checked ({checked} slices)")
    print("engine-core CPU per step, us (median; min-max): the launches and copies queued,")
    print("then after the step's event (lists or take, publish_step, the slices), and both:")
    medians = {n: {p: statistics.median(v) for p, v in t.items()} for n, t in times.items()}
    for label, samples in times.items():
        print(f"  {label:14s} " + "  ".join(
            f"{part} {medians[label][part]:8.1f} ({min(samples[part]):.0f}-"
            f"{max(samples[part]):.0f})" for part in parts))
    for label in ("patched, CPU", "patched, GPU"):
        print(f"  {label} / released: " + ", ".join(
            f"{part} {medians[label][part] / medians['released'][part]:.2f}x" for part in parts))
    print(f"GPU-direct publisher: {stats}")
    if args.json:
        args.json.write_text(json.dumps({"medians_us": medians, "requests": requests,
                                         "supports": supports, "device": name,
                                         "publisher": stats}, indent=1))


if __name__ == "__main__":
    main()

"""sm_90 SASS of every Triton kernel in kernels/, compiled without a GPU the
way the launchers launch them on the H200, so that two trees can be compared
kernel by kernel (issue 34: the split of capture must not change the code).

How (benchmarks/kernels_notes.md, "Reading a kernel's layouts without the
GPU"): a venv with the device's Triton (3.6) and the CPU torch; the tree's
``kernels/`` imported as the top-level package ``kernels``. Kernel launches
are recorded, not run: capture, sample and compact are called on CPU tensors
of the benchmark's shapes (B = 256 and an odd B = 5, V = 151936, bf16 and
fp32 probabilities, every setting form), with the launch decisions a CUDA
sm_90 device makes (``pdl_default``, ``compiled_for_nvidia``: on) and a stand-in
GPU-direct claim for ``into=``. Each distinct launch (kernel, argument
types and Triton's specialization of them, constexprs, options such as
num_warps and maxnreg) is compiled for ``GPUTarget("cuda", 90, 32)``; the
store kernel of kernels/direct.py is compiled for both of its modes.

Per launch: SASS instruction count, registers (``cuobjdump -res-usage``),
shared memory, and a hash of the SASS text with addresses, encodings and
the kernel's name stripped (a kernel renamed compares equal).

    /tmp/sassvenv/bin/python benchmarks/sass_compare.py --tree /tmp/sass_before \
        --out benchmarks/results/issue34_sass_before.json
    /tmp/sassvenv/bin/python benchmarks/sass_compare.py --tree . \
        --out benchmarks/results/issue34_sass_after.json
    /tmp/sassvenv/bin/python benchmarks/sass_compare.py \
        --compare benchmarks/results/issue34_sass_before.json \
        benchmarks/results/issue34_sass_after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

VOCAB = 151936
BATCHES = (256, 5)  # the benchmark's batch, and one whose row arrays are not 16-byte aligned
MAX_TOKENS = 8192


def import_tree(tree: Path) -> types.ModuleType:
    """The tree's kernels/ as the package ``kernels``, compiled mode (no
    interpreter: the kernels stay JITFunctions)."""
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, str(tree.resolve()))
    import kernels

    assert Path(kernels.__file__).resolve().parent == (tree / "kernels").resolve(), kernels.__file__
    return kernels


def kernel_modules() -> list[types.ModuleType]:
    return [m for name, m in sorted(sys.modules.items())
            if m is not None and (name == "kernels" or name.startswith("kernels."))]


class FakeClaim:
    """What a GPU-direct claim hands the kernels: the table's address (an
    int64, aligned) and the arrival counter."""

    def __init__(self, torch: Any) -> None:
        self.publisher = types.SimpleNamespace(table=0x7F00_0000_1000,
                                               arrivals=torch.zeros(1, dtype=torch.int64))

    def launched(self, rows: Any) -> None:
        pass


def record_launches(torch: Any) -> list[tuple[Any, tuple, dict]]:
    """Every launch capture, sample and compact make, as (kernel, args,
    kwargs), with a CUDA sm_90 device's launch decisions."""
    import triton.runtime.jit as jit

    launches: list[tuple[Any, tuple, dict]] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append((self, args, kwargs))

    jit.JITFunction.run = run
    # The decisions a CUDA sm_90 device makes, wherever a module imported them.
    patches = {
        "pdl_default": lambda device: True,
        "compiled_for_nvidia": lambda x: True,
        "check_into": lambda into, selected, max_tokens, vocab: (
            None if into is None else (None, None, into[2])),
        "claim_step": lambda target, batch, vocab: None if target is None else FakeClaim(torch),
        # a call that may have window rows publishes after its kernels: the
        # store kernel is compiled below on its own
        "publish_into": lambda target, rows: rows,
    }
    for module in kernel_modules():
        for name, value in patches.items():
            if hasattr(module, name):
                setattr(module, name, value)
    kernels = sys.modules["kernels"]
    for batch in BATCHES:
        for dtype in (torch.bfloat16, torch.float32):
            probs = torch.empty(batch, VOCAB, dtype=dtype)
            tokens = torch.zeros(batch, dtype=torch.int64)
            seeds = torch.arange(batch)
            per_row = {
                "top_k": torch.full((batch,), 1000, dtype=torch.int32),
                "top_p": torch.full((batch,), 0.9),
                "min_p": torch.full((batch,), 0.05),
                "greedy": torch.zeros(batch, dtype=torch.bool),
                "rows": torch.ones(batch, dtype=torch.bool),
            }
            for kw in ({"top_k": 1000}, {"top_k": 1000, "top_p": 0.9}, {"top_p": 0.9},
                       {"top_p": 0.9, "min_p": 0.1}, {"top_k": 1000, "greedy": True},
                       {**per_row, "order": "sequential", "overflow": "status"}):
                kernels.capture(probs, tokens, max_tokens=MAX_TOKENS, **kw)
                kernels.sample(probs, seeds, max_tokens=MAX_TOKENS, **kw)
            for mode in ("support", "selected"):
                kernels.capture(probs, tokens, top_k=1000, max_tokens=MAX_TOKENS,
                                into=(None, None, mode))
                kernels.sample(probs, seeds, top_p=0.9, max_tokens=MAX_TOKENS,
                               into=(None, None, mode))
            for kw in ({}, {"keep": "positive", "rows": per_row["rows"]},
                       {"overflow": "status"}, {"into": (None, None, "support")}):
                kernels.compact(probs, MAX_TOKENS, **kw)
    direct = sys.modules["kernels.direct"]
    for support in (True, False):
        launches.append((direct._direct_kernel, (0x7F00_0000_1000, torch.zeros(1, dtype=torch.int64)),
                         {"SUPPORT": support, "BLOCK": direct._BLOCK}))
    return launches


def plain(value: Any) -> Any:
    """JSON-able form of a specialization value."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return str(value)


def sass_summary(cubin: bytes, tools: Path, name: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    instructions = []
    for line in sass.splitlines():
        # "        /*0050*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;   /* 0x... */"
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if match:
            instructions.append(match.group(1).replace(name, "<kernel>"))
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    text = "\n".join(instructions)
    return {"instructions": len(instructions),
            "registers": int(registers.group(1)) if registers else None,
            "stack": int(stack.group(1)) if stack else None,
            "sass_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}


def compile_all(launches: list[tuple[Any, tuple, dict]]) -> list[dict[str, Any]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    seen: dict[str, dict[str, Any]] = {}
    for fn, args, kwargs in launches:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                              specialization, options)
        # what decides the compiled code: the kernel, argument types and their
        # specialization (alignment, divisibility, ==1), constexprs, options
        launch = {
            "kernel": fn.__name__,
            "signature": {k: v for k, v in signature.items() if v != "constexpr"},
            "attrs": {fn.arg_names[path[0]]: plain(v) for path, v in sorted(attrs.items())},
            "constexprs": {fn.arg_names[path[0]]: plain(v) for path, v in sorted(constexprs.items())},
            "options": {k: v for k, v in kwargs.items() if k not in fn.arg_names},
        }
        key = json.dumps(launch, sort_keys=True)
        if key in seen:
            continue
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        launch.update(sass_summary(compiled.asm["cubin"], tools, compiled.name))
        launch["shared"] = compiled.metadata.shared
        seen[key] = launch
        print(f"{launch['kernel']:24} {launch['instructions']:6} instr {launch['registers']:4} reg "
              f"{launch['shared']:6} B {launch['sass_sha256']}  {launch['constexprs']}", flush=True)
    return list(seen.values())


def config_key(launch: dict[str, Any]) -> str:
    """A launch's identity across trees but for the specialization of its
    arguments (the kernel's name without leading underscores: it may be
    renamed)."""
    return json.dumps({"kernel": launch["kernel"].lstrip("_"),
                       **{k: launch[k] for k in ("signature", "constexprs", "options")}},
                      sort_keys=True)


def attrs_differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(a["attrs"]) | set(b["attrs"])
                  if a["attrs"].get(k) != b["attrs"].get(k))


def compare(before_path: Path, after_path: Path) -> int:
    """Pairs each launch before with the one after of the same kernel,
    argument types, constexprs and options, and the same specialization (or,
    where none has it, the one differing on the fewest arguments: named),
    and compares their SASS hashes. Exit status 1 if any hash differs or a
    launch has no counterpart."""
    before = json.loads(before_path.read_text())["launches"]
    after = json.loads(after_path.read_text())["launches"]
    by_config: dict[str, list[dict[str, Any]]] = {}
    for launch in after:
        by_config.setdefault(config_key(launch), []).append(launch)
    matched: set[int] = set()
    rows: dict[str, list[int]] = {}
    problems = 0
    for launch in before:
        candidates = by_config.get(config_key(launch), [])
        stats = rows.setdefault(launch["kernel"], [0, 0, 0, 0, 0, 0])
        stats[0] += 1
        stats[3] = max(stats[3], launch["instructions"])
        stats[4] = max(stats[4], launch["registers"] or 0)
        stats[5] = max(stats[5], launch["shared"])
        if not candidates:
            problems += 1
            print(f"NO COUNTERPART: {launch['kernel']} {launch['constexprs']}")
            continue
        pick = min(candidates, key=lambda a: len(attrs_differ(launch, a)))
        matched.add(id(pick))
        differ = attrs_differ(launch, pick)
        if differ:
            stats[2] += 1
            print(f"specialization differs on {differ}: {launch['kernel']} {launch['constexprs']}"
                  f" (before {[launch['attrs'].get(k) for k in differ]}, "
                  f"after {[pick['attrs'].get(k) for k in differ]})")
        if pick["sass_sha256"] == launch["sass_sha256"]:
            stats[1] += 1
        else:
            problems += 1
            print(f"DIFFERENT SASS: {launch['kernel']} {launch['constexprs']}: "
                  f"{launch['instructions']} -> {pick['instructions']} instructions, "
                  f"{launch['registers']} -> {pick['registers']} registers")
    unmatched = [a for a in after if id(a) not in matched]
    for launch in unmatched:
        print(f"NEW AFTER: {launch['kernel']} {launch['constexprs']}")
    print("| kernel | launch configurations | identical SASS | specialization differs "
          "| most instructions | most registers | most shared memory (B) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kernel, (n, same, spec, instr, reg, smem) in sorted(rows.items()):
        print(f"| {kernel} | {n} | {same} | {spec} | {instr:,} | {reg} | {smem:,} |")
    print(f"{len(before)} launch configurations before, {len(after)} after; "
          f"{problems} with a different SASS hash or no counterpart, {len(unmatched)} new")
    return 1 if problems or unmatched else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="repository root whose kernels/ to compile")
    parser.add_argument("--out", type=Path, help="JSON file for the launches' SASS summary")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    # launches are recorded here, never replayed from a plan (kernels/launch_plan.py)
    os.environ["SHMASK_KERNEL_PLANS"] = "0"
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.tree is None or args.out is None:
        parser.error("--tree and --out, or --compare BEFORE AFTER")
    import_tree(args.tree)
    import torch
    import triton

    launches = compile_all(record_launches(torch))
    args.out.write_text(json.dumps({"triton": triton.__version__, "target": "cuda sm_90",
                                    "vocab": VOCAB, "batches": BATCHES,
                                    "launches": launches}, indent=1) + "\n")
    print(f"{len(launches)} launch configurations -> {args.out}")


if __name__ == "__main__":
    main()

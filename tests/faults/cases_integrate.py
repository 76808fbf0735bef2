"""Fault case of issue 33: `python -m shmask integrate` on mixed trees of
both released engines (make test-compat installs them).

A copy of each installed engine's patched files and pip metadata is put in
every mixed state: each non-empty proper subset of its files patched (a
seeded sample in `make test`), the patched bytes made by GNU patch itself,
not by shmask. Then the real CLI, `python -m shmask integrate <engine>
--check|--apply|--revert --json --site <copy>`: a false report is a call
whose exit code, tree state, per-file states or changed files differ from
the truth, or a tree left other than the action promises (all patched after
--apply, all released after --revert).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fault_cases import Result, case
from fault_lib import REPO, kill_group

ENGINES = ("sglang", "vllm")
SAMPLE = 4  # mixed trees per engine in `make test` (every one under `make faults`)


def installed_site(name: str) -> Path | None:
    """The site-packages holding the installed engine's package, or None.
    From the distribution's metadata, not from the imported module: a test
    of the same session may have imported the engine from a copy of its
    own (tests/compat/test_sglang_adapter.py), since removed."""
    try:
        site = Path(importlib.metadata.distribution(name).locate_file("")).resolve()
    except importlib.metadata.PackageNotFoundError:
        return None
    return site if (site / name / "__init__.py").is_file() else None


def _cli(*args: str) -> tuple[int, dict]:
    """The real CLI in its own process group; (exit code, its JSON)."""
    command = [sys.executable, "-m", "shmask", "integrate", *args, "--json"]
    proc = subprocess.Popen(command, cwd=str(REPO), env={"PATH": os.environ["PATH"]},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.communicate()
        return 124, {"error": "no answer within 120 s"}
    try:
        return proc.returncode, json.loads(out)
    except ValueError:
        return proc.returncode, {"error": f"not JSON: {(out + err)[-400:]}"}


def _copy_release(name: str, site: Path, into: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The patched files, __init__.py and dist-info of the installed engine
    copied into `into`; returns (released bytes, patched bytes) per file."""
    patch = REPO / "shmask" / "integrations" / f"{name}.patch"
    files = re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.MULTILINE)
    gnu = into.parent / f"{name}-patched-by-gnu-patch"
    for target in (into, gnu):
        for relative in files:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(site / relative, target / relative)
    shutil.copy(site / name / "__init__.py", into / name / "__init__.py")
    for dist_info in site.glob(f"{name}-*.dist-info"):
        shutil.copytree(dist_info, into / dist_info.name)
    subprocess.run(["patch", "-p1", "--fuzz=0", "-d", str(gnu), "-i", str(patch)], check=True,
                   capture_output=True, timeout=60, start_new_session=True)
    return ({f: (site / f).read_bytes() for f in files}, {f: (gnu / f).read_bytes() for f in files})


def _mixed_subsets(files: list[str], full: bool, rng: random.Random) -> list[tuple[str, ...]]:
    subsets = [s for size in range(1, len(files)) for s in itertools.combinations(sorted(files), size)]
    return subsets if full or len(subsets) <= SAMPLE else rng.sample(subsets, SAMPLE)


def _one_tree(result: Result, name: str, tree: Path, released: dict[str, bytes],
              patched: dict[str, bytes], subset: tuple[str, ...]) -> int:
    """check, apply and revert on the tree with `subset` patched; the false reports."""
    label = f"{name} with {len(subset)}/{len(released)} patched ({', '.join(subset)})"
    rest = sorted(set(released) - set(subset))

    mixed = {relative: patched[relative] if relative in subset else released[relative]
             for relative in released}

    def lay_out() -> None:
        for relative, data in mixed.items():
            (tree / relative).write_bytes(data)

    def now() -> dict[str, bytes]:
        return {relative: (tree / relative).read_bytes() for relative in released}

    truth = {relative: "applied" if relative in subset else "not applied" for relative in released}
    false = 0
    lay_out()
    rc, check = _cli(name, "--check", "--site", str(tree))
    false += not result.check(rc == 1 and check.get("state") == "partly applied"
                              and check.get("files") == truth and now() == mixed,
                              f"{label}: --check said rc {rc} {check.get('state') or check}")
    rc, applied = _cli(name, "--apply", "--site", str(tree))
    false += not result.check(rc == 0 and applied.get("state") == "applied"
                              and applied.get("changed") == rest and now() == patched,
                              f"{label}: --apply said rc {rc} {applied.get('state') or applied}, "
                              f"changed {applied.get('changed')}; tree patched: {now() == patched}")
    lay_out()
    rc, reverted = _cli(name, "--revert", "--site", str(tree))
    false += not result.check(rc == 0 and reverted.get("state") == "not applied"
                              and reverted.get("changed") == list(subset) and now() == released,
                              f"{label}: --revert said rc {rc} {reverted.get('state') or reverted}, "
                              f"changed {reverted.get('changed')}; tree released: {now() == released}")
    return false


@case("integrate on mixed trees")
def integrate_on_mixed_trees(result: Result, prefix: str, full: bool) -> None:
    rng = random.Random(33)
    trees: dict[str, int] = {}
    false = 0
    with tempfile.TemporaryDirectory(prefix="shmask-faults-integrate-") as scratch:
        for name in ENGINES:
            site = installed_site(name)
            if not result.check(site is not None, f"{name} is not installed here: `make test-compat` "
                                                  "installs the released engines"):
                continue
            tree = Path(scratch) / name / "site"
            released, patched = _copy_release(name, site, tree)
            subsets = _mixed_subsets(list(released), full, rng)
            for subset in subsets:
                false += _one_tree(result, name, tree, released, patched, subset)
            trees[name] = len(subsets)
    total = sum(trees.values())
    result.metrics.update(trees=trees, false_reports=false)
    counts = ", ".join(f"{name}: {count}" for name, count in trees.items())
    result.happened = (f"{'all' if full else 'a sample of'} mixed trees ({counts}) of the released "
                       "engines' files checked, completed by --apply and put back by --revert, "
                       "through the real CLI")
    result.figure = f"{total} trees x check/apply/revert, {false} false reports"

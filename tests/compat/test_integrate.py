"""`python -m shmask integrate sglang|vllm` against the released engines
(make test-compat): a dry run on the installed package itself, and apply,
check and revert on a copy of the installed files (the patched files and the
package's pip metadata, at the same relative paths), so the venv is never
changed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASED = {"sglang": "0.5.23", "vllm": "0.33.0"}


def _site(name: str) -> Path:
    return Path(importlib.util.find_spec(name).origin).resolve().parents[1]  # not imported


def _patched_files(name: str) -> list[str]:
    patch = (ROOT / "shmask" / "integrations" / f"{name}.patch").read_text()
    return re.findall(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE)


def _copy(name: str, into: Path) -> dict[str, bytes]:
    site = _site(name)
    for relative in _patched_files(name):
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / relative, into / relative)
    (into / name / "__init__.py").write_bytes((site / name / "__init__.py").read_bytes())
    (dist_info,) = site.glob(f"{name}-{RELEASED[name]}.dist-info")
    shutil.copytree(dist_info, into / dist_info.name)
    return {relative: (site / relative).read_bytes() for relative in _patched_files(name)}


def _integrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmask", "integrate", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={"PATH": os.environ["PATH"]})


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_dry_run_on_the_installed_engine(name):
    result = _integrate(name, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["version"] == report["supported"] == RELEASED[name]
    assert report["site"] == str(_site(name)) and report["state"] in ("not applied", "applied")


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_apply_check_revert_on_a_copy(name, tmp_path):
    originals = _copy(name, tmp_path)
    site = ("--site", str(tmp_path))
    assert "the patch is not applied" in _integrate(name, *site).stdout
    applied = _integrate(name, "--apply", *site)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    patch = (ROOT / "shmask" / "integrations" / f"{name}.patch").read_text()
    added = [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    patched = "".join((tmp_path / relative).read_text() for relative in originals)
    assert all(line in patched for line in added)
    assert not list(tmp_path.rglob("*.orig")) and not list(tmp_path.rglob("*.rej"))
    check = _integrate(name, "--json", *site)
    assert check.returncode == 0 and json.loads(check.stdout)["state"] == "applied"
    reverted = _integrate(name, "--revert", *site)
    assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    assert {relative: (tmp_path / relative).read_bytes() for relative in originals} == originals


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_another_version_is_refused_with_what_to_do(name, tmp_path):
    originals = _copy(name, tmp_path)
    (metadata,) = tmp_path.glob(f"{name}-*.dist-info/METADATA")
    metadata.write_text(re.sub(r"^Version: .*$", "Version: 99.0", metadata.read_text(), flags=re.MULTILINE))
    result = _integrate(name, "--apply", "--site", str(tmp_path))
    assert result.returncode == 1
    text = " ".join(result.stdout.split())
    assert f"{name} 99.0 is installed" in text and f"patch is for {name} {RELEASED[name]} only" in text
    assert f"pip install '{name}=={RELEASED[name]}'" in text
    assert {relative: (tmp_path / relative).read_bytes() for relative in originals} == originals

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
import signal
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


def _copy(name: str, into: Path, version: str | None = None) -> dict[str, bytes]:
    """The patched files, __init__.py and pip's dist-info of the installed engine
    (a wheel install), copied under `into`; `version` relabels the dist-info."""
    site = _site(name)
    for relative in _patched_files(name):
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / relative, into / relative)
    (into / name / "__init__.py").write_bytes((site / name / "__init__.py").read_bytes())
    (dist_info,) = site.glob(f"{name}-{RELEASED[name]}.dist-info")
    copied = into / (dist_info.name if version is None else f"{name}-{version}.dist-info")
    shutil.copytree(dist_info, copied)
    if version is not None:
        metadata = copied / "METADATA"
        metadata.write_text(re.sub(r"^Version: .*$", f"Version: {version}", metadata.read_text(),
                                   flags=re.MULTILINE))
    return {relative: (site / relative).read_bytes() for relative in _patched_files(name)}


def _integrate(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """The real CLI in its own process group (it runs GNU patch), killed whole on a hang."""
    command = [sys.executable, "-m", "shmask", "integrate", *args]
    env = {"PATH": os.environ["PATH"], **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _patched(name: str, originals: dict[str, bytes], tmp_path: Path) -> dict[str, bytes]:
    """The patched files, made by GNU patch itself in a copy (not by shmask)."""
    copy = tmp_path / "patched-by-gnu-patch"
    for relative, data in originals.items():
        (copy / relative).parent.mkdir(parents=True, exist_ok=True)
        (copy / relative).write_bytes(data)
    subprocess.run(["patch", "-p1", "--fuzz=0", "-d", str(copy), "-i",
                    str(ROOT / "shmask" / "integrations" / f"{name}.patch")],
                   check=True, capture_output=True, timeout=60, start_new_session=True)
    return {relative: (copy / relative).read_bytes() for relative in originals}


def _tree(site: Path, originals: dict[str, bytes]) -> dict[str, bytes]:
    return {relative: (site / relative).read_bytes() for relative in originals}


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


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_a_partly_patched_tree_is_named_completed_and_reverted_file_by_file(name, tmp_path):
    """Issue 33 #2 on the released trees: the patched tree with one file put
    back (each file in turn). --check said "applied", --apply did nothing,
    --revert only swapped which files were patched."""
    site = tmp_path / "site"
    originals = _copy(name, site)
    patched = _patched(name, originals, tmp_path)
    for put_back in sorted(originals):
        mixed = {**patched, put_back: originals[put_back]}
        for relative, data in mixed.items():
            (site / relative).write_bytes(data)
        check = _integrate(name, "--site", str(site))
        assert check.returncode == 1, check.stdout
        text = " ".join(check.stdout.split())
        assert "the patch is partly applied" in text and f"are not ({put_back})" in text, put_back
        report = json.loads(_integrate(name, "--json", "--site", str(site)).stdout)
        assert report["files"] == {f: "not applied" if f == put_back else "applied" for f in originals}
        assert report["state"] == "partly applied" and not report["ok"]
        assert _tree(site, originals) == mixed
        applied = json.loads(_integrate(name, "--apply", "--json", "--site", str(site)).stdout)
        assert applied["ok"] and applied["changed"] == [put_back], put_back
        assert _tree(site, originals) == patched
        for relative, data in mixed.items():
            (site / relative).write_bytes(data)
        reverted = json.loads(_integrate(name, "--revert", "--json", "--site", str(site)).stdout)
        assert reverted["ok"] and reverted["changed"] == sorted(set(originals) - {put_back}), put_back
        assert _tree(site, originals) == originals
    assert not list(site.rglob("*.orig")) and not list(site.rglob("*.rej"))


def test_a_local_version_label_is_the_same_release(tmp_path):
    """Issue 33 #13: vllm 0.33.0+cu126 (a per-CUDA wheel of 0.33.0) was
    refused with advice to install 0.33.0."""
    originals = _copy("vllm", tmp_path, version="0.33.0+cu126")
    check = _integrate("vllm", "--site", str(tmp_path))
    assert check.returncode == 0, check.stdout
    assert f"vllm 0.33.0+cu126 in {tmp_path}\n" in check.stdout and "the patch is not applied" in check.stdout
    applied = json.loads(_integrate("vllm", "--apply", "--json", "--site", str(tmp_path)).stdout)
    assert applied["ok"] and applied["version"] == "0.33.0+cu126" and applied["state"] == "applied"
    assert _tree(tmp_path, originals) == _patched("vllm", originals, tmp_path / "gnu")


def _editable(name: str, tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """What `pip install -e <checkout>` leaves: the package in the source
    checkout (SGLang's under python/, vLLM's at the top), and in
    site-packages the dist-info with an editable direct_url.json (PEP 610)
    and a .pth naming the checkout."""
    checkout = tmp_path / "checkout"
    source = checkout / "python" if name == "sglang" else checkout
    site = tmp_path / "site-packages"
    originals = _copy(name, source)
    site.mkdir()
    dist_info = f"{name}-{RELEASED[name]}.dist-info"
    (source / dist_info).rename(site / dist_info)
    (site / dist_info / "direct_url.json").write_text(
        json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}}))
    (site / f"__editable__.{name}-{RELEASED[name]}.pth").write_text(f"{source}\n")
    return source, site, originals


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_an_editable_install_is_found_and_patched_in_its_checkout(name, tmp_path):
    """Issue 33 #12: an editable install was refused ("cannot tell which
    version"), with or without --force and --site. Found from the import path
    (the checkout on it, as the .pth puts it; ahead of the venv's own wheel),
    from --site <checkout> and from --site <site-packages>."""
    source, site, originals = _editable(name, tmp_path)
    on_path = os.pathsep.join([str(site), str(source)])
    for args, pythonpath in (((), on_path), (("--site", str(source)), str(site)),
                             (("--site", str(site)), "")):
        result = _integrate(name, "--json", *args, pythonpath=pythonpath)
        assert result.returncode == 0, (args, result.stdout)
        report = json.loads(result.stdout)
        assert report["site"] == str(source) and report["version"] == RELEASED[name], args
        assert report["state"] == "not applied", args
    applied = _integrate(name, "--apply", pythonpath=on_path)
    assert applied.returncode == 0, applied.stdout
    assert _tree(source, originals) == _patched(name, originals, tmp_path / "gnu")
    reverted = _integrate(name, "--revert", "--site", str(site))
    assert reverted.returncode == 0 and _tree(source, originals) == originals


def test_a_legacy_editable_install_is_found(tmp_path):
    """pip's legacy editable mode / `setup.py develop`: an .egg-link in
    site-packages names the checkout, which holds the egg-info."""
    source, site, originals = _editable("sglang", tmp_path)
    egg_info = source / "sglang.egg-info"
    (site / "sglang-0.5.23.dist-info").rename(egg_info)
    (egg_info / "direct_url.json").unlink()
    (egg_info / "METADATA").rename(egg_info / "PKG-INFO")
    (site / "sglang.egg-link").write_text(f"{source}\n.\n")
    for where in (site, source):
        report = json.loads(_integrate("sglang", "--json", "--site", str(where)).stdout)
        assert report["site"] == str(source) and report["version"] == "0.5.23", where
        assert report["state"] == "not applied", where
    assert _tree(source, originals) == originals

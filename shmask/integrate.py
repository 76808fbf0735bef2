"""`python -m shmask integrate sglang|vllm`: the engine patches that ship
inside the package (shmask/integrations/*.patch), checked against, applied
to, or reverted from the installed engine.

Each patch was made against one released version of its engine; another
version is refused with what to do (`--force` tries the patch anyway, which
still has to apply without fuzz). A local version label (`0.33.0+cu126`, a
per-CUDA build of the release) is the same release.

The engine is found however pip installed it: a wheel (the package and its
dist-info side by side in site-packages) or an editable install (the package
in a source checkout; the dist-info in site-packages names the checkout in
its direct_url.json, or a legacy `.egg-link` does, with the egg-info in the
checkout).

Whether the patch is applied is decided per file, from the file's contents:
each file's part of the patch is dry-run forward and in reverse, both with
`--forward` (never GNU patch's `--batch`, which takes a hunk that looks
reversed for a reversed patch and applies it the other way). A file is
"not applied" when only the forward run applies cleanly, "applied" when only
the reverse one does; anything else (edited, missing, both) does not apply
and nothing is done. A tree where some files are patched and others not is
"partly applied": `--check` names both sets and fails, `--apply` patches the
rest, `--revert` takes it out of the patched ones only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class IntegrateError(Exception):
    """Why an engine cannot be checked or patched, said for a person."""


@dataclass(frozen=True)
class Engine:
    name: str  # the import name, also the distribution name and the patch's
    version: str  # the released version the patch was made against
    guide: str  # the integration guide, in the repository


ENGINES = {
    "sglang": Engine("sglang", "0.5.23", "docs/integrations/sglang.md"),
    "vllm": Engine("vllm", "0.33.0", "docs/integrations/vllm.md"),
}

# A file's state, and the tree's (a tree is also PARTLY when some files are
# applied and the rest not applied).
APPLIED, NOT_APPLIED, DIFFERS, PARTLY = "applied", "not applied", "does not apply", "partly applied"


def patch_path(engine: Engine) -> Path:
    """The patch file as installed (package data of shmask)."""
    path = Path(str(importlib.resources.files("shmask") / "integrations" / f"{engine.name}.patch"))
    if not path.is_file():
        raise IntegrateError(f"{path} is missing: this shmask was installed without its integration patches")
    return path


# ------------------------------------------------------------- the patch

@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the directory that holds the engine's package
    text: str  # this file's ---/+++ header and hunks: a patch of its own


_HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def split_patch(patch: Path) -> list[FilePatch]:
    """The patch cut into one patch per file. Hunks are walked by the line
    counts of their @@ headers, so a removed line that reads like a file
    header ("--- ...") stays in its hunk."""
    lines = patch.read_text().splitlines(keepends=True)
    files: list[FilePatch] = []
    index = 0
    while index < len(lines):
        if not (lines[index].startswith("--- ") and index + 1 < len(lines)
                and lines[index + 1].startswith("+++ b/")):
            index += 1  # "diff -ru a/... b/...", blank lines between files
            continue
        body = lines[index:index + 2]
        path = lines[index + 1][len("+++ b/"):].split("\t")[0].strip()
        index += 2
        while index < len(lines) and (hunk := _HUNK.match(lines[index])):
            old, new = (1 if count is None else int(count) for count in hunk.groups())
            body.append(lines[index])
            index += 1
            while (old > 0 or new > 0) and index < len(lines):
                kind = lines[index][:1]
                if kind not in (" ", "-", "+", "\n", "\\"):
                    break
                old -= kind in (" ", "-", "\n")  # "\n": a blank context line whose space was stripped
                new -= kind in (" ", "+", "\n")
                body.append(lines[index])
                index += 1
            while index < len(lines) and lines[index].startswith("\\"):  # "\ No newline at end of file"
                body.append(lines[index])
                index += 1
            if old != 0 or new != 0:
                raise IntegrateError(f"{patch} is malformed: a hunk of {path} ends before its line counts "
                                     f"(line {index + 1})")
        files.append(FilePatch(path, "".join(body)))
    if not files:
        raise IntegrateError(f"{patch} holds no file to patch")
    return files


def patched_files(engine: Engine) -> list[str]:
    """The files the patch changes, relative to the directory that holds the package."""
    return [file.path for file in split_patch(patch_path(engine))]


def _patch(site: Path, text: str, *options: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("patch") is None:
        raise IntegrateError("GNU patch is not installed (Debian/Ubuntu: apt-get install patch)")
    # --forward: a hunk that looks reversed is skipped and fails the run; GNU
    # patch's --batch would instead apply it the other way round. Its
    # questions go to no terminal (stdout is a pipe), so it never waits.
    command = ["patch", "--forward", "--fuzz=0", "-p1", "-d", str(site), *options]
    return subprocess.run(command, input=text, capture_output=True, text=True, timeout=60)


def file_state(site: Path, file: FilePatch) -> tuple[str, str]:
    """(APPLIED | NOT_APPLIED | DIFFERS, why it differs) for one file, from its contents."""
    if not (site / file.path).is_file():
        return DIFFERS, f"{site / file.path}: no such file"
    forward = _patch(site, file.text, "--dry-run")
    reverse = _patch(site, file.text, "--dry-run", "--reverse")
    if forward.returncode == 0 and reverse.returncode != 0:
        return NOT_APPLIED, ""
    if reverse.returncode == 0 and forward.returncode != 0:
        return APPLIED, ""
    if forward.returncode == 0:
        return DIFFERS, f"{file.path}: the patch applies to it both ways; cannot tell whether it is applied"
    return DIFFERS, (forward.stdout + forward.stderr).strip()


def tree_state(files: dict[str, str]) -> str:
    """The tree's state from its files' states."""
    states = set(files.values())
    if DIFFERS in states:
        return DIFFERS
    return states.pop() if len(states) == 1 else PARTLY


# ----------------------------------------------------------- the engine

def release_of(version: str) -> str:
    """"0.33.0+cu126" -> "0.33.0": a local version label (PEP 440) marks a
    build of the same release (per CUDA version, a vendor's), not another one."""
    return version.split("+", 1)[0]


def find_site(engine: Engine, site: Path | None = None) -> Path:
    """The directory that holds the engine's package, where the patch's paths
    start. Without `site`: the one `import <engine>` would use, found without
    importing it (site-packages for a wheel, the source checkout for an
    editable install). `site` is that directory, or the site-packages of an
    editable install (its metadata names the checkout)."""
    if site is None:
        spec = importlib.util.find_spec(engine.name)
        if spec is None or spec.origin is None:
            pin = f"{engine.name}=={engine.version}"
            raise IntegrateError(f"{engine.name} is not installed in this Python; install {pin} "
                                 f"(pip install '{pin}') and run this with the engine's Python")
        return Path(spec.origin).resolve().parents[1]
    if (site / engine.name / "__init__.py").is_file():
        return site
    for root in _editable_roots(engine, [site]):
        for source in (root, root / "src"):  # a flat layout, or a src one
            if (source / engine.name / "__init__.py").is_file():
                return source
    raise IntegrateError(f"{site} holds no {engine.name} package ({site / engine.name}/__init__.py), "
                         f"nor the metadata of an editable install of it: give --site the directory "
                         f"that holds {engine.name}/")


def _same_name(name: str | None, engine: Engine) -> bool:
    return re.sub(r"[-_.]+", "-", (name or "").lower()) == engine.name


def _editable_root(dist: importlib.metadata.Distribution) -> Path | None:
    """The source checkout of an editable install (PEP 610 direct_url.json), else None."""
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return None
    url = urllib.parse.urlparse(str(direct.get("url", "")))
    if not direct.get("dir_info", {}).get("editable") or url.scheme != "file":
        return None
    return Path(urllib.request.url2pathname(url.path))


def _editable_roots(engine: Engine, paths: list[Path]) -> list[Path]:
    """The source checkouts that editable installs found in `paths` name."""
    roots = []
    for dist in importlib.metadata.distributions(name=engine.name, path=[str(p) for p in paths]):
        root = _editable_root(dist)
        if root is not None:
            roots.append(root)
    for directory in paths:  # legacy `pip install -e` / `setup.py develop`: the checkout's path, first line
        link = directory / f"{engine.name}.egg-link"
        if link.is_file():
            roots.append((directory / link.read_text().splitlines()[0].strip()).resolve())
    return roots


def installed_version(engine: Engine, site: Path, also: Path | None = None) -> str:
    """The version in the metadata of the package in `site`: beside it (a
    wheel's dist-info; the egg-info a legacy editable install leaves in the
    checkout), else an editable install's dist-info on this Python's path (or
    in `also`) whose checkout holds it. Not another copy elsewhere."""
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if _same_name(dist.metadata["Name"], engine):
            return str(dist.version)
    package = (site / engine.name).resolve()
    searched = ([also] if also is not None else []) + [Path(p) for p in sys.path if p]
    for dist in importlib.metadata.distributions(name=engine.name,
                                                 path=[str(p) for p in searched]):
        root = _editable_root(dist)
        if root is not None and package.is_relative_to(root.resolve()):
            return str(dist.version)
    raise IntegrateError(f"cannot tell which {engine.name} version is in {site}: no "
                         f"{engine.name}-*.dist-info there, nor an editable install's on this Python's "
                         f"path naming it (was it installed by pip?); --force tries the patch anyway")


# ------------------------------------------------------------ the command

@dataclass
class Report:
    engine: str
    version: str  # installed ("unknown" under --force without metadata)
    supported: str  # the release the patch is for
    site: str  # the directory holding the package
    patch: str
    state: str  # APPLIED | NOT_APPLIED | PARTLY | DIFFERS
    files: dict[str, str] = field(default_factory=dict)  # path -> APPLIED | NOT_APPLIED | DIFFERS
    done: str = ""  # what --apply / --revert did: "applied" | "reverted"
    changed: list[str] = field(default_factory=list)  # the files it changed
    detail: str = ""  # patch's own output for the files that do not apply

    @property
    def ok(self) -> bool:
        return self.state in (APPLIED, NOT_APPLIED)

    @property
    def same_release(self) -> bool:
        return release_of(self.version) == self.supported


def integrate(name: str, action: str = "check", site: Path | None = None, force: bool = False) -> Report:
    """action: "check" (dry runs only), "apply" or "revert". Raises
    IntegrateError for what no action can fix here (engine missing, version
    not the supported release without `force`)."""
    if name not in ENGINES:
        raise IntegrateError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}")
    if action not in ("check", "apply", "revert"):
        raise IntegrateError(f"unknown action {action!r}: one of check, apply, revert")
    engine = ENGINES[name]
    patch = patch_path(engine)
    given = site
    site = find_site(engine, site)
    try:
        version = installed_version(engine, site, also=given)
    except IntegrateError:
        if not force:
            raise
        version = "unknown"
    if release_of(version) != engine.version and not force:
        raise IntegrateError(
            f"{engine.name} {version} is installed in {site}, but this shmask's patch is for "
            f"{engine.name} {engine.version} only. Either install that version "
            f"(pip install '{engine.name}=={engine.version}'), or use the shmask release made for "
            f"{engine.name} {version} if there is one; --force tries this patch anyway (it must still "
            f"apply exactly, and the result is untested). The changes the patch makes are listed in "
            f"{engine.guide}.")
    parts = split_patch(patch)
    report = Report(engine.name, version, engine.version, str(site), str(patch), "")
    _assess(report, site, parts)
    if report.state == DIFFERS or action == "check":
        return report
    options: tuple[str, ...] = () if action == "apply" else ("--reverse",)
    want, have = (APPLIED, NOT_APPLIED) if action == "apply" else (NOT_APPLIED, APPLIED)
    todo = [part for part in parts if report.files[part.path] == have]
    if todo:
        _run(site, todo, *options)
        _assess(report, site, parts)
        if report.state != want:  # contents changed under us, or patch did something else
            raise IntegrateError(f"after {action} the patch is {report.state} in {site}, not {want}: "
                                 + ", ".join(f"{path} {state}" for path, state in report.files.items()))
        report.done = {"apply": "applied", "revert": "reverted"}[action]
        report.changed = [part.path for part in todo]
    return report


def _assess(report: Report, site: Path, parts: list[FilePatch]) -> None:
    details = []
    for part in parts:
        state, detail = file_state(site, part)
        report.files[part.path] = state
        if detail:
            details.append(detail)
    report.state, report.detail = tree_state(report.files), "\n".join(details)


def _run(site: Path, parts: list[FilePatch], *options: str) -> None:
    # GNU patch writes one file at a time: if the real run fails after the
    # dry runs passed (a write error, a file changed in between), the files
    # it already wrote are put back, so this run never half-patches a tree.
    saved = {part.path: (site / part.path).read_bytes() for part in parts if (site / part.path).is_file()}
    result = _patch(site, "".join(part.text for part in parts), *options,
                    "--no-backup-if-mismatch", "--reject-file=-")
    if result.returncode != 0:  # e.g. site-packages not writable; the dry run passed
        for path, data in saved.items():
            try:
                (site / path).write_bytes(data)
            except OSError:
                pass  # not writable at all: nothing was written there either
        raise IntegrateError(f"patch failed in {site} (every file left as it was):\n"
                             f"{(result.stdout + result.stderr).strip()}")

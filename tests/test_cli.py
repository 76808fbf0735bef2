from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys

import pytest

import shmask
from shmask.cli import human_bytes
from shmask.segment import list_segments


def _cli(*args: str, columns: int = 200, python_args: tuple[str, ...] = ("-m", "shmask"),
         ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_args, *args], capture_output=True, text=True,
                          timeout=60, env={"SHMASK_RING_MB": "64", "COLUMNS": str(columns), "PATH": ""})


def test_ls_shows_a_live_segment(writer):
    result = _cli("ls")
    assert result.returncode == 0
    assert writer.segment_name in result.stdout


def test_doctor_reports_native_core_and_shm():
    result = _cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "native core" in result.stdout and "loaded" in result.stdout and "/dev/shm" in result.stdout


def test_gc_runs():
    result = _cli("gc", "--prefix", "shmnothing")
    assert result.returncode == 0 and "0 segment(s) removed" in result.stdout


def test_no_command_prints_help():
    result = _cli()
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "doctor" in result.stdout and "gc" in result.stdout


def test_version():
    result = _cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"shmask {shmask.__version__}"


def test_ls_json(writer, prefix):
    result = _cli("ls", "--json", "--prefix", prefix)
    assert result.returncode == 0, result.stderr
    segments = json.loads(result.stdout)["segments"]
    mine = [s for s in segments if s["name"] == writer.segment_name]
    assert len(mine) == 1 and mine[0]["alive"] is True
    assert mine[0]["producer_pid"] == os.getpid() and mine[0]["capacity"] > 0
    assert mine[0]["in_use_bytes"] == mine[0]["head"] - mine[0]["tail"]


def test_doctor_json():
    result = _cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["problems"] == 0
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["native core"]["ok"] and checks["/dev/shm"]["free_bytes"] > 0
    assert checks["config"]["config"]["ring_mb"] == 64


def test_gc_json():
    result = _cli("gc", "--json", "--prefix", "shmnothing")
    assert result.returncode == 0 and json.loads(result.stdout) == {"removed": []}


def test_names_are_not_cut_when_piped(writer):
    """A pipe (grep, a log file) gets whole lines whatever the width."""
    result = _cli("ls", columns=30)
    assert result.returncode == 0
    assert writer.segment_name in result.stdout
    result = _cli("doctor", columns=30)
    assert "shmask/_native" in result.stdout  # the core's path, in full


def test_works_without_rich(writer):
    code = ("import sys; sys.modules['rich'] = None; from shmask.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    for args in (["ls"], ["doctor"], ["gc", "--prefix", "shmnothing"], []):
        result = _cli(*args, python_args=("-c", code))
        assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert writer.segment_name in _cli("ls", python_args=("-c", code)).stdout


@pytest.mark.parametrize("columns", [250, 80])
def test_rich_table_on_a_terminal(writer, columns):
    """A table that fits the terminal is rich's; at 80 columns (where rich
    cut the names to `/shmte...`) it is the plain aligned lines, whole."""
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen([sys.executable, "-m", "shmask", "ls"], stdout=follower,
                                   stderr=follower,
                                   env={"COLUMNS": str(columns), "PATH": "", "TERM": "xterm"})
        os.close(follower)
        output = b""
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            output += data
        assert process.wait(timeout=60) == 0
    finally:
        os.close(leader)
    text = output.decode(errors="replace")
    assert writer.segment_name in text
    assert ("┃" in text) == (columns == 250)  # rich's table border


# ------------------------------------------------- --json, sizes, --rings

def test_json_before_or_after_the_command(writer, prefix):
    for args in (["--json", "ls", "--prefix", prefix], ["ls", "--json", "--prefix", prefix],
                 ["ls", "--prefix", prefix, "--json"]):
        result = _cli(*args)
        assert result.returncode == 0, (args, result.stderr)
        names = [s["name"] for s in json.loads(result.stdout)["segments"]]
        assert names == [writer.segment_name], args
    for command in ("doctor", "gc"):
        before, after = _cli("--json", command), _cli(command, "--json")
        assert json.loads(before.stdout).keys() == json.loads(after.stdout).keys(), command


def test_help_lists_every_command_with_json():
    result = _cli("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--json machine-readable output, one JSON object (ls, gc, doctor, integrate)" in text
    for command in ("ls", "gc", "doctor", "integrate"):
        assert "--json" in _cli(command, "--help").stdout, command


def test_sizes_in_human_units(writer, prefix):
    assert [human_bytes(n) for n in (0, 1023, 1024, 2560, 3 * 2**20 // 2, 2**30, 5 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "2.5 KiB", "1.5 MiB", "1.0 GiB", "5.0 TiB"]
    info = next(s for s in list_segments(prefix) if s.name == writer.segment_name)
    line = next(line for line in _cli("ls", "--prefix", prefix).stdout.splitlines()
                if writer.segment_name in line)
    assert f"  {human_bytes(info.size)}  " in line and "MiB" in human_bytes(info.size)


def _room(result: subprocess.CompletedProcess) -> dict:
    return next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "room for rings")


def test_doctor_counts_room_for_n_rings():
    one = _room(_cli("doctor", "--json"))  # SHMASK_RING_MB=64
    assert one["ok"] and one["rings"] == 1 and one["ring_bytes"] >= 64 * 2**20
    three = _cli("doctor", "--rings", "3")
    assert three.returncode == 0, three.stdout
    assert f"3 ring(s) of {human_bytes(one['ring_bytes'])}" in three.stdout
    assert f"need {human_bytes(3 * one['ring_bytes'])}" in three.stdout
    too_many = one["free_bytes"] // one["ring_bytes"] + 1
    result = _cli("--json", "doctor", "--rings", str(too_many))
    assert result.returncode == 1
    room = _room(result)
    assert not room["ok"] and room["need_bytes"] == too_many * one["ring_bytes"] > room["free_bytes"]
    assert "give it" in room["result"] and "--shm-size" in room["result"]


def test_doctor_refuses_a_bad_ring_count():
    for bad in ("0", "-2", "many"):
        result = _cli("doctor", "--rings", bad)
        assert result.returncode == 2 and "--rings" in result.stderr, bad


# ---------------------------------------------------------------- integrate
# A synthetic engine: each patched file holds only the patch's own "before"
# lines (hunks apply at an offset, never with fuzz), with pip-style metadata.

def _before_image(patch: str) -> dict[str, str]:
    files: dict[str, list[str]] = {}
    current: list[str] = []
    for line in patch.splitlines():
        if line.startswith("+++ b/"):
            current = files.setdefault(line[len("+++ b/"):], [])
        elif line.startswith(("---", "diff ", "@@")) or line.startswith("+"):
            continue
        elif line.startswith(("-", " ")) or line == "":
            current.append(line[1:])
    return {name: "\n".join(lines) + "\n" for name, lines in files.items()}


def _fake_engine(site, name: str, version: str) -> dict[str, str]:
    from shmask.integrate import ENGINES, patch_path

    originals = _before_image(patch_path(ENGINES[name]).read_text())
    for relative, text in originals.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)
    (site / name / "__init__.py").write_text("")
    dist_info = site / f"{name}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return originals


def _integrate(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """The real CLI in its own process group (it runs GNU patch), killed whole on a hang."""
    command = [sys.executable, "-m", "shmask", "integrate", *args]
    env = {"PATH": os.environ["PATH"], **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _files(site, originals) -> dict[str, str]:
    return {relative: (site / relative).read_text() for relative in originals}


@pytest.mark.parametrize("name,version", [("sglang", "0.5.23"), ("vllm", "0.33.0")])
def test_integrate_checks_applies_and_reverts(tmp_path, name, version):
    originals = _fake_engine(tmp_path, name, version)
    site = ("--site", str(tmp_path))
    check = _integrate(name, *site)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{name} {version} in {tmp_path}" in check.stdout and "patch is not applied" in check.stdout
    assert _files(tmp_path, originals) == originals  # a dry run
    applied = _integrate(name, "--apply", *site)
    assert applied.returncode == 0 and "applied: the patch is now applied" in applied.stdout
    patched = _files(tmp_path, originals)
    assert all(patched[f] != originals[f] for f in originals)
    assert not list(tmp_path.rglob("*.orig")) and not list(tmp_path.rglob("*.rej"))
    again = json.loads(_integrate(name, "--apply", "--json", *site).stdout)
    assert again["state"] == "applied" and again["done"] == "" and again["ok"]
    assert _files(tmp_path, originals) == patched  # not applied twice
    reverted = _integrate(name, "--revert", *site)
    assert reverted.returncode == 0 and "reverted: the patch is now not applied" in reverted.stdout
    assert _files(tmp_path, originals) == originals


def test_integrate_refuses_another_engine_version(tmp_path):
    originals = _fake_engine(tmp_path, "sglang", "0.5.22")
    result = _integrate("sglang", "--apply", "--site", str(tmp_path))
    assert result.returncode == 1
    text = " ".join(result.stdout.split())
    assert "sglang 0.5.22 is installed" in text and "patch is for sglang 0.5.23 only" in text
    assert "pip install 'sglang==0.5.23'" in text and "--force" in text
    assert _files(tmp_path, originals) == originals
    report = json.loads(_integrate("sglang", "--json", "--site", str(tmp_path)).stdout)
    assert report["ok"] is False and "0.5.22" in report["error"]
    forced = _integrate("sglang", "--apply", "--force", "--site", str(tmp_path))
    assert forced.returncode == 0 and "patch made for 0.5.23; --force" in forced.stdout
    assert _files(tmp_path, originals) != originals


def test_integrate_says_when_the_files_differ(tmp_path):
    originals = _fake_engine(tmp_path, "vllm", "0.33.0")
    edited = "vllm/v1/engine/output_processor.py"
    before = {**originals, edited: originals[edited].replace("reqs_to_abort", "to_abort")}
    (tmp_path / edited).write_text(before[edited])
    result = _integrate("vllm", "--apply", "--site", str(tmp_path))
    assert result.returncode == 1
    assert "does not apply" in result.stdout and "vllm==0.33.0" in result.stdout
    assert "FAILED" in result.stdout  # patch's own word on the hunk
    assert _files(tmp_path, originals) == before  # nothing half-applied: the dry run came first


def test_integrate_without_the_engine_or_its_metadata(tmp_path):
    result = _integrate("vllm", "--site", str(tmp_path))
    assert result.returncode == 1 and f"{tmp_path} holds no vllm package" in result.stdout
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    result = _integrate("vllm", "--site", str(tmp_path))
    assert result.returncode == 1 and "cannot tell which vllm version" in result.stdout
    assert _cli("integrate", "tgi").returncode == 2


def test_a_failed_apply_leaves_every_file_as_it_was(tmp_path):
    """GNU patch writes file by file: when the real run fails after the dry
    run (a file changed in between), the file it already patched is put back
    and no reject file is left in the engine's directory."""
    from shmask.integrate import IntegrateError, _run, split_patch

    (tmp_path / "pkg").mkdir()
    first, second = tmp_path / "pkg" / "a.py", tmp_path / "pkg" / "b.py"
    first.write_text("x = 1\ny = 2\nz = 3\n")
    second.write_text("changed meanwhile\n")
    patch = tmp_path / "two.patch"
    patch.write_text(
        "--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1,3 +1,3 @@\n x = 1\n-y = 2\n+y = 20\n z = 3\n"
        "--- a/pkg/b.py\n+++ b/pkg/b.py\n@@ -1 +1 @@\n-original\n+patched\n")
    with pytest.raises(IntegrateError, match="left as it was"):
        _run(tmp_path, split_patch(patch))
    assert first.read_text() == "x = 1\ny = 2\nz = 3\n"
    assert second.read_text() == "changed meanwhile\n"
    assert not list(tmp_path.rglob("*.rej")) and not list(tmp_path.rglob("*.orig"))


@pytest.mark.parametrize("name,version", [("sglang", "0.5.23"), ("vllm", "0.33.0")])
def test_integrate_on_a_partly_patched_tree(tmp_path, name, version):
    """Issue 33 #2: one patched file put back. --check names the patched and
    unpatched files and fails (it said "applied"), --apply patches the rest (it
    did nothing), --revert unpatches only the patched ones (GNU patch's --batch
    swapped which files were patched)."""
    originals = _fake_engine(tmp_path, name, version)
    site = ("--site", str(tmp_path))
    assert _integrate(name, "--apply", *site).returncode == 0
    patched = _files(tmp_path, originals)
    put_back = sorted(originals)[0]
    (tmp_path / put_back).write_text(originals[put_back])
    mixed = {**patched, put_back: originals[put_back]}
    check = _integrate(name, *site)
    assert check.returncode == 1, check.stdout
    text = " ".join(check.stdout.split())
    assert f"the patch is partly applied: {len(originals) - 1} of {len(originals)} files are patched" in text
    assert f"1 are not ({put_back})" in text and "--apply patches the rest" in text
    report = json.loads(_integrate(name, "--json", *site).stdout)
    assert report["state"] == "partly applied" and not report["ok"]
    assert report["files"] == {f: "not applied" if f == put_back else "applied" for f in originals}
    assert _files(tmp_path, originals) == mixed  # --check changed nothing
    applied = json.loads(_integrate(name, "--apply", "--json", *site).stdout)
    assert applied["ok"] and applied["state"] == "applied" and applied["changed"] == [put_back]
    assert _files(tmp_path, originals) == patched
    (tmp_path / put_back).write_text(originals[put_back])
    reverted = json.loads(_integrate(name, "--revert", "--json", *site).stdout)
    assert reverted["ok"] and reverted["state"] == "not applied"
    assert reverted["changed"] == sorted(set(originals) - {put_back})
    assert _files(tmp_path, originals) == originals


def test_integrate_accepts_a_local_version_label(tmp_path):
    """Issue 33 #13: vllm 0.33.0+cu126 (a per-CUDA wheel of 0.33.0) is that
    release; another release with a label is still refused."""
    originals = _fake_engine(tmp_path, "vllm", "0.33.0+cu126")
    check = _integrate("vllm", "--site", str(tmp_path))
    assert check.returncode == 0, check.stdout
    assert f"vllm 0.33.0+cu126 in {tmp_path}\n" in check.stdout and "--force" not in check.stdout
    assert "the patch is not applied" in check.stdout
    applied = json.loads(_integrate("vllm", "--apply", "--json", "--site", str(tmp_path)).stdout)
    assert applied["version"] == "0.33.0+cu126" and applied["state"] == "applied"
    assert _files(tmp_path, originals) != originals
    other = tmp_path / "other"
    _fake_engine(other, "vllm", "0.33.1+cu126")
    refused = _integrate("vllm", "--site", str(other))
    assert refused.returncode == 1 and "vllm 0.33.1+cu126 is installed" in " ".join(refused.stdout.split())


def _editable(tmp_path, name: str, version: str) -> tuple:
    """A source checkout (the package under checkout/python/, as SGLang lays
    it out) and a site-packages holding what `pip install -e checkout/python`
    leaves there: the dist-info with an editable direct_url.json and a .pth
    naming the checkout."""
    source, site = tmp_path / "checkout" / "python", tmp_path / "site-packages"
    originals = _fake_engine(source, name, version)
    site.mkdir()
    (source / f"{name}-{version}.dist-info").rename(site / f"{name}-{version}.dist-info")
    (site / f"{name}-{version}.dist-info" / "direct_url.json").write_text(
        json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}}))
    (site / f"__editable__.{name}-{version}.pth").write_text(f"{source}\n")
    return source, site, originals


def test_integrate_finds_an_editable_install(tmp_path):
    """Issue 33 #12: `pip install -e`: the package is in the checkout, its
    dist-info in site-packages. Found from the import path (the checkout on
    it, as the .pth puts it), from --site <checkout>, and from --site
    <site-packages>; the patch goes into the checkout."""
    source, site, originals = _editable(tmp_path, "sglang", "0.5.23")
    on_path = os.pathsep.join([str(site), str(source)])  # what the .pth adds, before the venv's own
    for args, pythonpath in (((), on_path), (("--site", str(source)), str(site)),
                             (("--site", str(site)), "")):
        report = _integrate("sglang", "--json", *args, pythonpath=pythonpath)
        assert report.returncode == 0, (args, report.stdout)
        report = json.loads(report.stdout)
        assert report["site"] == str(source) and report["version"] == "0.5.23", args
        assert report["state"] == "not applied", args
    applied = _integrate("sglang", "--apply", "--site", str(site))
    assert applied.returncode == 0 and "applied: the patch is now applied" in applied.stdout
    assert all(_files(source, originals)[f] != originals[f] for f in originals)
    reverted = _integrate("sglang", "--revert", pythonpath=on_path)
    assert reverted.returncode == 0 and _files(source, originals) == originals


def test_integrate_finds_a_legacy_editable_install(tmp_path):
    """`setup.py develop` / pip's legacy editable mode: an .egg-link in
    site-packages names the checkout, which holds the egg-info."""
    source, site, originals = _editable(tmp_path, "sglang", "0.5.23")
    (site / "sglang-0.5.23.dist-info").rename(source / "sglang.egg-info")
    (source / "sglang.egg-info" / "direct_url.json").unlink()
    (source / "sglang.egg-info" / "METADATA").rename(source / "sglang.egg-info" / "PKG-INFO")
    (site / "sglang.egg-link").write_text(f"{source}\n.\n")
    for where in (site, source):
        report = json.loads(_integrate("sglang", "--json", "--site", str(where)).stdout)
        assert report["site"] == str(source) and report["version"] == "0.5.23", where
        assert report["state"] == "not applied"


def test_integrate_without_metadata_under_force(tmp_path):
    """A copied tree with no metadata anywhere: refused with --force named;
    --force checks and applies it, the version said to be unknown."""
    originals = _fake_engine(tmp_path, "vllm", "0.33.0")
    (tmp_path / "vllm-0.33.0.dist-info" / "METADATA").unlink()
    (tmp_path / "vllm-0.33.0.dist-info").rmdir()
    refused = _integrate("vllm", "--site", str(tmp_path))
    assert refused.returncode == 1 and "--force tries the patch anyway" in " ".join(refused.stdout.split())
    forced = _integrate("vllm", "--apply", "--force", "--site", str(tmp_path))
    assert forced.returncode == 0 and "vllm unknown (patch made for 0.33.0; --force)" in forced.stdout
    assert _files(tmp_path, originals) != originals


# ------------------------------------------- what doctor says of SHMASK_*

def test_doctor_counts_a_misspelt_variable_as_a_problem():
    """A typo's setting does not apply: doctor fails and names the closest
    setting (it reported ok beside the warning)."""
    typo = "SHMASK_" + "RINGMB"  # spelt apart: test_config checks the repository's names
    env = {"SHMASK_RING_MB": "64", typo: "64", "PATH": ""}
    result = subprocess.run([sys.executable, "-m", "shmask", "--json", "doctor"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    check = next(c for c in report["checks"] if c["check"] == "SHMASK_* variables")
    assert not check["ok"] and check["unknown"] == [typo]
    assert "did you mean SHMASK_RING_MB?" in check["result"]
    clean = subprocess.run([sys.executable, "-m", "shmask", "--json", "doctor"], capture_output=True,
                           text=True, timeout=60, env={"SHMASK_RING_MB": "64", "PATH": ""})
    assert clean.returncode == 0 and json.loads(clean.stdout)["ok"], clean.stdout + clean.stderr


def test_a_ring_size_that_is_not_a_power_of_two_is_said(monkeypatch):
    """SHMASK_RING_MB=100 makes a 128 MiB ring: a RingSizeWarning says so
    once, doctor's config line too; a power of two says nothing."""
    import warnings

    from shmask import config as config_module

    monkeypatch.setattr(config_module, "_warned", set())
    with pytest.warns(config_module.RingSizeWarning, match="SHMASK_RING_MB=100 is rounded up to 128"):
        made = config_module.Config.from_env({"SHMASK_RING_MB": "100"})
    assert made.ring_capacity_bytes == 128 << 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_module.Config.from_env({"SHMASK_RING_MB": "100"})  # once per process
        config_module.Config.from_env({"SHMASK_RING_MB": "64"})
        config_module.Config(ring_mb=100)  # a program's own size: its business, no warning
        config_module.Config.from_env({}, ring_mb=100)
    result = _cli("--json", "doctor")
    assert json.loads(result.stdout)["checks"][2]["ring_rounding"] is None
    odd = subprocess.run([sys.executable, "-m", "shmask", "doctor"], capture_output=True, text=True,
                         timeout=60, env={"SHMASK_RING_MB": "100", "COLUMNS": "200", "PATH": ""})
    assert "SHMASK_RING_MB=100 is rounded up to 128" in odd.stdout, odd.stdout + odd.stderr

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import shmask


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


def test_rich_table_on_a_terminal(writer):
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen([sys.executable, "-m", "shmask", "ls"], stdout=follower,
                                   stderr=follower, env={"COLUMNS": "250", "PATH": "", "TERM": "xterm"})
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
    assert writer.segment_name in text and "┃" in text  # rich's table border

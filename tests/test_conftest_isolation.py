"""conftest.py's isolation, seen from outside: a small test session of its
own (a pytest child process, this directory's conftest) with a test that
leaks a segment, one that hangs past its timeout with children running, and
unrelated tests after them. Only the leaking or hanging test is reported;
the children are gone; the tests after them pass."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_session(tmp_path: Path, files: dict[str, str]) -> str:
    """Run pytest on `files` with this conftest, in a process group of its
    own (killed whole when this test is interrupted); its output."""
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\n")
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # shmask from this checkout
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rfEw", "-p", "no:cacheprovider",
                             str(tmp_path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        return proc.communicate(timeout=240)[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def summary(output: str) -> dict[str, int]:
    """The counts of the last line: {'passed': 6, 'errors': 2, ...}."""
    last = output.strip().splitlines()[-1]
    return {word: int(count) for count, word in re.findall(r"(\d+) (\w+)", last)}


def reported(output: str) -> list[str]:
    """The tests named in the short summary (FAILED or ERROR lines)."""
    return re.findall(r"^(?:FAILED|ERROR) \S+::(\w+)", output, re.MULTILINE)


def test_a_leaked_segment_fails_only_the_test_that_leaked_it(tmp_path):
    output = run_session(tmp_path, {
        "test_a.py": """
            import subprocess, sys
            import shmask
            from conftest import SESSION_PREFIX, leftover_segments
            KEPT = []

            def test_leaks(prefix):
                KEPT.append(shmask.Writer(shmask.Config(ring_mb=1, name_prefix=prefix)))

            def test_a_child_killed_with_its_writer_open(prefix):
                code = ("import os, signal, sys, shmask; "
                        "w = shmask.Writer(shmask.Config(ring_mb=1, name_prefix=sys.argv[1])); "
                        "os.kill(os.getpid(), signal.SIGKILL)")
                assert subprocess.run([sys.executable, "-c", code, prefix]).returncode == -9
                assert leftover_segments(prefix)

            def test_after_it_nothing_of_its_prefix_is_left():
                assert not leftover_segments(SESSION_PREFIX)

            def test_own_prefix_is_clean(prefix):
                assert not leftover_segments(prefix)

            def test_leaks_under_the_session_prefix():
                KEPT.append(shmask.Writer(shmask.Config(ring_mb=1, name_prefix=SESSION_PREFIX)))

            def test_last_of_the_module():
                pass
        """,
        "test_b.py": """
            from conftest import SESSION_PREFIX, leftover_segments

            def test_next_module_starts_clean():
                assert not leftover_segments(SESSION_PREFIX)
        """,
    })
    assert summary(output) == {"passed": 7, "warning": 1, "errors": 2}, output
    assert reported(output) == ["test_leaks", "test_last_of_the_module"], output
    assert "the test left shared-memory segments behind" in output
    assert "tests in test_a.py left shared-memory segments behind" in output
    # a dead process's segment (what shmask's garbage collection reclaims)
    # is removed and named in a warning against its test
    assert re.search(r"test_a_child_killed_with_its_writer_open left segments of dead processes",
                     output), output


def _gone(pid: int, timeout: float = 10) -> bool:
    """The process has exited (a zombie waiting to be reaped counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_test_that_times_out_has_its_children_killed_and_the_next_test_passes(tmp_path):
    pids = tmp_path / "pids"
    hang = """
        import pathlib, subprocess, sys, time
        import pytest

        PIDS = pathlib.Path(PIDS_FILE)
        # writes its pid and sleeps; SPAWNER starts one of these, then is one
        SLEEPER = "import os, sys, time; open(sys.argv[-1], 'a').write(f'{os.getpid()} '); time.sleep(600)"
        SPAWNER = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], "
                   "sys.argv[2]]); exec(sys.argv[1])")

        @pytest.mark.timeout(8)
        def test_hangs():
            # a child in a group of its own with a grandchild, a child in pytest's group
            subprocess.Popen([sys.executable, "-c", SPAWNER, SLEEPER, PIDS_FILE], start_new_session=True)
            subprocess.Popen([sys.executable, "-c", SLEEPER, PIDS_FILE])
            while not PIDS.exists() or len(PIDS.read_text().split()) < 3:
                time.sleep(0.05)
            time.sleep(600)

        def test_after_it():
            pass
    """.replace("PIDS_FILE", repr(str(pids)))
    output = run_session(tmp_path, {"test_hang.py": hang})
    assert summary(output) == {"failed": 1, "passed": 1, "warning": 1}, output
    assert reported(output) == ["test_hangs"], output
    assert "Timeout" in output and "left processes running" in output, output
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 3, output
    assert all(_gone(pid) for pid in started), [p for p in started if not _gone(p, 0)]


def test_every_long_test_names_a_test_that_exists():
    """tests/long_tests.txt (what `make test` leaves to `make test-long`)
    names real tests: a renamed one would silently move back."""
    from conftest import LONG_TESTS

    root = Path(__file__).resolve().parents[1]
    assert len(LONG_TESTS) >= 10
    for nodeid in LONG_TESTS:
        path, _, name = nodeid.partition("::")
        function = name.split("[")[0]
        assert f"def {function}(" in (root / path).read_text(), nodeid

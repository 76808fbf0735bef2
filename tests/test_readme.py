"""The README's "Use it" example runs as it is printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _use_it_block() -> str:
    text = README.read_text()
    section = text[text.index("## Use it\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in README's Use it section"
    return match.group(1)


def test_use_it_example_runs(prefix, tmp_path):
    script = tmp_path / "use_it.py"
    script.write_text(_use_it_block())
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix, "SHMASK_RING_MB": "16"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "WARNING" not in result.stderr
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(prefix + "-")]


def test_readme_names_the_make_targets():
    text = README.read_text()
    makefile = (README.parent / "Makefile").read_text()
    for target in ("demo", "test", "test-compat", "faults", "serve", "bench", "check", "wheel",
                   "package-check"):
        assert f"make {target}" in text, target
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
    assert "## Running it for weeks" in text

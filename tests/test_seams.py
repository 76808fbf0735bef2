"""The seams stay seams (issue 34), checked by reading the source:

- no module outside shmask/writer.py touches a Writer's private fields: the
  GPU-direct path goes through shmask/device_port.py's DevicePort;
- no integer offset into the GPU-direct table (native/shmask_direct.h) or
  the row-flags byte (SHM_ROW_*) outside shmask/layout.py, the one module
  whose values tests/test_constants.py checks against the built core.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# writer._ring, self.writer._direct, ...: a Writer's private field.
WRITER_PRIVATE = re.compile(r"\bwriter\._[A-Za-z]")
# A cast chain such as `table.to(tl.int64).to(tl.pointer_type(tl.int64))`.
_CASTS = r"(?:\.to\([^()]*(?:\([^()]*\))?[^()]*\))*"
LITERAL_OFFSETS = {
    # table + 256, desc + 8, counts + 15, header + 16, addresses + 2, entry + 64
    "an integer offset into the GPU-direct table":
        re.compile(r"\b(?:table|desc|counts|header|entry|addresses)\b" + _CASTS
                   + r"\s*\+\s*\d+\b"),
    # form << 2, forms[b] << 2
    "the form bit's shift as a literal": re.compile(r"\bforms?\b(?:\[[^\]]*\])?\s*<<\s*\d"),
    # flags & 3, flags == 0, flags[i] != 4
    "a literal flags value": re.compile(r"\bflags\b(?:\[[^\]]*\])?\s*(?:==|!=|&)\s*\d"),
    # status != 3 where a row becomes a flags byte (3: SKIPPED, not a flags status)
    "the SKIPPED code as a literal": re.compile(r"\bstatus\b\s*(?:==|!=)\s*3\b"),
}

# Not issue 34's to change (another engineer's file): strict xfail, so the
# day it is fixed this list must shrink.
NOT_YET: dict[str, str] = {}  # paths known to break a rule, each with why (none now)


def _sources() -> list[str]:
    paths = sorted((ROOT / "kernels").glob("*.py")) + sorted((ROOT / "shmask").rglob("*.py"))
    return [str(p.relative_to(ROOT)) for p in paths]


def writer_private_uses(path: str, text: str) -> list[str]:
    if path == "shmask/writer.py":
        return []
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if WRITER_PRIVATE.search(line)]


def literal_offsets(path: str, text: str) -> list[str]:
    if path == "shmask/layout.py":
        return []
    return [f"{path}:{n}: {what}: {line.strip()}"
            for n, line in enumerate(text.splitlines(), 1)
            for what, pattern in LITERAL_OFFSETS.items() if pattern.search(line)]


def _params() -> list[object]:
    return [pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=NOT_YET[path]))
            if path in NOT_YET else path for path in _sources()]


@pytest.mark.parametrize("path", _sources())
def test_no_writer_private_field_outside_writer(path: str) -> None:
    found = writer_private_uses(path, (ROOT / path).read_text())
    assert not found, "use shmask.device_port.DevicePort instead:\n" + "\n".join(found)


@pytest.mark.parametrize("path", _params())
def test_no_literal_layout_offset_outside_layout(path: str) -> None:
    found = literal_offsets(path, (ROOT / path).read_text())
    assert not found, "take the names from shmask/layout.py:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    # What kernels/ring.py, kernels/direct.py and kernels/host.py held before
    # issue 34 (each must be caught).
    "    desc = table.to(tl.pointer_type(tl.int64)) + 8  # shm_direct_step_desc at byte 64",
    "    entry = table + 256 + slot * 64",
    "    rows = tl.load(counts + 8).to(tl.int64)",
    "    fits = (status != 3) & (tl.load(counts + 15) == 0)",
    "                 (status | (form << 2)).to(tl.uint8))",
    "    target = tl.load(header + 16)  # shm_direct_step_desc.target",
    "    ids = tl.load(addresses + 2).to(tl.pointer_type(tl.int32)) + words",
    "    vocab = tl.load((desc + 10).to(tl.pointer_type(tl.int32)))",
    "        out.append((st | forms[b] << 2, lengths[b], data, logprobs))",
    "        return self.flags & 3",
])
def test_the_offset_patterns_catch_literal_offsets(line: str) -> None:
    assert literal_offsets("kernels/example.py", line)


@pytest.mark.parametrize("line", [
    "        writer._direct = self  # the Writer's hooks",
    "        args = (self.writer._ring, self._direct, c_handles, handles.size,",
    "    publisher = writer._publisher",
])
def test_the_private_pattern_catches_private_fields(line: str) -> None:
    assert writer_private_uses("kernels/example.py", line)


@pytest.mark.parametrize("line", [
    "    desc = table.to(tl.pointer_type(tl.int64)) + DESC",
    "        tl.store(counts + _ROWS, (rows + 1).to(tl.int32))",
    "    n_words = tl.load(id_offsets_ptr + b + 1).to(tl.int64) - id_start",
    "        lib.shm_direct_push_all(writer.ring_handle, direct)",
])
def test_the_patterns_let_named_offsets_pass(line: str) -> None:
    assert not literal_offsets("kernels/example.py", line)
    assert not writer_private_uses("kernels/example.py", line)


# ------------------------------------------------------------ C includes

NATIVE = ROOT / "native"
CONCERNS = ("ring", "reader", "queue", "decode", "guard", "direct")


def includes(text: str) -> list[str]:
    return re.findall(r'^#include "([^"]+)"', text, re.M)


@pytest.mark.parametrize("concern", ("core", *CONCERNS))
def test_each_core_file_includes_its_own_header_first(concern: str) -> None:
    """A concern's .c file includes its own header first (so the header
    stands alone) and never an umbrella that declares every concern."""
    found = includes((NATIVE / f"shmask_{concern}.c").read_text())
    assert found and found[0] == f"shmask_{concern}.h", found


def test_the_shared_header_includes_no_concern() -> None:
    """shmask_core.h holds what every concern shares; it includes none of
    them (the tree before included all six there: every file saw every
    concern). Only native/build.py's cffi source includes them all."""
    found = includes((NATIVE / "shmask_core.h").read_text())
    assert not [name for name in found if name.removeprefix("shmask_").removesuffix(".h")
                in CONCERNS], found

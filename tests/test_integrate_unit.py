"""shmask.integrate's parts that need no engine: the patch cut per file,
the per-file state from the file's contents (GNU patch dry runs on small
files), the tree's state, and the release part of a version."""

from __future__ import annotations

import pytest

from shmask.integrate import (
    APPLIED,
    DIFFERS,
    ENGINES,
    NOT_APPLIED,
    PARTLY,
    IntegrateError,
    file_state,
    patch_path,
    release_of,
    split_patch,
    tree_state,
)

# A removed line "-- x" and an added "++ y" read like file headers ("--- x",
# "+++ y") in the patch; the hunk's line counts keep them in their hunk.
TWO_FILES = (
    "diff -ru a/pkg/a.sql b/pkg/a.sql\n"
    "--- a/pkg/a.sql\n+++ b/pkg/a.sql\n@@ -1,3 +1,3 @@\n keep\n--- x\n+++ y\n last\n"
    "--- a/pkg/b.py\n+++ b/pkg/b.py\n@@ -1,2 +1,3 @@\n one\n two\n+three\n"
    "\\ No newline at end of file\n"
)


def test_split_patch_keeps_header_like_lines_in_their_hunk(tmp_path):
    patch = tmp_path / "two.patch"
    patch.write_text(TWO_FILES)
    first, second = split_patch(patch)
    assert first.path == "pkg/a.sql" and "--- x\n+++ y\n" in first.text
    assert second.path == "pkg/b.py" and second.text.endswith("\\ No newline at end of file\n")
    assert first.text + second.text == TWO_FILES.split("\n", 1)[1]  # all but the "diff" line


@pytest.mark.parametrize("bad", [
    "--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1,3 +1,3 @@\n x\n-y\n",  # ends before its counts
    "--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1,2 +1,2 @@\n x\nnot a hunk line\n",
    "no file header at all\n",
])
def test_split_patch_refuses_a_malformed_patch(tmp_path, bad):
    patch = tmp_path / "bad.patch"
    patch.write_text(bad)
    with pytest.raises(IntegrateError, match="malformed|holds no file"):
        split_patch(patch)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_shipped_patches_split_into_every_file_they_change(name):
    text = patch_path(ENGINES[name]).read_text()
    parts = split_patch(patch_path(ENGINES[name]))
    assert "".join(part.text for part in parts) == "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith("diff "))
    assert len({part.path for part in parts}) == len(parts) == text.count("\n+++ b/")


def test_file_state_from_contents(tmp_path):
    """Unpatched: only the forward dry run applies; patched: only the reverse
    one; edited, missing, or half-patched within the file: neither (and
    nothing is written by a check)."""
    patch = tmp_path / "one.patch"
    patch.write_text("--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1,3 +1,3 @@\n x = 1\n-y = 2\n+y = 20\n z = 3\n"
                     "@@ -5,3 +5,3 @@\n u = 1\n-v = 2\n+v = 20\n w = 3\n")
    (part,) = split_patch(patch)
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    target = site / "pkg" / "a.py"
    cases = {
        "x = 1\ny = 2\nz = 3\n-\nu = 1\nv = 2\nw = 3\n": NOT_APPLIED,
        "x = 1\ny = 20\nz = 3\n-\nu = 1\nv = 20\nw = 3\n": APPLIED,
        "x = 1\ny = 20\nz = 3\n-\nu = 1\nv = 2\nw = 3\n": DIFFERS,  # one hunk of two
        "x = 1\ny = 3\nz = 3\n-\nu = 1\nv = 2\nw = 3\n": DIFFERS,  # edited
    }
    for text, want in cases.items():
        target.write_text(text)
        state, detail = file_state(site, part)
        assert state == want, (text, detail)
        assert bool(detail) == (want == DIFFERS)
        assert target.read_text() == text
    target.unlink()
    assert file_state(site, part) == (DIFFERS, f"{target}: no such file")


def test_tree_state():
    assert tree_state({"a": APPLIED, "b": APPLIED}) == APPLIED
    assert tree_state({"a": NOT_APPLIED, "b": NOT_APPLIED}) == NOT_APPLIED
    assert tree_state({"a": APPLIED, "b": NOT_APPLIED}) == PARTLY
    assert tree_state({"a": APPLIED, "b": NOT_APPLIED, "c": DIFFERS}) == DIFFERS


@pytest.mark.parametrize("version,release", [
    ("0.33.0", "0.33.0"), ("0.33.0+cu126", "0.33.0"), ("0.33.0+rocm6.2.local", "0.33.0"),
    ("0.33.0.post1", "0.33.0.post1"), ("0.33.1.dev12+g1234abc", "0.33.1.dev12"),
])
def test_release_of_drops_only_the_local_label(version, release):
    assert release_of(version) == release

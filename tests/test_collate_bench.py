"""benchmarks/collate.py --smoke runs (issue 38, "Collation"): the responses
of a tiny micro-batch built through a real ring, every path checked
against the generated rows and timed, and the JSON holding what was asked
for. Once with ids rows (selected mode) and once with bitmask rows (32 L >=
V, support mode)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151_936
PATHS = ["a", "a-loads", "b", "c", "c-loop"]


def run_smoke(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """The benchmark in a process group of its own, killed whole on a timeout
    or when the test is interrupted."""
    command = [sys.executable, str(REPO / "benchmarks" / "collate.py"), "--smoke", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"collate.py --smoke ran past {timeout} s:\n{output[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group still runs
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, output, "")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequences, tokens, length, mode, form", [
    (2, 8, 50, "selected", "ids"),
    (3, 5, 4748, "support", "bitmask"),  # 32 * 4748 = 151,936: the form rule's boundary
])
def test_collate_smoke_checks_every_path_and_reports_the_sizes(tmp_path, prefix, sequences,
                                                                tokens, length, mode, form):
    out = tmp_path / "collate.json"
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    done = run_smoke(["--sequences", str(sequences), "--tokens", str(tokens), "--length",
                      str(length), "--mode", mode, "--json", str(out)], env, timeout=100)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "segments left in /dev/shm: 0" in done.stdout, done.stdout[-4000:]
    assert "needs a larger host" in done.stdout  # the smoke size is not the issue's
    result = json.loads(out.read_text())

    n = sequences * tokens
    assert (result["sequences"], result["tokens"], result["length"]) == (sequences, tokens, length)
    assert result["vocab"] == VOCAB and result["mode"] == mode and result["smoke"] is True
    assert result["num_tokens"] == n and result["nnz"] == n * length
    assert result["dense_mask_bytes"] == n * VOCAB
    assert result["segments_left"] == 0
    assert result["cuda"] == (result["device"] != "none")
    paths = {p["path"]: p for p in result["paths"]}
    assert list(paths) == PATHS

    for name, path in paths.items():
        assert path["checked"] is True and path["check"]["ok"] is True, name
        assert len(path["seconds"]) == result["repeats"] >= 1, name
        assert all(s > 0 for s in path["seconds"]) and path["median_s"] > 0, name
        assert path["baseline_over_path"] > 0, name
        assert path["response_bytes"] > 0 and path["tensor_bytes"] > 0, name
    assert paths["c"]["baseline_over_path"] == 1.0

    # shmask's packers compared every token's data, and sampled tokens one by one
    words = -(-VOCAB // 32)
    for name in ("a", "a-loads", "b"):
        check = paths[name]["check"]
        assert check["form"] == form, name
        assert check["tokens_compared"] == n and check["ids_compared"] == n * length, name
        assert check["tokens_sampled"] >= min(n, 2), name
        assert paths[name]["dense_mask_bytes"] == 0, name
        width = words if form == "bitmask" else length
        # offsets (N + 1) and seq_offsets (S + 1) int64, the id data and forms int32, valid
        expected = 8 * (n + 1) + 8 * (sequences + 1) + 4 * n * width + 4 * n + n
        expected += 4 * n if mode == "selected" else 0  # rollout logprobs
        assert paths[name]["tensor_bytes"] == expected, name
    # the dense masks: exactly the original bits, N x V bytes each
    for name in ("c", "c-loop"):
        path = paths[name]
        assert path["check"]["set_bits"] == n * length, name
        assert path["dense_mask_bytes"] == n * VOCAB, name
        assert path["tensor_bytes"] == n * VOCAB + (4 * n if mode == "selected" else 0), name
    # the same bodies feed the paths of one form
    assert paths["a"]["response_bytes"] == paths["a-loads"]["response_bytes"]
    assert paths["b"]["response_bytes"] == paths["c"]["response_bytes"] \
        == paths["c-loop"]["response_bytes"]


@pytest.mark.timeout(120)
def test_collate_runs_only_the_paths_asked_for(tmp_path, prefix):
    """--paths a,b: shmask's own paths alone (what a host too small for the
    dense mask can run at the issue's size): no baseline, so no ratio (null
    in the JSON), each path still checked."""
    out = tmp_path / "collate.json"
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    done = run_smoke(["--paths", "a,b", "--json", str(out)], env, timeout=100)
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads(out.read_text())
    assert [p["path"] for p in result["paths"]] == ["a", "b"]
    assert all(p["checked"] and p["baseline_over_path"] is None for p in result["paths"])
    bad = run_smoke(["--paths", "a,x"], env, timeout=60)
    assert bad.returncode == 2 and "--paths takes some of" in bad.stdout

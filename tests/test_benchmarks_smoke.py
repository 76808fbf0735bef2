"""The benchmarks still run: `benchmarks/run.py --quick` in its own process
(real zmq, real processes, real shared memory), every transport reported,
and every emission's rows verified at the tokenizer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_in_own_group(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run `command` in a process group of its own; on timeout, or when the
    test is interrupted (pytest-timeout raises in it), the whole group (the
    benchmark and every child it started) is killed, so nothing runs on
    orphaned into the tests after this one."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command[1:3]} ran past {timeout} s:\n{(out + err)[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group still runs
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.timeout(400)
def test_quick_benchmark_runs_and_verifies_rows():
    done = run_in_own_group([sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick"], REPO,
                            timeout=360)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for name in ("lists", "arrays", "oob", "shmask"):
        assert re.search(rf"^\W*{name}\s", output, re.MULTILINE), f"no result row for {name}"
    assert re.search(r"^mismatches: 0$", output, re.MULTILINE), output[-4000:]
    assert re.search(r"^segments left in /dev/shm: 0", output, re.MULTILINE), output[-4000:]


# The GPU-direct paths run their kernels in Triton's interpreter (--quick,
# even on a GPU host): about a minute on an idle 2-core machine, 2-3 under load.
@pytest.mark.timeout(900)
def test_quick_gpu_direct_benchmark_runs_and_rows_match_the_cpu_path(tmp_path):
    """benchmarks/direct.py --quick: the decode loop through the whole
    pipeline, CPU path and GPU-direct paths (the store kernel, capture's and
    compaction's own kernels, in Triton's interpreter), the tokenizer's
    checksums equal across the paths that send the same rows."""
    out = tmp_path / "direct.json"
    # Every path that sends rows, and "off" (the table's baseline); the two
    # masks-only paths (capture, compact: rows computed, then dropped) add
    # ~20 s each here and check nothing more, so only make test-gpu runs them.
    paths = ("off", "cpu", "direct", "fused", "compact-direct", "compact-fused")
    if os.environ.get("SHMASK_TEST_GPU") == "1":
        paths += ("capture", "compact")
    done = run_in_own_group([sys.executable, "direct.py", "--quick", "--out", str(out),
                             "--paths", ",".join(paths)], REPO / "benchmarks", timeout=840)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for path in paths:
        assert re.search(rf"^\W*{path}\s.*\s(True|-)\s", output, re.MULTILINE), f"no row for {path}"
    assert not re.search(r"\sFalse\s", output), output[-4000:]
    runs = {r["path"]: r["stats"] for r in json.loads(out.read_text())}
    assert runs["direct"]["direct_steps"] == runs["compact-direct"]["direct_steps"] == 12
    assert runs["fused"]["fused_steps"] == runs["compact-fused"]["fused_steps"] == 12


@pytest.mark.timeout(400)
def test_response_leg_benchmark_runs_and_responses_are_byte_identical(tmp_path):
    """benchmarks/response_leg.py at a tiny size: scheduler, detokenizer and
    1 or 2 tokenizer processes (requests routed by RefBatch.select), a row
    per configuration, every sampled response byte-identical to SGLang's
    way, every emission's responses built and timed."""
    out = tmp_path / "response_leg.json"
    done = run_in_own_group([sys.executable, "response_leg.py", "--requests", "8", "16",
                             "--tokenizers", "1", "2", "--support", "50", "--emission", "5",
                             "--emissions", "2", "--warmup", "1", "--step-ms", "2",
                             "--out", str(out)], REPO / "benchmarks", timeout=360)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for requests in (8, 16):
        for tokenizers in (1, 2):
            assert re.search(rf"^\| {requests} \| {tokenizers} \|", output, re.MULTILINE), \
                f"no table row for {requests} requests, {tokenizers} tokenizers:\n{output[-4000:]}"
    assert re.search(r"^segments left in /dev/shm: 0", output, re.MULTILINE), output[-4000:]
    configs = json.loads(out.read_text())["configs"]
    assert len(configs) == 4
    for config in configs:
        assert config["mismatches"] == 0, config
        # first and last request of every emission (2 + 1 warmup) at every tokenizer
        assert config["checked"] == 2 * 3 * config["tokenizers"], config
        for tokenizer in config["per_tokenizer"]:
            assert len(tokenizer["busy_ms"]) == 2 and min(tokenizer["busy_ms"]) > 0, tokenizer
            assert tokenizer["response_mb_per_emission"] > 0, tokenizer
            assert tokenizer["requests_per_emission"] == config["requests"] // config["tokenizers"]


# In Triton's interpreter (B = 2, V = 4000, 3 distributions): ~50 s on a
# busy 2-core machine, most of it the interpreter's bitmask scans.
@pytest.mark.timeout(400)
def test_sweep_smoke_runs_every_path_on_every_distribution(tmp_path):
    """benchmarks/sweep.py --smoke end to end on the CPU: every path measured
    and checked on every distribution, the worst-case table, no row that
    differs from the torch reference, FlashInfer reported as not built."""
    out = tmp_path / "sweep.json"
    # the CPU path even on a GPU host: no device visible, the interpreter on
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "benchmarks/sweep.py", "--smoke", "--json", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        output, err = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, err = proc.communicate()
        pytest.fail(f"sweep.py --smoke ran past 360 s:\n{(output + err)[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group still runs
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, (output + err)[-4000:]
    dists = ["fp32 s8", "bf16 s8", "mix"]
    # the paths, written out here so that one the script drops fails
    shmask_paths = [f"capture {s}" for s in ("p0.6", "p0.9", "p0.99", "k1", "k20", "k1000",
                                             "k4096", "k1000 p0.9", "min_p0.1", "mixed")]
    shmask_paths += [f"sample {s}" for s in ("p0.9", "k1000", "k1000 p0.9", "min_p0.1")]
    shmask_paths += ["compact k1000", "read (floor)"]
    assert "flashinfer: not built (no CUDA device)" in output, output[:2000]
    for dist in dists:
        block = output.split(f"\n{dist}: top_p 0.9 support mean ", 1)[1].split("\n\n", 1)[0]
        for name in shmask_paths:
            assert re.search(rf"^  {re.escape(name)} +\|", block, re.MULTILINE), \
                f"no row for {name} on {dist}:\n{block}"
    table = output.split("\nworst case over 3 distributions", 1)[1]
    for name in shmask_paths:
        assert re.search(rf"^{re.escape(name)} +\|", table, re.MULTILINE), \
            f"no worst-case row for {name}:\n{table}"
    assert re.search(r"^checks: 0 mismatched rows;", output, re.MULTILINE), output[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["path"], r["dist"]) for r in rows} == {(p, d) for p in shmask_paths for d in dists}



@pytest.mark.timeout(120)
def test_sweep_names_a_path_slower_than_its_baseline_under_an_unchanged_worst_case(tmp_path):
    """sweep.py's --baseline comparison (against_baseline) on rows written
    out here: a path 15% slower on one distribution is marked SLOWER though
    its worst case did not move (the slower distribution is not its worst),
    and that distribution is named, not one where it got faster by more; a
    path 10% faster and one within 1% are not marked; a path the baseline
    lacks is left out; another card is said."""
    rows = {"capture p0.9": {"flat": (300.0, 300.0), "peaked": (140.0, 161.0),
                             "mid": (200.0, 160.0)},  # moved more, but faster: not named
            "capture k1000": {"flat": (130.0, 117.0), "peaked": (129.0, 116.1)},
            "compact k1000": {"flat": (74.0, 74.5), "peaked": (74.2, 74.0)}}
    then = [{"path": p, "dist": d, "gpu_us": t} for p, ds in rows.items() for d, (t, _) in ds.items()]
    now = [{"path": p, "dist": d, "gpu_us": n} for p, ds in rows.items() for d, (_, n) in ds.items()]
    now.append({"path": "sample p0.9", "dist": "flat", "gpu_us": 500.0})
    (tmp_path / "then.json").write_text(json.dumps({"device": "card A", "rows": then}))
    (tmp_path / "now.json").write_text(json.dumps(now))
    script = (
        "import json, sys\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import sweep\n"
        f"base = json.load(open({str(tmp_path / 'then.json')!r}))\n"
        f"now = json.load(open({str(tmp_path / 'now.json')!r}))\n"
        "print('TABLE', json.dumps(sweep.against_baseline(now, base, 'card A')))\n"
        "sweep.against_baseline(now, base, 'card B')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.split("\nagainst the baseline")[1:]
    table = {r["path"]: r for r in json.loads(first.split("TABLE ", 1)[1])}
    assert list(table) == ["capture p0.9", "capture k1000", "compact k1000"]
    p = table["capture p0.9"]
    assert p["slower"] and p["ratio"] == 1.0 and p["moved_most_on"] == "peaked"
    assert abs(p["moved_ratio"] - 1.15) < 1e-9
    assert not table["capture k1000"]["slower"] and not table["compact k1000"]["slower"]
    assert first.count("SLOWER") == 1 and "another card" not in first
    assert "this run: card B, another card" in second

@pytest.mark.timeout(200)
def test_replay_smoke_checks_and_measures_both_row_forms(tmp_path):
    """benchmarks/replay.py --smoke on the CPU: the replay checked against
    the dense mask for ids rows and bitmask rows, then every path timed."""
    out = tmp_path / "replay.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "benchmarks/replay.py", "--smoke", "--json", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, output[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["rows"].split()[1] for r in results] == ["rows", "rows"]
    assert results[0]["rows"].startswith("50-id") and results[1]["rows"].startswith("bitmask")
    for r in results:
        assert r["max_abs_error"] < 1e-3 and r["mean_logp"] < 0, r
        assert all(v > 0 for v in r["forward_ms"].values()), r
        # torch's gather of the support: the ids rows' floor, not the bitmask rows'
        assert ("support_gather" in r["forward_ms"]) == r["rows"].startswith("50-id"), r
        assert set(r["forward_backward_ms"]) == {"dense_mask", "replay", "dense_gradient_write"}


@pytest.mark.timeout(300)
def test_bound_misled_counts_rows_and_applies_each_tuning():
    """benchmarks/bound_misled.py on 4 rows of one distribution (the bound in
    Triton's interpreter without a GPU): a line per variant, the committed
    values first, and a count floor set with --tuning keeps fewer ids than
    the committed one (the value reached the kernel, and was put back)."""
    done = run_in_own_group([sys.executable, "bound_misled.py", "--dists", "fp32 s5$",
                             "--top-p", "0.9", "--batch", "4", "--tuning", "P_KEEP=1024",
                             "--tuning", "WINDOW_MIN=8192"], REPO / "benchmarks", timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = re.findall(r"^fp32 s5 +0 +0\.90 (\S+) +\| +(\d+) +(\d+) \| +(\d+)", output, re.MULTILINE)
    assert [line[0] for line in lines] == ["committed", "P_KEEP=1024", "WINDOW_MIN=8192"], output
    kept = [int(line[3]) for line in lines]
    # P_KEEP's variant keeps fewer; the next variant, which does not set it,
    # keeps what the committed value keeps (P_KEEP was put back)
    assert 0 < kept[1] < kept[0] == kept[2], output
    # peaked rows: no window rows (1024 ids still settle them: a floor of
    # 256 would not, and decision 58 would make them window rows)
    assert all(line[1] == "0" for line in lines), output

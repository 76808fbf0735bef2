"""examples/trainer.py for real: it starts the example server (its engine
as processes, rings under this test's prefix), takes 2 prompts x 2 samples
with base64 sampling masks, packs them (shmask.train.from_binary), replays
them under a toy policy (shmask.kernels.replay_logprobs, full=True; Triton's
interpreter without a GPU), takes one Adam step on the GRPO-style loss and
stops the server. Its last line, a JSON report, is checked: every row
defined, supports within top_k, masses in (0, 1], full=True's outputs
consistent, the replay equal to the dense-mask reference on one sequence,
the loss changed by the step; and the server's ring is gone."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from conftest import leftover_segments, run_child

ROOT = Path(__file__).resolve().parents[1]
TOP_K = 50  # the trainer's default --top-k


@pytest.mark.timeout(240)
def test_trainer_replays_the_servers_masks_and_steps(prefix):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "SHMASK_NAME_PREFIX": prefix, "SHMASK_RING_MB": "8"}
    done = run_child([sys.executable, str(ROOT / "examples" / "trainer.py"), "--prompts", "2",
                      "--samples", "2", "--steps", "1", "--check"], env, timeout=210)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "shmask example server: http://127.0.0.1:" in done.stderr  # the server it started
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert report["sequences"] == 4 and report["prompts"] == 2 and report["samples"] == 2
    assert 0 < report["tokens"] <= report["sequences"] * report["max_new_tokens"]
    # The server's rows hold every sampled token: each logp_S is defined.
    assert report["defined"] == report["tokens"] and report["undefined"] == 0
    assert report["top_k"] == TOP_K
    assert 1 <= report["support_size_min"] <= report["support_size_mean"] \
        <= report["support_size_max"] <= TOP_K
    assert 0 < report["support_mass_min"] <= report["support_mass_mean"] \
        <= report["support_mass_max"] <= 1
    # full=True: logp_full = logp_S + log(support mass), row by row
    assert report["logp_full_identity_error"] < 1e-4
    # the replay (support only) against the dense [L, V] mask and log-softmax
    assert report["reference_max_error"] < 1e-5
    before, after = report["loss"]
    assert math.isfinite(before) and math.isfinite(after) and before != after, report["loss"]
    assert f"{report['defined']}/{report['tokens']} rows defined" in done.stdout
    # The trainer stopped the server with SIGTERM: its producer unlinked the ring.
    assert leftover_segments(prefix) == []

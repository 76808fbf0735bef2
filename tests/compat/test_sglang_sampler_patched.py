"""SGLang 0.5.23's sampler patched to capture with shmask's kernels, against
the released sampler, on the same batch (issue 36, item 1).

Both are SGLang's real `Sampler.forward` (pytorch backend, CPU; shmask's
kernels under Triton's interpreter), built by tests/compat/_sglang_sampler.py;
the patched one is sampler.py with shmask/integrations/sglang.patch's section
applied. Per opted-in row: the same status, the same ids in the same order
(descending weight; the logits have no ties), the same selected and support
logprobs to float32 rounding (shmask sums the support mass in its kernel's
order). Unseeded draws, made equal by seeding torch's generator.
"""

from __future__ import annotations

import _sglang_sampler as harness
import numpy as np
import pytest
import torch

from shmask.adapters import sglang_sampler

VOCAB, MAX_TOKENS = 512, 192
ROWS = [  # (temperature, top_k, top_p, min_p, mode); mode None: not opted in
    (1.0, -1, 0.9, 0.0, "support"),  # top-p only: the RL rollout setting
    (1.0, -1, 0.6, 0.0, "selected"),
    (0.8, 30, 1.0, 0.0, "support"),  # top-k only
    (1.0, 40, 0.95, 0.0, "support"),  # top-k + top-p
    (1.0, 12, 1.0, 0.0, None),  # no mask
    (1.0, -1, 1.0, 0.2, "support"),  # min-p only
    (1.0, 300, 1.0, 0.0, "support"),  # past max_tokens: OVERFLOW
    (1.2, 20, 0.8, 0.05, "selected"),  # all three
    (0.0, -1, 1.0, 0.0, "support"),  # greedy in a sampled batch (SGLang: top_k 1)
    (1.0, -1, 0.3, 0.0, "support"),
]
MASK_ROWS = [row for row, case in enumerate(ROWS) if case[4] is not None]
SUPPORT_ROWS = [row for row, case in enumerate(ROWS) if case[4] == "support"]
OVERFLOW_ROW = 6


def _batch() -> tuple[torch.Tensor, object]:
    logits = np.random.default_rng(11).standard_normal((len(ROWS), VOCAB)) * 2.0
    logits = torch.from_numpy(logits.astype(np.float32))
    temperatures, top_ks, top_ps, min_ps, _ = zip(*ROWS, strict=True)
    info = harness.sampling_info(logits, temperatures=temperatures, top_ks=top_ks, top_ps=top_ps,
                                 min_ps=min_ps, mask_rows=MASK_ROWS, support_rows=SUPPORT_ROWS)
    return logits, info


def _forward(patched: bool, monkeypatch: pytest.MonkeyPatch | None = None,
             **env: str) -> tuple[torch.Tensor, object, object]:
    if monkeypatch is not None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    sglang_sampler._settings.cache_clear()  # SHMASK_* are read once a process
    try:
        module = harness.load_sampler_module(patched=patched)
        with harness.sampler_context(MAX_TOKENS):
            logits, info = _batch()
            ids, output = harness.run_forward(module, module.Sampler(), logits, info)
    finally:
        sglang_sampler._settings.cache_clear()
    return ids, output, info


@pytest.fixture(scope="module")
def released():
    return _forward(False)


@pytest.fixture(scope="module")
def patched():
    return _forward(True)


def _assert_rows_equal(got, want, info, *, ordered: bool = True) -> None:
    got_rows, want_rows = harness.ok_rows(got, info), harness.ok_rows(want, info)
    assert [row.status for row in got_rows] == [row.status for row in want_rows]
    worst = 0.0
    for batch_row, mine, theirs in zip(MASK_ROWS, got_rows, want_rows, strict=True):
        if theirs.status != 0:
            continue
        if ordered:
            np.testing.assert_array_equal(mine.ids, theirs.ids, err_msg=f"row {batch_row}")
        else:
            assert np.all(np.diff(mine.ids) > 0), f"row {batch_row}: ascending ids"
            assert sorted(mine.ids.tolist()) == sorted(theirs.ids.tolist()), f"row {batch_row}"
        np.testing.assert_allclose(mine.selected_logprob, theirs.selected_logprob, rtol=1e-6,
                                   atol=1e-6, err_msg=f"row {batch_row}")
        if theirs.support_logprobs is None:
            assert mine.support_logprobs is None
            continue
        order = (np.arange(len(mine.ids)) if ordered
                 else np.argsort(np.argsort(-theirs.support_logprobs, kind="stable")))
        theirs_by_id = dict(zip(theirs.ids.tolist(), theirs.support_logprobs.tolist(), strict=True))
        want_values = np.array([theirs_by_id[i] for i in mine.ids.tolist()], dtype=np.float32)
        np.testing.assert_allclose(mine.support_logprobs, want_values, rtol=1e-6, atol=1e-6,
                                   err_msg=f"row {batch_row}")
        worst = max(worst, float(np.max(np.abs(mine.support_logprobs - want_values))))
        assert order.shape == mine.ids.shape
    assert worst < 1e-5


def test_same_tokens_statuses_rows_and_logprobs(released, patched):
    released_ids, released_out, info = released
    patched_ids, patched_out, _ = patched
    assert torch.equal(patched_ids, released_ids)
    statuses = patched_out.statuses.tolist()
    assert statuses == [1 if row == OVERFLOW_ROW else 0 for row in MASK_ROWS], statuses
    _assert_rows_equal(patched_out, released_out, info)
    # the top-p-only rows are the ones released SGLang could not bound: here
    # they are exact rows within max_tokens (or OVERFLOW), never a partial row
    for batch_row, row in zip(MASK_ROWS, harness.ok_rows(patched_out, info), strict=True):
        if row.status == 0:
            assert 1 <= len(row.ids) <= MAX_TOKENS, f"row {batch_row}"
            assert int(patched_ids[batch_row]) in row.ids.tolist()


def test_output_has_the_released_shapes_and_types(released, patched):
    _, released_out, _ = released
    _, patched_out, _ = patched
    for field in ("token_ids", "lengths", "selected_logprobs", "support_logprobs", "statuses"):
        mine, theirs = getattr(patched_out, field), getattr(released_out, field)
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, field
    assert type(patched_out) is type(released_out)
    # past a row's length the patched rows are zeros (deterministic bytes)
    ids = patched_out.token_ids
    for row, length in enumerate(patched_out.lengths.tolist()):
        assert not ids[row, length:].any()


def test_ascending_order_is_the_same_rows_by_id(released, monkeypatch):
    _, released_out, info = released
    patched_ids, patched_out, _ = _forward(True, monkeypatch, SHMASK_ROW_ORDER="ascending")
    assert torch.equal(patched_ids, released[0])
    _assert_rows_equal(patched_out, released_out, info, ordered=False)


def test_engine_capture_is_the_released_capture(released, monkeypatch):
    """SHMASK_CAPTURE=engine: the patched sampler captures as released, bit
    for bit."""
    _, released_out, _ = released
    _, engine_out, _ = _forward(True, monkeypatch, SHMASK_CAPTURE="engine")
    for field in ("token_ids", "lengths", "selected_logprobs", "support_logprobs", "statuses"):
        assert torch.equal(getattr(engine_out, field), getattr(released_out, field)), field


def test_pending_capture_declines_without_opted_in_rows():
    class Info:
        sampling_mask_batch_indices = None

    assert sglang_sampler.pending_capture(torch.zeros(2, 4), Info(), True) is None

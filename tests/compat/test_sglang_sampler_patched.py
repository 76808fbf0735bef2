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

from types import SimpleNamespace

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


def _forward(patched: bool, monkeypatch: pytest.MonkeyPatch | None = None, *,
             max_tokens: int = MAX_TOKENS, disaggregation: str = "null",
             **env: str) -> tuple[torch.Tensor, object, object]:
    if monkeypatch is not None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    sglang_sampler._settings.cache_clear()  # SHMASK_* are read once a process
    try:
        module = harness.load_sampler_module(patched=patched)
        with harness.sampler_context(max_tokens, disaggregation=disaggregation):
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
    # released SGLang's type, or its subclass with the rows past the cap
    # (the top-p-only rows may pass it: test_rows_past_the_cap_come_whole)
    assert isinstance(patched_out, type(released_out))
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


SMALL_CAP = 40  # below every top-p-only row's support here, and below top_k 300


def _materialized(output, info):
    """The rows as the patched scheduler's materialize_sampling_mask_output
    (SGLang's real method, its file patched) hands them to the requests:
    per opted-in row (status, ids, logprobs)."""
    processor = harness.load_module(
        "sglang/srt/managers/scheduler_components/batch_result_processor.py", patched=True)
    reqs = [SimpleNamespace(return_sampling_mask=opted, sampling_logprobs_mode=(
        "support" if support else "selected")) for opted, support in zip(
        info.return_sampling_masks, info.return_sampling_support_logprobs, strict=True)]
    holder = SimpleNamespace(sampling_mask_output=output)
    processor.SchedulerBatchResultProcessor.materialize_sampling_mask_output(reqs, holder)
    assert holder.sampling_mask_output is None
    return {b: (holder.next_token_sampling_mask_status[b], holder.next_token_sampling_mask_idx[b],
                holder.next_token_sampling_logprobs[b]) for b in MASK_ROWS}


def test_rows_past_the_cap_come_whole(monkeypatch):
    """SHMASK_PAST_CAP=exact (the default): at a cap of 40 the top-p-only
    rows and the top_k 300 row are longer than the cap; they reach the
    requests whole, ids ascending, the same ids and logprobs as the released
    sampler's rows at a cap of the whole vocabulary (where nothing is cut).
    The rows within the cap are the released rows, in the released order."""
    released_ids, released_out, info = _forward(False, max_tokens=VOCAB)
    patched_ids, patched_out, _ = _forward(True, monkeypatch, max_tokens=SMALL_CAP,
                                           SHMASK_PAST_CAP="exact")
    assert torch.equal(patched_ids, released_ids)
    assert type(patched_out).__name__ == "SpilledSamplingMaskOutput"
    # any path that rebuilds the released fields alone sees OVERFLOW, never a cut row
    fixed_status = dict(zip(MASK_ROWS, patched_out.statuses.tolist(), strict=True))
    got = _materialized(patched_out, info)
    want = dict(zip(MASK_ROWS, harness.ok_rows(released_out, info), strict=True))
    past = [b for b in MASK_ROWS if want[b].status == 0 and len(want[b].ids) > SMALL_CAP]
    assert set(past) >= {0, 6}, past  # a top-p-only row and the top_k 300 row
    for b in MASK_ROWS:
        status, ids, logprobs = got[b]
        assert status == want[b].status, f"row {b}"
        if status != 0:
            continue
        if b in past:
            assert fixed_status[b] == 1, f"row {b}: OVERFLOW in the released fields"
            assert np.all(np.diff(ids) > 0), f"row {b}: ascending"
            order = np.argsort(want[b].ids)
            np.testing.assert_array_equal(ids, want[b].ids[order], err_msg=f"row {b}")
            want_values = None if want[b].support_logprobs is None else want[b].support_logprobs[order]
        else:
            np.testing.assert_array_equal(ids, want[b].ids, err_msg=f"row {b}")
            want_values = want[b].support_logprobs
        if want_values is None:
            np.testing.assert_allclose(logprobs, [want[b].selected_logprob], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_allclose(logprobs, want_values, rtol=1e-6, atol=1e-6,
                                       err_msg=f"row {b}")


def test_rows_past_the_cap_overflow_when_configured(monkeypatch):
    """SHMASK_PAST_CAP=status: released SGLang's output type and OVERFLOW for
    every row past the cap (SGLang aborts those requests with its 400)."""
    _, released_out, info = _forward(False, max_tokens=VOCAB)
    _, patched_out, _ = _forward(True, monkeypatch, max_tokens=SMALL_CAP, SHMASK_PAST_CAP="status")
    assert type(patched_out) is type(released_out)
    want = dict(zip(MASK_ROWS, harness.ok_rows(released_out, info), strict=True))
    statuses = dict(zip(MASK_ROWS, patched_out.statuses.tolist(), strict=True))
    for b in MASK_ROWS:
        longer = want[b].status == 0 and len(want[b].ids) > SMALL_CAP
        assert statuses[b] == (1 if longer else want[b].status), f"row {b}"


def test_a_spilled_row_that_disagrees_with_its_length_is_invalid(monkeypatch):
    """A bitmask whose popcount is not the row's length (never made by the
    kernels: here forged) fails that request (INVALID), never returns a
    wrong row; the other rows are as before."""
    _, patched_out, info = _forward(True, monkeypatch, max_tokens=SMALL_CAP,
                                    SHMASK_PAST_CAP="exact")
    spilled = [c for c, n in enumerate(patched_out.spill_lengths.tolist()) if n > 0]
    assert len(spilled) >= 2
    honest = _materialized(patched_out, info)
    _, patched_out, _ = _forward(True, monkeypatch, max_tokens=SMALL_CAP, SHMASK_PAST_CAP="exact")
    patched_out.spill_lengths[spilled[0]] += 1
    forged = _materialized(patched_out, info)
    forged_row = MASK_ROWS[patched_out.spill_rows[spilled[0]]]
    assert forged[forged_row][0] == 2 and forged[forged_row][1] is None
    for b in MASK_ROWS:
        if b != forged_row:
            assert forged[b][0] == honest[b][0], f"row {b}"
            if honest[b][0] == 0:
                np.testing.assert_array_equal(forged[b][1], honest[b][1])


def test_a_prefill_server_never_spills(monkeypatch):
    """PD prefill (SGLang's metadata buffer holds cap entries a row): rows
    past the cap are OVERFLOW in released SGLang's own output type, whatever
    SHMASK_PAST_CAP says."""
    _, released_out, info = _forward(False, max_tokens=VOCAB)
    _, prefill_out, _ = _forward(True, monkeypatch, max_tokens=SMALL_CAP,
                                 disaggregation="prefill", SHMASK_PAST_CAP="exact")
    assert type(prefill_out) is type(released_out)
    want = dict(zip(MASK_ROWS, harness.ok_rows(released_out, info), strict=True))
    statuses = dict(zip(MASK_ROWS, prefill_out.statuses.tolist(), strict=True))
    longer = [b for b in MASK_ROWS if want[b].status == 0 and len(want[b].ids) > SMALL_CAP]
    assert longer and all(statuses[b] == 1 for b in longer)


# ------------------------------------------------ SHMASK_DRAW=shmask


def _assert_drawn_rows(ids, output, info, capture_rows):
    """The draw's rows: the capture path's rows (the supports do not depend
    on the token), each drawn token in its row, its selected logprob the
    support's at that token."""
    got, want = harness.ok_rows(output, info), harness.ok_rows(capture_rows, info)
    assert [row.status for row in got] == [row.status for row in want]
    for batch_row, mine, theirs in zip(MASK_ROWS, got, want, strict=True):
        if theirs.status != 0:
            continue
        np.testing.assert_array_equal(mine.ids, theirs.ids, err_msg=f"row {batch_row}")
        token = int(ids[batch_row])
        assert token in mine.ids.tolist(), f"row {batch_row}: token {token} outside its support"
        if mine.support_logprobs is not None:
            np.testing.assert_allclose(mine.support_logprobs, theirs.support_logprobs, rtol=1e-6,
                                       atol=1e-6, err_msg=f"row {batch_row}")
            at = mine.ids.tolist().index(token)
            assert mine.selected_logprob == pytest.approx(float(mine.support_logprobs[at]),
                                                          abs=1e-6), f"row {batch_row}"


def _captures(monkeypatch) -> list[int]:
    """Calls of shmask.kernels.capture (fixed_capture imports it per call)."""
    import shmask.kernels

    calls: list[int] = []
    real = shmask.kernels.capture

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(shmask.kernels, "capture", counted)
    return calls


def test_shmask_draw_gives_tokens_and_rows_in_one_pass(patched, monkeypatch):
    """SHMASK_DRAW=shmask: shmask.kernels.sample draws the batch and its rows
    are the masks, laid out as the capture's (no capture runs): the same
    statuses, ids and support logprobs as the patched capture's rows, every
    token inside its row. Unseeded rows draw from torch's generator:
    another generator state, other tokens."""
    calls = _captures(monkeypatch)
    ids, output, info = _forward(True, monkeypatch, SHMASK_DRAW="shmask")
    assert calls == []
    _assert_drawn_rows(ids, output, info, patched[1])
    again, _, _ = _forward(True, monkeypatch, SHMASK_DRAW="shmask")
    assert torch.equal(again, ids)  # the same generator state, the same draws
    module = harness.load_sampler_module(patched=True)
    with harness.sampler_context(MAX_TOKENS):
        logits, info = _batch()
        others = [harness.run_forward(module, module.Sampler(), logits, info, torch_seed=seed)[0]
                  for seed in (1, 2, 3)]
    assert any(not torch.equal(other, ids) for other in others)


def test_shmask_draw_captures_again_where_the_token_sync_may_change_tokens(patched, monkeypatch):
    """With SGLang's TP token sync on (SYNC_TOKEN_IDS_ACROSS_TP), a rank's
    token may be replaced after the draw: the rows are captured with the
    final tokens, as without the draw."""
    module = harness.load_sampler_module(patched=True)
    monkeypatch.setattr(module, "SYNC_TOKEN_IDS_ACROSS_TP", True)
    monkeypatch.setattr(module.torch.distributed, "all_reduce", lambda *a, **k: None)
    calls = _captures(monkeypatch)
    monkeypatch.setenv("SHMASK_DRAW", "shmask")
    sglang_sampler._settings.cache_clear()
    try:
        with harness.sampler_context(MAX_TOKENS):
            logits, info = _batch()
            ids, output = harness.run_forward(module, module.Sampler(), logits, info)
    finally:
        sglang_sampler._settings.cache_clear()
    assert calls == [1]
    _assert_drawn_rows(ids, output, info, patched[1])


def test_shmask_draw_replays_a_seeded_request_by_seed_and_position(monkeypatch):
    """A request's sampling_seed (deterministic inference) with its position
    sets its draw: the same seeds and positions draw the same tokens
    whatever torch's generator holds; another position draws anew. (Released
    SGLang's seeded draw needs sgl_kernel's CPU hash, which does not install
    here; shmask's draw needs nothing of it.)"""
    monkeypatch.setenv("SHMASK_DRAW", "shmask")
    sglang_sampler._settings.cache_clear()
    module = harness.load_sampler_module(patched=True)
    seeds = [7 + row for row in range(len(ROWS))]

    def draw(torch_seed: int, position: int) -> torch.Tensor:
        with harness.sampler_context(MAX_TOKENS, deterministic=True):
            logits = _batch()[0]
            temperatures, top_ks, top_ps, min_ps, _ = zip(*ROWS, strict=True)
            info = harness.sampling_info(logits, temperatures=temperatures, top_ks=top_ks,
                                         top_ps=top_ps, min_ps=min_ps, mask_rows=MASK_ROWS,
                                         support_rows=SUPPORT_ROWS, seeds=seeds)
            output = module.LogitsProcessorOutput(next_token_logits=logits.clone())
            torch.manual_seed(torch_seed)
            positions = torch.full((len(ROWS),), position, dtype=torch.int64)
            ids = module.Sampler().forward(output, info, return_logprob=False,
                                           top_logprobs_nums=[0] * len(ROWS),
                                           token_ids_logprobs=[None] * len(ROWS),
                                           positions=positions)
            assert output.sampling_mask_output.statuses.tolist()[0] == 0
        return ids

    try:
        first = draw(0, 5)
        assert torch.equal(draw(1, 5), first)
        assert any(not torch.equal(draw(0, position), first) for position in (6, 7, 8))
    finally:
        sglang_sampler._settings.cache_clear()

"""tests/compat/_sglang_sampler.py against SGLang 0.5.23's released sampler.

The released `Sampler.forward` (pytorch backend, CPU) must capture exactly
what an independent float64 numpy model of that backend keeps (derived from
top_k_top_p_min_p_sampling_from_probs_torch and _build_sampling_mask_output),
and the patch loader must apply only sampler.py's section of a patch, or say
why it cannot. Unseeded: seeded sampling needs sgl_kernel (see the helper).
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import _sglang_sampler as harness
import numpy as np
import pytest
import torch

from shmask.integrate import split_patch

VOCAB, MAX_TOKENS = 256, 32
# One row per case; top_k -1 and top_p 1 are "off" (SGLang's API values).
# Row 5 keeps 64 > MAX_TOKENS tokens: OVERFLOW, and in "support" mode, so the
# support row after it (6) is only read right if non-OK rows are counted too.
ROWS = [  # (temperature, top_k, top_p, min_p, mode); mode None: not opted in
    (1.0, 8, 1.0, 0.0, "selected"),  # 0 top-k
    (1.0, -1, 0.6, 0.0, "support"),  # 1 top-p
    (0.7, 20, 0.8, 0.0, "selected"),  # 2 top-k + top-p
    (1.0, -1, 1.0, 0.1, "support"),  # 3 min-p
    (1.0, 10, 1.0, 0.0, None),  # 4 no mask
    (1.0, 64, 1.0, 0.0, "support"),  # 5 OVERFLOW
    (0.7, 12, 0.9, 0.0, "support"),  # 6 top-k + top-p
    (0.0, -1, 1.0, 0.0, "selected"),  # 7 greedy (SGLang: top_k 1) in a sampled batch
]
MASK_ROWS = [row for row, case in enumerate(ROWS) if case[4] is not None]
SUPPORT_ROWS = [row for row, case in enumerate(ROWS) if case[4] == "support"]
OVERFLOW_ROW = 5


def _logits() -> torch.Tensor:
    logits = np.random.default_rng(7).standard_normal((len(ROWS), VOCAB)) * 2.5
    return torch.from_numpy(logits.astype(np.float32))


def _info(logits: torch.Tensor):
    temperatures, top_ks, top_ps, min_ps, _ = zip(*ROWS, strict=True)
    return harness.sampling_info(logits, temperatures=temperatures, top_ks=top_ks, top_ps=top_ps,
                                 min_ps=min_ps, mask_rows=MASK_ROWS, support_rows=SUPPORT_ROWS)


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
              min_p: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The pytorch backend's kept support in float64: (ids by descending
    weight, their logprobs over the kept mass, the smallest distance of a
    top-p or min-p decision from its threshold)."""
    if temperature == 0.0:  # SamplingParams makes it greedy: top_k 1
        temperature, top_k = 1.0, 1
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    w = p[order]
    keep = np.ones(len(w), dtype=bool)
    if top_k > 0:
        keep[top_k:] = False  # by rank
    exclusive = np.cumsum(w) - w  # over the full sorted row, before top-k
    keep &= ~(exclusive > top_p)
    margin = float(np.abs(exclusive - top_p).min()) if top_p < 1.0 else np.inf
    if min_p > 0:
        threshold = w[0] * min_p  # the row's max: rank 0 is never dropped
        keep &= ~(w < threshold)
        margin = min(margin, float(np.abs(w - threshold).min()))
    assert keep[0] and not np.any(keep[1:] & ~keep[:-1]), "the kept set is a prefix"
    kept = w[keep]
    return order[keep], np.log(kept / kept.sum()), margin


@pytest.fixture(scope="module")
def released():
    """One forward of the released sampler: (logits, info, next ids, rows)."""
    module = harness.load_sampler_module(patched=False)
    with harness.sampler_context(MAX_TOKENS):
        logits = _logits()
        info = _info(logits)
        sampler = module.Sampler()
        ids, output = harness.run_forward(module, sampler, logits, info)
    return logits, info, ids, output


def test_released_capture_matches_the_float64_reference(released):
    logits, info, ids, output = released
    assert torch.equal(info.sampling_mask_batch_indices, torch.tensor(MASK_ROWS))
    rows = harness.ok_rows(output, info)
    assert len(rows) == len(MASK_ROWS)
    for batch_row, row in zip(MASK_ROWS, rows, strict=True):
        if batch_row == OVERFLOW_ROW:
            continue
        temperature, top_k, top_p, min_p, mode = ROWS[batch_row]
        ref_ids, ref_logprobs, margin = reference(logits[batch_row].numpy(), temperature, top_k, top_p,
                                                  min_p)
        assert margin > 1e-5, f"row {batch_row}: a cutoff within float32 noise; pick other logits"
        assert row.status == 0, f"row {batch_row}"
        assert set(row.ids.tolist()) == set(ref_ids.tolist()), f"row {batch_row}"
        np.testing.assert_array_equal(row.ids, ref_ids, err_msg=f"row {batch_row}: descending weight")
        sampled = int(ids[batch_row])
        # atol: a logprob near 0 carries float32's absolute error, not a relative one
        np.testing.assert_allclose(row.selected_logprob, ref_logprobs[list(ref_ids).index(sampled)],
                                   rtol=1e-5, atol=1e-6, err_msg=f"row {batch_row}")
        if mode == "support":
            np.testing.assert_allclose(row.support_logprobs, ref_logprobs, rtol=1e-5, atol=1e-6,
                                       err_msg=f"row {batch_row}")
        else:
            assert row.support_logprobs is None


def test_statuses_and_the_overflow_row(released):
    _, info, _, output = released
    statuses = output.statuses.tolist()
    assert statuses == [1 if row == OVERFLOW_ROW else 0 for row in MASK_ROWS]
    # an OVERFLOW row still packs its first MAX_TOKENS ids (and its support row)
    assert output.lengths[MASK_ROWS.index(OVERFLOW_ROW)] == MAX_TOKENS
    assert output.support_logprobs.shape == (len(SUPPORT_ROWS), MAX_TOKENS)
    assert harness.ok_rows(output, info)[MASK_ROWS.index(OVERFLOW_ROW)] == (1, None, None, None)


def test_sampled_token_is_inside_its_support(released):
    _, info, ids, output = released
    for batch_row, row in zip(MASK_ROWS, harness.ok_rows(output, info), strict=True):
        if row.status == 0:
            assert int(ids[batch_row]) in row.ids.tolist(), f"row {batch_row}"
    assert int(ids[7]) == int(_logits()[7].argmax())  # the greedy row


def test_context_is_published_only_inside_the_block():
    from sglang.srt import runtime_context

    before = runtime_context.get_context()
    with harness.sampler_context(5, deterministic=True):
        sampler = harness.load_sampler_module(patched=False).Sampler()
        assert sampler.sampling_mask_max_tokens == 5 and sampler.enable_deterministic
        assert runtime_context.get_exec().kernel.sampling_backend == "pytorch"
        assert runtime_context.get_parallel().tp_size == 1
    assert runtime_context.get_context() is before


def test_seeds_are_refused_where_sglang_would_not_use_them():
    logits = torch.zeros(2, 64)
    params = dict(temperatures=[1.0, 1.0], top_ks=[4, 4], top_ps=[1.0, 1.0], min_ps=[0.0, 0.0],
                  mask_rows=[0, 1], support_rows=[1])
    with harness.sampler_context(8):
        with pytest.raises(ValueError, match="deterministic=True"):
            harness.sampling_info(logits, seeds=[1, 2], **params)
    with harness.sampler_context(8, deterministic=True):
        info = harness.sampling_info(logits, seeds=[1, 2], **params)
        assert info.sampling_seed.tolist() == [1, 2] and info.sampling_seed.dtype == torch.int64
        assert info.sampling_support_logprobs_capture_indices.tolist() == [1]
        if importlib.util.find_spec("sgl_kernel") is None:
            module = harness.load_sampler_module(patched=False)
            with pytest.raises(RuntimeError, match="sgl_kernel"):
                harness.run_forward(module, module.Sampler(), logits, info)


# ------------------------------------------------------------- the patch

def _sampler_section(extra_line: str) -> str:
    """A patch section for sampler.py that appends one line to it."""
    old = harness.INSTALLED_SAMPLER.read_text().splitlines(keepends=True)
    diff = difflib.unified_diff(old, [*old, extra_line + "\n"], f"a/{harness.SAMPLER_FILE}",
                                f"b/{harness.SAMPLER_FILE}")
    return f"diff -ru a/{harness.SAMPLER_FILE} b/{harness.SAMPLER_FILE}\n" + "".join(diff)


def _other_sections() -> str:
    """The shipped patch's sections for files other than sampler.py."""
    return "".join(file.text for file in split_patch(harness.PATCH) if file.path != harness.SAMPLER_FILE)


def test_patch_without_a_sampler_section_is_refused(tmp_path: Path):
    patch = tmp_path / "no-sampler.patch"
    patch.write_text(_other_sections())
    assert len(split_patch(patch)) >= 1
    with pytest.raises(harness.SamplerPatchError, match="has no section for sglang/srt/layers/sampler.py"):
        harness.load_sampler_module(patched=True, patch=patch)


def test_sampler_section_that_does_not_apply_is_refused(tmp_path: Path):
    patch = tmp_path / "stale.patch"
    patch.write_text(_sampler_section("# x").replace("\n ", "\n stale context ", 1))
    with pytest.raises(harness.SamplerPatchError, match="sampler.py section does not apply"):
        harness.load_sampler_module(patched=True, patch=patch)


def test_two_sampler_sections_are_refused(tmp_path: Path):
    patch = tmp_path / "twice.patch"
    patch.write_text(_sampler_section("# one") + _sampler_section("# two"))
    with pytest.raises(harness.SamplerPatchError, match="2 sections for sglang/srt/layers/sampler.py"):
        harness.load_sampler_module(patched=True, patch=patch)


def test_only_the_sampler_section_is_applied_and_both_modules_coexist(tmp_path: Path, released):
    # The shipped patch's other files are absent from the temp tree: applying
    # them too would fail.
    patch = tmp_path / "with-sampler.patch"
    patch.write_text(_other_sections() + _sampler_section("# shmask harness test"))
    patched = harness.load_sampler_module(patched=True, patch=patch)
    released_module = harness.load_sampler_module(patched=False)
    assert harness.load_sampler_module(patched=True, patch=patch) is patched  # cached
    assert patched is not released_module and patched.Sampler is not released_module.Sampler
    assert Path(patched.__file__).read_text().endswith("# shmask harness test\n")
    assert Path(released_module.__file__) == harness.INSTALLED_SAMPLER
    # The comparison the integration test makes: same inputs, same outputs.
    _, _, ids, output = released
    with harness.sampler_context(MAX_TOKENS):
        logits = _logits()
        patched_ids, patched_output = harness.run_forward(patched, patched.Sampler(), logits, _info(logits))
    assert torch.equal(patched_ids, ids)
    for field in ("token_ids", "lengths", "selected_logprobs", "support_logprobs", "statuses"):
        assert torch.equal(getattr(patched_output, field), getattr(output, field)), field

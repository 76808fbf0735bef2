"""shmask.admission: the one rule by which a server in SGLang's shape (the
patched SGLang scheduler, the example server) admits requests for sampling
masks. Torch-free; the SGLang scheduler's use of it is tested through
SGLang's own code in tests/compat/test_sglang_top_p_only.py."""

from __future__ import annotations

import pytest

from shmask.admission import TOP_K_ALL, sampling_mask_refusal

CAP = 4096


def refusal(top_k: int = TOP_K_ALL, top_p: float = 1.0, min_p: float = 0.0, **kwargs) -> str | None:
    return sampling_mask_refusal(top_k=top_k, top_p=top_p, min_p=min_p, cap=CAP, **kwargs)


@pytest.mark.parametrize("settings", [
    dict(top_k=1), dict(top_k=2), dict(top_k=CAP), dict(top_p=0.9), dict(top_k=-1, top_p=0.5),
    dict(min_p=0.05), dict(top_k=CAP + 1), dict(top_k=CAP + 1, top_p=0.99),
    dict(top_p=0.9, capture="shmask", past_cap="status")])
def test_bounded_supports_are_admitted(settings):
    assert refusal(**settings) is None


def test_the_full_vocabulary_is_refused_with_what_to_set():
    for settings in (dict(), dict(top_k=-1), dict(top_k=152_000, vocab=151_936),
                     dict(top_p=0.99999999)):
        message = refusal(**settings)
        assert message is not None and "cannot return the full vocabulary" in message, settings
        assert "set top_p < 1" in message and "min_p > 0" in message
    assert "-1 (all)" in refusal(top_k=-1)
    assert "which is 1.0 as a float32" in refusal(top_p=0.99999999)
    assert "which is 1.0" not in refusal()


def test_past_the_cap_follows_shmask_past_cap_and_engine_capture_is_released():
    released = ("return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k "
                f"<= {CAP}; got top_k={CAP + 1}. Lower top_k or increase "
                "--sampling-mask-max-tokens.")
    assert refusal(top_k=CAP + 1, past_cap="status") == released
    assert refusal(top_k=CAP + 1, capture="engine") == released
    # SGLang's own capture admits nothing but top-k rows, top-p or not
    assert refusal(top_p=0.9, capture="engine") is not None
    assert refusal(top_k=CAP, capture="engine") is None

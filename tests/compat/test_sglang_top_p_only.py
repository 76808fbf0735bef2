"""Top-p-only masks in SGLang 0.5.23 (issue 36, item 2): admission through
SGLang's real request path, released and patched.

Requests are made the way SGLang's serving code makes them: /generate's
`GenerateReqInput` sampling-params dict and /v1/chat/completions'
`ChatCompletionRequest.to_sampling_params`, each into a real SamplingParams
(normalised, verified), then the scheduler's real `handle_generate_request`
(tests/compat/_sglang_scheduler.py says what stands in for the parts that
need a loaded model). Released SGLang refuses `top_k=-1` with masks (400);
patched, it is admitted when top_p < 1 as a float32 (or min_p > 0), and the
full vocabulary is refused with a 400 that says what to set. The rows such
requests produce are tested in test_sglang_sampler_patched.py
(test_rows_past_the_cap_come_whole).
"""

from __future__ import annotations

from types import SimpleNamespace

import _sglang_sampler as harness
import _sglang_scheduler as scheduler
import pytest

from shmask.adapters import sglang_sampler

CAP = 64


@pytest.fixture(autouse=True)
def _fresh_settings():
    sglang_sampler._settings.cache_clear()  # SHMASK_* are read once a process
    yield
    sglang_sampler._settings.cache_clear()


def _generate_params(**sampling):
    """/generate: GenerateReqInput's sampling_params dict, as the tokenizer
    manager turns it into SamplingParams."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = GenerateReqInput(text="hi", sampling_params=sampling, return_sampling_mask=True)
    request.normalize_batch_and_arguments()
    return scheduler.sampling_params(**request.sampling_params)


def _chat_request(**fields):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 return_sampling_mask=True, **fields)


def _chat_params(request):
    """/v1/chat/completions: the request's own to_sampling_params."""
    sampling = request.to_sampling_params(stop=[], model_generation_config={})
    return scheduler.sampling_params(**{key: value for key, value in sampling.items()
                                        if value is not None})


def test_generate_top_p_only_is_admitted_patched_and_refused_released():
    params = _generate_params(top_k=-1, top_p=0.9, max_new_tokens=4)
    released = scheduler.admit(params, patched=False, cap=CAP)
    assert not released.queued and released.status_code == 400
    assert "top_k" in (released.message or "")
    assert scheduler.admit(params, patched=True, cap=CAP) == (True, None, None)


def test_chat_top_p_only_is_admitted_with_meta_info():
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    chat = OpenAIServingChat.__new__(OpenAIServingChat)  # its validation reads these two
    chat.is_minimax_m3 = False
    chat.tokenizer_manager = SimpleNamespace(model_config=SimpleNamespace(is_multimodal=False))
    request = _chat_request(top_p=0.9, return_meta_info=True)
    with harness.sampler_context(CAP):  # the published config the validation reads
        assert chat._validate_request(request) is None
        refused = chat._validate_request(_chat_request(top_p=0.9))
    params = _chat_params(request)
    assert params.top_k >= 1 << 30 and params.top_p == pytest.approx(0.9)  # top_k unset: all
    assert scheduler.admit(params, patched=False, cap=CAP).status_code == 400
    assert scheduler.admit(params, patched=True, cap=CAP) == (True, None, None)
    # without return_meta_info the chat endpoint refuses, as released
    assert refused == "return_sampling_mask requires return_meta_info=true."


@pytest.mark.parametrize("sampling", [
    {"top_k": -1, "top_p": 1.0},
    {"top_k": -1, "top_p": 0.99999999},  # 1.0 as a float32
    {"top_k": scheduler.VOCAB, "top_p": 1.0},  # every id of the vocabulary
])
def test_full_vocabulary_is_refused_with_what_to_set(sampling):
    admission = scheduler.admit(_generate_params(**sampling), patched=True, cap=CAP)
    assert not admission.queued and admission.status_code == 400
    message = admission.message or ""
    assert "full vocabulary" in message and "top_p < 1" in message and "finite top_k" in message
    if sampling["top_p"] < 1:
        assert "1.0 as a float32" in message


@pytest.mark.parametrize("sampling, admitted", [
    ({"top_k": 1}, True),  # greedy
    ({"temperature": 0.0}, True),  # greedy by temperature
    ({"top_k": CAP}, True),
    ({"top_k": -1, "min_p": 0.1}, True),  # min_p bounds the support too
    ({"top_k": 200, "top_p": 1.0}, True),  # past the cap: travels whole (exact)
    ({"top_k": 200, "top_p": 0.8}, True),
])
def test_admission_patched(sampling, admitted):
    admission = scheduler.admit(_generate_params(**sampling), patched=True, cap=CAP)
    assert admission.queued is admitted, admission


def test_past_cap_status_refuses_finite_top_k_above_the_cap_as_released(monkeypatch):
    """SHMASK_PAST_CAP=status: rows past the cap would be OVERFLOW, so a
    finite top_k above it is refused as released; top-p-only is admitted
    (its rows past the cap abort their request with SGLang's OVERFLOW 400)."""
    monkeypatch.setenv("SHMASK_PAST_CAP", "status")
    params = _generate_params(top_k=200)
    patched = scheduler.admit(params, patched=True, cap=CAP)
    assert patched == scheduler.admit(params, patched=False, cap=CAP)
    assert patched.status_code == 400
    assert scheduler.admit(_generate_params(top_k=-1, top_p=0.9), patched=True, cap=CAP).queued


@pytest.mark.parametrize("sampling", [{"top_k": -1, "top_p": 0.9}, {"top_k": 200},
                                      {"top_k": 20}, {"top_k": -1, "top_p": 1.0}])
def test_engine_capture_admits_as_released(monkeypatch, sampling):
    """SHMASK_CAPTURE=engine keeps SGLang's own capture, which full-sorts a
    top-p-only row: admission is the released one."""
    monkeypatch.setenv("SHMASK_CAPTURE", "engine")
    params = _generate_params(**sampling)
    assert (scheduler.admit(params, patched=True, cap=CAP)
            == scheduler.admit(params, patched=False, cap=CAP))


def test_a_prefill_server_refuses_finite_top_k_past_the_cap():
    """PD prefill: the first row reaches decode through SGLang's metadata
    buffer of cap entries, so rows past the cap are OVERFLOW there and a
    finite top_k above the cap is refused as released; top-p-only is
    admitted (a row past the cap aborts its request with SGLang's 400)."""
    params = _generate_params(top_k=200)
    prefill = scheduler.admit(params, patched=True, cap=CAP, disaggregation="prefill")
    assert prefill == scheduler.admit(params, patched=False, cap=CAP, disaggregation="prefill")
    assert prefill.status_code == 400
    assert scheduler.admit(params, patched=True, cap=CAP, disaggregation="decode").queued
    assert scheduler.admit(_generate_params(top_k=-1, top_p=0.9), patched=True, cap=CAP,
                           disaggregation="prefill").queued

"""Run SGLang 0.5.23's real request admission (`Scheduler.handle_generate_request`,
released or with shmask/integrations/sglang.patch's scheduler.py section
applied) on the CPU, for one request (a helper for the compat tests; it
holds no tests).

    admit(params, *, patched, cap, vocab=VOCAB) -> Admission(queued, status_code, message)

`params` is a real SamplingParams (normalised and verified as the tokenizer
manager does). Everything from `handle_generate_request` to the waiting queue
is SGLang's own code: Req construction, the disaggregation / speculative /
backend checks, the sampling-mask check (the patched one calls
`shmask.adapters.sglang_sampler.sampling_mask_refusal`), SGLang's
`_reject_sampling_mask_request` and `prepare_abort` for a refusal, the
prompt-length and logprob checks after it.

What stands in, because it exists only in a scheduler that loaded a model
(`Scheduler.__init__` builds it from the model and the GPU's memory): the
KV-cache sizing of a request's max_new_tokens (`init_req_max_new_tokens`,
reads the token pool), the prefix tree and grammar manager (no cache, no
grammar), the waiting queue (`_add_request_to_queue`: recorded) and the
output streamer's socket to the detokenizer (`stream_output`: recorded).
Plain values: the model's vocabulary size and eos ids, the length limits.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any, NamedTuple

import _sglang_sampler as harness

VOCAB = 512
SCHEDULER_FILE = "sglang/srt/managers/scheduler.py"


class Admission(NamedTuple):
    queued: bool  # reached the waiting queue unfinished
    status_code: int | None  # the abort's HTTP status, None if not refused
    message: str | None


def sampling_params(vocab: int = VOCAB, **values: Any) -> Any:
    """A SamplingParams as the tokenizer manager makes one: from the
    request's dict, normalised, verified against the vocabulary."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(**values)
    params.normalize(None)
    params.verify(vocab)
    return params


def admit(params: Any, *, patched: bool, cap: int, vocab: int = VOCAB,
          return_sampling_mask: bool = True, disaggregation: str = "null") -> Admission:
    """One request through `handle_generate_request` of a scheduler whose
    --sampling-mask-max-tokens is `cap`. `disaggregation` is the published
    --disaggregation-mode (what the patched sampling-mask rule reads; the
    scheduler's own disaggregation checks, which need a bootstrap server,
    run as for "null")."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    module = harness.load_module(SCHEDULER_FILE, patched)
    queued: list[Any] = []
    streamed: list[Any] = []
    with harness.sampler_context(cap, disaggregation=disaggregation):
        scheduler = module.Scheduler.__new__(module.Scheduler)
        scheduler.__dict__.update(
            server_args=ServerArgs(model_path="dummy", sampling_mask_max_tokens=cap),
            enable_session_radix_cache=False,
            model_config=SimpleNamespace(hf_eos_token_id=None, vocab_size=vocab),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            dllm_config=None, tokenizer=None,
            disaggregation_mode=DisaggregationMode.NULL,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            kv_events_publisher=SimpleNamespace(enable_kv_cache_events=False),
            max_req_input_len=256, max_req_len=512,
            tree_cache=SimpleNamespace(cache_controller=None),
            grammar_manager=SimpleNamespace(process_req_with_grammar=lambda req: False),
            init_req_max_new_tokens=lambda req: None,
            _add_request_to_queue=lambda req, *args, **kwargs: queued.append(req),
            output_streamer=SimpleNamespace(
                stream_output=lambda reqs, *args, **kwargs: streamed.extend(reqs)),
        )
        request = TokenizedGenerateReqInput(
            rid="r", input_text="hi", input_ids=array("q", [1, 2, 3]), input_embeds=None,
            mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
            return_sampling_mask=return_sampling_mask)
        scheduler.handle_generate_request(request)
    reqs = queued + streamed
    assert len(reqs) == 1, f"one request in, {len(queued)} queued and {len(streamed)} streamed out"
    reason = reqs[0].finished_reason
    if reason is None:
        return Admission(bool(queued), None, None)
    info = reason.to_json()
    return Admission(False, int(info.get("status_code") or 0), str(info.get("message")))

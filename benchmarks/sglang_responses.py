"""Issue 36 item 3: one emission's /generate responses, the patched SGLang
tokenizer manager's path against the released one, per emission.

256 requests x 50 rows x 1000 entries (support mode), read out of a ring
as the tokenizer manager reads them. Per request, what each SGLang does
from the chunk to the response bytes (non-streaming; a stream event is the
same work on fewer rows):

  released   SGLang 0.5.23's `SamplingMaskChunk.to_lists(support_logprobs=True)`
             (its class, from the installed package: run after `make
             test-compat`), the lists extended into the request's state,
             then its `dumps_json` (orjson with SGLang's options) of the
             output dict;
  patched    SHMASK_MASK_FORMAT=arrays: the rows copied into the request's
             `SamplingMaskCSR` (what `lists_or_abort` does), then the
             patched `dumps_json`, i.e. orjson with `default=json_default`
             (shmask's native writer writes the rows; shmask/integrations/
             sglang.patch, sglang/srt/utils/json_response.py).

With --chat, the same rows as /v1/chat/completions answers (a
`ChatCompletionResponse` of SGLang's protocol module, the output's
meta_info in its choice): released, pydantic's `model_dump_json` of the
lists (SGLang's `model_json_response`); patched, the arrays kept in
meta_info and the patched `model_json_response`'s `adapter.model_json`
(pydantic's fields by `model_dump`, the rows by the native writer).

Every response is compared byte for byte. Medians over --repeats of the
emission's total; the writer's threads are SHMASK_JSON_THREADS (run with
SHMASK_JSON_THREADS=1 for one thread: the issue's goal is >= 3x there).

    .venv/bin/python benchmarks/sglang_responses.py [--repeats 7] [--requests 256] [--chat]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson
from _common import BATCH, EMIT_TOKENS, median_ms, now, print_table
from responses import one_emission

from shmask.adapters.sglang import (
    LENGTH_FIELD,
    LOGPROBS_FIELD,
    MASK_FIELD,
    SamplingMaskCSR,
    json_default,
    model_json,
)
from shmask.response_json import json_threads

WIDTH = 1000
OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY  # SGLang's dumps_json


def output(meta_masks: Any, meta_logprobs: Any, rows: int) -> dict[str, Any]:
    """The output dict the tokenizer manager hands /generate (its other
    meta_info fields fixed: they are the same on both sides)."""
    return {"output_ids": [7] * rows,
            "meta_info": {"id": "req", "finish_reason": {"type": "length", "length": rows},
                          "prompt_tokens": 3, MASK_FIELD: meta_masks,
                          LOGPROBS_FIELD: meta_logprobs, LENGTH_FIELD: rows,
                          "completion_tokens": rows, "cached_tokens": 0}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=BATCH)
    parser.add_argument("--chat", action="store_true",
                        help="/v1/chat/completions answers instead of /generate's")
    args = parser.parse_args()
    try:
        from sglang.srt.entrypoints.openai.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            UsageInfo,
        )
        from sglang.srt.sampling.sampling_mask import SamplingMaskChunk as Released
        from sglang.srt.utils.json_response import dumps_json as released_dumps
    except ImportError:
        print("SGLang is not installed here: run `make test-compat` first")
        return 1

    def released(chunk: Any) -> bytes:
        masks: list[Any] = []  # the request state's lists
        logprobs: list[Any] = []
        got = Released(lengths=chunk.lengths, token_ids=chunk.ids,
                       logprobs=chunk.logprobs).to_lists(support_logprobs=True)
        masks.extend(got[0])
        logprobs.extend(got[1])
        if args.chat:
            return chat(output(masks, logprobs, len(masks))).model_dump_json(by_alias=True).encode()
        return released_dumps(output(masks, logprobs, len(masks)))

    def patched(chunk: Any) -> bytes:
        rows = SamplingMaskCSR(True)
        rows.extend(chunk)
        if args.chat:
            written = model_json(chat(output(rows, rows.logprob_rows, len(rows))))
            assert written is not None
            return written
        return orjson.dumps(output(rows, rows.logprob_rows, len(rows)), default=json_default,
                            option=OPTIONS)

    def chat(out: dict[str, Any]) -> Any:
        """The /v1/chat/completions answer SGLang builds around an output."""
        return ChatCompletionResponse(
            id="req", created=1_796_000_000, model="m",
            usage=UsageInfo(prompt_tokens=3, completion_tokens=len(out["output_ids"]),
                            total_tokens=3 + len(out["output_ids"])),
            choices=[ChatCompletionResponseChoice(
                index=0, message={"role": "assistant", "content": "x"}, finish_reason="length",
                meta_info=out["meta_info"])])

    paths = {"released: to_lists + dumps_json": released,
             "patched (arrays): CSR copy + dumps_json(default=json_default)": patched}
    if args.chat:
        paths = {"released: to_lists + pydantic model_dump_json": released,
                 "patched (arrays): CSR copy + model_json (native rows)": patched}
    # "sent": each response dropped once built, as a server does once it has
    # written it (memory reused); "kept": all the emission's responses kept
    # (every page fresh: a page fault per 4 KiB on both sides)
    times: dict[tuple[str, str], list[float]] = {(name, mode): [] for name in paths
                                                 for mode in ("sent", "kept")}
    mismatches = 0
    with one_emission(args.requests, EMIT_TOKENS, WIDTH) as chunks:
        for _ in range(args.repeats):
            out = {}
            for name, build in paths.items():
                started = now()
                for c in chunks:
                    build(c)  # dropped at once
                times[(name, "sent")].append(now() - started)
                started = now()
                out[name] = [build(c) for c in chunks]
                times[(name, "kept")].append(now() - started)
            want, got = out.values()
            response_bytes = len(want[0])
            mismatches += sum(a != b for a, b in zip(want, got, strict=True))
            del out, want, got
    medians = {key: median_ms(values) for key, values in times.items()}
    rows = []
    for mode in ("sent", "kept"):
        baseline = medians[(next(iter(paths)), mode)]
        rows += [[name, mode, f"{medians[(name, mode)]:.1f}",
                  f"{baseline / medians[(name, mode)]:.2f}x"] for name in paths]
    endpoint = "/v1/chat/completions" if args.chat else "/generate"
    print_table(f"one emission's {endpoint} responses: {args.requests} requests x {EMIT_TOKENS} "
                f"rows x {WIDTH} (support), SHMASK_JSON_THREADS={json_threads()}, median of "
                f"{args.repeats}; byte mismatches: {mismatches}",
                ["path", "responses", "ms (all requests)", "speedup"], rows)
    print(f"bytes per response: {response_bytes:,}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

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

Every response is compared byte for byte. Medians over --repeats of the
emission's total; the writer's threads are SHMASK_JSON_THREADS (run with
SHMASK_JSON_THREADS=1 for one thread: the issue's goal is >= 3x there).

    .venv/bin/python benchmarks/sglang_responses.py [--repeats 7] [--requests 256]
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
    args = parser.parse_args()
    try:
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
        return released_dumps(output(masks, logprobs, len(masks)))

    def patched(chunk: Any) -> bytes:
        rows = SamplingMaskCSR(True)
        rows.extend(chunk)
        return orjson.dumps(output(rows, rows.logprob_rows, len(rows)), default=json_default,
                            option=OPTIONS)

    paths = {"released: to_lists + dumps_json": released,
             "patched (arrays): CSR copy + dumps_json(default=json_default)": patched}
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
        baseline = medians[("released: to_lists + dumps_json", mode)]
        rows += [[name, mode, f"{medians[(name, mode)]:.1f}",
                  f"{baseline / medians[(name, mode)]:.2f}x"] for name in paths]
    print_table(f"one emission's /generate responses: {args.requests} requests x {EMIT_TOKENS} "
                f"rows x {WIDTH} (support), SHMASK_JSON_THREADS={json_threads()}, median of "
                f"{args.repeats}; byte mismatches: {mismatches}",
                ["path", "responses", "ms (all requests)", "speedup"], rows)
    print(f"bytes per response: {response_bytes:,}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

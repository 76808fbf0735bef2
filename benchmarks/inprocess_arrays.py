"""Arrays for in-process consumers (issue 18, item 4): what one emission
costs the consumer side of each engine adapter, lists form (the default)
against arrays form (SHMASK_MASK_FORMAT=arrays), on the same rows.

Workload: `requests` (256) requests x `tokens` (50) rows per emission x
`support` (1000) ids per row, ascending distinct ids in a 151,936 vocabulary.

- SGLang (support and selected mode): per request's chunk, what the patched
  tokenizer manager does with it: lists, ``to_lists`` + ``extend`` into the
  request's lists; arrays, the rows copied into a ``SamplingMaskCSR``
  (``lists_or_abort``'s arrays path). The chunk is released either way.
- vLLM (masks are ids only, one row per request per step): the emission's
  50 steps, each step's 256 references resolved by ``resolve_outputs`` (as
  the patched frontend calls it: one copy out of the ring per mask, record
  released) and ``to_nested_list()`` of each, as vLLM's
  output processor builds ``CompletionOutput.sampling_mask``: lists, vLLM's
  type (Python lists); arrays, ``arrays_mask_type`` (numpy views).

Rows are written and published outside the timed part; each repetition
publishes fresh rows. Medians of `--reps` (3) repetitions, interleaved;
ratio = lists / arrays.

    python benchmarks/inprocess_arrays.py [--requests 256] [--tokens 50] [--support 1000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from _common import SEGMENT_PREFIX, VOCAB, print_table

import shmask
from shmask.adapters import sglang as sglang_adapter
from shmask.adapters import vllm as vllm_adapter


def step_rows(rng: np.random.Generator, requests: int, support: int) -> tuple[np.ndarray, ...]:
    """[requests, support] ascending distinct ids (one per stride of the
    vocabulary) and their logprobs."""
    stride = VOCAB // support
    ids = (np.arange(support, dtype=np.int64) * stride
           + rng.integers(0, stride, (requests, support))).astype(np.int32)
    logprobs = (rng.standard_normal((requests, support)) - 4).astype(np.float32)
    return ids, logprobs


def sglang_emission(writer: shmask.Writer, rng: np.random.Generator, mode: str, args: Any):
    """One emission's chunks (one per request), published, not yet read."""
    rows = [sglang_adapter.SamplingMaskRows(mode, writer) for _ in range(args.requests)]
    lengths = np.full(args.requests, args.support, np.int32)
    for _ in range(args.tokens):
        ids, logprobs = step_rows(rng, args.requests, args.support)
        sglang_adapter.append_step(rows, lengths, ids, logprobs[:, 0], logprobs, writer=writer)
    return rows, sglang_adapter.take_all(rows, writer=writer)


def time_sglang(chunks: list, support: bool, form: str) -> float:
    gc.collect()
    start = time.perf_counter()
    kept = []
    for chunk in chunks:
        if form == "lists":
            masks, values = chunk.to_lists(support_logprobs=support)
            state_masks: list[Any] = []
            state_values: list[Any] = []
            state_masks.extend(masks)
            state_values.extend(values)
            kept.append((state_masks, state_values))
        else:
            csr = sglang_adapter.SamplingMaskCSR(support)
            csr.extend(chunk)
            kept.append(csr)
    elapsed = time.perf_counter() - start
    del kept  # freeing the lists is not counted
    return elapsed


def vllm_emission(publisher: vllm_adapter.MaskPublisher, rng: np.random.Generator,
                  args: Any) -> list[Any]:
    """The emission's references: `tokens` steps, one row per request each."""
    steps = []
    offsets = np.arange(args.requests + 1, dtype=np.int64) * args.support
    for _ in range(args.tokens):
        ids, _ = step_rows(rng, args.requests, args.support)
        step = publisher.publish_step(vllm_adapter.mask_type()(ids.reshape(-1), offsets, None))
        # The two fields of vLLM's EngineCoreOutput that the resolver touches.
        steps.append([SimpleNamespace(request_id=f"r{i}", finish_reason=None,
                                      new_sampling_mask=step.slice_request(i, 1))
                      for i in range(args.requests)])
    return steps


def time_vllm(resolver: vllm_adapter.MaskResolver, steps: list[Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    kept = []
    for outputs in steps:  # each step's message: resolve_outputs, as the patched frontend
        assert not resolver.resolve_outputs(outputs)
        kept += [o.new_sampling_mask.to_nested_list() for o in outputs]
    elapsed = time.perf_counter() - start
    del kept
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--support", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ring_mb = max(64, 2 * args.requests * args.tokens * args.support * 8 >> 20)
    config = shmask.Config(ring_mb=ring_mb, name_prefix=SEGMENT_PREFIX, lease_s=600)
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, list[float]]] = {}
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        sglang_adapter.configure(writer=writer, reader=reader)
        for mode in ("support", "selected"):
            times = results[f"SGLang meta_info, {mode} mode"] = {"lists": [], "arrays": []}
            for _ in range(args.reps):
                for form in ("lists", "arrays"):
                    rows, chunks = sglang_emission(writer, rng, mode, args)
                    times[form].append(time_sglang(chunks, mode == "support", form))
                    for r in rows:
                        r.close()
                    writer.reclaim()
                    assert writer.ring_usage()[0] == 0, "every record released"
        publisher = vllm_adapter.MaskPublisher(writer)
        resolvers = {form: vllm_adapter.MaskResolver(reader, mask_format=form)
                     for form in ("lists", "arrays")}
        times = results["vLLM sampling_mask (resolve_outputs + to_nested_list)"] = {
            "lists": [], "arrays": []}
        for _ in range(args.reps):
            for form in ("lists", "arrays"):
                refs = vllm_emission(publisher, rng, args)
                times[form].append(time_vllm(resolvers[form], refs))
        publisher.close()
    rows = []
    for name, by_form in results.items():
        lists_ms = 1000 * statistics.median(by_form["lists"])
        arrays_ms = 1000 * statistics.median(by_form["arrays"])
        rows.append([name, f"{lists_ms:,.1f}", f"{arrays_ms:,.1f}", f"{lists_ms / arrays_ms:.1f}x"])
    print_table(f"Consumer cost per emission: {args.requests} requests x {args.tokens} tokens "
                f"x {args.support} support, medians of {args.reps}",
                ["consumer", "lists ms", "arrays ms", "lists / arrays"], rows)


if __name__ == "__main__":
    main()

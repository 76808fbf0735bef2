"""vLLM 0.33.0's per-step CPU for sampling masks, released against the
patched path (issue 36 item 5), in one run, through vLLM's own modules.

One decode step: `requests` (256) requests, one position each, rows of
`support` (1000) ascending ids in a 151,936 vocabulary, as the model runner
hands them to the scheduler (a batch ``SamplingMaskLists``: int32 ids,
int64 offsets).

- engine core: the scheduler's per-request ``slice_request`` into an
  ``EngineCoreOutput``, then vLLM's ``MsgpackEncoder.encode`` of the step's
  ``EngineCoreOutputs`` (frames kept as bytes, as the socket would take
  them). Patched: ``shmask_vllm.publish_step`` first (the step into the
  ring), then the same loop and encode.
- frontend: ``MsgpackDecoder.decode`` of those frames, then what the
  output processor builds per request: ``to_nested_list()`` of its mask
  (checked outside the timing: every request's ids the same on both paths)
  (``CompletionOutput.sampling_mask``'s lists; ``--format arrays``: the
  arrays subclass's views, SHMASK_MASK_FORMAT=arrays). Patched:
  ``shmask_vllm.resolve_outputs`` between the two (each reference resolved
  and released).

zmq is not included (the same for both). Medians of ``--steps`` steps per
path, the paths interleaved step by step, after warm-up; with ``--json
FILE`` the figures are written there too.

    python benchmarks/vllm_step.py [--requests 256] [--support 1000] [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import numpy as np
from _common import SEGMENT_PREFIX, VOCAB

import shmask
from shmask.adapters import vllm as vllm_adapter


def step_masks(rng: np.random.Generator, requests: int, support: int) -> Any:
    from vllm.v1.outputs import SamplingMaskLists

    stride = VOCAB // support
    ids = (np.arange(support, dtype=np.int64) * stride
           + rng.integers(0, stride, (requests, support))).astype(np.int32).ravel()
    offsets = np.arange(requests + 1, dtype=np.int64) * support
    return SamplingMaskLists(ids, offsets, None)


def engine_core(masks: Any, requests: int, encoder: Any, publisher: Any) -> list[bytes]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    if publisher is not None:
        masks = publisher.publish_step(masks)
    outputs = [EngineCoreOutput(f"req-{i}", [7], new_sampling_mask=masks.slice_request(i, 1))
               for i in range(requests)]
    return [bytes(frame) for frame in encoder.encode(EngineCoreOutputs(outputs=outputs))]


def frontend(frames: list[bytes], decoder: Any, resolver: Any) -> list[Any]:
    """Each request's to_nested_list(), as the output processor builds it."""
    outputs = decoder.decode(frames).outputs
    if resolver is not None:
        failed = resolver.resolve_outputs(outputs)
        assert not failed, failed
    return [output.new_sampling_mask.to_nested_list() for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--support", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--format", choices=("lists", "arrays"), default="lists")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    writer = shmask.Writer(shmask.Config(ring_mb=256, name_prefix=SEGMENT_PREFIX,
                                         max_tokens=4096, queue_rows=4))
    reader = shmask.Reader(writer.config)
    publisher = vllm_adapter.MaskPublisher(writer)
    resolver = vllm_adapter.MaskResolver(reader, mask_format=args.format)
    rng = np.random.default_rng(0)
    paths = {"vLLM 0.33.0 as released": (None, None), "patched (shmask)": (publisher, resolver)}
    times: dict[str, dict[str, list[float]]] = {p: {"engine": [], "frontend": [], "bytes": []}
                                                 for p in paths}
    gc.collect()
    try:
        for step in range(args.steps + 10):
            masks = step_masks(rng, args.requests, args.support)
            built = []
            for name, (pub, res) in paths.items():
                began = time.perf_counter()
                frames = engine_core(masks, args.requests, encoder, pub)
                middle = time.perf_counter()
                built.append(frontend(frames, decoder, res))
                ended = time.perf_counter()
                if step >= 10:  # warm-up
                    times[name]["engine"].append((middle - began) * 1e3)
                    times[name]["frontend"].append((ended - middle) * 1e3)
                    times[name]["bytes"].append(sum(len(f) for f in frames))
            # Every request's ids, both paths the same (outside the timing).
            released, patched = ([[np.asarray(row).tolist() for row in rows] for rows in masks_of]
                                 for masks_of in built)
            if released != patched or len(released[0][0]) != args.support:
                raise SystemExit(f"step {step}: the patched frontend's masks differ from vLLM's")
    finally:
        publisher.close()
        resolver.close()
        writer.close()
    print(f"vllm_step: {args.requests} requests x {args.support} ids, one position each, "
          f"{args.steps} steps, format {args.format}; ms per step, median (p90)")
    print(f"{'path':26} | {'engine core':>17} | {'frontend':>17} | message")
    summary = {}
    for name, found in times.items():
        row = {part: (statistics.median(v), statistics.quantiles(v, n=10)[-1])
               for part, v in found.items() if part != "bytes"}
        frames_bytes = int(statistics.median(found["bytes"]))
        summary[name] = {**{k: v[0] for k, v in row.items()}, "message_bytes": frames_bytes}
        print(f"{name:26} | {row['engine'][0]:7.3f} ({row['engine'][1]:6.3f}) | "
              f"{row['frontend'][0]:7.3f} ({row['frontend'][1]:6.3f}) | {frames_bytes:,} B")
    released, patched = summary.values()
    print(f"patched / released: engine core {patched['engine'] / released['engine']:.2f}x, "
          f"frontend {patched['frontend'] / released['frontend']:.2f}x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "ms_per_step": summary}, out, indent=1)


if __name__ == "__main__":
    main()

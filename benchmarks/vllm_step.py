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

Between them the message crosses a real zmq PUSH/PULL pair over ipc, as
vLLM sends it (``send`` of the first frame tracked, the rest by
``send_multipart(copy=False)``; ``recv_multipart(copy=False)``), unless
``--no-zmq``. Each part's time is the CPU time of the thread that runs it
(``time.thread_time``: a receive's wait for the bytes is not CPU; zmq's
I/O thread, which moves 257 frames as released and 1 patched, is not
counted for either). After 10 warm-up steps the collector's heap is
frozen, as vLLM's engine core freezes it after start-up
(``freeze_gc_heap``). Medians of ``--steps`` steps per path, the paths
interleaved step by step, after warm-up; with ``--json FILE`` the figures
are written there too.

    python benchmarks/vllm_step.py [--requests 256] [--support 1000] [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import time
from typing import Any

import numpy as np
from _common import SEGMENT_PREFIX, VOCAB

import shmask
from shmask.adapters import vllm as vllm_adapter

WARMUP = 10  # steps before the timed ones (the heap is frozen after them)


def step_masks(rng: np.random.Generator, requests: int, support: int) -> Any:
    from vllm.v1.outputs import SamplingMaskLists

    stride = VOCAB // support
    ids = (np.arange(support, dtype=np.int64) * stride
           + rng.integers(0, stride, (requests, support))).astype(np.int32).ravel()
    offsets = np.arange(requests + 1, dtype=np.int64) * support
    return SamplingMaskLists(ids, offsets, None)


def engine_core(masks: Any, requests: int, encoder: Any, publisher: Any, sockets: Any) -> Any:
    """The step's outputs sent as vLLM's engine core sends them; returns
    the frames (or, with --no-zmq, the encoded buffers)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    if publisher is not None:
        masks = publisher.publish_step(masks)
    outputs = [EngineCoreOutput(f"req-{i}", [7], new_sampling_mask=masks.slice_request(i, 1))
               for i in range(requests)]
    buffers = encoder.encode(EngineCoreOutputs(outputs=outputs))
    if sockets is None:
        return [bytes(frame) for frame in buffers]
    import zmq

    push, _ = sockets
    more = zmq.SNDMORE if len(buffers) > 1 else 0
    push.send(buffers[0], more, copy=False, track=True)
    if more:
        push.send_multipart(buffers[1:], copy=False)
    return None


def frontend(frames: Any, decoder: Any, resolver: Any, sockets: Any) -> list[Any]:
    """Each request's to_nested_list(), as the output processor builds it."""
    if sockets is not None:
        frames = sockets[1].recv_multipart(copy=False)
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
    parser.add_argument("--no-zmq", action="store_true", help="the message not sent: encode only")
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
    sockets = None
    if not args.no_zmq:
        import tempfile

        import zmq

        context = zmq.Context()
        folder = tempfile.mkdtemp(prefix="shmask-vllm-step-")
        pull = context.socket(zmq.PULL)
        pull.bind(f"ipc://{folder}/outputs")
        push = context.socket(zmq.PUSH)
        push.connect(f"ipc://{folder}/outputs")
        sockets = (push, pull)
    paths = {"vLLM 0.33.0 as released": (None, None), "patched (shmask)": (publisher, resolver)}
    times: dict[str, dict[str, list[float]]] = {p: {"engine": [], "frontend": []}
                                                 for p in paths}
    sizes: dict[str, int] = {}
    gc.collect()
    try:
        for step in range(args.steps + WARMUP):
            if step == WARMUP:
                # What vLLM's engine core does after start-up and warm-up
                # (vllm.utils.gc_utils.freeze_gc_heap): every object made
                # so far leaves the collector's view.
                gc.collect()
                gc.freeze()
            masks = step_masks(rng, args.requests, args.support)
            built = []
            for name, (pub, res) in paths.items():
                began = time.thread_time()
                frames = engine_core(masks, args.requests, encoder, pub, sockets)
                middle = time.thread_time()
                lists = frontend(frames, decoder, res, sockets)
                ended = time.thread_time()
                # Kept as one array, the lists dropped: the next path's
                # collections must not walk this path's lists.
                built.append(np.concatenate([np.asarray(row, np.int64)
                                             for rows in lists for row in rows]))
                del lists
                if step >= WARMUP:
                    times[name]["engine"].append((middle - began) * 1e3)
                    times[name]["frontend"].append((ended - middle) * 1e3)
            if step == 0:  # the message's size, from an untimed encode of each path
                for name, (pub, res) in paths.items():
                    frames = engine_core(masks, args.requests, encoder, pub, None)
                    sizes[name] = sum(len(f) for f in frames)
                    if res is not None:
                        res.resolve_outputs(decoder.decode(frames).outputs)  # released
            # Every request's ids, both paths the same (outside the timing).
            if not np.array_equal(built[0], built[1]) or built[0].size != args.requests * \
                    args.support:
                raise SystemExit(f"step {step}: the patched frontend's masks differ from vLLM's")
    finally:
        gc.unfreeze()  # what was frozen is freed as usual at exit
        publisher.close()
        resolver.close()
        writer.close()
        if sockets is not None:
            for socket in sockets:
                socket.close(linger=0)
            context.term()
            shutil.rmtree(folder, ignore_errors=True)
    print(f"vllm_step: {args.requests} requests x {args.support} ids, one position each, "
          f"{args.steps} steps, format {args.format}, "
          f"{'no zmq' if args.no_zmq else 'over zmq ipc'}; CPU ms per step, median (p90)")
    print(f"{'path':26} | {'engine core':>17} | {'frontend':>17} | message")
    summary = {}
    for name, found in times.items():
        row = {part: (statistics.median(v), statistics.quantiles(v, n=10)[-1])
               for part, v in found.items()}
        frames_bytes = sizes[name]
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
